"""train.precision=fp32|bf16: the arithmetic of the policy's passes, and the master copy the optimizer updates.

- `fp32` (the baseline): weights, gradients, optimizer state and every op in fp32.
- `bf16` on engine=single: weights, gradients and AdamW's moments stay fp32 (the master copy: an update smaller
  than one bf16 step of a weight, 1/256 of it, still lands); every forward of the policy's and the reference's
  backbone runs under torch.autocast(bfloat16): matmuls in bf16, norms, softmax and reductions in fp32 where
  autocast says so, and the backward follows the forward's dtypes. The heads compute logits and their softmax in
  fp32 whatever the hidden states' dtype (heads/common.py). The backbone is wrapped by replacing its instance
  `forward` (as rlrun.activations does for layers), so the train pass, the logprob passes, generation and
  evaluation all see the same numerics; the warm start, before the wrap, stays fp32.
- `bf16` on engine=deepspeed: DeepSpeed's bf16 block: the module in bf16, fp32 master weights and moments inside
  its ZeRO optimizer (engine.dtype=auto follows train.precision; a contradicting engine.dtype is refused).

Both bf16 paths keep fp32 master weights and optimizer state and compute in bf16; the run tag `rlrun.precision`
says which one ran (`path`).
"""

from __future__ import annotations

import types
from typing import Protocol

import torch

from . import models, registry
from .errors import ModelError


def resolved(cfg) -> str:
    """fp32 | bf16: train.precision, or engine.dtype where DeepSpeed's is set (the validator made them agree)."""
    return registry.get("engine", cfg.engine.name).dtype(cfg.engine, cfg.train.precision)


def reduced(cfg) -> bool:
    """Whether the run computes below fp32 (its precision object's `reduced`)."""
    return bool(registry.get("precision", resolved(cfg)).reduced)


def path(cfg) -> str:
    """The run tag rlrun.precision: fp32, bf16-autocast (engine=single) or bf16-deepspeed."""
    if not reduced(cfg):
        return "fp32"
    return registry.get("engine", cfg.engine.name).BF16_PATH


def autocasts(cfg) -> bool:
    return path(cfg) == "bf16-autocast"


def _autocast_forward(self, *args, **kwargs):
    """A backbone's forward under bf16 autocast, on the device its weights are on."""
    device = next(self.parameters()).device.type
    with torch.autocast(device, dtype=torch.bfloat16):
        return type(self).forward(self, *args, **kwargs)


PHASES: tuple[str, ...] = ("generate", "old_logprobs", "ref_logprobs", "train")  # every pass of the policy
NOTES = {"bf16-autocast": "fp32 master weights and AdamW state, backbone forward and backward under "
         "torch.autocast(bfloat16), logits and softmax in fp32 (engine=single)",
         "bf16-deepspeed": "DeepSpeed's bf16 mode: bf16 weights and compute, fp32 master weights and optimizer "
         "state in the ZeRO optimizer"}


class Precision(Protocol):
    """The contract of a precision (train.precision): built as `Option(cfg)` (the whole run config: DeepSpeed's
    engine.dtype decides its path there)."""

    exactness: str
    phases: tuple[str, ...]
    path: str  # fp32 | bf16-autocast | bf16-deepspeed: the run tag rlrun.precision
    reduced: bool  # computes below fp32 (a bf16 path): DeepSpeed's bf16 mode, the divergence hint, the planner
    dtype: str  # the torch dtype its passes compute in: a generator's copy elsewhere (vLLM's rollout.dtype) matches it

    @property
    def note(self) -> str | None: ...

    def apply(self, model, role: str) -> None: ...


class Fp32:
    """train.precision=fp32 (the baseline)."""

    exactness = "baseline"
    phases = PHASES
    reduced = False
    dtype = "float32"

    def __init__(self, cfg):
        self.path = path(cfg)

    @property
    def note(self) -> str | None:
        """What the run's precision does, said once at setup (None for the baseline)."""
        return NOTES.get(self.path)

    def apply(self, model, role: str) -> None:
        """Put one copy of the policy (`role`: trainer, reference or generator; rlrun.policy builds them all) on
        this precision's path, so that every copy computes as the trainer does."""
        if self.path == "bf16-autocast":
            _autocast(model)
        elif self.path == "bf16-deepspeed" and role == "generator":
            model.to(torch.bfloat16)  # DeepSpeed's bf16 module computes in bf16 weights; its own copies it casts


class Bf16(Fp32):
    """train.precision=bf16: bf16 compute over fp32 master weights (rlrun's autocast on engine=single, DeepSpeed's
    bf16 mode on engine=deepspeed). Not the baseline's numbers: close to them (docs/precision.md)."""

    exactness = "approximate"
    reduced = True
    dtype = "bfloat16"


def option(cfg) -> Fp32:
    """The precision object of a run (train.precision, or DeepSpeed's engine.dtype: `resolved`)."""
    from . import registry

    return registry.get("precision", resolved(cfg))(cfg)


def apply(model, cfg, role: str = "trainer") -> None:
    """`model` (a copy of the policy in `role`) on the run's precision path; None is left alone."""
    if model is not None:
        option(cfg).apply(model, role)


def _autocast(model) -> None:
    """bf16-autocast: run `model`'s backbone under autocast, and check that what trains is fp32 (the master)."""
    backbone, _ = models.split(model)
    backbone.forward = types.MethodType(_autocast_forward, backbone)
    low = sorted({str(p.dtype) for p in model.parameters() if p.requires_grad and p.dtype != torch.float32})
    if low:  # the validator refuses model.dtype!=float32 without LoRA; a peft that made bf16 adapters lands here
        raise ModelError(f"train.precision=bf16 keeps fp32 master weights, but trainable parameters are {low}; "
                         "set model.dtype=float32 (LoRA: a peft that keeps adapters in fp32).")


def autocasting(model) -> bool:
    """Whether `model`'s backbone runs under autocast (apply)."""
    backbone, _ = models.split(model)
    return vars(backbone).get("forward") is not None and vars(backbone)["forward"].__func__ is _autocast_forward
