"""`rlrun`: compose the config (Hydra), validate it, hand it to the runner. Nothing else lives here.

Only Hydra, OmegaConf and rlrun.config are imported before validation: `rlrun --help`, `--cfg job` and a refused
config never import torch, transformers, deepspeed, vllm or mlflow (tests/unit/test_cli.py checks it).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from . import ranks, registry, signals
from .config import ConfigError, validate
from .errors import (
    CheckError,
    CheckpointError,
    DivergedError,
    ExportError,
    FaultError,
    LinkError,
    ModelError,
    RecordError,
    RolloutError,
    TaskError,
    TrackingError,
)
from .tracking import secrets

log = logging.getLogger("rlrun")

# Errors that are the user's input, not a bug: shown as one clear message, no traceback.
USER_ERRORS = (ConfigError, ModelError, TaskError, TrackingError, CheckpointError, ExportError, RolloutError,
               RecordError, LinkError, DivergedError, CheckError)
# conf/ sits beside the package in the repository (install with `pip install -e .`).
CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


def restored(cfg: DictConfig) -> DictConfig:
    """`rlrun resume=<MLflow run id> [overrides]`: the run's own config (its config.yaml) with only the overrides
    of this command line on top, so that none of the original ones need repeating. The resume check still refuses
    an override that changes what is trained (checkpoint.changed_keys)."""
    from omegaconf import OmegaConf

    from . import tracking
    from .tracking.store import is_run_id, saved_config

    resume = str(cfg.resume)
    if not (HydraConfig.initialized() and is_run_id(resume) and tracking.stores(cfg.tracking)):
        return cfg
    saved = saved_config(cfg.tracking.uri, resume)
    if saved is None:
        return cfg
    keys = [o.split("=", 1)[0].lstrip("+~") for o in HydraConfig.get().overrides.task if "=" in o]
    for key in {*keys, "resume", "tracking", "progress"}:  # where this launch logs and shows is its own
        OmegaConf.update(saved, key, OmegaConf.select(cfg, key), merge=False, force_add=True)
    log.info("resume=%s: the run's config, with %s from this command line", resume, ", ".join(keys) or "nothing")
    return saved


def auto_resume(cfg: DictConfig) -> DictConfig:
    """`resume=auto`, for a job a scheduler may restart (a SLURM requeue or preemption, a pod restarted): continue
    from the newest checkpoint in checkpoint.dir when it holds one, else start a new run. checkpoint.dir defaults to
    the run's output folder's checkpoints/ (in a sweep: one per job, the same when the job restarts). Decided before
    validation; a restart with nothing to resume from says so (docs/cluster.md)."""
    if str(cfg.resume) != "auto":
        return cfg
    cfg = cfg.copy()
    if not cfg.checkpoint.dir and HydraConfig.initialized():
        cfg.checkpoint.dir = os.path.join(HydraConfig.get().runtime.output_dir, "checkpoints")
    folder = cfg.checkpoint.dir
    if not folder:
        raise ConfigError(["resume=auto continues from checkpoint.dir when it holds a checkpoint, and checkpoint.dir "
                           "is not set. Set checkpoint.dir=FOLDER, or resume=false."])
    from .folders import checkpoint_steps

    found = checkpoint_steps(folder) if os.path.isdir(folder) else []
    restart = os.environ.get("SLURM_RESTART_COUNT", "0")
    again = f"SLURM requeued this job (restart {restart}); " if restart != "0" else ""
    if found:
        log.info("resume=auto: %scontinuing the run of %s from its newest checkpoint", again, folder)
    elif again:
        log.warning("resume=auto: %s%s holds no checkpoint yet, so the job starts over as a new run", again, folder)
    cfg.resume = bool(found)
    return cfg


def run(cfg: DictConfig, run_name: str | None = None, check_first: bool = False) -> dict:
    """Validate (no torch import), then hand over to the runner with the recipe that trains `loss`. `check_first`:
    run `rlrun check` on the configuration before it trains (a sweep's job: report.check_jobs): a failed probe is a
    CheckError naming it; the probes' results are logged to the run (check/*, check.txt)."""
    try:
        cfg = auto_resume(restored(cfg))
        typed = validate(cfg)
    except ConfigError as e:
        e.before_start = True  # nothing built, nothing logged: the CLI leaves no output folder behind
        raise
    from .runner import run as run_training

    on_start = checked(typed) if check_first else None
    return run_training(typed, cfg, run_name, registry.get("recipe", typed.loss.name).train,  # heavy: after validation
                        on_start=on_start)


def checked(typed):
    """The probes of `rlrun check` on a validated config, before its run exists: a CheckError naming the failed
    probes, or what logs their results to the run once it starts (None: no probe ran)."""
    from . import check

    rows = check.rows_of(typed, job=True)
    if not rows:
        return None
    if any(r.ok is False and r.blocks for r in rows):
        raise CheckError(f"rlrun check: {check.summary(rows)} (run `rlrun check` with this job's overrides for the "
                         "table; docs/check.md)")
    if any(r.ok is False for r in rows):  # the memory plan missed: reported and logged, the job trains
        log.warning("rlrun check: %s; the job trains (a forecast, not what it trains: docs/check.md)",
                    check.summary(rows))
    else:
        log.info("rlrun check: %s", check.summary(rows))

    def log_check(tracker) -> None:
        tracker.log(0, check.metrics(rows))
        tracker.tags({"rlrun.check": check.summary(rows)})
        tracker.text(check.table(rows) + "\n" + check.summary(rows), "check.txt")

    return log_check


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig):
    # before validation and model build: a signal from now on ends the run KILLED (restored when main returns)
    previous = signals.interrupt_on_signals()
    signals.stacks_on_sigusr1()  # a run that looks stuck: kill -USR1 <pid> shows where it waits
    try:
        return _main(cfg)
    finally:
        signals.restore(previous)


