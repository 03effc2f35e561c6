"""`python -m rlrun.cluster collect PARENT_RUN_ID --uri URI`: end a sweep whose jobs rlrun's SLURM launcher
submitted (submit.py) once they have ended, as a local sweep ends: the comparison, figures, verdict and equivalence on
the parent run, its status, and the failed jobs listed (exit 1). The collect job the launcher queues behind the jobs
runs it; run by hand while jobs are still queued or running, it says which and changes nothing (`--wait`: wait for
them).

Before drawing, nothing a job logged is left behind: a job that could not reach the store kept its records in its
folder's mlflow_spill.jsonl, which is sent first; a run still RUNNING whose SLURM job has ended (its node died, it was
SIGKILLed, out of memory, out of time) is marked FAILED with that cause and its log, its steps kept; a job that never
started a run is named. SLURM's queue is asked with `squeue`, so no accounting (sacct) is needed.
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import subprocess
import sys
import time

from .. import tracking
from ..tracking.spill import FILE_NAME, replay
from .submit import TAG

log = logging.getLogger("rlrun.cluster")
ACTIVE = {"PENDING", "RUNNING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "CONFIGURING", "COMPLETING", "SUSPENDED",
          "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED", "RESV_DEL_HOLD", "PREEMPTED"}


class CollectError(RuntimeError):
    """Collect cannot go on (the store or SLURM does not answer, not a submitted sweep): one message, exit 1."""


def client_for(uri: str, wait_s: float):
    """An MLflow client that has answered, trying for up to `wait_s` (the store may be restarting)."""
    client, deadline, said = tracking.open_client(uri), time.monotonic() + wait_s, False
    while True:
        try:
            client.search_experiments(max_results=1)
            return client
        except Exception as e:  # noqa: BLE001 - any failure: the store does not answer (yet)
            if time.monotonic() > deadline:
                raise CollectError(f"MLflow at {uri} does not answer ({type(e).__name__}); collect again when it "
                                   "does") from e
            if not said:
                log.warning("MLflow at %s does not answer (%s); trying again for up to %g s", uri, type(e).__name__,
                            wait_s)
                said = True
            time.sleep(2)


def active_jobs(arrays: list[str]) -> dict[str, str]:
    """{job id (ARRAY_TASK): state} of the sweep's jobs SLURM still holds (queued, running, requeued)."""
    done = subprocess.run(["squeue", "-h", "-r", "-o", "%i %T"], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise CollectError(f"SLURM does not answer (squeue: {done.stderr.strip()[-300:]}); collect again when it "
                           "does")
    jobs = dict(line.split()[:2] for line in done.stdout.splitlines() if len(line.split()) >= 2)
    return {j: s for j, s in jobs.items() if j.split("_")[0] in arrays and s in ACTIVE}


def send_kept(client, folder: str) -> list[str]:
    """Each job folder's spill file (records its run kept while the store was down), sent; -> what stays kept."""
    left = []
    for path in sorted(glob.glob(os.path.join(folder, "*", FILE_NAME)) + glob.glob(os.path.join(folder, FILE_NAME))):
        sent, kept = replay(client, path)
        if sent:
            log.info("sent %d records a job had kept in %s", sent, path)
        if kept:
            left.append(f"{path} ({kept} records)")
    return left


def job_log(folder: str, job: str) -> str:
    return os.path.join(folder, ".submitit", job, f"{job}_0_log.err")


def mark_orphans(client, runs, folder: str) -> list[str]:
    """Runs left RUNNING by a SLURM job that has ended -> FAILED, with the cause as their error; -> their names."""
    marked = []
    for run in runs:
        if run.info.status != "RUNNING":
            continue
        job = run.data.tags.get("rlrun.slurm.job", "?")
        client.set_tag(run.info.run_id, "error", f"its SLURM job {job} ended and the run did not: the process died "
                       "without a word (its node failed, or SIGKILL: out of memory, past its time limit, scancel); "
                       f"the steps it logged are kept. Its log: {job_log(folder, job)}")
        client.set_terminated(run.info.run_id, "FAILED")
        marked.append(run.data.tags.get("mlflow.runName", run.info.run_id))
    return marked


def missing(info: dict, runs) -> list[str]:
    """The jobs of the arrays that left no run at all (cancelled while queued, or dead before their run existed)."""
    seen = {r.data.tags.get("rlrun.slurm.job") for r in runs}
    return [j for a, n in info["arrays"].items() for j in (f"{a}_{i}" for i in range(n)) if j not in seen]


def draw(client, parent: str, info: dict, uri: str) -> None:
    """The sweep's end as sweep.SweepCallback draws it at the end of a local sweep (exits 1 on failed jobs)."""
    from omegaconf import OmegaConf

    from ..sweep import SweepCallback
    from ..tracking import ui

    cb = SweepCallback()
    cb.client, cb.parent_id = client, parent
    cb.group = client.get_run(parent).data.tags.get(ui.GROUP_TAG)
    cb.figures_dir, cb.baseline = os.path.join(info["dir"], "figures"), info.get("baseline")
    cb.on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": info["dir"]}},
                                         "report": {"baseline": info.get("baseline")},
                                         "tracking": {"uri": uri, "ui_port": info.get("ui_port", tracking.UI_PORT)}}))


