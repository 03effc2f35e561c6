"""Setup in one call: `setup` builds every component a recipe trains with, once, in a fixed order, and returns a
frozen `Setup` record. The recipes read the record and never reach back; nothing in it is changed afterwards, and
the validated config is never rewritten (`head.size=auto` is resolved into `Setup.head_size`)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import activations, models, plan, precision, registry
from ..meters import OFFLOAD_PHASES, Meter

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
    engine: Any
    meter: Meter
    head: Any  # the head module (rlrun.heads.Head): dense | tiled | chunked
    head_size: int | None  # tokens per tile or chunk, head.size=auto resolved (dense: ignored)
    data: Any  # Data.value: the task (GRPO) or the preference pairs (DPO)
    rollout: Any | None  # the generator (GRPO), built on the weights the run starts from
    plan: Any | None  # rlrun.plan.Plan, None when the run could not be planned
    grad_accum: int  # micro-batches per rank per optimizer step
    warnings: tuple[str, ...]  # about the data and settings (the run tag rlrun.warnings)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def setup(cfg, tracker, *, load: Callable[[Any, int | None], Data], grad_accum: int, with_reference: bool,
          reference_path: str | None = None, with_rollout: bool = False, resume: dict | None = None) -> Setup:
    """Seed; build the policy and tokenizer; `load` the recipe's data; warm-start the policy (when `warm_start`
    applies); copy or load the reference; add LoRA; hand both to the engine; plan the memory (resolving
    head.size=auto); load a checkpoint's engine state (`resume`); build the rollout on those weights."""
    seed_everything(cfg.seed)
    policy, tokenizer = models.build(cfg.model, cfg.seed)
    data = load(tokenizer, models.context_size(policy))
    warnings = list(data.warnings)
    warm = cfg.warm_start
    if warm_applies(cfg):
        from ..warmstart import warm_start

        if cfg.task.name != "arith":  # the user's data: asked for, so say what it trains on
            log.warning("%s", warm_notice(cfg, len(data.warm_rows)))

        with timed(tracker, "warm_start"):
            warm_start(policy, tokenizer, data.warm_rows, dataclasses.asdict(warm), cfg.seed, cache=warm.cache)
    lora = cfg.model.lora
    # LoRA: the reference pass can run the policy with its adapters disabled (models.reference), no copy
    adapters_off = lora.enabled and lora.reference == "adapters_off" and reference_path is None
    reference = None
    if with_reference and not adapters_off:
        reference = frozen_reference(policy, reference_path, cfg.model.dtype)
    if lora.enabled:  # after the warm start and the reference copy: both are of the base model
        policy = models.add_lora(policy, lora)
    activations.apply(policy, cfg.activations)  # the policy only: the reference never runs with a gradient
    for model in (policy, reference):  # train.precision=bf16 on engine=single: backbones under bf16 autocast
        precision.apply(model, cfg)
    shapes = plan.shapes_of(policy, plan.weight_dtype(cfg))  # before the engine partitions it (ZeRO-3)
    engine = registry.get("engine", cfg.engine.name).Engine(cfg, policy, reference, grad_accum)
    head_size, memory = plan_memory(cfg, tracker, engine, tokenizer, shapes, data.plan_rows, warnings)
    device_notes(cfg, tracker, engine)
    if resume is not None:
        engine.load_state_dict(resume)
    rollout = None
    if with_rollout:
        with engine.generation():  # ZeRO-3: the engine copies full weights
            rollout = registry.get("rollout", cfg.rollout.name).build(cfg.rollout, engine.model, tokenizer,
                                                                      engine.device)
    skip = () if cfg.offload.enabled else OFFLOAD_PHASES  # not logged: charts of phases that never ran mislead
    return Setup(tokenizer=tokenizer, engine=engine, meter=Meter(engine.device, skip=skip),
                 head=registry.get("head", cfg.head.name), head_size=head_size, data=data.value, rollout=rollout,
                 plan=memory, grad_accum=grad_accum, warnings=tuple(warnings))


def warm_applies(cfg) -> bool:
    """warm_start.enabled: true, or auto for the embedded random-init model on its own synthetic task (task=arith,
    whose answers the warm start's off-by-one labels are made for); never on the user's data unless asked."""
    enabled = cfg.warm_start.enabled
    return enabled is True or (enabled == "auto" and cfg.model.name == "tiny" and cfg.task.name == "arith")


def warm_notice(cfg, rows: int) -> str:
    w = cfg.warm_start
    return (f"warm start: {w.steps} supervised steps on {rows} training rows, prompt -> answer (DPO: the chosen "
            f"response), {w.wrong_prob:.0%} of the labels made wrong on purpose (the answer with one of "
            f"{list(w.offsets)} added, where it is a number); it is meant for task=arith's short numeric answers. "
            "warm_start.enabled=false turns it off.")


PRECISION_PATHS = {"bf16-autocast": "fp32 master weights and AdamW state, backbone forward and backward under "
                   "torch.autocast(bfloat16), logits and softmax in fp32 (engine=single)",
                   "bf16-deepspeed": "DeepSpeed's bf16 mode: bf16 weights and compute, fp32 master weights and "
                   "optimizer state in the ZeRO optimizer"}


def device_notes(cfg, tracker, engine) -> None:
    """The device and versions as run tags, and a note for each option that moves nothing on this device."""
    tracker.tags({"rlrun.device": engine.device.type, "rlrun.torch": torch.__version__,
                  "rlrun.world_size": str(engine.world), "rlrun.precision": precision.path(cfg)})
    if precision.resolved(cfg) == "bf16":
        log.info("train.precision=bf16: %s", PRECISION_PATHS[precision.path(cfg)])
    if cfg.offload.enabled and not engine.offload_effective():
        log.info("offload=on on a CPU-only run: optimizer state already lives in host memory, nothing moves.")
        tracker.tags({"offload.effective": "false"})
    if not activations.effective(cfg.activations, engine.device):
        log.info("activations=offload on a CPU-only run: saved activations already live in host memory, nothing "
                 "moves.")
        tracker.tags({"activations.effective": "false"})


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


def frozen_reference(policy, path: str | None, dtype: str):
    """The reference model: a frozen copy of the initial policy, or a local checkpoint."""
    ref = models.load_hf(path, dtype)[0] if path else copy.deepcopy(policy)
    return ref.requires_grad_(False)
