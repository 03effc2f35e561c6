"""rollout.pipeline=sync|async as objects (the registry's `pipeline` entries): where the GRPO recipe's rollouts
come from. The recipe asks `next(step, rollouts, got)` for the next one and never names the option.

- `Sync` (the baseline): generated in this process with the current weights when the buffer runs short
  (train.dynamic_sampling's rounds included); a rollout engine with its own weights (vLLM) is synced first when
  a step changed them.
- `Async`: taken in order from the generator process (rlrun/pipeline), which runs up to rollout.max_staleness
  optimizer steps ahead on its own copy of the policy (rlrun.policy, role generator).
- `Replay` (rollout=replay, not an axis option: the rollout option's own source, axes.source_of): read in order
  from a record (rlrun/rollout/record.py); nothing is generated. `Recording` wraps any of them for
  rollout.record=DIR: each rollout is written as the recipe takes it.

Each is built by the recipe as `Source(cfg, s, prompts, window=, grad_accum=, drawn=)` (the contract:
rlrun/pipeline/protocol.py); `stateful()` is what it checkpoints, `open(cleanup, tracker, step)` starts it (after a
checkpoint is restored), `ahead(step)` runs at the start of every optimizer step. `memory` is its term for the
planner (rlrun/plan/phases.py).
"""

from __future__ import annotations

import contextlib
import os

from .. import pipeline
from ..errors import RecordError
from ..plan.phases import Phase
from ..rollout import Rollout, record
from ..runner import timed
from . import sampling


class Sync:
    exactness = "baseline"
    phases: tuple[str, ...] = ("generate", "sync")
    generates_here = True
    generator_process = False

    def __init__(self, cfg, s, prompts, *, window: int, grad_accum: int, drawn=None):
        self.cfg, self.s, self.prompts, self.drawn = cfg, s, prompts, drawn  # drawn: dynamic sampling's totals
        self.synced_at = 0  # the rollout engine holds the weights after this many optimizer steps

    def stateful(self) -> dict:
        return {}

    def open(self, cleanup, tracker, step: int) -> None:
        self.synced_at = step

    def ahead(self, step: int) -> None:
        pass

    def next(self, step: int, rollouts: int, got):
        s, cfg = self.s, self.cfg
        if s.rollout.needs_sync and self.synced_at != step and cfg.rollout.sync_weights:
            with s.meter.phase("sync"), s.engine.generation():  # only when a step changed the weights
                s.rollout.sync(s.engine.model)
            self.synced_at = step
        # generated and scored; with train.dynamic_sampling, more rounds until the rollout's groups carry a signal
        return sampling.draw(cfg, s, self.prompts, rollouts, got.sampling, self.drawn), step

    @staticmethod
    def memory(cfg, s, gen: Phase, device_type: str) -> tuple[Phase, dict[str, int]]:
        return gen, {}


class Async(Sync):
    """Not the baseline's numbers: rollouts drawn by weights up to K steps old (compared by what it learns, with
    the staleness and the generator-trainer mismatch logged beside its speed)."""

    exactness = "approximate"
    phases = ("generate", "wait", "sync", "step")  # the whole step: generation overlaps training
    generates_here = False  # the generator process builds its own (rlrun/pipeline/worker.py)
    generator_process = True  # on rollout.worker_device; `rlrun check` probes it

    def __init__(self, cfg, s, prompts, *, window: int, grad_accum: int, drawn=None):
        super().__init__(cfg, s, prompts, window=window, grad_accum=grad_accum, drawn=drawn)
        self.pipe = pipeline.Pipeline(cfg, window=window, grad_accum=grad_accum, device=s.engine.device)

    def stateful(self) -> dict:
        return {"pipeline": self.pipe}

    def open(self, cleanup, tracker, step: int) -> None:
        cleanup.callback(self.pipe.close)  # however the loop ends (error, Ctrl-C, SIGTERM): no process left behind
        with timed(tracker, "generator_start"):  # its own interpreter, model and rollout engine
            self.pipe.start(self.s.engine.model, step)

    def ahead(self, step: int) -> None:
        """Request what the next steps train on, publishing these weights if needed."""
        self.pipe.ahead(step, self.s.engine.model, lambda r: sampling.prompts_of(self.cfg, self.s, self.prompts, r),
                        self.s.meter)

    def next(self, step: int, rollouts: int, got):
        with self.s.meter.phase("wait"):  # the trainer idles until the generator has it
            g = self.pipe.take()
        got.worker.append((g.busy_s, g.idle_s))
        return sampling.scored(self.cfg, self.s, g.rows, g.rollout), g.version

    @staticmethod
    def memory(cfg, s, gen: Phase, device_type: str) -> tuple[Phase, dict[str, int]]:
        """The generate phase re-planned on the worker process's own copy of the weights, and what the trainer's
        phases carry besides: on CPU, the two shared weight slots it writes (trainable parameters, double-buffered);
        on an accelerator shared with the worker (rollout.worker_device unset or naming the trainer's kind), the
        worker's whole generate peak, since it runs while the trainer trains. The slots are host memory on an
        accelerator, not the device's."""
        gen = Phase(gen.parts, {"generator process: its copy of the weights": s.params * s.param_bytes})
        if device_type == "cpu":
            return gen, {"weight slots for the generator (2 x trainable, shared memory)":
                         2 * s.trainable * s.param_bytes}
        device = cfg.rollout.worker_device
        if device is None or str(device).split(":")[0] == device_type:
            return gen, {"generator process on this device (weights, generate peak)": gen.peak}
        return gen, {}


