"""What a user sees in MLflow, checked against a real `mlflow server` on 127.0.0.1: a 3-job sweep logged over HTTP,
then read back through the client: the experiment kind (model training, not GenAI), the runs' source and git
tags, their descriptions, the sweep parent's comparison table, and figures legible in the artifact viewer."""

import os
import subprocess
from pathlib import Path

import pytest
from helpers import free_port, start_server, stop_server

from rlrun import tracking

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "false", "PYTHONPATH": str(ROOT / "tests")}

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("mlflow_ui")]  # one server and one sweep for the module


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A tracking server with its own sqlite store and artifact folder; stopped at the end."""
    tmp = tmp_path_factory.mktemp("server")
    proc, url = start_server(tmp, free_port(), ENV)
    try:
        yield url, tmp
    finally:
        stop_server(proc)


@pytest.fixture(scope="module")
def swept(server):
    url, tmp = server
    work = tmp / "work"
    work.mkdir()
    r = subprocess.run(["rlrun", "-cn", "logprob_policies", "experiment=smoke", "train.steps=3", "progress=false",
                        f"tracking.uri={url}", "tracking.experiment=ui", f"hydra.sweep.dir={work}/sweep"],
                       cwd=work, env=ENV, capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stderr[-3000:]
    client = tracking.open_client(url)
    exp = client.get_experiment_by_name("ui")
    runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"])
    parent = next(x for x in runs if x.data.tags.get("rlrun.kind") == "sweep")
    children = [x for x in runs if x.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    return client, exp, parent, children, tmp


def test_experiment_opens_as_model_training(swept):
    _, exp, _, children, _ = swept
    assert exp.tags.get("mlflow.experimentKind") == "custom_model_development"
    assert len(children) == 3


def test_runs_say_where_they_come_from_and_what_they_are(swept):
    _, _, parent, children, _ = swept
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
    tab), measurements of the machine under system/ (MLflow's "System metrics" tab): no catch-all section."""
    client, _, _, children, _ = swept
    for child in children:
        keys = set(child.data.metrics)
        assert {"train/loss", "train/reward_mean", "train/grad_norm", "train/lr", "system/time/step_s",
                "system/mem/train_peak_mib", "system/throughput/gen_tokens_per_s", "system/passes/old_run_total",
                "system/summary/step_s"} <= keys, sorted(keys)
        assert {k.split("/")[0] for k in keys} == {"train", "eval", "system"}, sorted(keys)
        steps = [m.step for m in client.get_metric_history(child.info.run_id, "train/loss")]
        assert steps == [0, 1, 2]


def test_sweep_parent_description_holds_the_comparison_table(swept):
    client, _, parent, children, _ = swept
    note = parent.data.tags["mlflow.note.content"]
    assert "| run | reward / acc | step s |" in note
    for c in children:
        assert f"| {c.data.tags['mlflow.runName']} |" in note
    assert "comparison.json" in {a.path for a in client.list_artifacts(parent.info.run_id)}
    name = parent.data.tags["mlflow.runName"]
    assert name.startswith("logprob_policies: ") and "tracking.uri" not in name and "progress" not in name


def test_figures_are_sized_for_the_artifact_viewer(swept):
    import matplotlib.image as mpimg

    client, _, parent, _, tmp = swept
    for name in ("curves.png", "memory.png", "throughput.png"):
        path = client.download_artifacts(parent.info.run_id, name, str(tmp))
        h, w = mpimg.imread(path).shape[:2]
        assert 700 <= w <= 1000 and 200 <= h <= 4000, (name, w, h)