def _main(cfg: DictConfig):
    secrets.guard_output()  # Hydra's handlers (cli.log) exist now: each gets the scrubbing filter
    hc = HydraConfig.get()
    run_name = cfg.run_name or hc.job.override_dirname or "default"
    if str(hc.mode) == "RunMode.MULTIRUN":
        from .tracking import short_name  # the sweep's callback has it loaded already

        return sweep_job(cfg, cfg.run_name or short_name(list(hc.overrides.task)) or run_name)
    for said in sweep_only(cfg):  # a single run: the keys only a sweep reads would be ignored without a word
        log.warning(said)
    try:
        run(cfg, run_name)
    except USER_ERRORS + (FaultError, KeyboardInterrupt) as e:
        if isinstance(e, KeyboardInterrupt):
            print("rlrun: interrupted", file=sys.stderr)
            sys.exit(signals.exit_code())  # 130 Ctrl-C, 143 SIGTERM, 129 SIGHUP
        rank = f" rank {ranks.rank()}:" if ranks.world_size() > 1 else ""
        print(f"rlrun:{rank} error: {e}", file=sys.stderr)
        if isinstance(e, ConfigError) and e.before_start and ranks.rank() == 0:
            from .folders import discard_refused

            discard_refused(hc.runtime.output_dir, hc.job.name)
        sys.exit(1 if isinstance(e, FaultError) else 2)  # 2: the user's input; 1: a fault outside it


def sweep_only(cfg: DictConfig) -> list[str]:
    """A warning for each key set in a single run that only a sweep reads (report.*), naming how to sweep."""
    r = cfg.get("report") or {}
    asked = {"report.replay": r.get("replay") is True, "report.repeats": (r.get("repeats") or 1) > 1,
             "report.baseline": r.get("baseline") is not None}
    return [f"{key}={OmegaConf.select(cfg, key)} is read by a sweep only (rlrun -m ...: docs/sweeps.md); this single "
            "run ignores it" for key, on in asked.items() if on]


