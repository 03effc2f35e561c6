"""Every copy of the policy model, built by one function with its role as an argument.

A run computes with up to three copies of the policy, and each must compute as the others do, or what the trainer
trains on is not what it thinks (a generator outside bf16 while the trainer runs in it, an adapter missing):

- `trainer`: the weights that train: the model (`models.build`), then, after setup's warm start, LoRA adapters,
  the activations option (checkpointed layers) and the precision path;
- `reference`: a frozen copy of the base weights (after the warm start, before LoRA) or `loss.reference_path`,
  on the precision path; never with a gradient, so no activations option;
- `generator`: rollout.pipeline=async's own copy in its worker process (rollout=hf generates with it, rollout=vllm
  is synced from it): the model, LoRA adapters, the precision path, then the trainer's weights.

The synchronous generator is the trainer's own copy (the engine's model), so it is on the same path by identity.
tests/unit/test_policy.py runs every copy on one probe batch for every precision x pipeline x LoRA.
"""

from __future__ import annotations

import copy

import torch

from . import activations, models, precision

ROLES = ("trainer", "reference", "generator")


def build(cfg, role: str, *, base=None, state: dict | None = None, device: str | torch.device | None = None):
    """The `role` copy of the policy of run config `cfg`. `base`: the model to start from (trainer: setup's
    warm-started model; reference: the model to copy, unless loss.reference_path names a checkpoint); a fresh
    `models.build` when None. `state`: weights to load (generator: the trainer's state dict). `device`: where to
    put it (generator)."""
    if role not in ROLES:
        raise ValueError(f"role {role!r}; one of {ROLES}")
    path = getattr(cfg.loss, "reference_path", None) if role == "reference" else None
    if path:
        model = models.load_hf(path, cfg.model.dtype)[0]
    elif role == "reference":
        model = copy.deepcopy(base)
    else:
        model = base if base is not None else models.build(cfg.model, cfg.seed)[0]
    if role != "reference" and cfg.model.lora.enabled:
        model = models.add_lora(model, cfg.model.lora)
    if role == "trainer":  # the only copy that runs a pass with a gradient
        activations.option(cfg.activations).apply(model)
    if role == "reference":
        model.requires_grad_(False)
    precision.apply(model, cfg, role)
    if state is not None:
        model.load_state_dict(state)
    if device is not None:
        # not requires_grad_(False): it changes which CPU kernels the linear layers take, and so the last bits of
        # the logprobs; generation runs under no_grad anyway, and K=0 must draw what the trainer's process draws
        model.to(device).eval()
    return model
