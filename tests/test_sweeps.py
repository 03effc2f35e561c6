"""Sweeps through the real entry point: parent/child runs, figures, failures, and the report command."""

import itertools
import os
import subprocess
from pathlib import Path

import pytest
from helpers import runs

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "false", "PYTHONPATH": str(ROOT / "tests")}
FIGURES = {"memory.png", "throughput.png", "curves.png", "equivalence.png"}


def sweep(tmp, *args):
    return subprocess.run(["rlrun", *args, "progress=false", f"hydra.sweep.dir={tmp}/sweep"], cwd=tmp, env=ENV,
                          capture_output=True, text=True, timeout=1200)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("smoke")
    r = sweep(tmp, "-cd", str(ROOT / "sweeps"), "-cn", "smoke")
    assert r.returncode == 0, r.stderr[-3000:]
    client, all_runs = runs(tmp / "mlflow.db")
    return tmp, client, all_runs


def test_smoke_sweep_has_one_parent_and_a_child_per_job(smoke):
    tmp, client, all_runs = smoke
    parents = [r for r in all_runs if r.data.tags.get("rlrun.kind") == "sweep"]
    assert len(parents) == 1
    parent = parents[0]
    assert parent.info.status == "FINISHED" and parent.data.params["sweep.name"] == "smoke"
    children = [r for r in all_runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(children) == len(all_runs) - 1 == 36  # 2 losses x 3 heads x 3 policies x 2 offload
    assert all(c.info.status == "FINISHED" for c in children)
    combos = {(c.data.params["loss.name"], c.data.params["head.name"], c.data.params["logprob_policy.name"],
               c.data.params["offload.name"]) for c in children}
    assert combos == set(itertools.product(["dapo", "cispo"], ["dense", "tiled", "chunked"],
                                           ["always", "window", "skip"], ["off", "on"]))
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert FIGURES | {"sweep_config.yaml"} <= artifacts
    assert FIGURES <= {p.name for p in (tmp / "sweep" / "figures").iterdir()}


def test_equivalence_holds_across_the_smoke_sweep(smoke):
    tmp, _, _ = smoke
    lines = (tmp / "sweep" / "figures" / "equivalence.txt").read_text().splitlines()
    assert len(lines) == 34  # per loss: 17 efficient variants vs the dense/always/off baseline
    for line in lines:
        dloss = float(line.split("max|dloss|=")[1].split()[0])
        dreward = float(line.split("max|dreward|=")[1])
        assert dloss < 1e-5 and dreward == 0, line


def test_figures_have_one_series_per_job_and_report_redraws_them_from_the_store(smoke):
    from mlflow.tracking import MlflowClient

    from rlrun import report

    tmp, _, all_runs = smoke
    parent = next(r for r in all_runs if r.data.tags.get("rlrun.kind") == "sweep")
    client = MlflowClient(f"sqlite:///{tmp}/mlflow.db")
    _, children = report.child_runs(client, parent.info.run_id)
    figs, rows = report.figures(client, children)
    loss_ax, reward_ax = figs["curves.png"].axes
    assert len(loss_ax.get_lines()) == len(reward_ax.get_lines()) == 36
    assert {t.get_text() for t in reward_ax.get_legend().get_texts()} == set(report.labels(children))
    assert loss_ax.get_xlabel() == "optimizer step"
    assert "MiB" in [a.get_ylabel() for a in figs["memory.png"].axes]  # the colour bars
    out = tmp / "report"
    r = subprocess.run(["rlrun-report", parent.info.run_id, "--uri", f"sqlite:///{tmp}/mlflow.db", "--out", str(out)],
                       cwd=tmp, env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    for name in FIGURES:  # same store, same data: the same pixels
        assert (out / name).read_bytes() == (tmp / "sweep" / "figures" / name).read_bytes(), name
    r = subprocess.run(["rlrun-report", "--experiment", "rlrun", "--filter", "params.`head.name` = 'tiled'",
                        "--uri", f"sqlite:///{tmp}/mlflow.db", "--out", str(tmp / "filtered")],
                       cwd=tmp, env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "12 runs" in r.stdout


def test_failed_jobs_are_marked_and_the_sweep_goes_on_then_exits_nonzero(tmp_path):
    r = sweep(tmp_path, "-m", "experiment=smoke", "task.reward=rlrun.tasks:partial_credit,helpers:nan_reward",
              "logprob_policy=always,skip", "loss.kl_coef=0.1")
    assert r.returncode == 1
    assert "3 of 4 sweep jobs failed" in r.stderr
    _, all_runs = runs(tmp_path / "mlflow.db")
    parent = next(r for r in all_runs if r.data.tags.get("rlrun.kind") == "sweep")
    children = {(c.data.params["task.reward"], c.data.params["logprob_policy.name"]): c
                for c in all_runs if c is not parent}
    assert len(children) == 4 and parent.info.status == "FAILED"
    assert children["rlrun.tasks:partial_credit", "always"].info.status == "FINISHED"
    nan = children["helpers:nan_reward", "always"]
    assert nan.info.status == "FAILED" and "NonFiniteLossError" in nan.data.tags["error"]
    refused = [c for (_, policy), c in children.items() if policy == "skip"]
    assert len(refused) == 2 and all(c.info.status == "FAILED" and "loss.kl_coef=0" in c.data.tags["error"]
                                     for c in refused)
    assert (tmp_path / "sweep" / "figures" / "curves.png").exists()  # figures of the jobs that finished
