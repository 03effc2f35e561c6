"""rlrun's SLURM launcher (`hydra/launcher=slurm`, registered by hydra_plugins/rlrun_slurm): submit and return.

Hydra's own `submitit_slurm` blocks the submitting process until every job has returned (facebookresearch/hydra
#2479, #3058, #3091), hours when jobs queue, and it learns that a job died without a result only from `sacct`, which a
cluster without accounting lacks (it then waits for ever). This launcher submits the jobs exactly as that one does
(submitit's job array, the same options: partition, gpus_per_node, timeout_min, setup, ...; each job runs the Hydra job
with the sweep's callbacks), then returns at once, leaving the sweep's parent run RUNNING. A collect job, submitted
behind the array (`--dependency=afterany`), runs `python -m rlrun.cluster collect` when the last job ends: the
comparison, figures, verdict and status land on the parent as a local sweep's do. `python -m rlrun.cluster collect
PARENT_RUN_ID` does the same by hand (collect.py).

What collect needs is the parent's tag `rlrun.slurm` (JSON): the arrays, how many jobs, the sweep folder, the
baseline, the collect job.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import subprocess
import sys

from omegaconf import OmegaConf

from .. import sweep

TAG = "rlrun.slurm"
SBATCH_KEYS = ("partition", "account", "qos", "comment", "constraint", "exclude")  # where the collect job may run
log = logging.getLogger("rlrun.cluster")


def launch(launcher, job_overrides, initial_job_idx: int):
    """Hydra's Launcher.launch for `launcher` (a submitit SlurmLauncher): the jobs as one SLURM array, a collect job
    behind it; -> a completed JobReturn per job (its result lands in MLflow, not here)."""
    import submitit
    from hydra.core.singleton import Singleton
    from hydra.core.utils import JobReturn, JobStatus, filter_overrides
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf

    from .. import tracking

    config = launcher.config
    parent = os.environ.get(sweep.ENV)
    if parent is None and tracking.stores(config.tracking):  # Hydra only warned that the sweep's callback failed
        print("rlrun: error: the sweep's parent run could not be created (the warning above says why), so nothing "
              "would collect its jobs; nothing was submitted. Check tracking.uri and run the sweep again.",
              file=sys.stderr)
        sys.exit(1)
    params = dict(launcher.params)
    collect = params.pop("collect", True)
    executor = submitit.AutoExecutor(cluster="slurm", folder=params.pop("submitit_folder"),
                                     slurm_max_num_timeout=params.pop("max_num_timeout", 0))
    base = set(OmegaConf.structured(BaseQueueConf).keys())
    executor.update_parameters(**{k if k in base else f"slurm_{k}": v for k, v in params.items()})
    sweep_dir = os.path.abspath(str(config.hydra.sweep.dir))
    os.makedirs(sweep_dir, exist_ok=True)
    calls = []
    for i, overrides in enumerate(job_overrides):
        log.info("\t#%d : %s", initial_job_idx + i, " ".join(filter_overrides(overrides)))
        calls.append((list(overrides), "hydra.sweep.dir", initial_job_idx + i, f"job_id_for_{initial_job_idx + i}",
                      Singleton.get_state()))
    jobs = executor.map_array(launcher, *zip(*calls))
    array = str(jobs[0].job_id).split("_")[0]
    if parent:
        info = record(config, parent, array, len(jobs), sweep_dir, params if collect else None)
        sweep.SUBMITTED.add(parent)  # its end is collect's, not this process's
        print(submitted(config, parent, info), flush=True)
    else:
        print(f"rlrun: {len(jobs)} jobs submitted to SLURM as array {array} (logs: {sweep_dir}/.submitit/); with "
              "tracking=none nothing collects them", flush=True)
    return [JobReturn(overrides=list(o), status=JobStatus.COMPLETED) for o in job_overrides]


def record(config, parent: str, array: str, count: int, sweep_dir: str, params: dict | None) -> dict:
    """The parent's tag `rlrun.slurm`, with this array added (a sweeper that launches in batches calls `launch` once
    per batch) and the collect job, when asked, submitted behind all of them (the one before it cancelled)."""
    from .. import tracking

    client = tracking.open_client(config.tracking.uri)
    run = client.get_run(parent)
    info = json.loads(run.data.tags.get(TAG, "{}"))
    arrays = {**info.get("arrays", {}), array: count}
    info = {"arrays": arrays, "jobs": sum(arrays.values()), "dir": sweep_dir, "experiment": run.info.experiment_id,
            "baseline": OmegaConf.select(config, "report.baseline", default=None),
            "ui_port": OmegaConf.select(config, "tracking.ui_port", default=tracking.UI_PORT),
            "collect": info.get("collect")}
    if params is not None:
        if info["collect"]:
            subprocess.run(["scancel", info["collect"]], capture_output=True, timeout=60)
        info["collect"] = collect_job(config, parent, info, params)
    client.set_tag(parent, TAG, json.dumps(info))
    return info


def collect_job(config, parent: str, info: dict, params: dict) -> str:
    """sbatch `python -m rlrun.cluster collect PARENT` behind the arrays (afterany: whatever their ends), in the jobs'
    partition and account, after the launcher's `setup` lines; -> its job id."""
    script = os.path.join(info["dir"], ".submitit", "collect.sh")
    os.makedirs(os.path.dirname(script), exist_ok=True)
    command = [sys.executable, "-m", "rlrun.cluster", "collect", parent, "--uri", str(config.tracking.uri),
               "--wait-store", "600"]
    with open(script, "w") as f:
        f.write("\n".join(["#!/bin/bash", "# rlrun's SLURM launcher: the sweep's comparison once its jobs ended",
                           *(params.get("setup") or []), f"exec {shlex.join(command)}", ""]))
    sbatch = ["sbatch", "--parsable", f"--dependency=afterany:{':'.join(info['arrays'])}", "--job-name=rlrun-collect",
              f"--output={info['dir']}/collect.log", "--open-mode=append", "--time=30", "--ntasks=1",
              "--cpus-per-task=1", *[f"--{k}={params[k]}" for k in SBATCH_KEYS if params.get(k)], script]
    done = subprocess.run(sbatch, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        log.error("the collect job was not submitted (%s); when the jobs end, run: python -m rlrun.cluster collect %s "
                  "--uri %s", done.stderr.strip()[-500:], parent, config.tracking.uri)
        return ""
    return done.stdout.strip().split(";")[0]


def submitted(config, parent: str, info: dict) -> str:
    """What the submitting process prints before it returns."""
    from ..tracking import ui

    uri = str(config.tracking.uri)
    base = uri.rstrip("/") if uri.startswith(("http://", "https://")) else None
    where = f"\n  parent run (RUNNING until they end): {ui.run_page(base, info['experiment'], parent)}" if base else ""
    arrays = ",".join(info["arrays"])
    by = (f"SLURM job {info['collect']} (collect, queued behind them) draws the sweep's comparison on it when the last "
          f"one ends; squeue -j {arrays},{info['collect']} shows where they are"
          if info["collect"] else "nothing collects them by itself: run the command below when they end")
    return (f"rlrun: {info['jobs']} jobs submitted to SLURM (array {arrays}; logs: {info['dir']}/.submitit/); this "
            f"command returns now and they run as the cluster schedules them.{where}\n  {by}\n"
            f"  the comparison of the jobs that ended, drawn now: python -m rlrun.cluster collect {parent} --uri {uri}")
