"""The rollout contract: what the GRPO recipe uses of `rollout=hf` and `rollout=vllm`."""

from __future__ import annotations

from typing import Protocol

from . import Rollout as Batch  # the dataclass a generate call returns


class Sampler(Protocol):
    """A sampler (`rollout=hf|vllm`): completions for prompts, one sampling seed per prompt, as a
    `rlrun.rollout.Rollout` batch."""

    needs_sync: bool  # False: it samples from the trainer's `model` itself, nothing to copy

    def generate(self, model, prompts: list[str], seeds: list[int]) -> Batch: ...

    def sync(self, model) -> None:
        """Copy the current weights of `model` into the sampler."""


class RolloutModule(Protocol):
    """What `registry.get("rollout", name)` is: a module whose `build` returns a `Sampler`."""

    def build(self, cfg, model, tokenizer, device) -> Sampler: ...

    def reserved(self, cfg, device_gib: float) -> dict[str, int]:
        """What the sampler takes of a CUDA device of `device_gib` GiB besides the policy ({part: bytes}; the
        planner)."""