class Replay:
    """rollout=replay: the rollouts of the record at rollout.path, in the order the recording run trained on them,
    with its rewards and the versions of the weights that drew them (staleness is the record's). train.overlong's
    shaping is applied here, as the training side chooses. The read is metered as the wait phase (the trainer waits
    for its rollout): no generate phase, so no generation throughput is reported for tokens nobody generated."""

    exactness = "baseline"  # the recording run's rollouts: with its config, its numbers bit for bit
    phases: tuple[str, ...] = ("wait",)
    generates_here = False  # no sampler is built
    generator_process = False  # nothing generates

    def __init__(self, cfg, s, prompts, *, window: int, grad_accum: int, drawn=None):
        self.cfg, self.s = cfg, s
        self.record = record.Record(os.path.expanduser(cfg.rollout.path))

    def stateful(self) -> dict:
        return {}  # the rollout number is the buffer's (checkpointed): a resumed replay reads on from there

    def open(self, cleanup, tracker, step: int) -> None:
        tracker.tags({"rlrun.replay": os.path.abspath(self.record.path), "rlrun.replay.digest": self.record.digest,
                      "rlrun.replay.rollouts": len(self.record)})
        record.as_dataset(tracker, self.record, "replay")  # the run page's Datasets: what it trained on

    def ahead(self, step: int) -> None:
        pass

    def next(self, step: int, rollouts: int, got):
        engine = self.s.engine
        with self.s.meter.phase("wait"):
            if engine.world > 1:  # data parallel: this rank's rows of the whole rollout, only they to the device
                t, meta = record.share(*self.record.read(rollouts, "cpu"), engine.rank, engine.world)
                t = {k: v.to(engine.device) for k, v in t.items()}
            else:
                t, meta = self.record.read(rollouts, engine.device)
        roll = Rollout(input_ids=t["input_ids"], attention_mask=t["attention_mask"], prompt_len=meta["prompt_len"],
                       response_mask=t["response_mask"], gen_logprobs=t["gen_logprobs"],
                       completions=meta["completions"], finished=t["finished"])
        return sampling.shape(self.cfg, meta["rows"], roll, meta["totals"], meta["by_reward"]), meta["version"]

    @staticmethod
    def memory(cfg, s, gen: Phase, device_type: str) -> tuple[Phase, dict[str, int]]:
        """No generation: a recorded rollout's tensors (ids, masks, logprobs: kilobytes) are all it reads."""
        return Phase({}, gen.resident), {}


class Recording:
    """rollout.record=DIR: `source`'s rollouts, each written to the record (rlrun/rollout/record.py) as the recipe
    takes it, numbered as the recipe counts them (a resumed run writes again from its checkpoint's rollout). With
    data parallel every rank sends its share to rank 0, the only one with a `recorder`, which writes the whole
    rollout."""

    def __init__(self, source, recorder: record.Recorder | None, engine, pad_id: int):
        self.source, self.recorder, self.engine, self.pad_id = source, recorder, engine, pad_id

    def __getattr__(self, name):  # stateful, ahead, memory, ...: the source's own
        return getattr(self.source, name)

    def open(self, cleanup, tracker, step: int) -> None:
        if self.recorder is not None:
            tracker.tags({"rlrun.record": os.path.abspath(self.recorder.path)})
            # when the run ends (finished, failed or stopped): the record as written, with its digest, in Datasets
            cleanup.callback(self._as_dataset, tracker, self.recorder.path)
        self.source.open(cleanup, tracker, step)

    @staticmethod
    def _as_dataset(tracker, path: str) -> None:
        with contextlib.suppress(RecordError, OSError):  # a record left unreadable must not hide why the run ended
            record.as_dataset(tracker, record.Record(path), "recorded")

    def next(self, step: int, rollouts: int, got):
        d, version = self.source.next(step, rollouts, got)
        tensors, meta = record.parts_of(d)
        if self.engine.world > 1:  # every rank's share, in rank order: the rollout's rows in their global order
            tensors, meta = record.join(self.engine.gather((tensors, meta)), self.pad_id)
        if self.recorder is not None:
            self.recorder.write(rollouts, tensors, meta, version, step)
        return d, version
