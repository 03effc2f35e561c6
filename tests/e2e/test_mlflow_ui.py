"""What a user sees in MLflow, checked against a real `mlflow server` on 127.0.0.1: a 3-job sweep logged over HTTP,
then read back through the client and the REST API the UI reads: the experiment kind (model training, not GenAI),
the links printed, the saved view (metric and swept-key columns, runs grouped by sweep), short run names (while
the sweep runs too) with the full overrides as a tag, the metric the compare page opens on, no offload phases with
offload=off, the runs' source and git tags, their descriptions, the sweep parent's comparison, and figures legible
in the artifact viewer (docs/figures/mlflow_*.png are screenshots of these pages)."""

import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import TEST_PATH
from helpers import free_port, start_server, stop_server

from rlrun import tracking
from rlrun.tracking import ui

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "false",
       "PYTHONPATH": os.pathsep.join([str(ROOT), TEST_PATH])}  # this checkout's rlrun, wherever installed

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("mlflow_ui")]  # one server and one sweep for the module


@pytest.fixture(scope="session")  # not module: xdist may run another module between this one's tests
def server(tmp_path_factory):
    """A tracking server with its own sqlite store and artifact folder; stopped at the end."""
    tmp = tmp_path_factory.mktemp("server")
    proc, url = start_server(tmp, free_port(), ENV)
    try:
        yield url, tmp
    finally:
        stop_server(proc)


