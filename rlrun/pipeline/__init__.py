"""rollout.pipeline=async: generation in a worker process of its own, overlapped with training, at most
`rollout.max_staleness` (K) optimizer steps behind the trainer (docs/pipeline.md).

The schedule is fixed in advance, never a race. Rollout r is first trained on at optimizer step `first_step(r)`
(the synchronous schedule of recipes/grpo.py) and is generated with the weights after `version(r) =
max(0, first_step(r) - K)` optimizer steps. At the start of step s the trainer publishes its weights (version s)
and requests every rollout first trained on by step s + K; the worker takes requests strictly in order, each
with exactly the version it names. So a seed fixes which weights draw which completions whatever the timing, K=0
is the synchronous run, and no rollout is first trained on more than K steps after the weights that drew it.

Weights travel through two shared-memory slots (double buffering: the trainer writes version v+1 while the worker
still samples with v, which it has already copied into its own model); only parameters that train are sent (LoRA:
the adapters). Rollouts come back as plain arrays with their version and the worker's busy / idle seconds.

Bounded: /dev/shm is checked for room before the slots are made (a failure there leaves nothing in it); the worker
beats a heartbeat, and one silent for `rollout.worker_timeout_s` (stopped, hung) or dead is GeneratorLost, one
message, the run FAILED, exit 1; the worker and everything it started are one process group, killed at the end.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import queue
import shutil
import time
from dataclasses import dataclass
from multiprocessing.process import BaseProcess

import torch

from .. import procs
from ..errors import FaultError, RolloutError
from ..rollout import Rollout
from . import worker

log = logging.getLogger("rlrun")


class PipelineError(RuntimeError):
    """The generation worker failed with an error of its own (a bug); the message carries its traceback."""


class GeneratorLost(FaultError):
    """The generation worker died, or gave no sign of life for rollout.worker_timeout_s: one message, exit 1."""


HEARTBEAT_S = worker.HEARTBEAT_S  # the generator says it is alive this often (a thread, even while it generates)
START_S = 300.0  # the least time the generator may take to start (a fresh interpreter unpickling the weights)
STOP_S = 5.0  # at the end, how long the generator may take to stop before its process group is killed
SHM = "/dev/shm"


def first_step(index: int, window: int, grad_accum: int) -> int:
    """The optimizer step that first trains on rollout `index` (a rollout is `window` micro-steps of a rank, an
    optimizer step `grad_accum`): the step at which the synchronous loop generates it."""
    return index * window // grad_accum


def version(index: int, window: int, grad_accum: int, staleness: int) -> int:
    """The weights (optimizer steps taken) that generate rollout `index` with at most `staleness` steps of lag."""
    return max(0, first_step(index, window, grad_accum) - staleness)


@dataclass
class Generated:
    """One rollout from the worker: the rows it was drawn for, the batch, and where and how it was made."""

    index: int
    version: int
    rows: list[dict]
    rollout: Rollout
    busy_s: float  # the worker's seconds generating it
    idle_s: float  # the worker's seconds waiting before it (for a request or for weights)


def threads(cfg_threads: int | None, device: torch.device) -> tuple[int, int]:
    """(trainer threads, worker threads): on CPU the cores torch uses are split between the two processes (the
    worker gets `rollout.worker_threads`, default half); on an accelerator the trainer keeps its own."""
    total = torch.get_num_threads()
    work = cfg_threads or max(1, total // 2)
    if device.type != "cpu":
        return total, work
    return max(1, total - work), work


class Pipeline:
    """The trainer's side: `ahead(step, ...)` publishes weights and requests rollouts, `take()` returns the next
    rollout in order. Checkpointed (`state_dict`): the rollouts requested but not yet trained on, with their rows
    and versions, so a resumed run trains on exactly what the uninterrupted one would."""

    def __init__(self, cfg, *, window: int, grad_accum: int, device: torch.device, build=None):
        self.cfg, self.window, self.grad_accum, self.device = cfg, window, grad_accum, device
        # (cfg, state, device) -> (policy, tokenizer, rollout engine), run in the worker; looked up when the pipeline
        # is made, not when this module was imported, so that a test's fault reaches the process a run starts
        self.build = build or worker.build
        self.staleness = cfg.rollout.max_staleness
        self.submitted = 0  # rollouts requested so far: the next request's index
        self.taken = 0  # rollouts handed to the trainer so far
        self.rows: dict[int, list[dict]] = {}  # requested, not yet received
        self.ready: dict[int, Generated] = {}  # received (or restored), not yet taken
        self.published: int | None = None  # the newest version sent to the worker
        self.loaded: int | None = None  # the newest version the worker has copied into its model
        self.slot_versions: list[int | None] = [None, None]  # the version each weight slot holds
        self.next_slot = 0
        self.proc: BaseProcess | None = None
        self.reaped = False  # the worker's process has been reaped (its pid may be another's: no group kill)

    # -- the worker -----------------------------------------------------------------------------------------------
    def start(self, model, step: int) -> None:
        """Start the worker with the weights of `model` (version `step`). Shared memory (/dev/shm) is checked first
        and nothing of a failed start is left there."""
        import torch.multiprocessing as mp

        params = dict(model.named_parameters())
        self.names = [n for n, p in params.items() if p.requires_grad]
        check_shm(sum(2 * params[n].numel() * params[n].element_size() for n in self.names)
                  + sum(t.numel() * t.element_size() for t in model.state_dict().values()))
        trainer_threads, worker_threads = threads(self.cfg.rollout.worker_threads, self.device)
        ctx = mp.get_context("spawn")  # a fresh interpreter: no copy of the trainer's threads, locks or CUDA state
        device = self.cfg.rollout.worker_device or str(self.device)
        with shm_failure():
            self.slots = [{n: torch.empty(params[n].shape, dtype=params[n].dtype).share_memory_()
                           for n in self.names} for _ in range(2)]
            state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
            self.inbox, self.outbox, self.beat = ctx.Queue(), ctx.Queue(), ctx.Value("d", 0.0, lock=False)
            self.proc = ctx.Process(target=worker.main, name="rlrun-generator", args=(
                self.cfg, state, self.slots, self.inbox, self.outbox, worker_threads, device, step, os.getpid(),
                self.build, self.beat))
            self.proc.start()
        del state
        self.started = time.monotonic()
        self.threads_before = torch.get_num_threads()
        torch.set_num_threads(trainer_threads)
        log.info("rollout.pipeline=async: generator process %d on %s (%d thread(s)), trainer %d thread(s), at most "
                 "%d step(s) of staleness", self.proc.pid, device, worker_threads, trainer_threads, self.staleness)
        self.published = self.loaded = step
        self._expect("ready")

    def close(self) -> None:
        """Stop the worker (at the end of the run, and on any error or signal): it and everything it started (its
        process group) are killed if it has not stopped within STOP_S; nothing is left running."""
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        try:
            self.inbox.put(("stop",))
        except (OSError, ValueError):
            pass
        if not self.reaped and proc.pid is not None:
            procs.kill_group(proc.pid, STOP_S)
        proc.join()
        for q in (self.inbox, self.outbox):
            q.cancel_join_thread()
            q.close()
        torch.set_num_threads(self.threads_before)

    # -- the schedule ---------------------------------------------------------------------------------------------
    def ahead(self, step: int, model, draw, meter) -> None:
        """At the start of optimizer step `step` (the weights of `model` are version `step`): request every rollout
        first trained on by step + K, publishing these weights first when a request needs them. `draw(index)` ->
        (rows, prompts, seeds) draws the prompts of rollout `index`."""
        assert self.proc is not None, "start() the pipeline first"
        last = min(step + self.staleness, self.cfg.train.steps - 1)  # nothing for steps the run will not take
        while first_step(self.submitted, self.window, self.grad_accum) <= last:
            r = self.submitted
            v = version(r, self.window, self.grad_accum, self.staleness)
            assert v <= step, (r, v, step)  # a rollout is never requested before its weights exist
            if v != self.published:
                with meter.phase("sync"):
                    self.publish(model, v)
            rows, prompts, seeds = draw(r)
            self.rows[r] = rows
            self.inbox.put(("generate", r, v, prompts, seeds))
            self.submitted += 1

    def publish(self, model, v: int) -> None:
        """Copy the trainable weights (version `v`) into the next slot and tell the worker; a slot is reused once the
        worker has copied out the version it held (it loads versions in order)."""
        slot = self.next_slot
        held = self.slot_versions[slot]
        assert self.loaded is not None, "start() the pipeline first"
        while held is not None and self.loaded < held:
            self._receive()
        with torch.no_grad():
            params = dict(model.named_parameters())
            for n in self.names:
                self.slots[slot][n].copy_(params[n].detach())
        self.slot_versions[slot], self.next_slot = v, 1 - slot
        self.inbox.put(("weights", v, slot))
        self.published = v

    def take(self) -> Generated:
        """The next rollout in order (waits for the worker)."""
        r = self.taken
        while r not in self.ready:
            self._receive()
        self.taken += 1
        return self.ready.pop(r)

    # -- messages from the worker ---------------------------------------------------------------------------------
    def _receive(self):
        """Handle one message from the worker (waiting for it); a dead, silent or failed worker raises."""
        while True:
            try:
                msg = self.outbox.get(timeout=HEARTBEAT_S)
                break
            except queue.Empty:
                self._check_alive()
        kind = msg[0]
        if kind == "error":
            raise PipelineError(f"the generation worker failed:\n{msg[1]}")
        if kind == "user_error":  # the config's or the machine's (a missing library, out of device memory)
            raise RolloutError(f"the generator process (rollout.pipeline=async): {msg[1]}")
        if kind == "loaded":
            self.loaded = msg[1]
        elif kind == "rollout":
            _, r, v, payload, busy, idle = msg
            roll = worker.from_payload(payload, self.device)
            self.ready[r] = Generated(r, v, self.rows.pop(r), roll, busy, idle)
        return kind

    def _check_alive(self) -> None:
        """GeneratorLost when the worker has died, or its heartbeat is older than rollout.worker_timeout_s (START_S
        at the least before its first one)."""
        assert self.proc is not None and self.proc.pid is not None, "start() the pipeline first"
        pid, timeout = self.proc.pid, self.cfg.rollout.worker_timeout_s
        if procs.exited(pid):  # not reaped yet: what it started goes with it, then it is reaped
            procs.kill_group(pid)
            self.proc.join()
            code, self.reaped = self.proc.exitcode or 0, True
            how = f"killed by {signal_name(-code)}" if code < 0 else f"exit code {code}"
            oom = " (SIGKILL is how the kernel's OOM killer ends a process: `dmesg` says if it did)" if code == -9 \
                else ""
            raise GeneratorLost(f"the generator process (pid {pid}, rollout.pipeline=async) ended with no error "
                                f"message ({how}){oom}; the run cannot go on without it. Rerun, with more memory if "
                                "it ran out, or use rollout.pipeline=sync.")
        beat = self.beat.value
        silent = time.monotonic() - (beat or self.started)
        if silent > (timeout if beat else max(timeout, START_S)):
            raise GeneratorLost(f"the generator process (pid {pid}, rollout.pipeline=async) has given no sign of life "
                                f"for {silent:.0f} s (rollout.worker_timeout_s={timeout:g}): it is stopped (kill "
                                "-STOP, a debugger), starved of CPU or memory, or hung. It was killed; resume from "
                                "the last checkpoint, raise rollout.worker_timeout_s if it is only slow, or use "
                                "rollout.pipeline=sync.")

    def _expect(self, kind: str) -> None:
        while self._receive() != kind:
            pass

    # -- checkpoint -----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything requested and not yet trained on (waiting for the worker to finish what it has started)."""
        while self.rows:
            self._receive()
        return {"submitted": self.submitted, "taken": self.taken,
                "ready": [dict(index=g.index, version=g.version, rows=g.rows, busy_s=g.busy_s, idle_s=g.idle_s,
                               rollout=worker.to_payload(g.rollout)) for g in self.ready.values()]}

    def load_state_dict(self, state: dict) -> None:
        self.submitted, self.taken = state["submitted"], state["taken"]
        self.ready = {g["index"]: Generated(g["index"], g["version"], g["rows"],
                                            worker.from_payload(g["rollout"], self.device), g["busy_s"], g["idle_s"])
                      for g in state["ready"]}


