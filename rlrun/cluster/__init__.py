"""A SLURM cluster and an MLflow server on this machine, for tests, CI, and trying rlrun's cluster path on a laptop
(docs/cluster.md): `python -m rlrun.cluster start DIR` starts munged, slurmctld and slurmd (one node, slurm.py),
PostgreSQL with a database for MLflow (postgres.py) and `mlflow server` on it with proxied artifacts (server.py),
each on a free port with its state under DIR (a part already running is left as it is); `stop DIR` ends all of it,
and nothing of it is left running.

A step that fails names itself (`slurm: slurmctld`, `postgres: initdb`, ...) with the cause and its log's last
lines, and what the start had brought up is stopped again. `restart DIR --only postgres`, `stop`/`start --only
mlflow` and `kill-node DIR` (slurmd and its jobs die at once, as when a node fails; `start DIR` brings it back) are the
faults the tests inject.

Running sweeps on it (or on a real cluster) is rlrun's SLURM launcher (submit.py, `hydra/launcher=slurm`) and
`python -m rlrun.cluster collect` (collect.py).
"""

from __future__ import annotations

import os
import time

from . import daemon, postgres, server, slurm
from .daemon import ClusterError

PARTS = ("slurm", "postgres", "mlflow")
DEFAULTS = {"cpus": 2, "grace_s": 30, "requeue_s": 5, "node_timeout_s": 10}

__all__ = ["ClusterError", "PARTS", "start", "stop"]


def settings(folder: str, **given) -> dict:
    """The cluster's settings and ports: as first chosen (cluster.json), else `given` or the defaults and free
    ports."""
    state = daemon.load(folder)
    if not state:
        state = {**DEFAULTS, **{k: v for k, v in given.items() if v is not None}}
        state |= {name: daemon.free_port() for name in ("ctld_port", "slurmd_port", "pg_port", "mlflow_port")}
    return state


def start(folder: str, parts=PARTS, **given) -> dict:
    """Start `parts` of the cluster in `folder` (absolute); -> the state, with each part's start-up seconds."""
    folder = os.path.abspath(folder)
    if len(os.path.join(folder, "munge", "munge.socket")) > 100:  # a UNIX socket's path has 107 bytes at most
        daemon.fail("the cluster folder", f"{folder} is too long for munge's socket path; choose a shorter one")
    daemon.owner(folder, None, 0o755)
    state = settings(folder, **given)
    daemon.save(folder, state)
    seconds = state.setdefault("startup_s", {})
    steps = {"slurm": lambda: slurm.start(folder, state),
             "postgres": lambda: postgres.start(folder, state["pg_port"]),
             "mlflow": lambda: server.start(folder, state["mlflow_port"], state["pg_port"])}
    for part in [p for p in PARTS if p in parts]:
        began = time.monotonic()
        steps[part]()
        seconds[part] = round(time.monotonic() - began, 1)
    state["uri"] = server.url(state["mlflow_port"])
    daemon.save(folder, state)
    write_env(folder, state)
    return state


def write_env(folder: str, state: dict) -> None:
    with open(os.path.join(folder, "env"), "w") as f:
        f.write(f"# . {folder}/env: what clients of this cluster need (python -m rlrun.cluster)\n"
                f"export SLURM_CONF={slurm.paths(folder)['conf']}\n"
                f"export RLRUN_CLUSTER_URI={state['uri']}   # tracking.uri=$RLRUN_CLUSTER_URI\n")


def stop(folder: str, parts=PARTS) -> list[str]:
    """Stop `parts` (all: then every process still marked as this cluster's too); -> what was stopped. Fails when
    something of the cluster is still running after that."""
    folder = os.path.abspath(folder)
    state = daemon.load(folder)
    done = []
    if "mlflow" in parts:
        done += server.stop(folder)
    if "postgres" in parts and state:
        done += postgres.stop(folder, state["pg_port"])
    if "slurm" in parts:
        done += slurm.stop(folder, state.get("grace_s", DEFAULTS["grace_s"]))
    if set(parts) == set(PARTS):
        stray = daemon.marked(folder)
        for pid in stray:
            daemon.stop_pid(pid, wait_s=5)
        if stray:
            done.append(f"{len(stray)} stray process(es)")
        left = daemon.marked(folder)
        if left:
            daemon.fail("stop", "still running: " + ", ".join(daemon.describe(p) for p in left))
    return done
