"""Sweeps through the real entry point: parent/child runs, figures, failures, and the report command."""

import itertools
import os
import subprocess
from pathlib import Path

import pytest
from conftest import TEST_PATH
from helpers import runs

ROOT = Path(__file__).resolve().parents[2]
# this checkout's code first (not the editable install's, which may be another worktree), then the tests' helpers
ENV = {**os.environ, "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "false",
       "PYTHONPATH": os.pathsep.join([str(ROOT), TEST_PATH])}
SMOKE_SWEEP = pytest.mark.xdist_group("smoke_sweep")  # the tests that share the module's sweep
FIGURES = {"cost.png", "memory.png", "memory_plan.png", "throughput.png", "curves.png", "equivalence.png"}


def sweep(tmp, *args):
    return subprocess.run(["rlrun", *args, "progress=false", f"hydra.sweep.dir={tmp}/sweep"], cwd=tmp, env=ENV,
                          capture_output=True, text=True, timeout=1200)


@pytest.fixture(scope="session")  # not module: xdist may run another module between this one's tests
def smoke(tmp_path_factory):  # 18 training jobs: only slow tests use it (and one xdist worker: SMOKE_SWEEP)
    """The shipped smoke sweep with offload=off only: on CPU offload=on moves nothing and gives the same run bit
    for bit (test_runs), so its 18 jobs would repeat the others'."""
    tmp = tmp_path_factory.mktemp("smoke")
    # report.check_jobs=false: each job's `rlrun check` (~3 s) is tested in test_check.py and test_mlflow_ui.py
    r = sweep(tmp, "-cd", str(ROOT / "sweeps"), "-cn", "smoke", "offload=off", "report.check_jobs=false")
    assert r.returncode == 0, r.stderr[-3000:]
    client, all_runs = runs(tmp / "mlflow.db")
    return tmp, client, all_runs