def sweep_job(cfg: DictConfig, run_name: str):
    """One job of a multirun: a failure is recorded (child run FAILED with its error) and the sweep goes on. With
    report.check_jobs (default), the job's configuration is checked first (`rlrun check`)."""
    from . import tracking  # here, not at the top: the CLI validates a config without it

    try:
        if OmegaConf.select(cfg, "report.replay", default=False):  # a paired sweep: job 0 records, the rest replay
            from .rollout import paired

            hc = HydraConfig.get()
            cfg = paired.job_config(cfg, hc.job.num, hc.sweep.dir)
        return run(cfg, run_name, check_first=bool(OmegaConf.select(cfg, "report.check_jobs", default=False)))
    except KeyboardInterrupt:
        # a SLURM job's signal is its own (requeued, preempted, cancelled), not the sweep's end: the parent goes on
        on_slurm = os.environ.get("SUBMITIT_EXECUTOR") == "slurm"
        if tracking.stores(cfg.tracking) and cfg.tracking.parent_run_id and not on_slurm:
            tracking.mark(cfg.tracking.uri, cfg.tracking.parent_run_id, "KILLED")
        raise
    except Exception as e:  # noqa: BLE001 - every failure of a job is reported by the sweep
        log.error("job %s failed: %s: %s", run_name, type(e).__name__, e)
        if tracking.stores(cfg.tracking) and not getattr(e, "rlrun_run_id", None):
            # refused before its run existed (a config, a check, a replay's missing record): still list it, named,
            # so the sweep counts it; a store that cannot take even that is the sweep's to report (it counts jobs)
            try:
                tracking.record_failure(cfg, run_name, e)
            except Exception as again:  # noqa: BLE001
                log.error("job %s: its failure could not be recorded either (%s)", run_name, type(again).__name__)
        return {"error": f"{type(e).__name__}: {e}"}


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def plan_main(cfg: DictConfig):
    """`rlrun plan <overrides>`: validate, then print the memory plan (rlrun/plan/); builds no weights."""
    try:
        typed = validate(cfg)
        from . import plan
        from .runner.lifecycle import fits_record

        fits_record(typed)  # a replay's record checked as its run would check it (no plan of a run that is refused)
        text = plan.report(typed)
    except USER_ERRORS as e:
        print(f"rlrun plan: error: {e}", file=sys.stderr)
        sys.exit(2)
    print(text)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def check_main(cfg: DictConfig):
    """`rlrun check <overrides>`: validate, then prove the configuration on a probe rollout (rlrun/check/); exit 1
    when a probe fails."""
    try:
        typed = validate(cfg)
        from . import check
        from .runner.lifecycle import fits_record

        fits_record(typed)  # a replay's record checked as its run would check it
        text, ok = check.report(typed, progress=True)
    except USER_ERRORS as e:
        print(f"rlrun check: error: {e}", file=sys.stderr)
        sys.exit(2)
    print(text)
    if not ok:
        sys.exit(1)


# a plan or a check writes nothing: no output folder or logs, and no sweep (a sweep config's hydra.mode included)
PLAN_ARGS = ["hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=disabled",
             "hydra/hydra_logging=disabled", "hydra.mode=RUN"]


def entry():
    """The `rlrun` command. A Ctrl-C or SIGTERM that reaches this far (a sweep waiting on its launcher's workers)
    ends with one line and exit 130 / 143 instead of a traceback; the sweep's runs are marked KILLED on the way
    out (sweep.SweepCallback.end_interrupted)."""
    from .config import targets

    targets.guard()  # no code from a config: checked before Hydra instantiates a callback, launcher or sweeper
    secrets.guard_output()  # no password, token or environment secret in a printed line (tracking/secrets.py)
    try:
        if sys.argv[1:2] in (["plan"], ["check"]):
            verb = sys.argv[1]
            if {"-m", "--multirun"} & set(sys.argv):
                sys.exit(f"rlrun {verb}: error: {verb} one configuration at a time (no -m / --multirun).")
            sys.argv[1:2] = []
            sys.argv += PLAN_ARGS
            return plan_main() if verb == "plan" else check_main()
        main()
    except KeyboardInterrupt:
        print("rlrun: interrupted", file=sys.stderr)
        sys.exit(signals.exit_code())


if __name__ == "__main__":
    entry()
