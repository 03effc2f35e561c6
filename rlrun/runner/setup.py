"""Setup in one call: `setup` builds every component a recipe trains with, once, in a fixed order, and returns a
frozen `Setup` record. The recipes read the record and never reach back; nothing in it is changed afterwards, and
the validated config is never rewritten (`head.size=auto` is resolved into the bound head, `Setup.axes.head`).
Every option of the run is an object there (`Setup.axes`, rlrun/axes.py): the recipes call them, never name them."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import axes, batching, models, plan, policy, ranks, registry, warmstart
from ..engine.protocol import Engine
from ..meters import OFFLOAD_PHASES, Meter
from ..rollout.protocol import Sampler
from . import console

log = logging.getLogger("rlrun")


@dataclass(frozen=True)
class Data:
    """What a recipe's `load(tokenizer, context_size)` gives setup: its data (`value`, kept as `Setup.data`), the
    rows to warm-start on ({prompt, answer}), the rows the memory plan sizes from, and warnings about the data."""

    value: Any
    warm_rows: list[dict]
    plan_rows: list[dict]
    warnings: list[str]


@dataclass(frozen=True)
class Setup:
    """Everything one run trains with. `engine.model` is the policy (wrapped, moved, maybe partitioned)."""

    tokenizer: Any
    engine: Engine
    meter: Meter
    axes: axes.Axes  # every option of the run as its object, bound (head size, ranks, device)
    data: Any  # Data.value: the task (GRPO) or the preference pairs (DPO)
    rollout: Sampler | None  # the generator (GRPO, sync), built on the weights the run starts from
    grad_accum: int  # micro-batches per rank per optimizer step
    warnings: tuple[str, ...]  # about the data and settings (the run tag rlrun.warnings)
    memory: Any = None  # the memory plan (plan.Plan; None where the run could not be planned)
    head_size: int | None = None  # head.size resolved (auto: the plan's choice)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def setup(cfg, tracker, *, load: Callable[[Any, int | None], Data], grad_accum: int, with_reference: bool,
          reference_path: str | None = None, with_rollout: bool = False, resume: dict | None = None,
          temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0) -> Setup:
    """Seed; build the policy and tokenizer; `load` the recipe's data; warm-start the policy (when `warm_start`
    applies); build the reference and the trainer's copy (rlrun.policy: LoRA, activations, precision); hand both
    to the engine; plan the memory (resolving head.size=auto); load a checkpoint's engine state (`resume`); build
    the rollout on those weights; bind the axes (`temperature`, `top_p`, `top_k`: the distribution of the run's
    logprobs, GRPO's the sampler's)."""
    seed_everything(cfg.seed)
    base, tokenizer = models.build(cfg.model, cfg.seed)
    data = load(tokenizer, models.context_size(base))
    warnings = list(data.warnings)
    if warmstart.applies(cfg):
        notice = warmstart.notice(cfg, len(data.warm_rows))
        if notice:  # the user's data: asked for, so say what it trains on
            log.warning("%s", notice)
        with timed(tracker, "warm_start"):
            # minutes on CPU when not cached (300 steps): a bar, as the run's steps have
            shown = cfg.progress and ranks.is_main()
            warmstart.warm_start(base, tokenizer, data.warm_rows, dataclasses.asdict(cfg.warm_start), cfg.seed,
                                 cache=cfg.warm_start.cache,
                                 progress=lambda n: console.progress(0, n, "warm start", enabled=shown))
    # LoRA's adapters_off: the reference pass runs the policy with its adapters disabled (models.reference)
    reference = None
    if with_reference and not models.adapters_off_reference(cfg.model.lora, reference_path):
        reference = policy.build(cfg, "reference", base=base)  # of the base: before the trainer's LoRA
    trainer = policy.build(cfg, "trainer", base=base)
    shapes = plan.shapes_of(trainer, plan.weight_dtype(cfg))  # before the engine partitions it (ZeRO-3)
    engine = registry.get("engine", cfg.engine.name).Engine(cfg, trainer, reference, grad_accum)
    head_size, memory = plan_memory(cfg, tracker, engine, tokenizer, shapes, data.plan_rows, warnings)
    bound = axes.resolve(cfg, head_size=head_size, temperature=temperature, top_p=top_p, top_k=top_k,
                         agree=batching.agree(engine), device=engine.device)
    device_notes(cfg, tracker, engine, bound)
    if resume is not None:
        engine.load_state_dict(resume)
    rollout = None
    if with_rollout:
        with engine.generation():  # ZeRO-3: the engine copies full weights
            rollout = registry.get("rollout", cfg.rollout.name).build(cfg.rollout, engine.model, tokenizer,
                                                                      engine.device)
    skip = () if cfg.offload.enabled else OFFLOAD_PHASES  # not logged: charts of phases that never ran mislead
    return Setup(tokenizer=tokenizer, engine=engine, meter=Meter(engine.device, skip=skip), axes=bound,
                 data=data.value, rollout=rollout, grad_accum=grad_accum, warnings=tuple(warnings), memory=memory,
                 head_size=head_size)


def device_notes(cfg, tracker, engine, bound: axes.Axes) -> None:
    """The device and versions as run tags, and a note for each option that moves nothing on this device."""
    tracker.tags({"rlrun.device": engine.device.type, "rlrun.torch": torch.__version__,
                  "rlrun.world_size": str(engine.world), "rlrun.precision": bound.precision.path})
    if bound.precision.note:
        log.info("train.precision=%s: %s", cfg.train.precision, bound.precision.note)
    if cfg.offload.enabled and not engine.offload_effective():
        log.info("offload=%s on a CPU-only run: optimizer state already lives in host memory, nothing moves.",
                 cfg.offload.name)
        tracker.tags({"offload.effective": "false"})
    if not bound.activations.effective():
        log.info("activations=%s on a CPU-only run: saved activations already live in host memory, nothing "
                 "moves.", cfg.activations.name)
        tracker.tags({"activations.effective": "false"})
    if bound.objective is not None:  # GRPO: whether zero-advantage rows leave the train pass (recipes/skipping.py)
        o = bound.objective
        tracker.tags({"rlrun.skip_zero_advantage": "on" if o.skip_zero_advantage else f"off ({o.kept_reason})"})
        if cfg.train.skip_zero_advantage and not o.skip_zero_advantage:
            log.info("train.skip_zero_advantage: rows of advantage 0 stay in the train pass (%s); it would not be "
                     "exact without them.", o.kept_reason)


def plan_memory(cfg, tracker, engine, tokenizer, shapes, rows: list[dict], warnings: list[str]):
    """Predict each phase's memory (rlrun/plan/) and log it as plan/* at step 0 beside the measured mem/*, with its
    parts as the artifact plan.txt. Returns (head size, plan); head.size=auto is resolved here, rank 0's choice for
    all ranks. A run that cannot be planned warns (appended to `warnings`) and goes on, unless the size is auto."""
    size = cfg.head.size
    try:
        n_rows, seq_len, tokens = plan.lengths(cfg, tokenizer, rows)
        size = plan.resolve_size(cfg, shapes, tokens, engine.device.type, engine.world)
        if cfg.head.size == "auto":
            size = engine.gather(size)[0]
            log.info("head.size=auto: %d tokens per %s tile (head.memory_budget_mib=%s)", size, cfg.head.name,
                     cfg.head.memory_budget_mib)
            tracker.tags({"rlrun.head.size": str(size)})
        memory = plan.predict(cfg, shapes, n_rows, seq_len, tokens, world=engine.world,
                              device_type=engine.device.type, head_size=size)
    except Exception as e:  # noqa: BLE001 - the plan is information; only head.size=auto depends on it
        if cfg.head.size == "auto":
            raise
        text = f"no memory plan for this run ({type(e).__name__}: {e}); training goes on without plan/*."
        log.warning("%s", text)
        warnings.append(text)
        return cfg.head.size, None
    tracker.log(0, plan.metrics(memory))
    tracker.text(plan.table(memory) + "\n\n" + plan.detail(memory), "plan.txt")
    return size, memory


@contextlib.contextmanager
def timed(tracker, what: str):
    """Time a one-off setup phase and log it as `time/<what>_s` (at step 0)."""
    t0 = time.perf_counter()
    yield
    seconds = time.perf_counter() - t0
    log.info("%s: %.1f s", what.replace("_", " "), seconds)
    tracker.log(0, {f"time/{what}_s": seconds})
