"""The cluster path's parts that need no daemon: resume=auto (a job a scheduler restarts continues its run),
`collect`'s bookkeeping on a real MLflow store (runs a dead job left RUNNING, jobs that left no run, records a job
kept), and the cluster script refusing a folder before it starts anything. The daemons themselves:
tests/distributed/test_cluster.py."""

import json
import logging
import os
import pwd
import time

import pytest
from conftest import make_cfg, new_store
from helpers import runs, steps

from rlrun import cli, tracking
from rlrun.config import ConfigError


def test_resume_auto_without_a_checkpoint_folder_is_one_error_naming_the_fix():
    with pytest.raises(ConfigError, match="checkpoint.dir"):
        cli.auto_resume(make_cfg("resume=auto"))


@pytest.mark.slow  # two runs of the smoke config
def test_resume_auto_starts_a_new_run_then_continues_it(tmp_path, monkeypatch, caplog):
    """The first launch finds no checkpoint and starts; the second (a requeued SLURM job) finds the first's and
    continues the same MLflow run: every step once."""
    new_store(tmp_path)
    caplog.set_level(logging.INFO, logger="rlrun")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    ckpt = tmp_path / "ckpt"
    assert cli.auto_resume(make_cfg("resume=auto", f"checkpoint.dir={ckpt}")).resume is False
    assert "holds no checkpoint yet, so the job starts over" in caplog.text  # a restart with nothing to resume
    args = ("experiment=smoke", "resume=auto", "checkpoint.every=1", f"checkpoint.dir={ckpt}", "export.enabled=false")
    cli.run(make_cfg(*args, "train.steps=2", tmp_path=tmp_path), "job")
    cli.run(make_cfg(*args, "train.steps=4", tmp_path=tmp_path), "job")
    assert "SLURM requeued this job (restart 1); continuing the run" in caplog.text
    client, [run] = runs(tmp_path / "mlflow.db")
    assert run.info.status == "FINISHED" and steps(client, run.info.run_id, "loss") == [0, 1, 2, 3]


def sweep_store(tmp_path):
    """A store holding a parent and three children as SLURM jobs 7_0..7_2 of a sweep of 4: FINISHED, FAILED, and
    RUNNING (its job died)."""
    from rlrun.cluster.submit import TAG

    client = tracking.open_client(new_store(tmp_path))
    exp = tracking.experiment_id(client, "rlrun")
    folder = tmp_path / "sweep"
    parent = client.create_run(exp, tags={TAG: json.dumps({"arrays": {"7": 4}, "jobs": 4, "dir": str(folder)})})
    children = []
    for job, status in (("7_0", "FINISHED"), ("7_1", "FAILED"), ("7_2", "RUNNING")):
        run = client.create_run(exp, tags={"mlflow.parentRunId": parent.info.run_id, "rlrun.slurm.job": job,
                                           "mlflow.runName": f"job {job}"})
        if status != "RUNNING":
            client.set_terminated(run.info.run_id, status)
        children.append(run.info.run_id)
    return client, parent.info.run_id, children, folder


def test_collect_marks_a_run_whose_job_died_and_names_the_job_that_left_none(tmp_path):
    from rlrun.cluster import collect
    from rlrun.tools.report import child_runs

    client, parent, children, folder = sweep_store(tmp_path)
    found = child_runs(client, parent)[1]
    assert collect.missing({"arrays": {"7": 4}, "jobs": 4}, found) == ["7_3"]
    assert collect.mark_orphans(client, found, str(folder)) == ["job 7_2"]
    dead = client.get_run(children[2])
    assert dead.info.status == "FAILED"
    assert "SLURM job 7_2 ended and the run did not" in dead.data.tags["error"]
    assert str(folder / ".submitit" / "7_2" / "7_2_0_log.err") in dead.data.tags["error"]
    assert client.get_run(children[1]).info.status == "FAILED" and "error" not in client.get_run(children[1]).data.tags


def test_collect_sends_what_a_job_kept_while_the_store_was_down(tmp_path):
    from rlrun.cluster import collect

    client, parent, children, folder = sweep_store(tmp_path)
    (folder / "0").mkdir(parents=True)
    spill = folder / "0" / "mlflow_spill.jsonl"
    now = int(time.time() * 1000)
    spill.write_text("".join(json.dumps({"op": "metrics", "run_id": children[0], "uri": "", "args": [
        ["train/loss", 0.5 - step / 10, now, step]]}) + "\n" for step in range(3)))
    assert collect.send_kept(client, str(folder)) == []
    assert not spill.exists()
    assert steps(client, children[0], "loss") == [0, 1, 2]


def test_collect_refuses_a_run_that_is_not_a_submitted_sweep(tmp_path, capsys):
    from rlrun.cluster import collect

    uri = new_store(tmp_path)
    client = tracking.open_client(uri)
    run = client.create_run(tracking.experiment_id(client, "rlrun"))
    assert collect.main([run.info.run_id, "--uri", uri]) == 1
    assert "is not a sweep rlrun's SLURM launcher submitted" in capsys.readouterr().err


def test_the_cluster_script_refuses_a_folder_the_daemons_cannot_reach_before_starting_anything(tmp_path):
    from rlrun.cluster import ClusterError, daemon, start

    with pytest.raises(ClusterError, match="too long"):
        start(str(tmp_path / ("x" * 120)))
    if os.geteuid() != 0:
        pytest.skip("as root only: the daemons run as their own users (munge, postgres)")
    try:
        pwd.getpwnam("munge")
    except KeyError:
        pytest.skip("no munge user (apt-get install -y munge)")
    closed = tmp_path / "closed"  # pytest's own folders are 0700, which the munge user cannot enter
    closed.mkdir(mode=0o700)
    with pytest.raises(ClusterError, match=r"the cluster folder: .* which the munge user cannot enter; choose"):
        start(str(closed / "c"))
    assert daemon.marked(str(closed / "c")) == []  # nothing was started
