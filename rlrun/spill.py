"""What a run could not send to its tracking store: kept in a local JSON-lines file and sent later, in order.

The tracker (`tracking.MLflow`) writes every metric, tag, text, table, artifact folder and the final status
through `Spill.write`, which queues it for one background thread: the step never waits for the store. The thread
sends the records in order, each retried a few times with backoff (a server that restarts or blips for a second
costs nothing). `flush` waits until everything queued was sent or kept: the run frame calls it before writing a
checkpoint (so a resume never misses a step logged before it) and `close` at the end. When it stays unreachable, records are appended to
`mlflow_spill.jsonl` in the run's output folder and training goes on; a warning says so once. Every
`RETRY_S` seconds, and for up to `END_WAIT_S` seconds at the end of the run, the file is replayed into the run;
what is still there after that is replayed with `rlrun-report --sync FILE` (report.sync).

Nothing is sent twice: a record leaves the file only after the store accepted it, and a metric carries its own
timestamp, so the store drops a metric it already holds (same key, step, timestamp and value) if an answer got
lost on the way back.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time

log = logging.getLogger("rlrun")

# Seconds between attempts at one write before it is spilled: ~7 s covers a server restart or a network blip.
DELAYS = (1.0, 2.0, 4.0)
RETRY_S = float(os.environ.get("RLRUN_TRACKING_RETRY_S", 30))  # while spilling: how often to try the store again
END_WAIT_S = float(os.environ.get("RLRUN_TRACKING_END_WAIT_S", 30))  # at the end: how long to wait for it
FILE_NAME = "mlflow_spill.jsonl"


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
        client.log_artifacts(run_id, a["folder"], a["name"])
    elif op == "status":
        client.set_terminated(run_id, status=a)
    else:
        raise ValueError(f"unknown spill record {op!r}")


class Spill:
    """One run's writes: sent at once while the store answers, kept in `path` (and retried) while it does not."""

    def __init__(self, client, path: str, uri: str):
        self.client, self.path, self.uri = client, path, uri
        self.pending = 0  # records in the file
        self.next_try = 0.0
        self.warned = False
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
            self.queue.join()

    def _work(self) -> None:
        while True:
            record = self.queue.get()
            try:
                self._deliver(record)
            except BaseException as e:  # noqa: BLE001 - e.g. a full disk: say it, never hang flush()
                log.error("tracking: a record was lost (%s: %s)", type(e).__name__, e)
            finally:
                self.queue.task_done()

    def _deliver(self, record: dict) -> None:
        if self.pending and time.monotonic() >= self.next_try:
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
                error = e
                if delay is not None:
                    time.sleep(delay)
        self._keep(record)
        if not self.warned:
            self.warned = True
            log.warning("MLflow at %s stopped answering (%s: %s); training goes on and what it logs is kept in %s, "
                        "sent when the store is back (or: rlrun-report --sync %s)", self.uri, type(error).__name__,
                        str(error)[:200], self.path, self.path)

    def _keep(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())  # a record is either in the store or on disk, also after a crash
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

    def close(self) -> None:
        """At the end of the run: everything queued goes out, then wait up to END_WAIT_S for the store to take
        what is kept, else say how to send it later."""
        self.flush()
        deadline = time.monotonic() + END_WAIT_S
        while self.pending and not self.drain() and time.monotonic() < deadline:
            time.sleep(min(5.0, max(0.0, deadline - time.monotonic())))
        if self.pending:
            log.warning("MLflow at %s is still unreachable: %d records of this run (its final status included) are "
                        "kept in %s; when the store is back, send them with: rlrun-report --sync %s",
                        self.uri, self.pending, self.path, self.path)


def replay(client, path: str) -> tuple[int, int]:
    """Send the records of a spill file in order; -> (sent, left). Sent records leave the file (it is removed when
    empty); the first one the store refuses stops the replay, and it and the rest stay for the next try."""
    if not os.path.exists(path):
        return 0, 0
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    sent = 0
    for line in lines:
        try:
            apply(client, json.loads(line))
        except Exception:  # noqa: BLE001 - unreachable again: keep this one and the rest
            break
        sent += 1
    left = lines[sent:]
    if left:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(left)
        os.replace(tmp, path)  # atomic: a crash here leaves either the old file or the new one
    else:
        os.remove(path)
    return sent, len(left)