def collect(parent: str, uri: str, wait: bool, wait_store_s: float) -> int:
    client = client_for(uri, wait_store_s)
    tags = client.get_run(parent).data.tags
    if TAG not in tags:
        raise CollectError(f"run {parent} is not a sweep rlrun's SLURM launcher submitted (no tag {TAG}); "
                           f"rlrun-report {parent} redraws any sweep's figures")
    info = json.loads(tags[TAG])
    while True:
        kept = send_kept(client, info["dir"])
        pending = active_jobs(info["arrays"])
        if not pending:
            break
        if not wait:
            print(f"rlrun collect: {len(pending)} of the sweep's {info['jobs']} jobs are still queued or running "
                  f"({', '.join(f'{j} {s}' for j, s in sorted(pending.items())[:8])}); nothing changed: the comparison "
                  "is drawn when they end (by the collect job, or here with --wait)")
            return 0
        time.sleep(10)
    if kept:
        raise CollectError(f"records the jobs kept could not be sent to {uri}: {'; '.join(kept)}; run rlrun "
                           "collect again when the store takes them")
    from ..tools.report import child_runs

    orphans = mark_orphans(client, child_runs(client, parent)[1], info["dir"])
    lost = missing(info, child_runs(client, parent)[1])
    if orphans:
        print(f"rlrun collect: {len(orphans)} run(s) whose SLURM job ended without ending them marked FAILED: "
              f"{', '.join(orphans)}", file=sys.stderr)
    try:
        draw(client, parent, info, uri)
    finally:
        if lost:
            client.set_tag(parent, "error", f"{len(lost)} job(s) left no run: {', '.join(lost)} (cancelled while "
                           "queued, or dead before their run existed; their logs: .submitit/ in the sweep folder)")
            client.set_terminated(parent, "FAILED")
            print(f"rlrun collect: {len(lost)} of {info['jobs']} jobs left no run: "
                  + ", ".join(f"{j} (log: {job_log(info['dir'], j)})" for j in lost), file=sys.stderr)
    return 1 if lost else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlrun.cluster collect", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("parent_run_id", help="the sweep's parent run (the submitting command printed it)")
    p.add_argument("--uri", default=os.environ.get("RLRUN_CLUSTER_URI", "sqlite:///mlflow.db"),
                   help="the tracking URI the sweep logged to (default: $RLRUN_CLUSTER_URI, else %(default)s)")
    p.add_argument("--wait", action="store_true", help="wait until the sweep's jobs have ended, then draw")
    p.add_argument("--wait-store", type=float, default=0, metavar="S",
                   help="seconds to keep trying a store that does not answer (default 0)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s] %(message)s")
    try:
        return collect(a.parent_run_id, a.uri, a.wait, a.wait_store)
    except CollectError as e:
        print(f"rlrun collect: error: {e}", file=sys.stderr)
        return 1
