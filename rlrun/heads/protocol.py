"""The head contract (see rlrun/heads/__init__.py): a head is a module of these two functions."""

from __future__ import annotations

from typing import Protocol


class Head(Protocol):
    def logprobs(self, hidden, weight, targets, temperature: float, size: int | None, with_entropy: bool = False):
        """Per-token logprobs [N] of `targets` at `temperature`; with_entropy: (logprobs, entropies), no gradient
        through the entropies."""

    def loss(self, hidden, weight, targets, mask, objective, num_tokens, temperature: float, size: int | None):
        """(loss, per-token stats): `objective` summed over the tokens of `mask`, divided by `num_tokens`."""
