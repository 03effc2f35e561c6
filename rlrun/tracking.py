"""MLflow tracking: one run per job, params flattened with '.', the resolved config as an artifact, metrics per
step, summary metrics, and a final status (FINISHED / FAILED / KILLED) that never leaves a run RUNNING.

`tracking=none` gives a tracker that records nothing. `tracking.parent_run_id` nests the run under a sweep's
parent run (passed explicitly, never through MLFLOW_RUN_ID, which would make start_run resume that run).

The functions below the trackers are the one place that opens a client, gets or creates an experiment and logs
params, metrics and figures: the loop's tracker, the sweep callback, `rlrun.bench` and `rlrun-report` share them.
mlflow is imported inside them, so importing this module stays cheap.
"""

from __future__ import annotations

import os
import re
import time
from urllib.parse import urlparse

from omegaconf import OmegaConf

from .errors import TrackingError


def flatten(d, prefix: str = "") -> dict[str, str]:
    out = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        else:
            out[name] = str(value)
    return out


def check_uri(uri: str, key: str = "tracking.uri", off: str = "tracking=none") -> None:
    """Fail before training if the store cannot be used, naming the fix (`key`, `off`: the option as the
    command that checks spells it, and how to turn tracking off there)."""
    scheme = urlparse(uri).scheme
    if scheme in ("", "file"):
        raise TrackingError(
            f"{key}={uri!r} is a file store, which MLflow 3.13+ rejects; use sqlite:///mlflow.db "
            f"(a local database file), http(s)://HOST:PORT for a tracking server, or {off}."
        )
    if scheme == "sqlite":
        path = uri[len("sqlite:///") :]
        folder = os.path.dirname(os.path.abspath(path)) if path else os.getcwd()
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as e:
            raise TrackingError(f"{key}={uri!r}: cannot create folder {folder!r} ({e.strerror}).") from e
        if not os.access(folder, os.W_OK):
            raise TrackingError(f"{key}={uri!r}: folder {folder!r} is not writable; choose another path.")


class Null:
    """tracking=none: records nothing."""

    run_id = None

    def log(self, step, metrics):
        pass

    def tags(self, tags):
        pass

    def summary(self, metrics):
        pass

    def text(self, text, name):
        pass

    def table(self, rows, name):
        pass

    def artifacts(self, folder, name):
        pass

    def finish(self, status):
        pass


def open_client(uri: str):
    """An MlflowClient that fails fast on an unreachable server instead of retrying for minutes."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def experiment_id(client, name: str) -> str:
    """The id of experiment `name`, created if missing. Jobs of a sweep may start together: if another process
    creates it between our read and our create, the create fails and we read theirs."""
    from mlflow.exceptions import MlflowException

    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    try:
        return client.create_experiment(name)
    except MlflowException:
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def connect(uri: str, experiment: str):
    """(client, experiment id) for writing runs; TrackingError naming the fix if the store cannot be used."""
    check_uri(uri)
    client = open_client(uri)
    try:
        return client, experiment_id(client, experiment)
    except Exception as e:  # noqa: BLE001 - any failure here means the store is unusable
        raise TrackingError(
            f"tracking.uri={uri!r} cannot be reached or used ({type(e).__name__}: {str(e)[:300]}). "
            "Start the server, fix the URI, or run with tracking=none."
        ) from e


def log_params(client, run_id: str, params: dict) -> None:
    """Params as strings cut to MLflow's 6000-character limit, in batches of MLflow's 100."""
    from mlflow.entities import Param

    batch = [Param(k, str(v)[:6000]) for k, v in params.items()]
    for i in range(0, len(batch), 100):
        client.log_batch(run_id, params=batch[i : i + 100])


def log_metrics(client, run_id: str, metrics: dict[str, float], step: int = 0) -> None:
    """Metrics at one step, in batches of 500 (under MLflow's 1000 per request)."""
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    batch = [Metric(k, float(v), now, step) for k, v in metrics.items()]
    for i in range(0, len(batch), 500):
        client.log_batch(run_id, metrics=batch[i : i + 500])


def log_figures(client, run_id: str, figs: dict) -> None:
    """{artifact file name: matplotlib figure} as artifacts of the run."""
    for name, fig in figs.items():
        client.log_figure(run_id, fig, name)


class MLflow:
    def __init__(self, cfg, config: dict, run_name: str | None, resume_run_id: str | None = None):
        self.client, exp_id = connect(cfg.uri, cfg.experiment)
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
        log_params(self.client, self.run_id, flatten(config))
        self.client.log_dict(self.run_id, config, "config.yaml")

    def log(self, step: int, metrics: dict[str, float]):
        if step >= self.first_step:
            log_metrics(self.client, self.run_id, metrics, step)

    def tags(self, tags: dict[str, str]):
        for k, v in tags.items():
            self.client.set_tag(self.run_id, k, str(v)[:5000])

    def summary(self, metrics: dict[str, float]):
        log_metrics(self.client, self.run_id, {f"summary/{k}": v for k, v in metrics.items()})

    def text(self, text: str, name: str):
        self.client.log_text(self.run_id, text, name)

    def table(self, rows: list[dict], name: str):
        """Rows of equal keys as an MLflow table (`name` ends in .json); the UI shows it under Artifacts."""
        self.client.log_table(self.run_id, {k: [r.get(k) for r in rows] for k in rows[0]}, name)

    def artifacts(self, folder: str, name: str):
        self.client.log_artifacts(self.run_id, folder, name)

    def finish(self, status: str):
        self.client.set_terminated(self.run_id, status=status)


def is_run_id(text: str) -> bool:
    return re.fullmatch(r"[0-9a-f]{32}", text) is not None


def checkpoint_dir_of(cfg, run_id: str) -> str:
    """`checkpoint.dir` of an MLflow run, for `resume=<run id>`."""
    if cfg.name != "mlflow":
        raise TrackingError(f"resume={run_id} looks up an MLflow run, but tracking=none; set tracking=mlflow and "
                            "tracking.uri to the store the run was logged to, or resume=CHECKPOINT_FOLDER.")
    try:
        params = open_client(cfg.uri).get_run(run_id).data.params
    except Exception as e:  # noqa: BLE001 - not found, or the store is unreachable: one message either way
        raise TrackingError(f"resume={run_id}: no such MLflow run in tracking.uri={cfg.uri!r} ({type(e).__name__}); "
                            "point tracking.uri at the store the run was logged to, or give resume=CHECKPOINT_FOLDER."
                            ) from e
    folder = params.get("checkpoint.dir")
    if folder in (None, "None", ""):
        raise TrackingError(f"resume={run_id}: that run wrote no checkpoints (checkpoint.dir was not set).")
    return folder


def mark(uri: str, run_id: str, status: str) -> None:
    open_client(uri).set_terminated(run_id, status)


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