@pytest.mark.slow
@SMOKE_SWEEP
def test_smoke_sweep_has_one_parent_and_a_child_per_job(smoke):
    tmp, client, all_runs = smoke
    parents = [r for r in all_runs if r.data.tags.get("rlrun.kind") == "sweep"]
    assert len(parents) == 1
    parent = parents[0]
    assert parent.info.status == "FINISHED" and parent.data.params["sweep.name"] == "smoke"
    children = [r for r in all_runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(children) == len(all_runs) - 1 == 18  # 2 losses x 3 heads x 3 policies
    assert all(c.info.status == "FINISHED" for c in children)
    combos = {(c.data.params["loss.name"], c.data.params["head.name"], c.data.params["logprob_policy.name"],
               c.data.params["offload.name"]) for c in children}
    assert combos == set(itertools.product(["dapo", "cispo"], ["dense", "tiled", "chunked"],
                                           ["always", "window", "skip"], ["off"]))
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert FIGURES | {"sweep_config.yaml"} <= artifacts
    assert FIGURES <= {p.name for p in (tmp / "sweep" / "figures").iterdir()}


@pytest.mark.slow
@SMOKE_SWEEP
def test_equivalence_holds_across_the_smoke_sweep(smoke):
    tmp, _, all_runs = smoke
    lines = (tmp / "sweep" / "figures" / "equivalence.txt").read_text().splitlines()
    assert len(lines) == 16  # per loss: 8 efficient variants vs the dense/always/off baseline
    for line in lines:
        dloss = float(line.split("max|dloss|=")[1].split()[0])
        dreward = float(line.split("max|dreward|=")[1])
        assert dloss < 1e-5 and dreward == 0, line
    parent = next(r for r in all_runs if r.data.tags.get("rlrun.kind") == "sweep")
    assert parent.data.metrics["equivalence/runs_compared"] == 16
    assert parent.data.metrics["equivalence/max_abs_diff_loss"] < 1e-5
    assert parent.data.tags["rlrun.equivalence"] == "16 run(s) compared with their baseline"


@pytest.mark.slow
def test_a_head_sweep_under_the_default_policy_checks_equivalence(tmp_path):
    """`rlrun -m head=dense,tiled,chunked`: no job is logprob_policy=always (the default is window), and the
    parent still carries the equivalence check against dense."""
    r = sweep(tmp_path, "-m", "head=dense,tiled,chunked", "experiment=smoke")
    assert r.returncode == 0, r.stderr[-3000:]
    _, all_runs = runs(tmp_path / "mlflow.db")
    parent = next(r for r in all_runs if r.data.tags.get("rlrun.kind") == "sweep")
    assert parent.data.metrics["equivalence/runs_compared"] == 2
    assert parent.data.metrics["equivalence/max_abs_diff_loss"] < 1e-5
    lines = (tmp_path / "sweep" / "figures" / "equivalence.txt").read_text().splitlines()
    assert len(lines) == 2 and all("vs head=dense" in line for line in lines), lines
    assert (tmp_path / "sweep" / "figures" / "equivalence.png").exists()


@pytest.mark.slow
@SMOKE_SWEEP
def test_figures_have_one_series_per_job_and_report_redraws_them_from_the_store(smoke):
    from mlflow.tracking import MlflowClient

    from rlrun.tools import report

    tmp, _, all_runs = smoke
    parent = next(r for r in all_runs if r.data.tags.get("rlrun.kind") == "sweep")
    client = MlflowClient(f"sqlite:///{tmp}/mlflow.db")
    _, children = report.child_runs(client, parent.info.run_id)
    figs, _ = report.figures(client, children)
    loss_ax, reward_ax = figs["curves.png"].axes[:2]
    assert len(loss_ax.get_lines()) == len(reward_ax.get_lines()) == 18
    assert {t.get_text() for t in figs["curves.png"].legends[0].get_texts()} == set(report.labels(children))
    assert loss_ax.get_xlabel() == "optimizer step"
    assert "growth MiB" in [a.get_ylabel() for a in figs["memory.png"].axes]  # the colour bar: growth, not RSS
    import matplotlib.pyplot as plt

    plt.close("all")
    report.main([parent.info.run_id, "--uri", f"sqlite:///{tmp}/mlflow.db", "--out", str(tmp / "in-process")])
    assert plt.get_fignums() == []  # written, then closed: a sweep's report leaves no figure open
    out = tmp / "report"
    r = subprocess.run(["rlrun-report", parent.info.run_id, "--uri", f"sqlite:///{tmp}/mlflow.db", "--out", str(out)],
                       cwd=tmp, env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    for name in FIGURES:  # same store, same data: the same pixels
        assert (out / name).read_bytes() == (tmp / "sweep" / "figures" / name).read_bytes(), name
    r = subprocess.run(["rlrun-report", "--experiment", "rlrun", "--filter", "params.`head.name` = 'tiled'",
                        "--uri", f"sqlite:///{tmp}/mlflow.db", "--out", str(tmp / "filtered")],
                       cwd=tmp, env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "6 runs" in r.stdout


@pytest.mark.slow
def test_failed_jobs_are_marked_and_the_sweep_goes_on_then_exits_nonzero(tmp_path):
    r = sweep(tmp_path, "-m", "experiment=smoke", "task.reward=rlrun.tasks:partial_credit,helpers:nan_reward",
              "logprob_policy=always,window")
    assert r.returncode == 1
    assert "2 of 4 sweep jobs failed" in r.stderr
    _, all_runs = runs(tmp_path / "mlflow.db")
    parent = next(r for r in all_runs if r.data.tags.get("rlrun.kind") == "sweep")
    children = {(c.data.params["task.reward"], c.data.params["logprob_policy.name"]): c
                for c in all_runs if c is not parent}
    assert len(children) == 4 and parent.info.status == "FAILED"
    assert children["rlrun.tasks:partial_credit", "always"].info.status == "FINISHED"
    nan = children["helpers:nan_reward", "always"]
    # a NaN reward is refused while scoring (Task.score): the job fails naming the reward and the value
    assert nan.info.status == "FAILED" and nan.data.tags["error"].startswith("TaskError: reward 'nan_reward'")
    assert "returned nan" in nan.data.tags["error"]
    assert (tmp_path / "sweep" / "figures" / "curves.png").exists()  # figures of the jobs that finished


@pytest.mark.slow  # two 4-step smoke jobs, one stopped at step 1 (~35 s)
def test_a_diverged_job_fails_the_sweep_and_is_named_not_ranked(tmp_path):
    """`train.lr=1e-3,1e8` under bf16: the 1e8 job's weights turn NaN while its loss stays finite. It ended FINISHED,
    the sweep exited 0 and its verdict ranked the NaN job first without a word."""
    r = sweep(tmp_path, "-m", "experiment=smoke", "train.precision=bf16", "train.lr=1e-3,1e8", "train.steps=4",
              "report.check_jobs=false", "export.enabled=false")
    assert r.returncode == 1, r.stderr[-3000:]
    assert "1 of 2 sweep jobs failed" in r.stderr and "training diverged" in r.stderr, r.stderr[-3000:]
    client, all_runs = runs(tmp_path / "mlflow.db")
    parent = next(x for x in all_runs if x.data.tags.get("rlrun.kind") == "sweep")
    by_lr = {float(c.data.params["train.lr"]): c for c in all_runs if c is not parent}
    assert by_lr[1e8].info.status == "FAILED" and by_lr[1e-3].info.status == "FINISHED", by_lr.keys()
    assert parent.info.status == "FAILED"
    answer = client.get_run(parent.info.run_id).data.tags["mlflow.note.content"]
    assert "Left out, not finished:" in answer and "(FAILED: DivergedError: training diverged" in answer, answer
    assert by_lr[1e8].data.tags["mlflow.runName"] in answer.split("Left out, not finished:")[1]


@pytest.mark.parametrize("store", ["fifo", "dangling link"])  # `rlrun -m` refused once its jobs are composed (~1 s)
def test_a_sweep_whose_store_cannot_be_used_stops_before_any_job(tmp_path, store):
    """Every job failed on the store and the command exited 0 (Hydra only warns about a callback's error)."""
    if store == "fifo":
        os.mkfifo(tmp_path / "mlflow.db")
    else:
        os.symlink(tmp_path / "gone" / "mlflow.db", tmp_path / "mlflow.db")
    r = sweep(tmp_path, "-m", "experiment=smoke", "seed=0,1", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db")
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.count("rlrun: error: tracking.uri=") == 1 and "(no job was run)" in r.stderr, r.stderr[-3000:]
    assert "Launching" not in r.stdout + r.stderr  # Hydra's "Launching 2 jobs locally": no job was launched
    assert not (tmp_path / "gone").exists()


def test_a_sweep_that_cannot_create_its_parent_run_exits_2_naming_the_store(tmp_path, capsys, monkeypatch):
    """A store that opens but takes no write (locked by another process, a read-only mount): said once, exit 2."""
    from omegaconf import OmegaConf

    from rlrun import sweep as sweep_module

    class Refusing:
        def create_run(self, *args, **kwargs):
            raise RuntimeError("(sqlite3.OperationalError) attempt to write a readonly database")

    monkeypatch.setattr(sweep_module.tracking, "connect", lambda uri, exp: (Refusing(), "1"))
    monkeypatch.setattr(sweep_module.tracking, "mark_experiment_kind", lambda client, exp: None)
    monkeypatch.setattr(sweep_module, "refuse_invalid_jobs", lambda config, name: None)
    monkeypatch.setattr(sweep_module, "swept_keys", lambda config: [])
    monkeypatch.setattr(sweep_module, "count", lambda config: "2 jobs")
    config = OmegaConf.create({
        "hydra": {"sweep": {"dir": str(tmp_path / "sweep")}, "launcher": {"_target_": "x"}, "overrides": {"task": []},
                  "sweeper": {}},
        "tracking": {"name": "mlflow", "uri": f"sqlite:///{tmp_path}/mlflow.db", "experiment": "rlrun"},
        "report": {"replay": False}})
    with pytest.raises(SystemExit) as e:
        sweep_module.SweepCallback().on_multirun_start(config)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "cannot be written" in err and "read-only" in err and "(no job was run)" in err, err


def test_a_sweep_counts_a_failed_job_the_store_holds_no_run_for(capsys):
    """tracking=none, or a job refused before its run existed: the jobs' own returns are counted, never 0."""
    from types import SimpleNamespace

    from rlrun.sweep import SweepCallback

    cb = SweepCallback()
    for i, error in enumerate([None, "RecordError: no record"]):
        cb.on_job_end(None, SimpleNamespace(_return_value={"error": error} if error else {"reward": 1.0},
                                            overrides=[f"head=h{i}"], status="JobStatus.COMPLETED"))
    with pytest.raises(SystemExit) as e:
        cb.on_multirun_end(None)
    assert e.value.code == 1
    assert "1 of 2 sweep jobs failed:\n  - head=h1: RecordError: no record" in capsys.readouterr().err


@pytest.mark.slow
def test_a_sweep_with_an_invalid_job_is_refused_before_any_job_runs(tmp_path):
    r = sweep(tmp_path, "-m", "experiment=smoke", "logprob_policy=always,skip", "loss=dapo,cispo",
              "loss.kl_coef=0.1")
    assert r.returncode == 2
    assert "sweep refused, 2 of 4 jobs are invalid (no job was run)" in r.stderr
    for loss in ("dapo", "cispo"):  # each invalid job named with its overrides and its full problem
        assert f"job experiment=smoke,logprob_policy=skip,loss={loss},loss.kl_coef=0.1" in r.stderr
    assert r.stderr.count("which needs loss.kl_coef=0 (got loss.kl_coef=0.1). Set loss.kl_coef=0") == 2
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "sweep").exists()


@pytest.mark.slow
def test_shipped_sweeps_run_from_any_working_directory(tmp_path):
    r = subprocess.run(["rlrun", "-cn", "logprob_policies", "--cfg", "hydra"], cwd=tmp_path, env=ENV,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "logprob_policy: always,window,skip" in r.stdout and "mode: MULTIRUN" in r.stdout
    r = subprocess.run(["rlrun", "-cn", "logprob_policies", "--cfg", "job"], cwd=tmp_path, env=ENV,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "steps: 100" in r.stdout, r.stderr[-2000:]


# --- Fast checks on a synthetic store (no training): the sweep parent, the report's figures and tables ---

def fake_sweep(tmp, kinds=("dapo", "dpo", "cispo")):
    """A parent run and one child per loss in a sqlite store, with the metrics the recipes log (DPO: accuracy and
    margin, no generation), like a finished sweep; -> (client, parent id, children)."""
    from conftest import new_store
    from mlflow.tracking import MlflowClient

    from rlrun import tracking
    from rlrun.tools import report

    client = MlflowClient(new_store(tmp))  # a copy of an empty store: no schema migrations per test
    exp = tracking.experiment_id(client, "rlrun")
    parent = client.create_run(exp, run_name="fake", tags={"rlrun.kind": "sweep"}).info.run_id
    for i, loss in enumerate(kinds):
        name = f"experiment=smoke,loss={loss},model.hidden_size=64,task.size=1000,train.steps=5"
        run = client.create_run(exp, run_name=name, tags={"mlflow.parentRunId": parent})
        rid = run.info.run_id
        client.log_batch(rid, params=[__import__("mlflow").entities.Param("loss.name", loss)])
        for step in range(5):
            m = {"loss": 1.0 / (step + 1 + i), "time/train_s": 0.1, "mem/train_peak_mib": 500.0 + i,
                 "mem/train_growth_mib": 20.0, "throughput/train_tokens_per_s": 1000.0 + i,
                 "time/step_s": 0.1 if loss == "dpo" else 0.3, "train_tokens": 100.0}  # step: train + generate
            if loss == "dpo":
                m.update({"rewards/accuracy": 0.5 + 0.1 * step, "rewards/margin": 0.2 * step})
            else:
                m.update({"eval/rewards/correct/mean": 0.05 * step})  # a task's named reward, held out
                m.update({"reward_mean": 0.1 * step, "throughput/gen_tokens_per_s": 300.0, "time/generate_s": 0.2,
                          "mem/generate_peak_mib": 400.0, "mem/generate_growth_mib": 5.0})
            tracking.log_metrics(client, rid, m, step)
        client.set_terminated(rid, "FINISHED")
    _, children = report.child_runs(client, parent)
    return client, parent, children


def test_report_colours_legend_dpo_panels_and_dashes(tmp_path):
    from rlrun.tools import report

    client, _, children = fake_sweep(tmp_path)
    names = report.labels(children)
    assert names == ["loss=dapo", "loss=dpo", "loss=cispo"]  # the overrides that differ, in full
    data = report.collect(client, children)
    fig = report.curves_figure(names, data)
    titles = [ax.get_title() for ax in fig.axes]
    assert any("accuracy (DPO)" in t for t in titles) and any("margin (DPO)" in t for t in titles)
    assert "held-out reward 'correct' per step" in titles  # each named reward's held-out mean, found in the runs
    assert all(ax.get_legend() is None for ax in fig.axes) and len(fig.legends) == 1  # one legend, figure-level
    assert [t.get_text() for t in fig.legends[0].get_texts()] == names  # the DPO run too
    legend_colour = {t.get_text(): h.get_color() for t, h in zip(fig.legends[0].get_texts(),
                                                                    fig.legends[0].legend_handles)}
    assert len({str(c) for c in legend_colour.values()}) == 3
    loss_ax = fig.axes[0]  # every run has a loss: its lines carry the legend's colours, in run order
    assert [str(line.get_color()) for line in loss_ax.get_lines()] == [str(legend_colour[n]) for n in names]
    text = report.table(names, data)
    assert "nan" not in text and text.count("\n") == 3  # every run a row, DPO's too (it generates nothing)
    md = report.markdown(names, data)
    assert md.count("\n") == 4 and "| loss=dpo |" in md and "nan" not in md


def test_figures_are_legible_in_the_artifact_viewer(tmp_path):
    from rlrun.tools import report

    client, _, children = fake_sweep(tmp_path)
    figs, _ = report.figures(client, children)
    report.write(figs, ([], []), tmp_path / "out")
    import matplotlib.image as mpimg

    for name, fig in figs.items():
        h, w = mpimg.imread(tmp_path / "out" / name).shape[:2]
        assert 700 <= w <= 1000, (name, w)  # shown at about its own size in MLflow's artifact viewer
        assert h <= 4000, (name, h)
        sizes = [t.get_fontsize() for t in fig.findobj(lambda a: hasattr(a, "get_fontsize") and a.get_text())]
        assert min(sizes) * report.DPI / 72 >= 11, (name, min(sizes))  # every label >= 11 px


def test_sweep_parent_carries_the_table_and_children_get_short_full_names(tmp_path):
    from rlrun.sweep import SweepCallback
    from rlrun.tools import report

    client, parent, children = fake_sweep(tmp_path)
    cb = SweepCallback()
    cb.client, cb.parent_id = client, parent
    cb.draw(report, children, str(tmp_path / "figures"))
    run = client.get_run(parent)
    note = run.data.tags["mlflow.note.content"]
    # DPO generates nothing: the whole step; 5 steps leave 3 timed, too few for a ranking
    assert note.startswith("Cost of the whole step: too few timed steps to compare (loss=dapo, loss=dpo, loss=cispo: "
                           "3; 5 are needed after the first 2: more train.steps).")
    assert "- **loss=dpo**: changed phases 0.1000 s [0.1000, 0.1000] · 0.1000 s/step · 1000 tokens/s · reward / acc " \
        "0.900" in note and "nan" not in note
    arts = {a.path for a in client.list_artifacts(parent)}
    assert {"comparison.json", "curves.png", "memory.png", "throughput.png"} <= arts
    names = {client.get_run(c.info.run_id).data.tags["mlflow.runName"] for c in children}
    assert names == {"loss=dapo", "loss=dpo", "loss=cispo"}


@pytest.mark.parametrize("still_running", [0, 2])
def test_a_sweep_that_ends_early_marks_its_running_jobs_killed_and_draws_the_finished_ones(tmp_path, capsys,
                                                                                        still_running):
    from rlrun.sweep import SweepCallback

    client, parent, children = fake_sweep(tmp_path)  # three FINISHED jobs
    exp = client.get_run(parent).info.experiment_id
    running = [client.create_run(exp, tags={"mlflow.parentRunId": parent}).info.run_id for _ in range(still_running)]
    cb = SweepCallback()
    cb.client, cb.parent_id, cb.figures_dir = client, parent, str(tmp_path / "figures")
    cb.end_interrupted()
    said = capsys.readouterr().err
    # the finished jobs' comparison is drawn as the sweep's end would have drawn it
    assert f"drawing the comparison of the 3 finished job(s): {tmp_path / 'figures'}" in said
    assert {"comparison.json", "curves.png"} <= {a.path for a in client.list_artifacts(parent)}
    assert (tmp_path / "figures" / "curves.png").exists()
    assert client.get_run(parent).info.status == "KILLED"
    assert all(client.get_run(r).info.status == "KILLED" for r in running)
    assert all(client.get_run(c.info.run_id).info.status == "FINISHED" for c in children)
    if still_running:
        assert "its parent run is marked KILLED, 2 job(s) still running marked KILLED with it" in said
    else:
        assert "its parent run is marked KILLED, no job was still running" in said and "0 job" not in said
    assert "rlrun: the sweep's answer" in said  # the finished jobs' answer, as the sweep's end would print it


@pytest.mark.slow
def test_report_unknown_run_is_one_clear_message(tmp_path):
    fake_sweep(tmp_path)
    r = subprocess.run(["rlrun-report", "deadbeef", "--uri", f"sqlite:///{tmp_path}/mlflow.db"], cwd=tmp_path,
                       env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.startswith("rlrun-report:"), r.stderr



@pytest.mark.slow  # one `rlrun -m` that is refused (a few seconds)
@pytest.mark.parametrize("args", [["seed=range(0,0)"], ["seed=range(0,0)", "head=dense,tiled"]])
def test_a_sweep_of_no_jobs_is_one_error_and_exit_2(tmp_path, args):
    """Was: exit 0, 'Launching 0 jobs', and a parent run left FAILED."""
    r = sweep(tmp_path, "-m", *args, "experiment=smoke")
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == (
        "rlrun: error: the sweep has no jobs: seed=range(0,0) give(s) no values; give every swept key at least one "
        "value, e.g. seed='range(0,3)' or seed=0,1,2")
    assert not (tmp_path / "mlflow.db").exists()  # refused before the parent run was created


@pytest.mark.slow  # a 2-job sweep of 2-step runs in a subprocess (~20 s)
def test_a_sweep_without_tracking_shortens_its_jobs_output_as_a_tracked_one_does(tmp_path):
    """A job of a tracking=none sweep has no parent run; it is still a job (Hydra's multirun), so its console says
    one header line and no samples table, and a single run of the same config says both."""
    r = sweep(tmp_path, "-m", "experiment=smoke", "head=dense,chunked", "train.steps=2", "tracking=none")
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout + r.stderr
    assert "last samples:" not in out and "logging:" not in out, out[-3000:]
    assert out.count("rlrun: loss=dapo") == 2, out[-3000:]  # each job's header, one line
    one = subprocess.run(["rlrun", "experiment=smoke", "train.steps=2", "tracking=none"], cwd=tmp_path, env=ENV,
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 0 and "last samples:" in one.stdout + one.stderr, one.stderr[-2000:]
