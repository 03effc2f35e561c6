"""MLflow as the dashboard, piece by piece (tracking/ui.py, sweep naming, the parent's comparison, the order metrics
reach the store): what the UI reads, checked on a local sqlite store. test_mlflow_ui.py checks it all end to end
against a real `mlflow server`."""

import json

from conftest import new_store
from omegaconf import OmegaConf

from rlrun import runner, sweep, sweep_jobs, tracking
from rlrun.tools import note
from rlrun.tracking import ui

CFG = {"experiment": "rlrun", "parent_run_id": None}


def test_a_sweep_names_its_jobs_by_the_keys_that_differ(monkeypatch):
    config = OmegaConf.create({"hydra": {"sweeper": {"params": {"loss": "dapo,cispo"}},
                                         "overrides": {"task": ["head=dense,tiled", "experiment=smoke",
                                                                "+train.lr=1e-3"]}}})
    assert sweep_jobs.swept_keys(config) == ["loss", "head"]
    monkeypatch.setenv(tracking.SWEEP_KEYS_ENV, "loss,head")
    assert tracking.short_name(["loss=cispo", "head=tiled", "experiment=smoke", "+train.lr=1e-3"]) == \
        "loss=cispo,head=tiled"
    monkeypatch.setenv(tracking.SWEEP_KEYS_ENV, "")  # one job, or nothing differs: the full overrides stay
    assert tracking.short_name(["head=tiled", "experiment=smoke"]) is None
    one = OmegaConf.create({"hydra": {"sweeper": {"params": None}, "overrides": {"task": ["head=tiled", "x=1"]}}})
    assert sweep_jobs.swept_keys(one) == []


def test_the_saved_view_has_the_metric_columns_and_adds_swept_params(tmp_path):
    client = tracking.open_client(new_store(tmp_path))
    exp = client.create_experiment("e")
    ui.prepare(client, exp)
    tags = client.get_experiment(exp).tags
    assert tags[ui.PRIMARY_METRIC_TAG] == "train/reward_mean"  # the chart view's first chart
    state, created = ui.read_view(tags)
    envelope = json.loads(tags["mlflow.sharedViewState.rlrun"])  # MLflow's saved-view envelope
    assert envelope["name"] == "rlrun: runs by sweep" and isinstance(envelope["createdAt"], int)
    assert state["selectedColumns"][:4] == ["metrics.`train/reward_mean`", "metrics.`train/rewards/accuracy`",
                                            "metrics.`eval/accuracy`", "metrics.`system/summary/step_s`"]
    assert "attributes.`Description`" in state["selectedColumns"]  # a sweep job's answer heads it (sweep.py)
    assert state["groupBy"]["groupByKeys"] == [{"mode": "tag", "groupByData": "rlrun.sweep_group"}]
    # a user who saved over the view keeps it; a sweep adds its keys' columns; a named primary metric stays
    state["groupBy"] = None
    client.set_experiment_tag(exp, ui.VIEW_TAG, ui.envelope(state, created))
    client.set_experiment_tag(exp, ui.PRIMARY_METRIC_TAG, "eval/accuracy")
    ui.prepare(client, exp, ("head.name", "train.lr"), "train/rewards/accuracy")
    tags = client.get_experiment(exp).tags
    state, again = ui.read_view(tags)
    assert state["groupBy"] is None and again == created
    assert state["selectedColumns"][-2:] == ["params.`head.name`", "params.`train.lr`"]
    assert tags[ui.PRIMARY_METRIC_TAG] == "eval/accuracy"
    client.set_experiment_tag(exp, ui.VIEW_TAG, "not json")  # unreadable: replaced by rlrun's
    ui.prepare(client, exp, ("head.name",))
    assert ui.read_view(client.get_experiment(exp).tags)[0]["selectedColumns"][-1] == "params.`head.name`"


