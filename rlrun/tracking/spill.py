"""What a run could not send to its tracking store: kept in a local JSON-lines file and sent later, in order.

The tracker (`tracking.MLflow`) writes every metric, tag, text, table, artifact folder and the final status
through `Spill.write`, which queues it for one background thread: the step never waits for the store. The thread
sends the records in order, each retried a few times with backoff (a server that restarts or blips for a second
costs nothing). Metrics of consecutive steps go in one request, at most one per `BATCH_S` seconds: a store's
cost is mostly per request, and the sender shares the interpreter (the GIL) with the step, so a request per step
took ~20 ms of a ~100 ms step of the embedded model (README, "Speed"). `flush` waits until everything queued was
sent or kept: the run frame calls it before writing a checkpoint (so a resume never misses a step logged before
it) and `close` at the end.

When the store stays unreachable, records are appended to `mlflow_spill.jsonl` in the run's output folder and
training goes on; a warning says so. Every `RETRY_S` seconds, and for up to `END_WAIT_S` seconds at the end of a
run that finished, the file is replayed into the run; what is still there after that is sent with
`rlrun-report --sync FILE` (report.sync), or by resuming the run from a checkpoint (which replays it first).

A record the store refuses for good (an invalid metric name, a deleted run) is not an outage: it is logged as an
error and set aside in `mlflow_spill.rejected.jsonl`, and the records after it go on. Records still in the queue
when the process is killed with SIGKILL (or the OOM killer) are lost: at most the steps since the last send or
checkpoint; a resume from the checkpoint logs those steps again.

Nothing is sent twice: a record leaves the file only after the store accepted it, and a metric carries its own
timestamp, so the store drops a metric it already holds (same key, step, timestamp and value: MLflow's SQL
stores do) if an answer got lost on the way back. The run and `--sync` take turns on the file (a lock beside it).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import threading
import time

from .. import nofollow
from ..nofollow import appending

log = logging.getLogger("rlrun")

# Seconds between attempts at one write before it is spilled: ~7 s covers a server restart or a network blip.
DELAYS = (1.0, 2.0, 4.0)
RETRY_S = float(os.environ.get("RLRUN_TRACKING_RETRY_S", 30))  # while spilling: how often to try the store again
END_WAIT_S = float(os.environ.get("RLRUN_TRACKING_END_WAIT_S", 30))  # at the end: how long to wait for it
BATCH_S = float(os.environ.get("RLRUN_TRACKING_BATCH_S", 1))  # metrics of this many seconds go in one request
BATCH_METRICS = 500  # and at most this many (MLflow takes 1000 per request)
FLUSH = {"op": "flush"}  # queued by flush(): send what was gathered now
FILE_NAME = "mlflow_spill.jsonl"
# MLflow's answers that no retry changes: the record itself is refused.
REFUSED = {"INVALID_PARAMETER_VALUE", "RESOURCE_DOES_NOT_EXIST", "RESOURCE_ALREADY_EXISTS", "INVALID_STATE",
           "BAD_REQUEST", "PERMISSION_DENIED", "UNAUTHENTICATED"}


class LostArtifacts(RuntimeError):
    """An artifact folder that is gone (or was not all sent): no retry brings it back."""


def refused(e: BaseException) -> bool:
    """True when the store answered and refused this record, or its files are gone (retrying cannot help); False
    for outages."""
    return isinstance(e, LostArtifacts) or getattr(e, "error_code", None) in REFUSED


def send_artifacts(client, run_id: str, folder: str, name: str) -> None:
    """Log the files of `folder` as artifact folder `name`, and check that the store lists each of them (a folder
    that is gone or empty would log nothing, silently)."""
    files = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    if not files:
        raise LostArtifacts(f"artifact {name!r}: {folder} is gone or empty, so nothing of it reached the run")
    client.log_artifacts(run_id, folder, name)
    listed = {os.path.basename(f.path) for f in client.list_artifacts(run_id, name)}
    missing = [f for f in files if f not in listed]
    if missing:
        raise LostArtifacts(f"artifact {name!r}: {', '.join(missing[:5])} of {folder} are not in the run")


def log_dataset(client, run_id: str, a: dict) -> None:
    """A dataset input (the run page's Datasets): MLflow keeps 36 characters of a digest, so the first 16 hex digits
    of a sha256 are the digest and the whole one is in the profile."""
    from mlflow.entities import Dataset, DatasetInput, InputTag

    profile = json.dumps({"sha256": a["digest"], **a["profile"]}, sort_keys=True)
    data = Dataset(a["name"], a["digest"][:16], "local", json.dumps({"uri": a["source"]}), None, profile)
    client.log_inputs(run_id, datasets=[DatasetInput(data, [InputTag("mlflow.data.context", a["context"])])])


def apply(client, record: dict) -> None:
    """Send one record to the store (raises what the client raises)."""
    from mlflow.entities import Metric

    op, run_id, a = record["op"], record["run_id"], record["args"]
    if op == "metrics":  # [[key, value, timestamp ms, step], ...], in batches under MLflow's 1000 per request
        batch = [Metric(k, float(v), int(ts), int(step)) for k, v, ts, step in a]
        for i in range(0, len(batch), 500):
            client.log_batch(run_id, metrics=batch[i : i + 500])
    elif op == "tags":
        for k, v in a.items():
            client.set_tag(run_id, k, v)
    elif op == "text":
        client.log_text(run_id, a["text"], a["name"])
    elif op == "table":
        client.log_table(run_id, a["columns"], a["name"])
    elif op == "artifacts":
        send_artifacts(client, run_id, a["folder"], a["name"])
    elif op == "dataset":
        log_dataset(client, run_id, a)
    elif op == "status":
        client.set_terminated(run_id, status=a)
    else:
        raise ValueError(f"unknown spill record {op!r}")


def _plain(value):
    """json.dumps fallback: numpy scalars as numbers, anything else as its text."""
    item = getattr(value, "item", None)
    return item() if callable(item) else str(value)


@contextlib.contextmanager
def locked(path: str):
    """An exclusive lock on `path`.lock: the run appending and `--sync` replaying take turns."""
    try:
        import fcntl
    except ImportError:  # no fcntl (Windows): no lock
        yield
        return
    fd = nofollow.open_existing(path + ".lock", os.O_RDWR | os.O_CREAT)  # never through a link
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


class Spill:
    """One run's writes: sent by a background thread while the store answers, kept in `path` (and retried) while
    it does not."""

    def __init__(self, client, path: str, uri: str):
        self.client, self.path, self.uri = client, path, uri
        self.pending = count(path)  # records in the file (one left by an earlier process in this folder counts)
        self.next_try = 0.0
        self.hurry = False  # the run is being stopped: one attempt per record, no waiting for the store
        self.stopping = threading.Event()
        self.queue: queue.Queue = queue.Queue()
        self.thread: threading.Thread | None = None

    def write(self, record: dict) -> None:
        """Queue `record` for the background sender (started on first use); returns at once."""
        if self.thread is None:
            self.thread = threading.Thread(target=self._work, name="rlrun-tracking", daemon=True)
            self.thread.start()
        self.queue.put(record)

    def flush(self) -> None:
        """Wait until every queued record was sent to the store or kept in the file."""
        if self.thread is not None:
            self.queue.put(FLUSH)
            self.queue.join()

    def _work(self) -> None:
        while True:
            records = self._gather()
            try:
                for group in batches(records):
                    if group[0] is None:  # close(): the run is over
                        return
                    if group[0] is not FLUSH:
                        self._deliver(joined(group), group)
            except BaseException as e:  # noqa: BLE001 - e.g. a full disk: say it, never hang flush()
                log.error("tracking: a record was lost (%s: %s)", type(e).__name__, e)
            finally:
                for _ in records:
                    self.queue.task_done()

    def _gather(self) -> list:
        """The next record and, after metrics, the metrics that follow within BATCH_S (up to BATCH_METRICS), until
        any other record, a flush or close arrives."""
        records = [self.queue.get()]
        deadline, size = time.monotonic() + BATCH_S, 0
        while records[-1] is not None and records[-1]["op"] == "metrics" and not self.hurry:
            size += len(records[-1]["args"])
            wait = deadline - time.monotonic()
            if size >= BATCH_METRICS or wait <= 0:
                break
            try:
                records.append(self.queue.get(timeout=wait))
            except queue.Empty:
                break
        return records

    def _deliver(self, record: dict, parts: list[dict] | None = None) -> None:
        """Send `record` (the join of `parts`: when the store refuses the join, each part is sent on its own, so
        that only the refused one is set aside)."""
        if self.pending and time.monotonic() >= self.next_try and not self.hurry:
            self.drain()
        if self.pending:  # still unreachable: keep the order, send later
            self._keep(record)
            return
        error = None
        for delay in (*DELAYS, None):
            try:
                apply(self.client, record)
                return
            except Exception as e:  # noqa: BLE001 - whatever the store says, training goes on
                if refused(e) and parts and len(parts) > 1:
                    for part in parts:
                        self._deliver(part)
                    return
                if refused(e):
                    return reject(self.path, record, e)
                error = e
                if delay is None or self.hurry:
                    break
                self.stopping.wait(delay)  # a sleep that close(wait=False) cuts short
        self._keep(record)
        if self.pending == 1:  # the first record of an outage
            log.warning("MLflow at %s does not answer (%s: %s); training goes on and what it logs is kept in %s "
                        "and sent when the store is back (after the run: rlrun-report --sync %s)", self.uri,
                        type(error).__name__, str(error)[:200], self.path, self.path)

    def _keep(self, record: dict) -> None:
        line = json.dumps(record, default=_plain) + "\n"
        with locked(self.path), appending(self.path) as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())  # a kept record survives the process
        self.pending += 1
        self.next_try = self.next_try or time.monotonic() + RETRY_S

    def drain(self) -> bool:
        """Replay the file into the store; True when it is empty (the store took everything)."""
        done, left = replay(self.client, self.path)
        self.pending = left
        self.next_try = time.monotonic() + RETRY_S if left else 0.0
        if done and not left:
            log.warning("MLflow at %s answers again: %d kept records sent", self.uri, done)
        return not left

    def close(self, wait: bool = True) -> None:
        """At the end of the run: everything queued goes out, the sender stops. `wait` (a finished run): wait up to
        END_WAIT_S for the store to take what is kept. Without it (a run being stopped by a signal or an error),
        each queued record gets one attempt and nothing waits for the store. Then says how to send the rest."""
        if not wait:
            self.hurry = True
            self.stopping.set()
        if self.thread is not None:
            self.queue.put(None)
            self.thread.join()
        deadline = time.monotonic() + (END_WAIT_S if wait else 0.0)
        while self.pending and not self.drain() and time.monotonic() < deadline:
            time.sleep(min(5.0, max(0.0, deadline - time.monotonic())))
        if self.pending:
            log.warning("MLflow at %s is still unreachable: %d records of this run (its final status included) are "
                        "kept in %s; when the store is back, send them with: rlrun-report --sync %s",
                        self.uri, self.pending, self.path, self.path)


def batches(records: list) -> list[list]:
    """`records` in order, grouped: consecutive metrics records of one run together, anything else alone."""
    out: list[list] = []
    for r in records:
        last = out[-1][-1] if out else None
        if (r is not None and r["op"] == "metrics" and last is not None and last is not FLUSH
                and last["op"] == "metrics" and last["run_id"] == r["run_id"]):
            out[-1].append(r)
        else:
            out.append([r])
    return out


def joined(group: list[dict]) -> dict:
    """One record of a group from `batches` (metrics: all their rows, in order)."""
    if len(group) == 1:
        return group[0]
    return {**group[0], "args": [row for r in group for row in r["args"]]}


def count(path: str) -> int:
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return sum(1 for line in f if line.strip())


def reject(path: str, record: dict | str, error: BaseException) -> None:
    """A record the store refused for good: said once, set aside beside the spill file, never retried."""
    rejected = path.replace(".jsonl", "") + ".rejected.jsonl"
    with appending(rejected) as f:
        f.write(record if isinstance(record, str) else json.dumps(record, default=_plain) + "\n")
    if isinstance(error, LostArtifacts):
        log.error("not sent: %s (the record is set aside in %s)", error, rejected)
        return
    log.error("MLflow refused a record of this run (%s: %s); it is set aside in %s and the rest goes on",
              type(error).__name__, str(error)[:300], rejected)


def replay(client, path: str) -> tuple[int, int]:
    """Send the records of a spill file in order; -> (sent, left). Sent records leave the file (it is removed when
    empty); when the store does not answer, that record and the rest stay for the next try. A record the store
    refuses for good, or a line that is not a record, is set aside (`reject`) and the replay goes on."""
    with locked(path):
        if not os.path.exists(path):
            return 0, 0
        with open(path) as f:
            lines = [line for line in f if line.strip()]
        sent = 0
        for line in lines:
            try:
                apply(client, json.loads(line))
            except (ValueError, KeyError, TypeError) as e:  # a torn or foreign line: never blocks the rest
                reject(path, line, e)
            except Exception as e:  # noqa: BLE001 - refused: set aside; unreachable again: stop here
                if not refused(e):
                    break
                reject(path, line, e)
            sent += 1
        left = lines[sent:]
        if left:
            # atomic: a crash here leaves either the old file or the new one (never written through a link)
            nofollow.write_replacing(path, "".join(left).encode())
        else:
            os.remove(path)
        return sent, len(left)