def signal_name(number: int) -> str:
    import signal

    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def check_shm(nbytes: int) -> None:
    """Before the weight slots are made: room in /dev/shm for them and the weights the generator starts with
    (RolloutError naming the sizes and the fix: Docker gives a container 64 MiB by default)."""
    if not os.path.isdir(SHM):
        return
    need, free = int(nbytes * 1.1), shutil.disk_usage(SHM).free
    if free < need:
        raise RolloutError(f"rollout.pipeline=async needs about {need / 2**20:.0f} MiB of shared memory ({SHM}: two "
                           "slots of the trainable weights, and the weights the generator starts with) and "
                           f"{SHM} has {free / 2**20:.0f} MiB free. Give it more (docker run --shm-size=4g; "
                           "Kubernetes: an emptyDir with medium: Memory at /dev/shm), or use rollout.pipeline=sync.")


class shm_failure:
    """Around making shared memory: a failure (no space left in /dev/shm) is RolloutError, and the segments this
    process had begun to make there are removed (torch names them torch_<pid>_*, and unlinks them once made)."""

    def __enter__(self):
        return self

    def __exit__(self, kind, error, tb):
        if kind is None or not issubclass(kind, (RuntimeError, OSError)):
            return False
        for path in glob.glob(os.path.join(SHM, f"torch_{os.getpid()}_*")):
            with contextlib.suppress(OSError):
                os.remove(path)
        raise RolloutError(f"rollout.pipeline=async could not make its shared memory in {SHM} "
                           f"({str(error).splitlines()[0][:200]}); give {SHM} more room (docker run --shm-size=4g) "
                           "or use rollout.pipeline=sync.") from None
