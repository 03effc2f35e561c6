"""The axes of a run as objects: each option found through the registry once, from the validated config.

What is true of an option is said on its object, once: `exactness` (one of EXACTNESS, relative to its axis's
baseline), `phases` (the phases of a step it changes: what a sweep should time it by), and its memory term, which
rlrun/plan/ asks for instead of naming the option. No module of rlrun/ but config/ (validation) and tools/
(benchmarks) compares an option's name: each reads these objects (tests/unit/test_axes.py checks the source). A new
option is its module plus its YAML (docs/adding-an-option.md).

    axis            config key            object (registry group)
    head            head                  the head module, bound to its size and temperature (heads.Bound)
    logprobs        logprob_policy        which extra passes a rollout needs (logprobs.Always | Window | Skip)
    offload         offload               whether optimizer state leaves the device for them (offload.On | Off)
    layout          batching              how a pass lays out its sequences (batching.layouts.*)
    activations     activations           what a pass with a gradient keeps (activations.Keep | ...)
    precision       train.precision       the arithmetic of every copy of the policy (precision.Fp32 | Bf16)
    pipeline        rollout.pipeline      where GRPO's rollouts come from (recipes/sources.Sync | Async)
    (decode)        rollout.decode        how rollout=hf runs its decode loop (rollout/decoding.Eager | Compiled):
                                          asked by the rollout and evaluation (decoding.of), not held here
    objective       loss (GRPO)           the loss bound to its aggregation and correction (losses.bound)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from . import algorithms, heads, precision, registry
from .activations.protocol import Activations
from .batching.protocol import Layout
from .logprobs import LogprobPolicy
from .losses.bound import Objective
from .offload import Offload
from .pipeline.protocol import Source
from .precision import Precision

# What an option's numbers are, relative to its axis's baseline (the option whose exactness is "baseline").
EXACTNESS = {
    "baseline": "the reference its axis is compared with",
    "bitwise": "the baseline's numbers, bit for bit",
    "fp_tolerance": "the baseline's numbers up to summation order (fp32: 1e-5 relative)",
    "approximate": "close to the baseline's, not equal (lower precision, staleness); compared by what it learns",
    "objective": "a different objective: compared by what it learns, not by its numbers",
}
SAME = ("bitwise", "fp_tolerance")  # the exactness of an option that trains its baseline's numbers


@dataclass(frozen=True)
class Axes:
    """The option fields typed by their axis's contract (registry.PROTOCOLS), so a checker holds the recipes to it,
    not to the baseline's class; the head is bound (heads.Bound) and the objective is GRPO's own object."""

    head: heads.Bound
    logprobs: LogprobPolicy
    offload: Offload
    layout: Layout
    activations: Activations
    precision: Precision
    pipeline: type[Source]  # the source class of rollout.pipeline (recipes/sources.py); GRPO builds it
    objective: Objective | None  # GRPO's; None for DPO (its loss is a function of sequence logprobs)


def resolve(cfg, *, head_size: int | None = None, temperature: float = 1.0, top_p: float = 1.0, agree=None,
            device: torch.device | str = "cpu", top_k: int = 0) -> Axes:
    """The axis objects of a validated run config. `head_size`: the tile size (head.size=auto resolved by the
    plan; default cfg.head.size); `temperature`, `top_p`: the distribution of the run's logprobs (GRPO: the
    sampler's, rollout.temperature, rollout.top_p and rollout.top_k; DPO: 1, 1, 0); `agree`:
    n -> the largest n over ranks (batching.agree(engine); None on one process); `device`: the run's."""
    size = head_size if head_size is not None else (cfg.head.size if cfg.head.size != "auto" else None)
    grpo = not algorithms.of(cfg).pairs
    return Axes(
        head=heads.Bound(registry.get("head", cfg.head.name), size, temperature, top_p, top_k),
        logprobs=registry.get("logprob_policy", cfg.logprob_policy.name)(cfg.logprob_policy),
        offload=registry.get("offload", cfg.offload.name)(cfg.offload),
        layout=registry.get("batching", cfg.batching.name)(cfg.batching, agree),
        activations=registry.get("activations", cfg.activations.name)(cfg.activations, device),
        precision=precision.option(cfg),
        pipeline=source_of(cfg),
        objective=Objective(cfg.loss, cfg.rollout.max_new_tokens, cfg.train.skip_zero_advantage) if grpo else None)


def source_of(cfg):
    """Where GRPO's rollouts come from: the rollout option's own source when it has one (rollout=replay reads a
    record), else rollout.pipeline's (recipes/sources.Sync | Async)."""
    own = getattr(registry.get("rollout", cfg.rollout.name), "SOURCE", None)
    return registry.load(own) if own is not None else registry.get("pipeline", cfg.rollout.pipeline)


def of(head="dense", size=16, temperature=1.0, batching="padded", max_tokens=64, activations="keep", every=1,
       loss=None, max_new_tokens=12, policy="always", offload="off", precision="fp32", pipeline="sync",
       agree=None, top_p=1.0, skip_zero_advantage=False, top_k=0) -> Axes:
    """The axes of a step run outside a run (benchmarks, tests), from option names and the few keys they read;
    `loss`: a loss config node for GRPO's objective (None: none)."""
    from types import SimpleNamespace as NS

    run = NS(engine=NS(name="single", dtype="auto"), train=NS(precision=precision))  # what precision.path reads
    return Axes(head=heads.Bound(registry.get("head", head), size, temperature, top_p, top_k),
                logprobs=registry.get("logprob_policy", policy)(None),
                offload=registry.get("offload", offload)(None),
                layout=registry.get("batching", batching)(NS(max_tokens=max_tokens), agree),
                activations=registry.get("activations", activations)(NS(every=every)),
                precision=registry.get("precision", precision)(run),
                pipeline=registry.get("pipeline", pipeline),
                objective=Objective(loss, max_new_tokens, skip_zero_advantage) if loss is not None else None)


def options(group: str) -> dict[str, Any]:
    """Every option of `group` (a registry group) as its object: what tests, sweeps and --help enumerate."""
    return {name: registry.get(group, name) for name in registry.REGISTRY[group]}


def exactness(group: str, name: str) -> str:
    """What `group=name`'s numbers are against its axis's baseline (a key of EXACTNESS)."""
    obj = registry.get(group, name)
    return getattr(obj, "exactness", None) or obj.EXACTNESS


def trains_same(group: str, name: str) -> bool:
    """Whether `group=name` trains its baseline's numbers (bit for bit or up to summation order)."""
    return exactness(group, name) in SAME


baseline = registry.baseline  # the option of an axis the others are compared with
