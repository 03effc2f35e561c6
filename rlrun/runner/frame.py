"""The step loop both recipes share: `Frame.steps` yields the steps and keeps their cadence (held-out evaluation,
checkpoints, Ctrl-C / SIGTERM deferred to the end of a step); `reduce` and `log` turn a step's numbers into metrics
on every rank and in the tracker. What the run trains with comes from the `Setup` record (setup.py).

State that is checkpointed is declared once: the `stateful` objects a recipe hands to `Frame.steps` (each with
`state_dict`/`load_state_dict`) are saved into every checkpoint and restored from it by name, together with the
engine's state (loaded by `setup`) and the RNGs.
"""

from __future__ import annotations

import logging
import math
import os
import random
import uuid

import numpy as np
import torch

from .. import checkpoint, folders, signals
from ..meters import LOAD_KEY, Meter
from .console import Progress, format_rows, progress, sweep_job
from .lifecycle import cfg_flat, export_dir
from .summary import DEAD_GRADIENTS_TAG, Summary, watch_gradients

log = logging.getLogger("rlrun")

# Keys of a checkpoint that the frame (step, rng, run_id, owner, config) and the engines (model, optimizer, scheduler,
# reference, world_size, deepspeed_checkpoint) write; a recipe's stateful objects take other names.
RESERVED = {"step", "rng", "run_id", "owner", "spill", "config", "model", "optimizer", "scheduler", "reference",
            "world_size", "deepspeed_checkpoint"}


class NonFiniteLossError(FloatingPointError):
    pass


def check_finite(loss: torch.Tensor, step: int, fix: str) -> None:
    if not torch.isfinite(loss):
        raise NonFiniteLossError(f"loss is {loss.item()} at step {step}; {fix}")


DIVERGED_FIX = "lower train.lr or train.grad_clip, or check the reward function."


def broken_weight(model) -> str | None:
    """The name of the first parameter of `model` holding a NaN or inf (this rank's share under ZeRO-3), or None.

    A loss can stay finite while the weights break: a bf16 backward that overflows gives an inf gradient, clipping
    turns it into NaN, and once the weights are NaN every completion gets the same reward, so
    train.skip_zero_advantage drops every row and the loss is exactly 0 from then on. One sum per parameter (no
    tensor the size of a parameter is made); a NaN or inf anywhere makes its sum non-finite."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            t = getattr(p, "ds_tensor", p)  # ZeRO-3 keeps this rank's partition there; p itself is empty
            if t.numel() and not torch.isfinite(t.detach().sum(dtype=torch.float32)):
                return name
    return None


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None:
        torch.cuda.set_rng_state_all(state["cuda"])


def rank_slice(items: list, engine) -> list:
    """This rank's share of a global batch (every rank reads the same stream; `len(items)` divides by the world)."""
    per_rank = len(items) // engine.world
    return items[engine.rank * per_rank : (engine.rank + 1) * per_rank]


def no_held_out(cfg, rows: str) -> str:
    """The warning for eval.every on a task without held-out `rows` (a warning, not a refusal: eval.every is on by
    default, and not every data set holds rows out)."""
    return (f"eval.every={cfg.eval.every} evaluates on held-out {rows}, but task={cfg.task.name} has none, so there "
            f"is no evaluation: set task.eval_size=N ({rows} held out of training) or, for task=dataset, "
            "task.eval_split=SPLIT.")


def meter_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """Per-rank meter readings -> the slowest rank's times, the largest peak, and each rank's peaks (world > 1)."""
    out = {k: max(p[k] for p in parts if k in p) for k in {k for p in parts for k in p}}
    out[LOAD_KEY] = os.getloadavg()[0]  # the machine's load as the step ended: a slow step on a busy machine
    if len(parts) > 1:
        for r, p in enumerate(parts):
            out.update({f"{k.replace('mem/', f'mem/rank{r}/')}": v for k, v in p.items() if k.startswith("mem/")})
    return out


