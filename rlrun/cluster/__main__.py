"""python -m rlrun.cluster start|stop|restart|status|kill-node DIR: a one-node SLURM cluster, PostgreSQL and an MLflow
server on this machine (rlrun/cluster/__init__.py; docs/cluster.md). python -m rlrun.cluster collect PARENT_RUN_ID:
the end of a sweep rlrun's SLURM launcher submitted (collect.py), on any cluster."""

from __future__ import annotations

import argparse
import os
import sys

from . import PARTS, ClusterError, daemon, postgres, server, slurm, start, stop


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rlrun.cluster", description=__doc__)
    p.add_argument("action", choices=["start", "stop", "restart", "status", "kill-node"])
    p.add_argument("folder", help="the cluster's folder: its config, state, logs, database and artifacts")
    p.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts of {','.join(PARTS)} (default: all)")
    p.add_argument("--cpus", type=int, help="CPUs of the node (default 2)")
    p.add_argument("--grace-s", type=int, help="seconds between SIGTERM and SIGKILL when a job is cancelled, "
                                               "requeued or preempted (KillWait, GraceTime; default 30)")
    p.add_argument("--requeue-s", type=int, help="seconds a requeued job waits before it may start again "
                                                 "(default 5; 120 on a stock cluster)")
    p.add_argument("--node-timeout-s", type=int, help="seconds without an answer from slurmd before the node is "
                                                      "declared down (SlurmdTimeout; default 10; 300 stock)")
    return p


def status(folder: str) -> str:
    state = daemon.load(folder)
    if not state:
        return f"no cluster in {folder}"
    env = daemon.environment(folder, SLURM_CONF=slurm.paths(folder)["conf"])
    ctld = daemon.alive(daemon.read_pid(slurm.paths(folder)["ctld_pid"]))
    return "\n".join([f"cluster in {folder}:",
                      f"  slurm: node {slurm.node_state(env) if ctld else 'controller not running'}",
                      f"  postgres: {'running' if postgres.running(folder) else 'stopped'} (port {state['pg_port']})",
                      f"  mlflow server: {'answers' if server.healthy(state['mlflow_port']) else 'not answering'} at "
                      f"{server.url(state['mlflow_port'])}",
                      f"  processes: {len(daemon.marked(folder))}"])


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["collect"]:  # a sweep submitted by rlrun's SLURM launcher: its end (collect.py)
        from . import collect

        sys.exit(collect.main(argv[1:]))
    a = parser().parse_args(argv)
    folder, parts = os.path.abspath(a.folder), [p.strip() for p in a.only.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        sys.exit(f"rlrun cluster: error: --only {','.join(unknown)}: the parts are {', '.join(PARTS)}")
    try:
        if a.action == "status":
            print(status(folder))
        elif a.action == "kill-node":
            print(f"rlrun cluster: node killed (slurmd, its slurmstepd and jobs): {len(slurm.kill_node(folder))} "
                  "processes")
        elif a.action == "stop":
            print(f"rlrun cluster: stopped {', '.join(stop(folder, parts)) or 'nothing (nothing was running)'}")
        else:
            if a.action == "restart":
                stop(folder, parts)
            up(folder, parts, a)
    except ClusterError as e:
        print(f"rlrun cluster: error: {e}", file=sys.stderr)
        sys.exit(1)


def up(folder: str, parts: list[str], a) -> None:
    """Start `parts`; when a step fails, what this start brought up is stopped again (nothing left running)."""
    try:
        state = start(folder, parts, cpus=a.cpus, grace_s=a.grace_s, requeue_s=a.requeue_s,
                      node_timeout_s=a.node_timeout_s)
    except ClusterError:
        if set(parts) == set(PARTS):
            stop(folder)
        else:
            stop(folder, parts)
        raise
    took = ", ".join(f"{k} {v} s" for k, v in state["startup_s"].items() if k in parts)
    print(f"rlrun cluster: up in {folder} ({took})\n"
          f"  . {folder}/env                 # SLURM_CONF for sinfo, sbatch, squeue and rlrun's SLURM launcher\n"
          f"  tracking.uri={state['uri']}   # MLflow; its store: PostgreSQL on port {state['pg_port']}; "
          f"artifacts: {folder}/mlflow/artifacts\n"
          f"  stop: python -m rlrun.cluster stop {folder}")


if __name__ == "__main__":
    main()
