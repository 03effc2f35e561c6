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
"""

from __future__ import annotations

import logging
import os
import queue
from dataclasses import dataclass
from multiprocessing.process import BaseProcess

import torch

from ..rollout import Rollout
from . import worker

log = logging.getLogger("rlrun")


class PipelineError(RuntimeError):
    """The generation worker failed or stopped; the message carries its traceback."""


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

    def __init__(self, cfg, *, window: int, grad_accum: int, device: torch.device, build=worker.build):
        self.cfg, self.window, self.grad_accum, self.device = cfg, window, grad_accum, device
        self.build = build  # (cfg, state, device) -> (policy, tokenizer, rollout engine), run in the worker
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

    # -- the worker -----------------------------------------------------------------------------------------------
    def start(self, model, step: int) -> None:
        """Start the worker with the weights of `model` (version `step`)."""
        import torch.multiprocessing as mp

        params = dict(model.named_parameters())
        self.names = [n for n, p in params.items() if p.requires_grad]
        self.slots = [{n: torch.empty(params[n].shape, dtype=params[n].dtype).share_memory_() for n in self.names}
                      for _ in range(2)]
        state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        trainer_threads, worker_threads = threads(self.cfg.rollout.worker_threads, self.device)
        ctx = mp.get_context("spawn")  # a fresh interpreter: no copy of the trainer's threads, locks or CUDA state
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        device = self.cfg.rollout.worker_device or str(self.device)
        self.proc = ctx.Process(target=worker.main, name="rlrun-generator", args=(
            self.cfg, state, self.slots, self.inbox, self.outbox, worker_threads, device, step, os.getpid(),
            self.build))
        self.proc.start()
        del state
        self.threads_before = torch.get_num_threads()
        torch.set_num_threads(trainer_threads)
        log.info("rollout.pipeline=async: generator process %d on %s (%d thread(s)), trainer %d thread(s), at most "
                 "%d step(s) of staleness", self.proc.pid, device, worker_threads, trainer_threads, self.staleness)
        self.published = self.loaded = step
        self._expect("ready")

    def close(self) -> None:
        """Stop the worker (at the end of the run, and on any error or signal): nothing is left running."""
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        if proc.is_alive():
            try:
                self.inbox.put(("stop",))
                proc.join(timeout=10)
            except (OSError, ValueError):
                pass
        if proc.is_alive():  # it ignores SIGTERM (see worker.py)
            proc.kill()
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
        """Handle one message from the worker (waiting for it); a dead or failed worker raises PipelineError."""
        while True:
            try:
                msg = self.outbox.get(timeout=1.0)
                break
            except queue.Empty:
                if not self.proc.is_alive():
                    raise PipelineError(f"the generation worker (pid {self.proc.pid}) stopped with exit code "
                                        f"{self.proc.exitcode} and no error message (killed? out of memory?)") from None
        kind = msg[0]
        if kind == "error":
            raise PipelineError(f"the generation worker failed:\n{msg[1]}")
        if kind == "loaded":
            self.loaded = msg[1]
        elif kind == "rollout":
            _, r, v, payload, busy, idle = msg
            roll = worker.from_payload(payload, self.device)
            self.ready[r] = Generated(r, v, self.rows.pop(r), roll, busy, idle)
        return kind

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
