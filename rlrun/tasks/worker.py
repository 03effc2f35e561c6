"""The reward worker: a run's rewards are called in one child process, started once per run, so that a reward
cannot take the run down or hold it forever.

- A call that does not return within `task.reward_timeout_s` stops the run (TaskError naming the reward and the
  row); the worker is killed.
- `sys.exit`, `os._exit`, `KeyboardInterrupt` or a crash inside a reward is a TaskError naming the reward and the
  row, never a silent exit of the run: the worker dies, not the trainer.
- Ctrl-C and SIGTERM are the trainer's: the worker ignores them. While the trainer waits on a reward, a signal
  that `signals.deferred()` holds back (finish the step, then stop) gives the reward `GRACE_S` seconds; a reward
  still running then is abandoned (worker killed) and the run stops at once (KeyboardInterrupt: KILLED, the
  checkpoints written so far kept). The worker also dies with the trainer (Linux: PR_SET_PDEATHSIG).
- The worker runs in a process group of its own: whatever a reward starts (a subprocess, a fork, one that ignores
  SIGTERM) is killed with it, by SIGKILL to the group, on a timeout, when the worker dies, and at the end of the
  run; when the trainer is killed the worker kills its group itself.
- Each call gets copies of the row's mutable values and runs in the run's working directory (scoring.call_one).

Protocol, over two pipes: length-prefixed pickles. The trainer sends the rewards' specs once (the worker imports
and binds them itself), then one `(number, completions, rows)` request per batch; the worker answers once per
batch, ("ok", values per reward) or ("error", message). Which call is running is in a small record both processes
map (`PROGRESS`, written before each call): the trainer reads it only while it waits, to bound the call and to name
it; so a batch costs two pipe messages, not one per call. A call is timed by the trainer's own clock from when the
trainer first saw it begin (at most one poll late), never from a time the worker wrote: a record read while it is
being written (the two processes share no lock) must not make a call look older than it is.

Rewards that draw random numbers draw from the worker's `random` (and numpy's / torch's, when the reward module
imported them), seeded with the run's seed when the worker starts; a resumed run starts them afresh.
"""

from __future__ import annotations

import logging
import mmap
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import tempfile
import time
import weakref

from .. import procs, signals
from .base import TaskError, short

log = logging.getLogger("rlrun")
GRACE_S = 3.0  # after a deferred SIGTERM / Ctrl-C, how long a running reward may still take before it is abandoned
IMPORT_S = 120.0  # the least time importing the rewards in the worker may take (a module may import a big library)
POLL_S = 0.2  # how often a wait on the worker looks at the clock and at signals
_HEADER = struct.Struct("<Q")  # a message's length, then its pickle
PROGRESS = struct.Struct("<qq")  # shared by both processes: request number, index of the call running
OOM = ("; SIGKILL is how the kernel's OOM killer ends a process when memory runs out (`dmesg` says so if it did), "
       "or someone ran kill -9")


