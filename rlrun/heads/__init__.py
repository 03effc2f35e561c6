"""Heads: hidden states + lm-head weight -> per-token logprobs, or the whole objective. Same contract each
(`Head` in protocol.py), found with `registry.get("head", name)`; setup binds the run's head to its tile size and
temperature once (`Bound`), and the recipes call that:

    logprobs(hidden [N, H], weight [V, H], targets [N], temperature, size) -> logprobs [N]
    logprobs(..., with_entropy=True) -> (logprobs [N], entropies [N]: the entropy as a metric, no gradient)
    loss(hidden, weight, targets, mask [N], objective, num_tokens, temperature, size) -> (loss, stats)

`objective(logprobs, sl, entropy) -> (per-token loss, per-token stats)` comes from `rlrun.losses.objective`; `sl`
says which tokens the logprobs belong to; `entropy` is each token's entropy of the tempered distribution, with
its gradient when `objective.entropy_coef` is non-zero. A sequence-level objective (loss=gspo) has `objective.fix`,
which a head calls with the detached logprobs of all N tokens before any per-token call (common.fix_sequences);
`num_tokens` is 1 when the objective carries loss.agg's per-token weights. `size` is the tile / chunk size in
tokens (ignored by dense).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Bound:
    """The run's head, bound once (setup) to its tile / chunk size (head.size=auto resolved) and the temperature
    of the run's logprobs: what the recipes call, never naming the head."""

    impl: Any  # the head module (protocol.Head)
    size: int | None
    temperature: float = 1.0
    top_p: float = 1.0  # < 1: logprobs of the sampler's renormalised top-p distribution (GRPO: rollout.top_p)
    top_k: int = 0  # > 0: of its k most likely tokens, before top_p (GRPO: rollout.top_k)

    @property
    def name(self) -> str:
        return self.impl.__name__.rsplit(".", 1)[-1]

    def logprobs(self, hidden, weight, targets, with_entropy: bool = False):
        return self.impl.logprobs(hidden, weight, targets, self.temperature, self.size, with_entropy=with_entropy,
                                  top_p=self.top_p, top_k=self.top_k)

    def loss(self, hidden, weight, targets, mask, objective, num_tokens):
        return self.impl.loss(hidden, weight, targets, mask, objective, num_tokens, self.temperature, self.size,
                              top_p=self.top_p, top_k=self.top_k)