def test_a_jobs_verdict_heads_its_description_once(tmp_path):
    """The runs table's Description column (the saved view's) shows each job's answer: a sweep's end writes it as the
    description's first line; the drawing during the sweep wrote an earlier one there, which is replaced."""
    client = tracking.open_client(new_store(tmp_path))
    exp = client.create_experiment("e")
    run_id = client.create_run(exp, tags={"mlflow.note.content": "GRPO-family RL with the tiled head."}).info.run_id
    callback = sweep.SweepCallback()
    callback.client = client
    callback.mark_verdict(client.get_run(run_id), "same · no difference measured vs head=dense")
    callback.mark_verdict(client.get_run(run_id), "same · 0.71x vs head=dense")
    tags = client.get_run(run_id).data.tags
    assert tags["mlflow.note.content"] == "same · 0.71x vs head=dense.\n\nGRPO-family RL with the tiled head."
    assert tags[ui.VERDICT_TAG] == "same · 0.71x vs head=dense"


def test_a_group_override_is_shown_as_its_name_param():
    config = OmegaConf.create({"head": {"name": "tiled", "size": 4}, "train": {"lr": 0.1}})
    assert [ui.param_of(config, k) for k in ("head", "train.lr", "missing")] == ["head.name", "train.lr", "missing"]


def test_the_learning_curve_is_the_first_metric_a_run_stores(tmp_path):
    """MLflow's compare page opens on the first metric the runs logged: not the plan, the warm start or the first
    evaluation (logged before the first step), but the learning curve; they follow it in the same batch."""
    uri = new_store(tmp_path)
    tracker = tracking.MLflow(OmegaConf.create({**CFG, "uri": uri}), {"loss": {"name": "dapo"}}, "x")
    tracker.log(0, {"plan/train_peak_mib": 1.0, "time/warm_start_s": 2.0})
    tracker.log(0, {"eval/accuracy": 0.5})
    tracker.log(0, {"loss": 0.1, "reward_mean": 0.25})
    tracker.log(1, {"loss": 0.2, "reward_mean": 0.5})
    tracker.summary({"step_s": 0.03617129350022878, "peak_mib": 640.45703125, "reward_first": 0.1})
    tracker.finish("FINISHED")
    run = tracking.open_client(uri).get_run(tracker.run_id)
    assert list(run.data.metrics)[0] == "train/reward_mean"
    # the runs table shows values as stored: the summary's at 4 significant digits, its learning numbers not again
    assert run.data.metrics["system/summary/step_s"] == 0.03617 and run.data.metrics["system/summary/peak_mib"] == 640.5
    assert "system/summary/reward_first" not in run.data.metrics
    assert run.data.metrics["system/time/warm_start_s"] == 2.0 and run.data.metrics["eval/accuracy"] == 0.5
    # a run that ends before its first step still stores what it logged
    early = tracking.MLflow(OmegaConf.create({**CFG, "uri": uri}), {}, "y")
    early.log(0, {"plan/train_peak_mib": 1.0})
    early.finish("FAILED")
    assert tracking.open_client(uri).get_run(early.run_id).data.metrics == {"system/plan/train_peak_mib": 1.0}


def test_results_open_on_model_training_and_mlflow_prints_no_genai_link(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", raising=False)
    tracker = tracking.MLflow(OmegaConf.create({**CFG, "uri": "sqlite:///mlflow.db"}), {}, "x")
    import os

    assert os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] == "true"  # its experiment link opens GenAI
    for uri, base in (("sqlite:///mlflow.db", "http://127.0.0.1:5000"), ("http://h:5001/", "http://h:5001")):
        hint = runner.results_hint(OmegaConf.create({"tracking": {"name": "mlflow", "uri": uri}}), tracker)
        assert f"{base}/#/experiments/1/runs?workflowType=machine_learning&viewStateShareKey=rlrun" in hint
        assert f"{base}/#/experiments/1/runs/{tracker.run_id}?workflowType=machine_learning" in hint
    text = sweep.links("http://h:5001", "3", "abc")
    assert "runs?workflowType=machine_learning&viewStateShareKey=rlrun" in text and "runs/abc?workflowType" in text