def _write(fd: int, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def _kill(proc: subprocess.Popen, wait_s: float = 0.0) -> None:
    """End the worker and every process it started (its process group: rlrun.procs), then reap it."""
    if proc.returncode is None:
        procs.kill_group(proc.pid, wait_s)
    proc.wait()


class RewardWorker:
    """The trainer's side: `score(completions, rows)` -> {reward name: values}; `close()` ends the worker."""

    def __init__(self, rewards: list, timeout_s: float, seed: int = 0):
        self.rewards, self.timeout_s, self.seed = rewards, float(timeout_s), seed
        self.proc: subprocess.Popen | None = None
        self.requests = 0
        self.start()

    def start(self) -> None:
        req_r, req_w = os.pipe()
        res_r, res_w = os.pipe()
        shared = tempfile.TemporaryFile()  # the progress record, mapped by both processes
        shared.truncate(PROGRESS.size)
        self.progress = mmap.mmap(shared.fileno(), PROGRESS.size)
        # its own process group (a session of its own: process_group= needs Python 3.11): it, and whatever a reward
        # starts, are killed together (on a timeout, at the end)
        self.proc = subprocess.Popen([sys.executable, "-m", "rlrun.tasks.worker", str(req_r), str(res_w),
                                      str(shared.fileno()), str(os.getpid())], start_new_session=True,
                                     pass_fds=(req_r, res_w, shared.fileno()), stdin=subprocess.DEVNULL)
        os.close(req_r)
        os.close(res_w)
        self.fd_out, self.fd_in, self.buffer = req_w, res_r, bytearray()
        # the descriptors still open: each is closed once (a number closed twice may by then be another thread's
        # file: the tracking sender's sqlite store, whose next read then fails with "disk I/O error")
        self._open_fds = [req_w, res_r]
        self._closer = weakref.finalize(self, _release, self.proc, self._open_fds, self.progress, shared)
        specs = [(r.spec, r.key, r.name, r.weight, r.kwargs, list(r.fields)) for r in self.rewards]
        self._send({"rewards": specs, "path": list(sys.path), "cwd": os.getcwd(), "seed": self.seed})
        reply = self._receive(lambda: ("importing the rewards in the reward worker", "import"),
                              max(self.timeout_s, IMPORT_S))
        if reply[0] != "ready":
            self.close()
            raise TaskError(reply[1])

    def close(self) -> None:
        """End the worker: it exits when its request pipe closes (killed if it does not within a second), and every
        process a reward started is killed with it (its process group)."""
        if self.proc is None:
            return
        self._open_fds.remove(self.fd_out)
        os.close(self.fd_out)  # the worker sees its request pipe close and exits
        _kill(self.proc, wait_s=1.0)
        self._closer()  # closes the rest
        self.proc = None

    def _abandon(self) -> str:
        """Kill the worker and what it started (a reward hangs, a signal stops the run, it died); the next `score`
        starts a new one. Returns how it ended."""
        assert self.proc is not None, "no worker to abandon"
        _kill(self.proc)
        code = self.proc.returncode
        self._closer()
        self.proc = None
        return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"

    def _send(self, obj) -> None:
        try:
            _write(self.fd_out, obj)
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            raise TaskError(f"the rows cannot be sent to the reward worker ({type(e).__name__}: {e}); a row's "
                            "columns must be plain data (text, numbers, lists, dicts).") from None
        except OSError:  # EPIPE: the worker is gone (killed between two batches)
            raise self._ended(None) from None

    def _ended(self, running) -> TaskError:
        """The error for a worker that is gone: the call it was in (`running()`, when it had begun one of this
        batch), else the rewards it runs; how it ended, and the fix."""
        request = self._progress()[0]  # read before the progress record goes with the worker
        what = running()[0] if running is not None and request == self.requests else None
        how = self._abandon()
        oom = OOM if "SIGKILL" in how else ""
        if what is not None:
            return TaskError(f"{what} ended the reward worker process ({how}): os._exit, a crash, or the process "
                             f"being killed{oom}. A reward must return a number.")
        names = ", ".join(f"{r.name} ({r.spec})" for r in self.rewards)
        return TaskError(f"the reward worker process, which runs the rewards {names}, ended between two batches "
                         f"({how}){oom}. Nothing was scored since; rerun, with more memory if it was the OOM killer, "
                         "or make the reward use less.")

    def _progress(self) -> tuple[int, int]:
        """The progress record, read until two reads agree: the worker writes it field by field, byte by byte
        (struct), so a single read may catch half a write."""
        now = PROGRESS.unpack_from(self.progress)
        while (again := PROGRESS.unpack_from(self.progress)) != now:
            now = again
        return now

    def _frame(self):
        if len(self.buffer) < _HEADER.size:
            return None
        (n,) = _HEADER.unpack_from(self.buffer)
        if len(self.buffer) < _HEADER.size + n:
            return None
        msg = pickle.loads(self.buffer[_HEADER.size : _HEADER.size + n])
        del self.buffer[: _HEADER.size + n]
        return msg

    def _receive(self, running, bound: float | None = None):
        """The worker's next message. `running()` -> (what the worker is running now, a key of that call);
        TaskError when that call outlasts `bound` (default: the reward timeout) or ends the worker;
        KeyboardInterrupt when a held-back signal has waited GRACE_S for it. A call's time counts from when this
        loop first saw its key."""

        bound = self.timeout_s if bound is None else bound
        key, since = None, 0.0
        while True:
            msg = self._frame()
            if msg is not None:
                return msg
            (what, now_key), now, asked = running(), time.monotonic(), signals.stop_asked()
            if now_key != key:  # another call has begun since the last look
                key, since = now_key, now
            if asked is not None and now - asked > GRACE_S:
                self._abandon()
                log.warning("%s was still running %.0f s after the signal: stopping now, without finishing the "
                            "step (the checkpoints written so far are kept)", what, GRACE_S)
                raise KeyboardInterrupt("a reward was still running after the signal")
            if now - since > bound:
                self._abandon()
                raise TaskError(f"{what} did not return within {bound:g} s (task.reward_timeout_s="
                                f"{self.timeout_s:g}); the reward worker was stopped. Make the reward faster (or "
                                "give it its own timeout), or raise task.reward_timeout_s.")
            ready, _, _ = select.select([self.fd_in], [], [], max(0.0, min(POLL_S, since + bound - now)))
            if ready:
                chunk = os.read(self.fd_in, 1 << 20)
                if not chunk:
                    raise self._ended(running)
                self.buffer += chunk

    def score(self, completions: list[str], rows: list[dict]) -> dict[str, list[float]]:
        from .scoring import _context

        if not rows:
            return {r.name: [] for r in self.rewards}
        if self.proc is None:
            self.start()
        self.requests += 1
        number, n = self.requests, len(rows)

        def running():  # the call the worker is in (its progress record), and a key of it
            request, k = self._progress()
            k = k if request == number else -1  # not begun yet: the first call is next
            r, i = self.rewards[max(k, 0) // n], max(k, 0) % n
            return _context(r, i, n, completions[i], rows[i]), k

        self._send((number, completions, rows))
        try:
            msg = self._receive(running)
        except KeyboardInterrupt:  # a signal that interrupted the wait itself: the worker is mid-call
            if self.proc is not None:
                self._abandon()
            raise
        if msg[0] == "error":
            raise TaskError(msg[1])
        return {r.name: values for r, values in zip(self.rewards, msg[1])}


def _release(proc, fds: list[int], progress, shared) -> None:
    _kill(proc)
    while fds:
        os.close(fds.pop())
    progress.close()
    shared.close()


# --- the worker process ------------------------------------------------------------------------------------------

def _read(f):
    head = f.read(_HEADER.size)
    if len(head) < _HEADER.size:
        return None
    return pickle.loads(f.read(_HEADER.unpack(head)[0]))


def _seed(seed: int) -> None:
    import random

    random.seed(seed)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(seed)
    if "torch" in sys.modules:
        sys.modules["torch"].manual_seed(seed)


def _load(init: dict) -> list:
    from . import scoring

    sys.path[:] = init["path"]
    os.chdir(init["cwd"])
    out = []
    for spec, key, name, weight, kwargs, fields in init["rewards"]:
        fn = scoring.import_reward(spec, key)
        r = scoring.Reward(fn, spec, weight, name, kwargs, key=key, fields=tuple(fields))
        r.call = scoring.bind(r, set(fields), key, historic=key == "task.reward")
        out.append(r)
    _seed(init["seed"])
    return out


def _serve(requests, fd: int, progress, rewards: list, home: str) -> None:
    """Answer each request with all its values, or the first error; before each call, the progress record says
    which call is running (the trainer reads it to bound and name a call: no message per call)."""
    from .scoring import call_one

    while (request := _read(requests)) is not None:
        number, completions, rows = request
        n = len(rows)
        try:
            values: list[list[float]] = []
            for j, r in enumerate(rewards):
                values.append([])
                for i, (c, row) in enumerate(zip(completions, rows)):
                    PROGRESS.pack_into(progress, 0, number, j * n + i)
                    values[-1].append(call_one(r, i, n, c, row, home, isolated=True))
            _write(fd, ("ok", values))
        except TaskError as e:
            _write(fd, ("error", str(e)))


def main(argv: list[str]) -> None:
    for sig in signals.SIGNALS:  # the trainer's to handle; it stops this process itself
        signal.signal(sig, signal.SIG_IGN)
    req_fd, res_fd, progress_fd, parent = (int(a) for a in argv[:4])
    procs.die_with_parent(parent)  # the trainer killed: this process kills its group
    progress = mmap.mmap(progress_fd, PROGRESS.size)
    with os.fdopen(req_fd, "rb") as requests:
        init = _read(requests)
        if init is None:
            return
        try:
            rewards = _load(init)
        except TaskError as e:
            _write(res_fd, ("error", str(e)))
            return
        except BaseException as e:  # noqa: BLE001 - whatever a reward module does on import, said in one line
            _write(res_fd, ("error", f"importing the rewards in the reward worker raised {type(e).__name__}: "
                                     f"{short(str(e), 300)}"))
            return
        _write(res_fd, ("ready",))
        _serve(requests, res_fd, progress, rewards, init["cwd"])


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    finally:  # however it ends (the trainer closed the pipe, or died first): with everything a reward started.
        procs.end_group()  # Its answers are written already; the pipe closing may come before the trainer's death
        # is seen here (getppid, PR_SET_PDEATHSIG), so the group is not left to that.
