"""Optimizer-state offload around the logprob passes (seed 002: make it optional and time it).

`offload=on` moves every optimizer-state tensor to host memory before the old/reference logprob passes and back
before training; `off` leaves it where it is. Moves are plain `.to()` copies, so state round-trips bit for bit.
On a CPU-only run the state is already in host memory and nothing moves; the loop says so once.
"""

from __future__ import annotations

from typing import Protocol

import torch


def move_state(optimizer: torch.optim.Optimizer, device: torch.device | str) -> int:
    """Move the tensors of the optimizer state to `device`; return the bytes that changed device. Scalars (AdamW's
    `step`) stay where the optimizer keeps them: torch keeps `step` on the host unless capturable/fused, and one
    brought onto a GPU would make every optimizer step wait for the device to read it back (a sync per tensor)."""
    device = torch.device(device)
    moved = 0
    for state in optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() > 0 and value.device != device:
                moved += value.numel() * value.element_size()
                state[key] = value.to(device, non_blocking=device.type == "cpu")
    if device.type == "cpu" and torch.cuda.is_available():
        torch.cuda.synchronize()
    return moved


def effective(enabled: bool, device: torch.device | str) -> bool:
    """Whether offload moves anything: only when the state lives on an accelerator (a device or its type)."""
    return bool(enabled) and getattr(device, "type", device) != "cpu"


def to_host(optimizer, enabled: bool, device: torch.device) -> int:
    return move_state(optimizer, "cpu") if effective(enabled, device) else 0


def to_device(optimizer, enabled: bool, device: torch.device) -> int:
    return move_state(optimizer, device) if effective(enabled, device) else 0


class Offload(Protocol):
    """The contract of an `offload` option: built as `Option(cfg.offload)`; the engines move the state."""

    exactness: str
    phases: tuple[str, ...]
    enabled: bool

    def frees_state(self, device_type: str) -> bool: ...


class Off:
    """offload=off (the baseline): optimizer state stays where the optimizer keeps it."""

    exactness = "baseline"
    phases = ("offload", "onload", "old_logprobs", "ref_logprobs")  # the prep phases and the passes between them

    ENABLED = False  # `enabled` of an object built without a config (benchmarks, tests: axes.of)

    def __init__(self, cfg=None):
        self.enabled = bool(getattr(cfg, "enabled", self.ENABLED))

    def frees_state(self, device_type: str) -> bool:
        """Whether the logprob passes run without the optimizer state on a `device_type` device (the planner)."""
        return effective(self.enabled, device_type)


class On(Off):
    """offload=on: optimizer state to host memory for the logprob passes and back before training; plain copies,
    so it comes back bit for bit. Nothing moves on a CPU run."""

    exactness = "bitwise"
    ENABLED = True


def option(cfg) -> Off:
    """The object of `offload=cfg.name` (through the registry)."""
    from . import registry

    return registry.get("offload", cfg.name)(cfg)
