"""Experiment kind, standard run tags and the run description (the MLflow tracker and the sweep callback)."""

from __future__ import annotations

import os
import re

from .. import algorithms
from ..render import short

SWEEP_KEYS_ENV = "RLRUN_SWEEP_KEYS"  # set by the sweep callback (rlrun/sweep.py): the keys its jobs differ in
EXPERIMENT_KIND = "custom_model_development"  # MLflow 3's UI then opens on model training, not GenAI traces


def mark_experiment_kind(client, exp_id: str) -> None:
    """Tag the experiment `mlflow.experimentKind=custom_model_development` unless it already says a kind."""
    try:
        if "mlflow.experimentKind" not in client.get_experiment(exp_id).tags:
            client.set_experiment_tag(exp_id, "mlflow.experimentKind", EXPERIMENT_KIND)
    except Exception:  # noqa: BLE001 - a UI hint: never worth failing a run for
        pass


def short_name(overrides: list[str]) -> str | None:
    """A sweep job's run name: its overrides of the keys that differ between the sweep's jobs (RLRUN_SWEEP_KEYS);
    None outside a sweep or where no key differs."""
    keys = set(filter(None, os.environ.get(SWEEP_KEYS_ENV, "").split(",")))
    return ",".join(o for o in overrides if o.split("=", 1)[0].lstrip("+~") in keys) or None


def git_commit(folder: str | None = None) -> str | None:
    """HEAD of the git checkout holding `folder` (default: the rlrun package), None outside one."""
    import subprocess

    folder = folder or os.path.dirname(os.path.abspath(__file__))
    try:
        r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=folder, capture_output=True, text=True, timeout=3)
    except (OSError, subprocess.SubprocessError):
        return None
    sha = r.stdout.strip()
    return sha if r.returncode == 0 and re.fullmatch(r"[0-9a-f]{40}", sha) else None


def standard_tags() -> dict[str, str]:
    """MLflow's source tags (shown as the run's Source) and who ran what, where: user, host, version, command."""
    import getpass
    import socket
    import sys

    from .. import __version__

    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - no user name in some containers
        user = "unknown"
    argv = sys.argv or ["rlrun"]
    tags = {"mlflow.source.name": os.path.basename(argv[0]) or "rlrun", "mlflow.source.type": "LOCAL",
            "mlflow.user": user, "rlrun.host": socket.gethostname(), "rlrun.version": __version__,
            "rlrun.command": " ".join(argv)[:5000]}
    commit = git_commit()
    if commit:
        tags["mlflow.source.git.commit"] = commit
    return tags | slurm_tags()


def slurm_job() -> str | None:
    """This process's SLURM job as squeue names it (an array job's task: ARRAY_TASK), None outside SLURM."""
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    return f"{array}_{task}" if array and task else os.environ.get("SLURM_JOB_ID")


def slurm_tags() -> dict[str, str]:
    """In a SLURM job: its id (collect asks SLURM whether a run's job still lives) and how many times SLURM
    requeued it."""
    job = slurm_job()
    return {"rlrun.slurm.job": job, "rlrun.slurm.restarts": os.environ.get("SLURM_RESTART_COUNT", "0")} if job else {}


def describe_run(config: dict) -> str:
    """One sentence saying what the run trains, from the resolved config (the start of `mlflow.note.content`)."""
    def name(group):
        part = config.get(group)
        return str(part.get("name", "?")) if isinstance(part, dict) else "?"

    loss = name("loss")
    recipe = algorithms.title(loss)
    steps = (config.get("train") or {}).get("steps", "?")
    return (f"{recipe} with the {name('head')} head, logprob policy {name('logprob_policy')}, optimizer offload "
            f"{name('offload')}, {name('rollout')} rollouts, engine {name('engine')}; model {name('model')}, "
            f"task {name('task')}, {steps} steps.")


def headline(summary: dict[str, float]) -> str:
    """The run's headline numbers as one sentence (the end of `mlflow.note.content`), from `Summary.result()`."""
    parts = []
    for curve, label in (("reward", "Reward"), ("accuracy", "Accuracy")):
        if f"{curve}_first" in summary:
            parts.append(f"{label} {short(summary[f'{curve}_first'])} → {short(summary.get(f'{curve}_last'))} "
                         "(mean of the first / last 3 steps)")
    if "eval_accuracy_first" in summary:
        parts.append(f"eval accuracy {short(summary['eval_accuracy_first'])} → "
                     f"{short(summary.get('eval_accuracy_last'))}")
    if "step_s" in summary:
        parts.append(f"{short(summary['step_s'])} s per step")
    toks = [f"{short(summary[k])} {what} tokens/s" for k, what in
            (("gen_tokens_per_s", "generated"), ("train_tokens_per_s", "trained")) if k in summary]
    parts += toks
    return ("Result: " + "; ".join(parts) + ".") if parts else ""

