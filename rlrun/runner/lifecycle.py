"""A run's life: restore a checkpoint (if resuming), open the tracker, hand over to the recipe, and end the MLflow run
FINISHED, FAILED or KILLED (never RUNNING)."""

from __future__ import annotations

import contextlib
import logging
import os

from .. import checkpoint, exportdir, faults, folders, ranks, registry, signals, tracking
from ..config import ConfigError
from ..errors import DivergedError
from ..rollout import record
from .console import end_table, header, results_hint

log = logging.getLogger("rlrun")


def run(cfg, raw, run_name: str | None, train, on_start=None) -> dict:
    """Train one validated config with `train` (a recipe's `train(cfg, raw, tracker, resume)`); `cfg` is typed,
    `raw` the composed DictConfig that is logged and checkpointed. Once the MLflow run exists every way out ends it
    FINISHED, FAILED or KILLED (SIGTERM arrives as KeyboardInterrupt: cli.main installs that at process start).
    `on_start(tracker)`: called once the run exists (a sweep job logs its check there)."""
    signals.set_grace(cfg.checkpoint.stop_grace_s)  # after a signal, how long the step in flight may take
    faults.check_devices(cfg)  # before anything is built: a device the machine lacks is one message
    check_rollouts(cfg)
    state = load_resume(cfg, raw) if cfg.resume else None
    checkpoint.check_writable(cfg.checkpoint.dir)
    main_rank = ranks.is_main()  # data parallel: only rank 0 talks to MLflow (and draws progress)
    exporting = export_dir(cfg) if cfg.export.enabled and main_rank else None
    if main_rank:  # before the MLflow run exists: a refused folder leaves no run behind
        exportdir.check_export(exporting, cfg.checkpoint.dir,
                               getattr(cfg.tracking, "uri", None))  # a store, where the tracking option has one
    # one run per checkpoint folder, one export per export folder, from here to the end of the run
    with folders.own_checkpoints(cfg.checkpoint.dir if main_rank else None, resuming=bool(cfg.resume)), \
            exportdir.own_export(exporting):
        return _tracked(cfg, raw, run_name, train, state, main_rank, on_start)


def fits_record(cfg) -> None:
    """rollout=replay: RecordError unless the record at rollout.path fits the config (the rollout option's
    `check`); run, `rlrun plan` and `rlrun check` alike."""
    fits = getattr(registry.get("rollout", cfg.rollout.name), "check", None)
    if fits is not None:
        fits(cfg)


def check_rollouts(cfg) -> None:
    """Before anything is built: the record a run replays must fit its config (rollout=replay: the rollout option's
    `check`), and a folder to record to must be new, empty, or this run's own record when it resumes. (With
    loss=dpo the config rules refuse both.)"""
    fits_record(cfg)
    if getattr(cfg.rollout, "record", None) and ranks.is_main():  # rank 0 writes it (the others may see it begun)
        record.check_folder(os.path.expanduser(cfg.rollout.record), cfg, resumed=bool(cfg.resume))


def _tracked(cfg, raw, run_name, train, state, main_rank, on_start=None) -> dict:
    """`run` from the MLflow run's creation to its end."""
    resume_id = state and state["run_id"]
    tracker: tracking.Tracker = tracking.Null()
    try:
        if main_rank:  # inside the try: a signal just after the run is created still ends it (tracking.MLflow)
            tracker = tracking.start(cfg.tracking, raw, run_name, resume_run_id=resume_id,
                                     previous_spill=state and state.get("spill"))
            print(header(cfg, tracker), flush=True)
            if on_start is not None:
                on_start(tracker)
        try:
            summary = train(cfg, raw, tracker, state)
        except FloatingPointError as e:  # frame.NonFiniteLossError: the run's error tag says what the console says
            raise DivergedError(faults.diverged(cfg, e)) from None
    except KeyboardInterrupt:
        end(tracker, "KILLED", "interrupted (KeyboardInterrupt)")
        raise
    except BaseException as e:
        end(tracker, "FAILED", f"{type(e).__name__}: {e}")
        with contextlib.suppress(AttributeError):  # a sweep job records a run for a failure only where none exists
            e.rlrun_run_id = tracker.run_id  # type: ignore[attr-defined]
        raise
    finally:
        shutdown = getattr(registry.get("engine", cfg.engine.name), "shutdown", None)
        if shutdown is not None:  # an engine with process-wide state (DeepSpeed's process group)
            shutdown()
    with signals.held():  # a Ctrl-C now waits until the run is marked FINISHED
        tracker.summary(summary)
        tracker.describe(tracking.headline(summary))
        tracker.finish("FINISHED")
    if main_rank:
        print(end_table(summary, cfg.train.steps) + "\n" + results_hint(cfg, tracker), flush=True)
    return summary


def end(tracker, status: str, error: str) -> None:
    """Mark the run `status` with its error; a second signal waits until that is done."""
    with signals.held():
        try:
            tracker.tags({"error": error})
        finally:
            tracker.finish(status)


def load_resume(cfg, raw) -> dict:
    """The checkpoint to continue from, refused when it trained something else or on another number of ranks."""
    where = cfg.checkpoint.dir if cfg.resume is True else str(cfg.resume)
    if cfg.resume is not True and not os.path.exists(where) and tracking.is_run_id(where):
        where = tracking.checkpoint_dir_of(cfg.tracking, where)  # resume=<MLflow run id>
    state, path = checkpoint.load_latest(where)
    now = cfg_flat(raw)
    changed = checkpoint.changed_keys(state["config"], now)
    if changed:
        raise ConfigError([f"resume from {path}: {k} was {state['config'].get(k)!r}, now {now.get(k)!r}; a "
                           "resumed run must train the same thing (only train.steps, the head, logging, "
                           "evaluation, export and tracking may change)" for k in changed])
    world = ranks.world_size()
    if state.get("world_size", 1) != world:
        raise ConfigError([f"resume from {path}: the checkpoint was written by {state.get('world_size', 1)} "
                           f"rank(s), this launch has {world}; resume with the same number of processes."])
    log.info("resuming from %s at step %d", path, state["step"])
    return state


def cfg_flat(raw) -> dict[str, str]:
    from omegaconf import OmegaConf

    return tracking.flatten(OmegaConf.to_container(raw, resolve=True))


def export_dir(cfg) -> str | None:
    """`export.dir`, or `model/` in the run's output folder (Hydra's run dir); None outside a Hydra run."""
    if cfg.export.dir:
        return cfg.export.dir
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    return os.path.join(HydraConfig.get().runtime.output_dir, "model")