@pytest.fixture(scope="session")  # not module: xdist may run another module between this one's tests
def swept(server):
    url, tmp = server
    work = tmp / "work"
    work.mkdir()
    proc = subprocess.Popen(["rlrun", "-cn", "logprob_policies", "experiment=smoke", "train.steps=3",
                             "progress=false", f"tracking.uri={url}", "tracking.experiment=ui",
                             f"hydra.sweep.dir={work}/sweep"], cwd=work, env=ENV, stdout=open(tmp / "out.txt", "w"),
                            stderr=open(tmp / "err.txt", "w"))
    client = tracking.open_client(url)
    running = {}  # run id -> name, of the children seen while the sweep still ran (before its end renames any)
    while proc.poll() is None:
        exp = client.get_experiment_by_name("ui")
        if exp is not None:
            runs = client.search_runs([exp.experiment_id])
            if any(x.data.tags.get("rlrun.kind") == "sweep" and x.info.status == "RUNNING" for x in runs):
                running |= {x.info.run_id: x.data.tags["mlflow.runName"] for x in runs
                            if "mlflow.parentRunId" in x.data.tags}
        time.sleep(0.3)
    assert proc.wait(timeout=1500) == 0, (tmp / "err.txt").read_text()[-3000:]
    exp = client.get_experiment_by_name("ui")
    runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"])
    parent = next(x for x in runs if x.data.tags.get("rlrun.kind") == "sweep")
    children = [x for x in runs if x.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    return client, exp, parent, children, tmp, running


def test_experiment_opens_as_model_training(swept):
    _, exp, _, children, *_ = swept
    assert exp.tags.get("mlflow.experimentKind") == "custom_model_development"
    assert len(children) == 3


def test_runs_say_where_they_come_from_and_what_they_are(swept):
    _, _, parent, children, *_ = swept
    in_git = tracking.git_commit() is not None
    for run in [parent, *children]:
        tags = run.data.tags
        assert tags["mlflow.source.name"] == "rlrun" and tags["mlflow.source.type"] == "LOCAL"
        assert tags["mlflow.user"] and tags["rlrun.host"] and tags["rlrun.version"]
        assert "-cn logprob_policies" in tags["rlrun.command"]
        assert ("mlflow.source.git.commit" in tags) == in_git
    for child in children:
        note = child.data.tags["mlflow.note.content"]
        policy = child.data.params["logprob_policy.name"]
        assert f"logprob policy {policy}" in note and "dapo loss" in note and "model tiny, task arith" in note
    assert sorted(c.data.tags["mlflow.runName"] for c in children) == [
        "logprob_policy=always", "logprob_policy=skip", "logprob_policy=window"]  # what differs, in full


def test_metrics_are_namespaced_learning_apart_from_the_machine(swept):
    """Learning curves under train/ and held-out evaluation under eval/ (the two sections of the "Model metrics"
    tab), measurements of the machine under system/ (MLflow's "System metrics" tab), a sweep job's answer among
    them (system/answer/, set at the sweep's end: the Model metrics tab opens on the learning curves), and the
    machine's load at each step: no catch-all section."""
    client, _, _, children, *_ = swept
    for child in children:
        keys = set(child.data.metrics)
        assert {"train/loss", "train/reward_mean", "train/grad_norm", "train/lr", "system/time/step_s",
                "system/mem/train_peak_mib", "system/throughput/gen_tokens_per_s", "system/passes/old_run_total",
                "system/summary/step_s"} <= keys, sorted(keys)
        assert {k.split("/")[0] for k in keys} == {"train", "eval", "system"}, sorted(keys)
        assert {"system/answer/same", "system/host/load_1m"} <= keys
        steps = [m.step for m in client.get_metric_history(child.info.run_id, "train/loss")]
        assert steps == [0, 1, 2]


def test_sweep_parent_description_holds_the_comparison_table(swept):
    client, _, parent, children, *_ = swept
    note = parent.data.tags["mlflow.note.content"]
    assert note.startswith("Cost of old_logprobs + ref_logprobs against ") and "Same result:" in note
    assert note.count("\n- **logprob\\_policy=") == 3 and "changed phases" in note
    for c in children:  # each job ran `rlrun check` first (report.check_jobs) and logged what it found
        # dense: "no full logits" does not apply; sync, one pass a rollout: nor "generator process", "logprob schedule"
        # nor speculation (off), and a job's check leaves resume out: 5 n/a of the 18
        assert c.data.tags["rlrun.check"] == "13 of 13 probes pass (5 n/a)"
        assert c.data.metrics["system/check/vs_baseline"] == 1.0 and "system/check/sequence_alone" in c.data.metrics
    for c in children:
        assert f"- **{c.data.tags['mlflow.runName'].replace('_', chr(92) + '_')}**: " in note
    assert "comparison.json" in {a.path for a in client.list_artifacts(parent.info.run_id)}
    name = parent.data.tags["mlflow.runName"]
    assert name.startswith("logprob_policies: ") and "tracking.uri" not in name and "progress" not in name


def test_each_job_states_its_answer_where_the_runs_table_shows_it(swept):
    """The saved view's Description column (before the metrics: no scrolling) opens with each job's verdict."""
    _, exp, _, children, *_ = swept
    assert "attributes.`Description`" in json.loads(json.loads(exp.tags[ui.VIEW_TAG])["state"])["selectedColumns"]
    verdicts = {c.data.tags["mlflow.runName"]: c.data.tags[ui.VERDICT_TAG] for c in children}
    assert verdicts["logprob_policy=always"] == "baseline"
    for name in ("logprob_policy=window", "logprob_policy=skip"):
        assert verdicts[name].startswith("same · ") and verdicts[name].endswith(" vs logprob_policy=always")
    for c in children:
        assert c.data.tags["mlflow.note.content"].startswith(c.data.tags[ui.VERDICT_TAG] + ".\n\nGRPO-family RL")


def test_figures_are_sized_for_the_artifact_viewer(swept):
    import matplotlib.image as mpimg

    client, _, parent, _, tmp, _ = swept
    for name in ("curves.png", "memory.png", "throughput.png"):
        path = client.download_artifacts(parent.info.run_id, name, str(tmp))
        h, w = mpimg.imread(path).shape[:2]
        assert 700 <= w <= 1000 and 200 <= h <= 4000, (name, w, h)


def test_runs_are_named_by_what_differs_from_the_start_with_the_full_overrides_as_a_tag(swept):
    _, _, parent, children, _, running = swept
    assert running, "no child run was seen while the sweep ran"
    assert set(running.values()) <= {"logprob_policy=always", "logprob_policy=skip", "logprob_policy=window"}
    for child in children:
        policy = child.data.params["logprob_policy.name"]
        assert child.data.tags["mlflow.runName"] == f"logprob_policy={policy}"
        overrides = child.data.tags["rlrun.overrides"].split()
        assert {f"logprob_policy={policy}", "experiment=smoke", "train.steps=3"} <= set(overrides)
        assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert child.data.tags["rlrun.sweep_group"] == parent.data.tags["rlrun.sweep_group"]  # the view's group


def test_the_experiment_opens_with_metric_columns_grouped_by_sweep(swept):
    _, exp, _, _, tmp, _ = swept
    view = json.loads(exp.tags["mlflow.sharedViewState.rlrun"])  # the "Views" menu's entry
    assert view["name"] == "rlrun: runs by sweep"
    state = json.loads(view["state"])
    assert {"metrics.`train/reward_mean`", "metrics.`eval/accuracy`", "metrics.`system/summary/step_s`",
            "params.`logprob_policy.name`"} <= set(state["selectedColumns"])
    assert state["groupBy"]["groupByKeys"] == [{"mode": "tag", "groupByData": "rlrun.sweep_group"}]
    assert exp.tags["mlflow.experiment.primaryMetric.name"] == "train/reward_mean"  # the chart view's first chart
    out = (tmp / "out.txt").read_text()
    base = f"#/experiments/{exp.experiment_id}/runs"
    assert f"{base}?workflowType=machine_learning&viewStateShareKey=rlrun" in out  # the links rlrun prints
    assert f"{base}/" in out and "View experiment at" not in out  # MLflow's own link opens GenAI traces


def test_compare_opens_on_the_learning_curve_and_phases_that_did_not_run_are_absent(swept):
    """MLflow's compare page shows the first metric of the runs as the store returns them (get-run's order)."""
    client, _, _, children, *_ = swept
    url = client.tracking_uri
    for child in children:
        with urllib.request.urlopen(f"{url}/api/2.0/mlflow/runs/get?run_id={child.info.run_id}", timeout=10) as r:
            keys = [m["key"] for m in json.load(r)["run"]["data"]["metrics"]]
        assert keys[0] == "train/reward_mean", keys[:5]
        assert child.data.params["offload.name"] == "off"
        assert not [k for k in keys if "offload" in k or "onload" in k]
        assert {"system/time/train_s", "system/mem/generate_peak_mib"} <= set(keys)


def test_the_compare_link_opens_the_chart_view_on_each_jobs_answer(swept):
    """The chart view's first section: bars of each job's answer, the numbers of its verdict (a job whose cost is
    within the noise drawn too, marked by answer/differs 0); the printed `compare` link opens it on this sweep's
    runs only."""
    _, exp, parent, children, tmp, _ = swept
    state = json.loads(json.loads(exp.tags[ui.VIEW_TAG])["state"])
    assert state["compareRunSections"][0]["uuid"] == ui.ANSWER_SECTION and state["isAccordionReordered"]
    first = [c["metricKey"] for c in state["compareRunCharts"] if c["metricSectionId"] == ui.ANSWER_SECTION]
    assert first == [*ui.ANSWER_CHARTS, "train/reward_mean"]
    for child in children:
        m, brief = child.data.metrics, child.data.tags[ui.VERDICT_TAG]
        assert m.get("system/answer/phase_s", 1.0) > 0  # absent: no step of the job ran at the full pace
        if brief == "baseline":
            assert m["system/answer/cost_x"] == m["system/answer/same"] == 1.0
        else:
            assert m["system/answer/same"] == (1.0 if brief.startswith("same") else 0.0)
            assert ("system/answer/cost_x" in m) == ("too few" not in brief)  # drawn, in the noise too
            if "no difference measured" in brief:  # drawn, marked, its interval holding 1
                assert m["system/answer/differs"] == 0
                assert m["system/answer/cost_x_low"] <= 1 <= m["system/answer/cost_x_high"]
            elif "system/answer/cost_x" in m:  # the brief's two decimals of the same ratio
                assert abs(m["system/answer/cost_x"] - float(brief.split(" · ")[1].split("x vs")[0])) <= 0.006
                assert m["system/answer/differs"] != 0
    view_id = f"rlrun-sweep-{parent.info.run_id}"  # the sweep's own view: its runs only
    sweep_state = json.loads(json.loads(exp.tags[f"mlflow.sharedViewState.{view_id}"])["state"])
    assert sweep_state["searchFilter"] == f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
    assert sweep_state["compareRunSections"][0]["uuid"] == ui.ANSWER_SECTION
    assert f"viewStateShareKey={view_id}&compareRunsMode=CHART" in (tmp / "out.txt").read_text()
