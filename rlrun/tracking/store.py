"""The tracking store: open a client, get or create an experiment, log params, metrics and figures, and the one
place metric names are mapped to MLflow's (`metric_key`). The run's tracker (mlflow.py), the sweep callback,
`rlrun.bench` and `rlrun-report` share these; mlflow is imported inside them, so importing this module stays cheap.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from urllib.parse import urlparse

from .. import nofollow
from ..errors import TrackingError
from . import secrets


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
        problem = store_file_problem(os.path.abspath(path)) if path and path != ":memory:" else None
        if problem:
            raise TrackingError(f"{key}={uri!r}: {problem}; point {key} at another file (a new one is created), "
                                f"or {off}.")


def store_file_problem(path: str) -> str | None:
    """What makes `path` no place for a sqlite store, seen before MLflow opens it (MLflow would create the database
    through a link to nothing, and retries a FIFO or a /proc file for minutes before any message); None if fine."""
    import stat

    if os.path.islink(path) and not os.path.exists(path):
        return (f"{path} is a symbolic link to nothing ({os.readlink(path)}); MLflow would create the database "
                "where it points")
    real = os.path.realpath(path)
    if real.startswith(("/proc/", "/sys/")):  # the kernel's files: sqlite's locking and writes fail slowly there
        return f"{path} is under /{real.split('/')[1]}, the kernel's files, not a file system for data"
    if not os.path.exists(path):
        return None  # a new store: MLflow creates it
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a folder" if stat.S_ISDIR(mode) else "not a regular file"
        return f"{path} is {kind}, not a database file"
    if not os.access(path, os.R_OK | os.W_OK):
        return f"{path} cannot be read and written by this user, or is on a read-only mount"
    return foreign_tables(path)


def foreign_tables(path: str) -> str | None:
    """Why the existing SQLite file at `path` is not an MLflow store to write into: a database of the user's own,
    with tables and no MLflow schema (MLflow would add its tables to it, some before refusing a name that clashes);
    None for an MLflow store, an empty file or one that is no database. Read only (`mode=ro`)."""
    import sqlite3
    from urllib.parse import quote

    if os.path.getsize(path) == 0:
        return None  # an empty file: a new store
    try:
        with contextlib.closing(sqlite3.connect(f"file:{quote(path)}?mode=ro", uri=True)) as db:
            tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.DatabaseError:
        return None  # not a database at all: MLflow's own error says so, with the fix (`unusable`)
    if not tables or {"experiments", "alembic_version"} <= tables:
        return None
    shown = ", ".join(sorted(tables)[:5]) + (", ..." if len(tables) > 5 else "")
    return (f"{path} is a database of its own ({len(tables)} tables: {shown}), not an MLflow store; MLflow would add "
            "its tables to it. Nothing was written to it")


def open_client(uri: str):
    """An MlflowClient that fails fast on an unreachable server instead of retrying for minutes. On a sqlite
    store the first use (which creates the database and runs MLflow's schema migrations) happens under a file lock
    (`<db>.lock`): two processes that start together on a new store would otherwise race in the migration."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    # MLflow's own "View run / View experiment" lines: their experiment link opens MLflow 3's UI on GenAI traces;
    # rlrun prints links to the model-training view instead (ui.py)
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # no "Downloading artifacts" bars
    from mlflow.tracking import MlflowClient

    for name in ("mlflow.store.db.utils", "alembic"):  # "Creating initial MLflow database tables..." and the like
        logging.getLogger(name).setLevel(logging.WARNING)

    if urlparse(uri).scheme != "sqlite":
        return Redacting(MlflowClient(tracking_uri=uri))
    with store_lock(uri):  # the client creates / migrates the store: one process at a time
        client = MlflowClient(tracking_uri=uri)
        client.search_experiments(max_results=1)
    return Redacting(client)


class Redacting:
    """An MlflowClient whose every string written passes `secrets.scrub` (params, tags, run names, text artifacts):
    every writer in rlrun opens its client here, so no caller has to remember. Reads pass through."""

    TEXT = (".txt", ".yaml", ".yml", ".json", ".log", ".md", ".csv")  # artifacts read, scrubbed, then logged

    def __init__(self, client):
        self._client = client

    def __getattr__(self, name: str):
        if name == "_client":  # not set yet: an instance being unpickled (joblib and submitit pickle the sweep's
            raise AttributeError(name)  # callback, its client with it), where looking it up again recursed
        return getattr(self._client, name)

    def set_tag(self, run_id, key, value, *args, **kwargs):
        return self._client.set_tag(run_id, key, secrets.scrub(str(value)), *args, **kwargs)

    def set_experiment_tag(self, experiment_id, key, value):
        return self._client.set_experiment_tag(experiment_id, key, secrets.scrub(str(value)))

    def log_param(self, run_id, key, value, *args, **kwargs):
        return self._client.log_param(run_id, key, secrets.scrub(str(value)), *args, **kwargs)

    def log_batch(self, run_id, metrics=(), params=(), tags=(), *args, **kwargs):
        from mlflow.entities import Param, RunTag

        return self._client.log_batch(run_id, metrics, [Param(p.key, secrets.scrub(p.value)) for p in params],
                                      [RunTag(t.key, secrets.scrub(t.value)) for t in tags], *args, **kwargs)

    def create_run(self, experiment_id, start_time=None, tags=None, run_name=None, *args, **kwargs):
        return self._client.create_run(experiment_id, start_time, secrets.scrub_tree(tags),
                                       run_name and secrets.scrub(run_name), *args, **kwargs)

    def update_run(self, run_id, status=None, name=None, *args, **kwargs):
        return self._client.update_run(run_id, status, name and secrets.scrub(name), *args, **kwargs)

    def log_dict(self, run_id, dictionary, artifact_file, *args, **kwargs):
        return self._client.log_dict(run_id, secrets.scrub_tree(dictionary), artifact_file, *args, **kwargs)

    def log_text(self, run_id, text, artifact_file, *args, **kwargs):
        return self._client.log_text(run_id, secrets.scrub(text), artifact_file, *args, **kwargs)

    def log_artifact(self, run_id, local_path, artifact_path=None, *args, **kwargs):
        if not local_path.endswith(self.TEXT) or not os.path.isfile(local_path):
            return self._client.log_artifact(run_id, local_path, artifact_path, *args, **kwargs)
        import tempfile

        with open(local_path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        with tempfile.TemporaryDirectory() as folder:  # the same name, scrubbed
            clean = os.path.join(folder, os.path.basename(local_path))
            with open(clean, "w", encoding="utf-8") as f:
                f.write(secrets.scrub(text))
            return self._client.log_artifact(run_id, clean, artifact_path, *args, **kwargs)


@contextlib.contextmanager
def store_lock(uri: str):
    """An exclusive fcntl lock on `<db>.lock` beside a sqlite store's file (none where it cannot be made: a
    read-only folder, a platform without fcntl, an in-memory database)."""
    path = uri[len("sqlite:///"):].split("?")[0]
    if not path or path == ":memory:":
        yield
        return
    try:
        import fcntl

        fd = nofollow.open_existing(os.path.abspath(path) + ".lock", os.O_RDWR | os.O_CREAT)  # never via a link
    except (ImportError, OSError):
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


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
    try:
        client = open_client(uri)  # a sqlite store is opened (and created or migrated) here
        return client, experiment_id(client, experiment)
    except Exception as e:  # noqa: BLE001 - any failure here means the store is unusable
        raise TrackingError(unusable(uri, e)) from e


def unusable(uri: str, e: Exception) -> str:
    """Why the store at `uri` cannot be used, and the fix: a locked database is another process's (wait, or use
    another file), a read-only one needs a writable place; neither is a damaged file to move aside."""
    why = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    if urlparse(uri).scheme != "sqlite":
        return (f"tracking.uri={uri!r} cannot be reached or used ({why}). Start the server, fix the URI, or run "
                "with tracking=none.")
    path = os.path.abspath(uri[len("sqlite:///"):])
    text = str(e).lower()
    if "database is locked" in text:
        return (f"tracking.uri={uri!r}: {path} is locked by another process writing to it ({why}); wait until it "
                "ends, point tracking.uri at another file, or run with tracking=none. The database is not damaged: "
                "do not move it aside.")
    if "readonly" in text or "read-only" in text:
        return (f"tracking.uri={uri!r}: {path} cannot be written ({why}): a read-only file or mount. Point "
                "tracking.uri at a writable file, or run with tracking=none.")
    return (f"tracking.uri={uri!r}: {path} cannot be used as an MLflow store ({why}). If it is not an MLflow "
            "database or is damaged, move it aside (a new one is created), point tracking.uri at another file, or "
            "run with tracking=none.")


def log_params(client, run_id: str, params: dict) -> None:
    """Params as strings cut to MLflow's 6000-character limit, in batches of MLflow's 100."""
    from mlflow.entities import Param

    batch = [Param(k, str(v)[:6000]) for k, v in params.items()]
    for i in range(0, len(batch), 100):
        client.log_batch(run_id, params=batch[i : i + 100])


# Measurements of the machine rather than of learning: logged under system/ (MLflow's "System metrics" tab).
SYSTEM_PREFIXES = ("time/", "mem/", "host/", "plan/", "throughput/", "passes/", "mismatch/", "summary/", "batching/",
                   "pipeline/", "check/")


def metric_key(name: str) -> str:
    """The MLflow name of a metric the code calls `name`: `loss` -> `train/loss`, `eval/accuracy` unchanged,
    `time/step_s` -> `system/time/step_s` (names already namespaced stay as they are)."""
    if name.startswith(("train/", "eval/", "system/")):
        return name
    if name.startswith(SYSTEM_PREFIXES):
        return "system/" + name
    return "train/" + name


def metric_name(name: str) -> str:
    """`name` as MLflow takes it (letters, digits, `_ - . space : /`): a benchmark's row named by its overrides
    (`head=dense offload=on`, bench check) is logged as `head:dense offload:on`; any other character becomes `_`."""
    return re.sub(r"[^\w\-. :/]", "_", name.replace("=", ":"))


def log_metrics(client, run_id: str, metrics: dict[str, float], step: int = 0) -> None:
    """Metrics at one step, in batches of 500 (under MLflow's 1000 per request), each name as MLflow takes it
    (`metric_name`: a name MLflow refuses would lose the whole batch)."""
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    batch = [Metric(metric_name(k), float(v), now, step) for k, v in metrics.items()]
    for i in range(0, len(batch), 500):
        client.log_batch(run_id, metrics=batch[i : i + 500])


def log_figures(client, run_id: str, figs: dict) -> None:
    """{artifact file name: matplotlib figure} as artifacts of the run."""
    for name, fig in figs.items():
        client.log_figure(run_id, fig, name)


def absolute_uri(uri: str) -> str:
    """A sqlite URI with an absolute path (`sqlite:///mlflow.db` -> `sqlite:////cwd/mlflow.db`); others as given."""
    if urlparse(uri).scheme == "sqlite" and not uri.startswith("sqlite:////"):
        return "sqlite:///" + os.path.abspath(uri[len("sqlite:///"):])
    return uri


def output_dir() -> str:
    """The run's output folder (Hydra's), or the working folder outside a Hydra run."""
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get().runtime.output_dir if HydraConfig.initialized() else os.getcwd()


def job_overrides() -> str | None:
    """The Hydra job's command-line overrides as typed (`head=tiled train.steps=5`); None outside a Hydra run."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    return " ".join(HydraConfig.get().overrides.task) or None


def is_run_id(text: str) -> bool:
    return re.fullmatch(r"[0-9a-f]{32}", text) is not None


def mark(uri: str, run_id: str, status: str) -> None:
    open_client(uri).set_terminated(run_id, status)


def checkpoint_dir_of(cfg, run_id: str) -> str:
    """`checkpoint.dir` of an MLflow run, for `resume=<run id>`."""
    from . import stores  # the package's, defined after this module is imported

    if not stores(cfg):
        raise TrackingError(f"resume={run_id} looks up an MLflow run, but tracking={cfg.name} keeps none; set "
                            "tracking=mlflow and tracking.uri to the store the run was logged to, or "
                            "resume=CHECKPOINT_FOLDER.")
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


def saved_config(uri: str, run_id: str):
    """The composed config an MLflow run logged at its start (its config.yaml artifact), as a DictConfig; None
    when the run or the file cannot be read (the resume then fails later with its own message)."""
    import tempfile

    from omegaconf import OmegaConf

    try:
        with tempfile.TemporaryDirectory() as tmp:
            return OmegaConf.load(open_client(uri).download_artifacts(run_id, "config.yaml", tmp))
    except Exception:  # noqa: BLE001 - not found or unreachable: checkpoint_dir_of says which, with the fix
        return None
