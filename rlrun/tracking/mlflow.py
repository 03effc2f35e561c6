"""tracking=mlflow: one MLflow run per job, params flattened with '.', the resolved config as an artifact, metrics
per step, summary metrics, and a final status (FINISHED / FAILED / KILLED) that never leaves a run RUNNING. Every
write after the run exists goes through the spill (spill.py): the step never waits for the store.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

from .. import algorithms, signals
from ..errors import TrackingError
from . import ui
from .spill import FILE_NAME as SPILL_FILE
from .spill import Spill, replay
from .store import absolute_uri, connect, flatten, job_overrides, log_params, metric_key, output_dir
from .tags import describe_run, mark_experiment_kind, slurm_tags, standard_tags

log = logging.getLogger("rlrun")
# The learning curves (GRPO, DPO): a run's first metric, which MLflow's compare page opens on (it shows the first
# metric the runs logged, in the order the store took them).
LEADS = ("reward_mean", "rewards/accuracy")


class MLflow:
    """The `Tracker` of tracking=mlflow: a new run, or the run `resume_run_id` continued (after sending what the
    interrupted process kept in `previous_spill`); `config` is the resolved config, logged as params."""

    stores = True

    def __init__(self, cfg, config: dict, run_name: str | None, resume_run_id: str | None = None,
                 previous_spill: str | None = None):
        self.client, exp_id = connect(cfg.uri, cfg.experiment)
        self.first_step = 0  # steps below this were logged before a resume: recomputed, not logged twice
        # each metric's last step logged before a resume: a held-out evaluation is logged at step N before step N
        # trains, so one that a kill caught between the two is in the store past the learning curve's last step
        self.last_logged: dict[str, int] = {}
        self.run_id: str | None = None
        self.uri = cfg.uri
        self.spill: Spill | None = None
        self.held: list[list] | None = []  # metrics logged before the first learning curve value (None once sent)
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
            self._reopened(resume_run_id)
            logged = self.client.get_metric_history(resume_run_id, metric_key("loss"))
            self.first_step = max((m.step for m in logged), default=-1) + 1
            self.last_logged = {m.key: m.step for m in self.client.get_run(resume_run_id).data.to_proto().metrics}
            self.held = None  # its metrics exist already: their order is set
            return
        tags = {"mlflow.runName": run_name} if run_name else {}
        if "resumed_from" in config:
            tags["rlrun.resumed_from"] = config.pop("resumed_from")
        overrides = job_overrides()
        if overrides:
            tags["rlrun.overrides"] = overrides[:5000]  # in full: a sweep's run name keeps only what differs
        if cfg.parent_run_id:
            tags["mlflow.parentRunId"] = cfg.parent_run_id
            with contextlib.suppress(Exception):  # the sweep's group in the UI's saved view (ui.py)
                tags[ui.GROUP_TAG] = self.client.get_run(cfg.parent_run_id).data.tags[ui.GROUP_TAG]
        mark_experiment_kind(self.client, exp_id)
        loss = (config.get("loss") or {}).get("name")
        ui.prepare(self.client, exp_id, primary=metric_key(algorithms.of(loss).curve if loss else LEADS[0]))
        self.about = describe_run(config)
        tags.update({**standard_tags(), "mlflow.note.content": self.about})
        self.run = self.client.create_run(exp_id, tags=tags, run_name=run_name)
        self.run_id = self.run.info.run_id
        log_params(self.client, self.run_id, flatten(config))
        self.client.log_dict(self.run_id, config, "config.yaml")

    def _reopened(self, run_id: str) -> None:
        """A resumed run is no longer in error: the interruption's error moves to `rlrun.interrupted`; under SLURM
        the job's id and requeue count are brought up to date."""
        error = self.client.get_run(run_id).data.tags.get("error")
        if error:
            self.client.set_tag(run_id, "rlrun.interrupted", error)
            self.client.delete_tag(run_id, "error")
        for key, value in slurm_tags().items():
            self.client.set_tag(run_id, key, value)

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
        self._spill().write({"op": op, "run_id": self.run_id, "uri": absolute_uri(self.uri), "args": args})

    def _spill(self) -> Spill:
        """The spill file's sender, made by the first write."""
        if self.spill is None:
            self.spill = Spill(self.client, self.spill_path, self.uri)
        return self.spill

    def log(self, step: int, metrics: dict[str, float]):
        """The learning curve goes first: what is logged before it (the plan, the warm start, the first
        evaluation) waits (in memory, seconds) and follows it in the same batch."""
        if step < self.first_step:
            return
        now = int(time.time() * 1000)  # fixed here: a resent metric is then one the store already holds
        lead = [k for k in LEADS if k in metrics]
        order = lead + [k for k in metrics if k not in lead]
        records = [[metric_key(k), float(metrics[k]), now, step] for k in order
                   if step > self.last_logged.get(metric_key(k), -1)]
        if not records:
            return
        if self.held is not None:
            if not lead:
                self.held += records
                return
            records, self.held = records + self.held, None
        self._send("metrics", records)

    def _release(self) -> None:
        """What waits for the learning curve, sent as it is (a run that ends before its first step)."""
        if self.held:
            self._send("metrics", self.held)
        self.held = None

    def tags(self, tags: dict[str, str]):
        self._send("tags", {k: str(v)[:5000] for k, v in tags.items()})

    def summary(self, metrics: dict[str, float]):
        """The run's performance summary (mean step time and tokens/s, peak memory per phase and of the run) as
        `system/summary/*`, to 4 significant digits. Its learning numbers (first / last reward, evaluations, last
        loss) are not logged again: they are the curves' first and latest values, and the run description states
        them."""
        self._release()
        perf = {k: v for k, v in metrics.items() if not k.endswith(("_first", "_last")) and not k.startswith("passes_")}
        now = int(time.time() * 1000)
        # 4 significant digits: the runs table shows a value as stored (0.03617129350022878); the histories keep all
        self._send("metrics", [[metric_key(f"summary/{k}"), float(f"{v:.4g}"), now, 0] for k, v in perf.items()])

    def text(self, text: str, name: str):
        self._send("text", {"text": text, "name": name})

    def table(self, rows: list[dict], name: str):
        """Rows of equal keys as an MLflow table (`name` ends in .json); the UI shows it under Artifacts."""
        self._send("table", {"columns": {k: [r.get(k) for r in rows] for k in rows[0]}, "name": name})

    def dataset(self, name: str, digest: str, source: str, context: str, profile: dict):
        self._send("dataset", {"name": name, "digest": digest, "source": os.path.abspath(source),
                               "context": context, "profile": profile})

    def artifacts(self, folder: str, name: str):
        self._send("artifacts", {"folder": os.path.abspath(folder), "name": name})

    def flush(self):
        """Wait until everything logged so far is in the store (or kept in the spill file)."""
        self._release()
        if self.spill is not None:
            self.spill.flush()

    def finish(self, status: str):
        """The final status, after everything logged before it. A run stopped by a signal or an error does not
        wait for an unreachable store (what is left is kept in the spill file)."""
        self._release()
        self._send("status", status)
        self._spill().close(wait=status == "FINISHED")  # _send made it

    def describe(self, text: str):
        """Append `text` (e.g. `headline(summary)`) to the run's description (`mlflow.note.content`)."""
        about = getattr(self, "about", None)
        if about is None:  # a resumed run: keep what its description says, replace an earlier result
            try:
                about = self.client.get_run(self.run_id).data.tags.get("mlflow.note.content", "").split(" Result: ")[0]
            except Exception:  # noqa: BLE001 - the store is away: leave the description as it is
                return
        self.tags({"mlflow.note.content": f"{about} {text}" if about else text})

