"""`rlrun`: compose the config (Hydra), validate it, run the loop, record it. Nothing else lives here."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from . import checkpoint, tracking
from .config import ConfigError, validate
from .engine import deepspeed as ds_engine
from .models import ModelError
from .rollout.vllm import RolloutError
from .tasks import TaskError

log = logging.getLogger("rlrun")

# Errors that are the user's input, not a bug: shown as one clear message, no traceback.
USER_ERRORS = (ConfigError, ModelError, TaskError, tracking.TrackingError, checkpoint.CheckpointError, RolloutError)
# conf/ sits beside the package in the repository (install with `pip install -e .`).
CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


def run(cfg: DictConfig, run_name: str | None = None) -> dict:
    """Validate, open the tracker, train; the MLflow run ends FINISHED, FAILED or KILLED, never RUNNING."""
    from . import loop  # heavy imports after validation, so bad configs fail fast

    validate(cfg)
    state = None
    if cfg.resume:
        state, path = checkpoint.load_latest(cfg.checkpoint.dir if cfg.resume is True else str(cfg.resume))
        now = loop.cfg_flat(cfg)
        changed = checkpoint.changed_keys(state["config"], now)
        if changed:
            raise ConfigError([f"resume from {path}: {k} was {state['config'].get(k)!r}, now {now.get(k)!r}; a "
                               "resumed run must train the same thing (only train.steps, the head, logging and "
                               "tracking may change)" for k in changed])
        world = ds_engine.world_size()
        if state.get("world_size", 1) != world:
            raise ConfigError([f"resume from {path}: the checkpoint was written by {state.get('world_size', 1)} "
                               f"rank(s), this launch has {world}; resume with the same number of processes."])
        log.info("resuming from %s at step %d", path, state["step"])
    # Data parallel: only rank 0 talks to MLflow (and draws progress); the others record nothing.
    main_rank = os.environ.get("RANK", "0") == "0"
    resume_id = state and state["run_id"]
    tracker = tracking.start(cfg.tracking, cfg, run_name, resume_run_id=resume_id) if main_rank else tracking.Null()
    try:
        summary = loop.train(cfg, tracker, state)
    except KeyboardInterrupt:
        tracker.tags({"error": "interrupted (KeyboardInterrupt)"})
        tracker.finish("KILLED")
        raise
    except BaseException as e:
        tracker.tags({"error": f"{type(e).__name__}: {e}"})
        tracker.finish("FAILED")
        raise
    finally:
        ds_engine.shutdown()
    tracker.summary(summary)
    tracker.finish("FINISHED")
    if main_rank:
        log.info("summary: %s", {k: round(v, 4) for k, v in summary.items()})
    if tracker.run_id:
        log.info("mlflow run %s (%s)", tracker.run_id, cfg.tracking.uri)
    return summary


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig):
    hc = HydraConfig.get()
    run_name = cfg.get("run_name") or hc.job.override_dirname or "default"
    if str(hc.mode) == "RunMode.MULTIRUN":
        return sweep_job(cfg, run_name)
    try:
        run(cfg, run_name)
    except USER_ERRORS + (KeyboardInterrupt,) as e:
        if isinstance(e, KeyboardInterrupt):
            print("rlrun: interrupted", file=sys.stderr)
            sys.exit(130)
        rank = f" rank {os.environ['RANK']}:" if ds_engine.world_size() > 1 else ""
        print(f"rlrun:{rank} error: {e}", file=sys.stderr)
        sys.exit(2)


def sweep_job(cfg: DictConfig, run_name: str):
    """One job of a multirun: a failure is recorded (child run FAILED with its error) and the sweep goes on."""
    try:
        return run(cfg, run_name)
    except KeyboardInterrupt:
        if cfg.tracking.name == "mlflow" and cfg.tracking.parent_run_id:
            tracking.mark(cfg.tracking.uri, cfg.tracking.parent_run_id, "KILLED")
        raise
    except Exception as e:  # noqa: BLE001 - every failure of a job is reported by the sweep
        log.error("job %s failed: %s: %s", run_name, type(e).__name__, e)
        if isinstance(e, ConfigError) and cfg.tracking.name == "mlflow":
            tracking.record_failure(cfg, run_name, e)  # refused before a run existed: still list it
        return {"error": f"{type(e).__name__}: {e}"}


if __name__ == "__main__":
    main()
