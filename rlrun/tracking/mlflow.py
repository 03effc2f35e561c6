"""MLflow tracking: one run per job, params flattened with '.', the resolved config as an artifact, metrics per
step, summary metrics, and a final status (FINISHED / FAILED / KILLED) that never leaves a run RUNNING.

`tracking=none` gives a tracker that records nothing. `tracking.parent_run_id` nests the run under a sweep's
parent run (passed explicitly, never through MLFLOW_RUN_ID, which would make start_run resume that run).

The functions below the trackers are the one place that opens a client, gets or creates an experiment and logs
params, metrics and figures: the loop's tracker, the sweep callback, `rlrun.bench` and `rlrun-report` share them.
mlflow is imported inside them, so importing this module stays cheap.

Metric names in MLflow (`metric_key`, the one place they are mapped): the code computes short names (`loss`,
`time/step_s`); a run logs the learning curves as `train/...`, held-out evaluation as `eval/...` (the two sections
of MLflow's "Model metrics" tab) and the measurements of the machine (time, memory, throughput, pass counts,
logprob mismatch, the run's performance summary) as `system/...`, which MLflow shows on its "System metrics" tab.
`rlrun-report` also reads runs logged before the names were namespaced.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from urllib.parse import urlparse

from omegaconf import OmegaConf

from . import signals
from .errors import TrackingError
from .spill import FILE_NAME as SPILL_FILE
from .spill import Spill, replay

log = logging.getLogger("rlrun")


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

    def flush(self):
        pass

    def describe(self, text):
        pass


def open_client(uri: str):
    """An MlflowClient that fails fast on an unreachable server instead of retrying for minutes. On a sqlite
    store the first use (which creates the database and runs MLflow's schema migrations) happens under a file lock
    (`<db>.lock`): two processes that start together on a new store would otherwise race in the migration."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    from mlflow.tracking import MlflowClient

    if urlparse(uri).scheme != "sqlite":
        return MlflowClient(tracking_uri=uri)
    with store_lock(uri):  # the client creates / migrates the store: one process at a time
        client = MlflowClient(tracking_uri=uri)
        client.search_experiments(max_results=1)
    return client


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

        fd = os.open(os.path.abspath(path) + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
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
        why = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        if urlparse(uri).scheme == "sqlite":
            path = os.path.abspath(uri[len("sqlite:///"):])
            raise TrackingError(f"tracking.uri={uri!r}: {path} cannot be used as an MLflow store ({why}). If it is "
                                "not an MLflow database or is damaged, move it aside (a new one is created), point "
                                "tracking.uri at another file, or run with tracking=none.") from e
        raise TrackingError(f"tracking.uri={uri!r} cannot be reached or used ({why}). Start the server, fix the "
                            "URI, or run with tracking=none.") from e


def log_params(client, run_id: str, params: dict) -> None:
    """Params as strings cut to MLflow's 6000-character limit, in batches of MLflow's 100."""
    from mlflow.entities import Param

    batch = [Param(k, str(v)[:6000]) for k, v in params.items()]
    for i in range(0, len(batch), 100):
        client.log_batch(run_id, params=batch[i : i + 100])


# Measurements of the machine rather than of learning: logged under system/ (MLflow's "System metrics" tab).
SYSTEM_PREFIXES = ("time/", "mem/", "plan/", "throughput/", "passes/", "mismatch/", "summary/")


def metric_key(name: str) -> str:
    """The MLflow name of a metric the code calls `name`: `loss` -> `train/loss`, `eval/accuracy` unchanged,
    `time/step_s` -> `system/time/step_s` (names already namespaced stay as they are)."""
    if name.startswith(("train/", "eval/", "system/")):
        return name
    if name.startswith(SYSTEM_PREFIXES):
        return "system/" + name
    return "train/" + name


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
    def __init__(self, cfg, config: dict, run_name: str | None, resume_run_id: str | None = None,
                 previous_spill: str | None = None):
        self.client, exp_id = connect(cfg.uri, cfg.experiment)
        self.first_step = 0  # steps below this were logged before a resume: recomputed, not logged twice
        self.run_id, self.uri, self.spill = None, cfg.uri, None
        self.spill_path = os.path.join(output_dir(), SPILL_FILE)
        try:
            self._open(cfg, exp_id, config, run_name, resume_run_id, previous_spill)
        except BaseException as e:  # the run exists but the caller never gets it: end it here, never RUNNING
            if self.run_id:
                with signals.held():
                    with contextlib.suppress(Exception):
                        error = f"{type(e).__name__}: {e}"
                        if isinstance(e, KeyboardInterrupt):
                            error = f"interrupted ({error})"
                        self.client.set_tag(self.run_id, "error", error[:5000])
                    self.client.set_terminated(self.run_id, "KILLED" if isinstance(e, KeyboardInterrupt) else "FAILED")
            raise

    def _open(self, cfg, exp_id, config: dict, run_name: str | None, resume_run_id: str | None,
              previous_spill: str | None):
        if resume_run_id and not self._run_exists(resume_run_id):  # the store changed since the checkpoint
            log.warning("resume: run %s is not in tracking.uri=%s; this continues as a new run tagged "
                        "rlrun.resumed_from=%s (its earlier steps stay in the store it was logged to; to continue "
                        "that run itself, set tracking.uri to that store)", resume_run_id, cfg.uri, resume_run_id)
            config = {**config, "resumed_from": resume_run_id}
            resume_run_id = None
        if resume_run_id:  # the same run continues: RUNNING again, params as first logged
            self._send_kept(previous_spill, resume_run_id)
            self.run_id = resume_run_id
            self.client.update_run(resume_run_id, status="RUNNING")
            logged = self.client.get_metric_history(resume_run_id, metric_key("loss"))
            self.first_step = max((m.step for m in logged), default=-1) + 1
            return
        tags = {"mlflow.runName": run_name} if run_name else {}
        if "resumed_from" in config:
            tags["rlrun.resumed_from"] = config.pop("resumed_from")
        if cfg.parent_run_id:
            tags["mlflow.parentRunId"] = cfg.parent_run_id
        mark_experiment_kind(self.client, exp_id)
        self.about = describe_run(config)
        tags.update({**standard_tags(), "mlflow.note.content": self.about})
        self.run = self.client.create_run(exp_id, tags=tags, run_name=run_name)
        self.run_id = self.run.info.run_id
        log_params(self.client, self.run_id, flatten(config))
        self.client.log_dict(self.run_id, config, "config.yaml")

    def _send_kept(self, path: str | None, run_id: str) -> None:
        """What the interrupted process could not send goes in first: the steps it holds count as logged, and its
        final status is overwritten by this run's. Refuses to resume while the store does not take them."""
        if not path or not os.path.exists(path):
            return
        sent, left = replay(self.client, path)
        if sent:
            log.info("resume: sent %d records the interrupted run had kept in %s", sent, path)
        if left:
            raise TrackingError(f"resume: {left} records of run {run_id} are still kept in {path} and the store "
                                f"at tracking.uri={self.uri!r} does not take them now; resume when it does, or send "
                                f"them first: rlrun-report --sync {path}")

    def _run_exists(self, run_id: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_run(run_id)
            return True
        except MlflowException as e:
            if e.error_code == "RESOURCE_DOES_NOT_EXIST":
                return False
            raise

    def _send(self, op: str, args) -> None:
        """Every write once the run exists: queued for the sender, kept in the spill file while the store is
        unreachable (the record names the store absolutely, for `rlrun-report --sync` from any folder)."""
        if self.spill is None:
            self.spill = Spill(self.client, self.spill_path, self.uri)
        self.spill.write({"op": op, "run_id": self.run_id, "uri": absolute_uri(self.uri), "args": args})

    def log(self, step: int, metrics: dict[str, float]):
        if step >= self.first_step:
            now = int(time.time() * 1000)  # fixed here: a resent metric is then one the store already holds
            self._send("metrics", [[metric_key(k), float(v), now, step] for k, v in metrics.items()])

    def tags(self, tags: dict[str, str]):
        self._send("tags", {k: str(v)[:5000] for k, v in tags.items()})

    def summary(self, metrics: dict[str, float]):
        """The run's performance summary (mean step time and tokens/s, peak memory per phase) as
        `system/summary/*`. Its learning numbers (first / last reward, evaluations, last loss) are not logged again:
        they are the curves' first and latest values, and the run description states them."""
        perf = {k: v for k, v in metrics.items() if not k.endswith(("_first", "_last")) and not k.startswith("passes_")}
        now = int(time.time() * 1000)
        self._send("metrics", [[metric_key(f"summary/{k}"), float(v), now, 0] for k, v in perf.items()])

    def text(self, text: str, name: str):
        self._send("text", {"text": text, "name": name})

    def table(self, rows: list[dict], name: str):
        """Rows of equal keys as an MLflow table (`name` ends in .json); the UI shows it under Artifacts."""
        self._send("table", {"columns": {k: [r.get(k) for r in rows] for k in rows[0]}, "name": name})

    def artifacts(self, folder: str, name: str):
        self._send("artifacts", {"folder": os.path.abspath(folder), "name": name})

    def flush(self):
        """Wait until everything logged so far is in the store (or kept in the spill file)."""
        if self.spill is not None:
            self.spill.flush()

    def finish(self, status: str):
        """The final status, after everything logged before it. A run stopped by a signal or an error does not
        wait for an unreachable store (what is left is kept in the spill file)."""
        self._send("status", status)
        self.spill.close(wait=status == "FINISHED")

    def describe(self, text: str):
        """Append `text` (e.g. `headline(summary)`) to the run's description (`mlflow.note.content`)."""
        about = getattr(self, "about", None)
        if about is None:  # a resumed run: keep what its description says, replace an earlier result
            try:
                about = self.client.get_run(self.run_id).data.tags.get("mlflow.note.content", "").split(" Result: ")[0]
            except Exception:  # noqa: BLE001 - the store is away: leave the description as it is
                return
        self.tags({"mlflow.note.content": f"{about} {text}" if about else text})


def absolute_uri(uri: str) -> str:
    """A sqlite URI with an absolute path (`sqlite:///mlflow.db` -> `sqlite:////cwd/mlflow.db`); others as given."""
    if urlparse(uri).scheme == "sqlite" and not uri.startswith("sqlite:////"):
        return "sqlite:///" + os.path.abspath(uri[len("sqlite:///"):])
    return uri


def output_dir() -> str:
    """The run's output folder (Hydra's), or the working folder outside a Hydra run."""
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get().runtime.output_dir if HydraConfig.initialized() else os.getcwd()


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


def start(cfg, config_obj, run_name: str | None = None, resume_run_id: str | None = None,
          previous_spill: str | None = None):
    """A tracker for the `tracking` config group; `config_obj` is the resolved config (logged as params).
    `previous_spill`: the spill file of the process that wrote the checkpoint a run resumes from."""
    if cfg.name == "none":
        return Null()
    return MLflow(cfg, OmegaConf.to_container(config_obj, resolve=True), run_name, resume_run_id, previous_spill)


# --- Experiment kind, standard run tags and the run description (MLflow.__init__ and the sweep callback) ---

EXPERIMENT_KIND = "custom_model_development"  # MLflow 3's UI then opens on model training, not GenAI traces


def mark_experiment_kind(client, exp_id: str) -> None:
    """Tag the experiment `mlflow.experimentKind=custom_model_development` unless it already says a kind."""
    try:
        if "mlflow.experimentKind" not in client.get_experiment(exp_id).tags:
            client.set_experiment_tag(exp_id, "mlflow.experimentKind", EXPERIMENT_KIND)
    except Exception:  # noqa: BLE001 - a UI hint: never worth failing a run for
        pass


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

    from . import __version__

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
    return tags


def describe_run(config: dict) -> str:
    """One sentence saying what the run trains, from the resolved config (the start of `mlflow.note.content`)."""
    def name(group):
        part = config.get(group)
        return str(part.get("name", "?")) if isinstance(part, dict) else "?"

    loss = name("loss")
    recipe = "DPO" if loss == "dpo" else f"GRPO-family RL ({loss} loss)"
    steps = (config.get("train") or {}).get("steps", "?")
    return (f"{recipe} with the {name('head')} head, logprob policy {name('logprob_policy')}, optimizer offload "
            f"{name('offload')}, {name('rollout')} rollouts, engine {name('engine')}; model {name('model')}, "
            f"task {name('task')}, {steps} steps.")


def _fmt(v) -> str:
    if v is None or (isinstance(v, float) and v != v):
        return "–"
    v = float(v)
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"


def headline(summary: dict[str, float]) -> str:
    """The run's headline numbers as one sentence (the end of `mlflow.note.content`), from `Summary.result()`."""
    parts = []
    for curve, label in (("reward", "Reward"), ("accuracy", "Accuracy")):
        if f"{curve}_first" in summary:
            parts.append(f"{label} {_fmt(summary[f'{curve}_first'])} → {_fmt(summary.get(f'{curve}_last'))} "
                         "(mean of the first / last 3 steps)")
    if "eval_accuracy_first" in summary:
        parts.append(f"eval accuracy {_fmt(summary['eval_accuracy_first'])} → "
                     f"{_fmt(summary.get('eval_accuracy_last'))}")
    if "step_s" in summary:
        parts.append(f"{_fmt(summary['step_s'])} s per step")
    toks = [f"{_fmt(summary[k])} {what} tokens/s" for k, what in
            (("gen_tokens_per_s", "generated"), ("train_tokens_per_s", "trained")) if k in summary]
    parts += toks
    return ("Result: " + "; ".join(parts) + ".") if parts else ""

