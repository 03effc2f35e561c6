"""MLflow tracking: one run per job, params flattened with '.', the resolved config as an artifact, metrics per
step, summary metrics, and a final status (FINISHED / FAILED / KILLED) that never leaves a run RUNNING.

`tracking=none` gives a tracker that records nothing. `tracking.parent_run_id` nests the run under a sweep's
parent run (passed explicitly, never through MLFLOW_RUN_ID, which would make start_run resume that run).
"""

from __future__ import annotations

import os
import time
from urllib.parse import urlparse

from omegaconf import OmegaConf


class TrackingError(RuntimeError):
    """The tracking URI or experiment cannot be used."""


def flatten(d, prefix: str = "") -> dict[str, str]:
    out = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        else:
            out[name] = str(value)
    return out


def check_uri(uri: str) -> None:
    """Fail before training if the store cannot be used, naming the fix."""
    scheme = urlparse(uri).scheme
    if scheme in ("", "file"):
        raise TrackingError(
            f"tracking.uri={uri!r} is a file store, which MLflow 3.13+ rejects; use sqlite:///mlflow.db "
            "(a local database file), http(s)://HOST:PORT for a tracking server, or tracking=none."
        )
    if scheme == "sqlite":
        path = uri[len("sqlite:///") :]
        folder = os.path.dirname(os.path.abspath(path)) if path else os.getcwd()
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as e:
            raise TrackingError(f"tracking.uri={uri!r}: cannot create folder {folder!r} ({e.strerror}).") from e
        if not os.access(folder, os.W_OK):
            raise TrackingError(f"tracking.uri={uri!r}: folder {folder!r} is not writable; choose another path.")


class Null:
    """tracking=none: records nothing."""

    run_id = None

    def log(self, step, metrics):
        pass

    def tags(self, tags):
        pass

    def summary(self, metrics):
        pass

    def finish(self, status):
        pass


class MLflow:
    def __init__(self, cfg, config: dict, run_name: str | None, resume_run_id: str | None = None):
        check_uri(cfg.uri)
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self._Metric = Metric
        self.client = MlflowClient(tracking_uri=cfg.uri)
        try:
            exp = self.client.get_experiment_by_name(cfg.experiment)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(cfg.experiment)
        except Exception as e:  # noqa: BLE001 - any failure here means the store is unusable
            raise TrackingError(
                f"tracking.uri={cfg.uri!r} cannot be reached or used ({type(e).__name__}: {str(e)[:300]}). "
                "Start the server, fix the URI, or run with tracking=none."
            ) from e
        self.first_step = 0  # steps below this were logged before a resume: recomputed, not logged twice
        if resume_run_id:  # the same run continues: RUNNING again, params as first logged
            self.run_id = resume_run_id
            self.client.update_run(resume_run_id, status="RUNNING")
            logged = self.client.get_metric_history(resume_run_id, "loss")
            self.first_step = max((m.step for m in logged), default=-1) + 1
            return
        tags = {"mlflow.runName": run_name} if run_name else {}
        if cfg.parent_run_id:
            tags["mlflow.parentRunId"] = cfg.parent_run_id
        self.run = self.client.create_run(exp_id, tags=tags, run_name=run_name)
        self.run_id = self.run.info.run_id
        params = [Param(k, v[:6000]) for k, v in flatten(config).items()]
        for i in range(0, len(params), 100):
            self.client.log_batch(self.run_id, params=params[i : i + 100])
        self.client.log_dict(self.run_id, config, "config.yaml")

    def log(self, step: int, metrics: dict[str, float]):
        if step < self.first_step:
            return
        now = int(time.time() * 1000)
        batch = [self._Metric(k, float(v), now, step) for k, v in metrics.items()]
        for i in range(0, len(batch), 500):
            self.client.log_batch(self.run_id, metrics=batch[i : i + 500])

    def tags(self, tags: dict[str, str]):
        for k, v in tags.items():
            self.client.set_tag(self.run_id, k, str(v)[:5000])

    def summary(self, metrics: dict[str, float]):
        now = int(time.time() * 1000)
        batch = [self._Metric(f"summary/{k}", float(v), now, 0) for k, v in metrics.items()]
        self.client.log_batch(self.run_id, metrics=batch)

    def finish(self, status: str):
        self.client.set_terminated(self.run_id, status=status)


def mark(uri: str, run_id: str, status: str) -> None:
    from mlflow.tracking import MlflowClient

    MlflowClient(uri).set_terminated(run_id, status)


def record_failure(config_obj, run_name: str, error: Exception) -> None:
    """A FAILED run for a job that was refused before training, so a sweep lists every job."""
    tracker = MLflow(config_obj.tracking, OmegaConf.to_container(config_obj, resolve=True), run_name)
    tracker.tags({"error": f"{type(error).__name__}: {error}"})
    tracker.finish("FAILED")


def start(cfg, config_obj, run_name: str | None = None, resume_run_id: str | None = None):
    """A tracker for the `tracking` config group; `config_obj` is the resolved config (logged as params)."""
    if cfg.name == "none":
        return Null()
    return MLflow(cfg, OmegaConf.to_container(config_obj, resolve=True), run_name, resume_run_id)
