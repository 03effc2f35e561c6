"""Sweeps whose jobs run in parallel worker processes (Hydra's joblib launcher, 2 workers): one parent, every
child with every step, on the default sqlite store and on a tracking server; Ctrl-C leaves no run RUNNING."""

import importlib.util
import os
import signal
import sqlite3
import subprocess
import sys
import time

import pytest
from helpers import free_port, start_server, stop_server

from rlrun import tracking

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.skipif(
    importlib.util.find_spec("hydra_plugins.hydra_joblib_launcher") is None,
    reason="the joblib launcher is not installed: pip install -e '.[launchers]'")]

ENV = {**os.environ, "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "false"}
JOBLIB = ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"]


def sweep(tmp_path, *overrides):
    """4 jobs on 2 workers: each worker takes a second job after its first (the store sees jobs start and end
    while others log)."""
    return subprocess.run([sys.executable, "-m", "rlrun", "-m", *JOBLIB, "experiment=smoke", "train.steps=3",
                           "progress=false", "seed=0,1,2,3", *overrides], cwd=tmp_path, env=ENV,
                          capture_output=True, text=True, timeout=900)


def check_sweep(client, r):
    assert r.returncode == 0, r.stderr[-3000:]
    assert "database is locked" not in r.stdout + r.stderr
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    (parent,) = [x for x in runs if x.data.tags.get("rlrun.kind") == "sweep"]
    children = [x for x in runs if x.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert parent.info.status == "FINISHED" and len(runs) == 5 and len(children) == 4
    for child in children:
        assert child.info.status == "FINISHED"
        assert sorted(m.step for m in client.get_metric_history(child.info.run_id, "train/loss")) == [0, 1, 2]
    assert sorted(c.data.params["seed"] for c in children) == [str(i) for i in range(4)]


def test_joblib_sweep_of_4_jobs_with_2_workers_on_sqlite(tmp_path):
    r = sweep(tmp_path)
    check_sweep(tracking.open_client(f"sqlite:///{tmp_path}/mlflow.db"), r)


def test_joblib_sweep_of_4_jobs_with_2_workers_on_a_server(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    server, url = start_server(store, free_port(), ENV)
    try:
        r = sweep(tmp_path, f"tracking.uri={url}")
        check_sweep(tracking.open_client(url), r)
    finally:
        stop_server(server)


def statuses(db):
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1) as con:
            return con.execute("SELECT status FROM runs").fetchall()
    except sqlite3.Error:
        return []


def children_logging(db):
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1) as con:
            return con.execute("SELECT COUNT(DISTINCT run_uuid) FROM metrics WHERE key = 'train/loss'").fetchone()[0]
    except sqlite3.Error:
        return 0


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_to_a_joblib_sweep_leaves_no_run_running(tmp_path, sig):
    db = tmp_path / "mlflow.db"
    p = subprocess.Popen([sys.executable, "-m", "rlrun", "-m", *JOBLIB, "experiment=smoke", "train.steps=300",
                          "progress=false", "seed=0,1,2,3"], cwd=tmp_path, env=ENV, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 300
    while p.poll() is None and children_logging(db) < 2 and time.time() < deadline:
        time.sleep(0.2)
    assert p.poll() is None and children_logging(db) == 2, "two jobs should be training by now"
    # Ctrl-C at a terminal reaches the whole foreground process group (the workers too); SIGTERM (a scheduler
    # cancelling the job) reaches the sweep's process alone
    os.killpg(p.pid, sig) if sig == signal.SIGINT else p.send_signal(sig)
    err = p.communicate(timeout=180)[1]
    assert p.returncode == 128 + sig, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    got = [s for (s,) in statuses(db)]
    assert len(got) >= 3 and "RUNNING" not in got and got.count("KILLED") >= 3, got
