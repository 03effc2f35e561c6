"""Tracking: one MLflow run per job (mlflow.py), written through a local spill that keeps what an unreachable store
cannot take (spill.py); the store's client, experiment and metric names (store.py); the standard tags and the run
description (tags.py); what MLflow's UI opens on: links, the saved view `rlrun`, the first chart (ui.py).
`tracking=none` gives `Null`, which records nothing; both satisfy `Tracker` (tracker.py) and are found through the
registry's `tracking` entry.

`tracking.parent_run_id` nests the run under a sweep's parent run (passed explicitly, never through MLFLOW_RUN_ID,
which would make start_run resume that run).

Metric names in MLflow (`metric_key`, the one place they are mapped): the code computes short names (`loss`,
`time/step_s`); a run logs the learning curves as `train/...`, held-out evaluation as `eval/...` (the two sections
of MLflow's "Model metrics" tab) and the measurements of the machine (time, memory, throughput, pass counts,
logprob mismatch, the run's performance summary) as `system/...`, which MLflow shows on its "System metrics" tab.
`rlrun-report` also reads runs logged before the names were namespaced.
"""

from __future__ import annotations

from typing import Any, cast

from omegaconf import OmegaConf

from .. import registry
from ..errors import TrackingError
from . import secrets, ui
from .mlflow import MLflow
from .store import (
    SYSTEM_PREFIXES,
    absolute_uri,
    check_uri,
    checkpoint_dir_of,
    connect,
    experiment_id,
    flatten,
    is_run_id,
    job_overrides,
    log_figures,
    log_metrics,
    log_params,
    mark,
    metric_key,
    open_client,
    output_dir,
    store_lock,
    unusable,
)
from .tags import (
    EXPERIMENT_KIND,
    SWEEP_KEYS_ENV,
    describe_run,
    git_commit,
    headline,
    mark_experiment_kind,
    short_name,
    standard_tags,
)
from .tracker import Null, Tracker

UI_PORT = 5000  # tracking.ui_port's default: `mlflow ui`'s own default port

__all__ = ["EXPERIMENT_KIND", "MLflow", "Null", "SWEEP_KEYS_ENV", "SYSTEM_PREFIXES", "Tracker", "TrackingError",
           "UI_PORT", "absolute_uri", "check_uri", "checkpoint_dir_of", "connect", "describe_run", "experiment_id",
           "flatten", "git_commit", "headline", "is_run_id", "job_overrides", "log_figures", "log_metrics",
           "log_params", "mark", "mark_experiment_kind", "metric_key", "open_client", "output_dir", "record_failure",
           "short_name", "standard_tags", "start", "store_lock", "stores", "ui", "unusable"]


def stores(cfg) -> bool:
    """Whether `tracking=cfg.name` keeps runs in the MLflow store at tracking.uri (its object's `stores`: a sweep's
    parent run, resume by run id, a failed run's record). False for a name the registry lacks: validation, not this
    question, says what is wrong with it."""
    found = registry.REGISTRY.get("tracking", {}).get(str(getattr(cfg, "name", "")))
    return found is not None and bool(getattr(registry.load(found), "stores", False))


def start(cfg, config_obj, run_name: str | None = None, resume_run_id: str | None = None,
          previous_spill: str | None = None) -> Tracker:
    """The tracker of `tracking=cfg.name` (the registry's entry); `config_obj` is the resolved config (logged as
    params). `previous_spill`: the spill file of the process that wrote the checkpoint a run resumes from."""
    factory = registry.get("tracking", cfg.name)
    config, found = secrets.loggable(config_obj, bool(getattr(cfg, "log_env", False)))  # ${oc.env:...} hidden
    return factory(cfg, config, run_name and secrets.text(run_name, found), resume_run_id, previous_spill)


def record_failure(config_obj, run_name: str, error: Exception) -> None:
    """A FAILED run for a job that was refused before training, so a sweep lists every job."""
    config, found = secrets.loggable(config_obj, bool(OmegaConf.select(config_obj, "tracking.log_env",
                                                                      default=False)))
    config = cast("dict[str, Any]", config)  # a run config: a mapping
    tracker = MLflow(config_obj.tracking, config, secrets.text(run_name, found))
    tracker.tags({"error": f"{type(error).__name__}: {error}"})
    tracker.finish("FAILED")
