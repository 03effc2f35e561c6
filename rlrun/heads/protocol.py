"""The head contract (see rlrun/heads/__init__.py): a head is a module of these functions and facts."""

from __future__ import annotations

from typing import Protocol


class Head(Protocol):
    EXACTNESS: str  # rlrun.axes.EXACTNESS: dense is the baseline
    PHASES: tuple[str, ...]  # the passes that go through a head
    TILED: bool  # whether head.size (a tile / chunk of tokens) means anything to it
    SWEEPS_SEQUENCE_LEVEL: bool  # a sequence-level loss (gspo) costs it a first no-grad sweep

    def logprobs(self, hidden, weight, targets, temperature: float, size: int | None, with_entropy: bool = False,
                 top_p: float = 1.0, top_k: int = 0):
        """Per-token logprobs [N] of `targets` at `temperature` (and `top_p` < 1 or `top_k` > 0: of each row's
        filtered set, renormalised, as the sampler drew: heads/common.top_p_drop); with_entropy: (logprobs,
        entropies), no gradient through the entropies."""

    def loss(self, hidden, weight, targets, mask, objective, num_tokens, temperature: float, size: int | None,
             top_p: float = 1.0, top_k: int = 0):
        """(loss, per-token stats): `objective` summed over the tokens of `mask`, divided by `num_tokens`."""

    def memory(self, size, tokens: int, vocab: int, *, grad: bool, trainable: bool, entropy_grad: bool = False,
               top_p: float = 1.0, top_k: int = 0) -> dict:
        """The memory term: {part: bytes} of what the head holds at its peak for `tokens` response tokens at
        `vocab` (a pass with a gradient or not; `trainable`: the lm head trains) (rlrun/plan/terms.head_parts)."""

    def freed_before_weight_grad(self, tokens: int, vocab: int) -> int:
        """Bytes the backward has freed when the next micro-batch's lm-head gradient is made."""