class Frame:
    """The loop of one run over the components of `s` (a `Setup`), logging to `tracker`; `curve` is the metric
    whose first and last values the run summary reports."""

    def __init__(self, cfg, raw, tracker, s, *, curve: str):
        self.cfg, self.raw, self.tracker, self.s = cfg, raw, tracker, s
        self.engine, self.meter = s.engine, s.meter
        self.summary = Summary(curve)
        self.bar: Progress | None = None  # set by `steps`
        self.last_samples: list[dict] = []  # the last samples table, printed at the end of the run
        self.exported: str | None = None
        self.in_sweep = sweep_job(cfg)  # a job's console output is shortened
        # who owns the checkpoints this run writes: rotation removes only the owner's (kept across resumes: restore)
        self.owner = self.engine.gather(uuid.uuid4().hex)[0]  # rank 0's, on every rank
        self.grad_watch: dict = {}  # consecutive dead-gradient steps (watch_gradients)
        self.broken: str | None = None  # a weight that is no longer finite, on any rank (reduce)
        self.warnings: list[str] = list(s.warnings)  # about the data and settings, all in the run tag rlrun.warnings
        if self.warnings:
            tracker.tags({"rlrun.warnings": "\n".join(self.warnings)})
        if cfg.export.enabled and self.engine.main:  # room for the export, known now that the model is built
            folders.check_space(export_dir(cfg), folders.model_bytes(self.engine.model))

    def restore(self, resume: dict | None, stateful: dict) -> int:
        """Load a checkpoint's `stateful` objects, the summary and the RNGs (setup loaded the engine's state);
        returns the step to continue from."""
        if resume is None:
            return 0
        self.owner = resume.get("owner") or self.owner  # a checkpoint of an older rlrun names none: a new owner
        for name, obj in {**stateful, "summary": self.summary}.items():
            obj.load_state_dict(resume[name])
        set_rng_state(resume["rng"])
        return resume["step"]

    def steps(self, start: int, stateful: dict, desc: str, evaluate=None):
        """Yield the steps from `start` on. Before a step that is a multiple of `eval.every`, and after the last
        step, `evaluate()` (-> rlrun.evaluate.Evaluation) runs on the held-out rows and is logged at that step.
        After each step: checkpoint `stateful` when due; on Ctrl-C / SIGTERM, checkpoint and stop
        (KeyboardInterrupt) after that step. Use as `with contextlib.closing(frame.steps(...)) as steps:` so the
        signal handlers are restored as soon as the loop ends, however it ends; then call `finish`."""
        stateful = {**stateful, "summary": self.summary}
        taken = RESERVED & set(stateful)  # the frame's and the engines' own keys of a checkpoint
        assert not taken, f"stateful names {sorted(taken)} collide with checkpoint keys"
        total = self.cfg.train.steps
        self.bar = progress(start, total, desc, enabled=self.cfg.progress and self.engine.main,
                            every=self.cfg.log.every or (max(1, round((total - start) / 5)) if self.in_sweep else None))
        every = self.cfg.eval.every if evaluate is not None else 0
        with signals.deferred() as stop:
            for step in self.bar:
                if every and step % every == 0:
                    self.evaluate(step, evaluate)
                self.meter.new_step()
                yield step
                self.maybe_checkpoint(step, stop["stop"], stateful)
            if every:  # resumed after the last step's checkpoint too: a kill may have come before this was logged
                self.evaluate(total, evaluate)  # (the tracker logs no metric at a step it already holds)

    def finish(self) -> dict[str, float]:
        """After the last step: check the policy's forward, export it, print the last samples; the run's summary
        numbers."""
        self.check_forward()
        self.export()
        if self.last_samples and self.engine.main and not self.in_sweep:
            log.info("last samples:\n%s", format_rows(self.last_samples))  # a sweep job's are in MLflow only
        return self.summary.result()

    def maybe_checkpoint(self, step: int, stop: bool, stateful: dict) -> None:
        """Write a checkpoint after `step` when due (every N steps, the last step, or a stop signal)."""
        c, done = self.cfg.checkpoint, step + 1
        stop = any(self.engine.gather(stop))  # a signal that reached one rank stops all of them after the same step
        if c.dir and ((c.every and done % c.every == 0) or done == self.cfg.train.steps or stop):
            self.tracker.flush()  # every step up to here is in the store: a resume from this checkpoint logs none twice
            state = {"step": done, "rng": rng_state(), "run_id": self.tracker.run_id, "owner": self.owner,
                     "spill": getattr(self.tracker, "spill_path", None), "config": cfg_flat(self.raw),
                     **{name: obj.state_dict() for name, obj in stateful.items()}}
            path = self.engine.save(c.dir, done, state, c.keep)
            if path:
                log.info("checkpoint %s", path)
            if c.export:
                self.export(os.path.join(c.dir, f"{checkpoint.tag(done)}_model"), log_artifact=False)
        if stop:
            raise KeyboardInterrupt

    def evaluate(self, step: int, evaluate) -> None:
        """Held-out evaluation, timed and metered as its own phase (outside the step's `time/step_s`)."""
        meter = Meter(self.engine.device)
        with meter.phase("eval"):
            result = evaluate()
        m = {**result.metrics, **meter.metrics()}
        m.pop("time/step_s")
        self.summary.add(m)
        self.tracker.log(step, m)
        if result.samples:
            self.samples(step, result.samples, "eval")
        if self.engine.main:  # as it happens: a long run's learning is seen before its end
            said = ", ".join(f"{k.removeprefix('eval/').replace('_', ' ')} {v:.3g}" for k, v in result.metrics.items()
                             if k in ("eval/accuracy", "eval/reward_mean"))
            if said:
                log.info("held-out evaluation at step %d: %s", step, said)

    def samples(self, step: int, rows: list[dict], kind: str) -> None:
        """A table of a few prompts, completions, answers and rewards; the last one is printed at the end."""
        self.last_samples = rows
        self.tracker.table(rows, f"samples/{kind}_step_{step:06d}.json")

    def export(self, folder: str | None = None, log_artifact: bool = True) -> None:
        """The policy and its tokenizer, written with save_pretrained (ZeRO-3: gathered, rank 0 writes)."""
        from ..export import export

        folder = folder or (self.cfg.export.enabled and export_dir(self.cfg))
        if not folder:
            return
        path = export(self.engine.model, self.s.tokenizer, folder, engine=self.engine,
                      lora=self.cfg.model.lora.export)
        if path:
            self.exported = path
            log.info("exported the policy to %s", path)
            if log_artifact:
                self.tracker.artifacts(path, "model")

    def warn(self, warnings: list[str]) -> None:
        """Warnings about the data that may cost the run (answers longer than max_new_tokens, ...): shown once, on
        the console and as a run tag."""
        for w in warnings:
            log.warning("%s", w)
        if warnings:
            self.warnings += warnings
            self.tracker.tags({"rlrun.warnings": "\n".join(self.warnings)})

    def reduce(self, part: dict) -> list[dict]:
        """This rank's small per-step numbers -> every rank's (sums, counts, min/max and per-sequence values only).
        Called after the optimizer step: each rank's broken weight, if any, travels with them, so every rank
        stops on the same step (`log`)."""
        by_rank = self.engine.gather({**part, "meter": self.meter.metrics(),
                                      "broken_weight": broken_weight(self.engine.model)})
        self.broken = next((p["broken_weight"] for p in by_rank if p["broken_weight"]), None)
        return by_rank

    def log(self, step: int, m: dict[str, float], **postfix) -> None:
        """Log the step's metrics (the gradient norm as it was, NaN included), then stop the run as diverged when
        the gradient norm or a weight is not finite: a run never ends FINISHED with a broken model."""
        text = watch_gradients(self.grad_watch, m["grad_norm"], m.get("equal_reward_groups_frac") == 1.0)
        if text:  # training that died quietly: say so once, in the console and on the run
            log.warning(text)
            self.tracker.tags({DEAD_GRADIENTS_TAG: text})
        self.summary.add(m)
        self.tracker.log(step, m)
        if self.bar is not None:  # within `steps`
            self.bar.set_postfix(**postfix)
        known = getattr(self.engine, "grad_norm_known", True)  # DeepSpeed may not report one (engine.deepspeed)
        if known and not math.isfinite(m["grad_norm"]):
            raise NonFiniteLossError(f"the gradient norm is {m['grad_norm']} at step {step} (the loss was "
                                     f"{m['loss']:.4g}); {DIVERGED_FIX}")
        if self.broken:
            raise NonFiniteLossError(f"the weights are no longer finite after step {step} ({self.broken} holds NaN "
                                     f"or inf; the loss was {m['loss']:.4g}); {DIVERGED_FIX}")

    def check_forward(self) -> None:
        """Before the export: the policy's forward on a few tokens is finite. Weights can stay finite while the
        forward is not (bf16 weights of 1e8 overflow it): its completions all get the same reward, the skipped
        rows leave the loss 0, and without this the run would end FINISHED with a model that outputs NaN. Every
        rank runs it (a ZeRO-3 forward is collective)."""
        from .. import models

        lm = models.unwrap(self.engine.model)
        backbone, weight = models.split(self.engine.model)
        vocab = int(getattr(lm.config, "vocab_size", 2))
        ids = torch.arange(min(8, vocab), device=self.engine.device).unsqueeze(0)
        with torch.no_grad():
            hidden = models.hidden_states(backbone, ids, torch.ones_like(ids))
            finite = bool(torch.isfinite(hidden).all())
            if finite and weight.numel():  # the last position's logits too, where this rank holds the whole head
                # (not ZeRO-3): one row, so the check adds no [tokens, vocab] tensor to a tiled head's run
                finite = bool(torch.isfinite(hidden[:, -1].float() @ weight.float().T).all())
        if not finite:
            raise NonFiniteLossError("the policy's forward gives NaN or inf at the end of training (its weights "
                                     f"are finite, but too large for its precision); {DIVERGED_FIX}")