def test_the_parent_description_leads_with_the_answer_then_one_line_per_job():
    nan = float("nan")
    step = note.STEP  # the report's step-time column (the console's, without evaluation)
    rows = [{"run": "head=dense", "reward / acc": 0.5, step: 0.9, "growth MiB": 12.0},
            {"run": "log_samples=*", "reward / acc": 0.5, step: 0.3, "growth MiB": 1.0},
            {"run": "failed", "reward / acc": nan, step: nan, "growth MiB": nan}]
    specs = {"reward / acc": ".3f", step: ".4f", "growth MiB": ".0f"}
    verdicts = {"head=dense": {"phase_s": 0.2, "phase_low": 0.19, "phase_high": 0.21, "same": None,
                               "same_text": "the baseline"},
                "log_samples=*": {"phase_s": 0.25, "phase_low": 0.2, "phase_high": 0.3, "same": True,
                                  "same_text": "loss off by 1e-08"}}
    text = note.comparison_note(rows, specs, ("Cost of train against head=dense (head): no difference measured.",
                                              verdicts))
    lines = text.splitlines()
    assert lines[0] == "Cost of train against head=dense (head): no difference measured."  # plain: the runs table
    assert lines[2] == ("- **head=dense**: changed phases 0.2000 s [0.1900, 0.2100] · 0.9000 s/step · reward / acc "
                        "0.500 · growth 12 MiB · same result: – (the baseline)")  # cheapest on the changed phases
    assert lines[3].startswith(r"- **log\_samples=\***: changed phases 0.2500 s") and "same result: yes" in lines[3]
    assert lines[4].startswith("- **failed**: – s/step")
    bare = note.comparison_note(rows, specs).splitlines()  # no answer: no ranking line, the jobs by step time
    assert bare[0].startswith(r"- **log\_samples=\***: 0.3000 s/step")
    assert "|" not in text  # no table: MLflow's run page draws it without borders and folds it after a row


def test_each_ended_job_says_how_long_the_sweep_has_left(monkeypatch, caplog):
    clock = iter([0.0, 10.0, 10.0, 40.0, 40.0, 70.0, 70.0, 71.0])
    monkeypatch.setattr(sweep.time, "monotonic", lambda: next(clock))
    cb = sweep.SweepCallback()
    cb.total = 3  # three jobs, run in this process
    with caplog.at_level("INFO", logger="rlrun.sweep"):
        for _ in range(3):
            cb.on_job_start(None)
            cb.on_job_end(None, None)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["sweep: job 1 of 3 ended after 10 s; about 20 s left (the mean job so far)",
                     "sweep: job 2 of 3 ended after 30 s; about 20 s left (the mean job so far)",
                     "sweep: job 3 of 3 ended after 30 s; the last one"]
    quiet = sweep.SweepCallback()  # jobs not known up front, or run by another launcher's workers: no line
    quiet.on_job_start(None)
    quiet.on_job_end(None, None)
    assert len(caplog.records) == 3


def test_a_sweep_is_named_by_what_it_sweeps_or_by_its_user():
    """Ad-hoc sweeps are no longer all named `sweep`: report.name, else the config's name (-cn), else the overrides
    with more than one value (a list value is one value; the repeats are not what a sweep is about)."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"report": {"name": None}})
    overrides = ["head=dense,tiled,chunked", "experiment=smoke", "train.betas=[0.9,0.99]", "report.repeat=0,1,2",
                 "seed=range(2)"]
    assert sweep.sweep_name(cfg, "config", overrides) == "head=dense,tiled,chunked seed=range(2)"
    assert sweep.sweep_name(cfg, "heads_on_smollm2", overrides) == "heads_on_smollm2"
    assert sweep.sweep_name(OmegaConf.create({"report": {"name": "mine"}}), "x", overrides) == "mine"
    assert sweep.sweep_name(cfg, None, ["experiment=smoke"]) == "sweep"
