"""The run's GRPO objective, bound once (setup) to the loss config: what the GRPO recipe calls per step and per
forward, with what is true of it said here once.

- `sequence_level`: the loss's own flag (a token's term depends on its sequence's ratio: gspo.py), so a step needs
  each token's sequence id and a head sweeps or fixes the ratios first;
- `old_before_loss`: the importance correction is sequence-level (loss.tis.level=sequence), so the old-policy
  logprobs are needed before the loss, in every rollout (the logprob policies read it);
- `prepare(micros, gather)`: loss.agg's weights over the step (agg.py), the heads' divisor and the token count;
- `per_token(tensors, mask)`: the per-token objective of one forward (rlrun.losses.objective);
- `is_weights(micro)`: a micro-batch's sequence-level importance weights, or None;
- `skip_zero_advantage`: whether the recipe drops the rows whose advantage is 0 (train.skip_zero_advantage, and
  exact: no term of the objective has a gradient there); `kept_reason`: why they stay in, when they do.
"""

from __future__ import annotations

import torch

from .. import registry
from . import agg, objective, sequence_is_weights


def sequence_level(name: str) -> bool:
    """Whether loss=`name` is sequence-level (its token term's `sequence_level` flag)."""
    return bool(getattr(registry.get("loss", name), "sequence_level", False))


def old_before_loss(lcfg) -> bool:
    """Whether the importance correction is sequence-level (loss.tis.level=sequence): the old-policy logprobs are
    needed before the loss. loss.tis.level is read here and in `Objective`, nowhere else."""
    tis = getattr(lcfg, "tis", None)
    return bool(tis is not None and tis.enabled and tis.level == "sequence")


def inert_reason(lcfg) -> str | None:
    """None where a token of advantage 0 adds nothing to the loss or its gradient; else the term that does."""
    if lcfg.kl_coef:
        return f"loss.kl_coef={lcfg.kl_coef}: the KL term has a gradient at advantage 0"
    if lcfg.entropy_coef:
        return f"loss.entropy_coef={lcfg.entropy_coef}: the entropy bonus has a gradient at advantage 0"
    return None


class Objective:
    def __init__(self, lcfg, max_new_tokens: int, skip_zero_advantage: bool = False):
        tis = lcfg.tis
        self.name, self.agg = lcfg.name, lcfg.agg
        self.agg_max_tokens = lcfg.agg_max_tokens or max_new_tokens  # loss.agg's L_max
        self.sequence_level = sequence_level(lcfg.name)
        self.token_correction = tis.enabled and tis.level == "token"
        self.old_before_loss = old_before_loss(lcfg)
        self.tis = tis
        self.kept_reason = inert_reason(lcfg) if skip_zero_advantage else "train.skip_zero_advantage=false"
        self.skip_zero_advantage = self.kept_reason is None
        self.kwargs = dict(clip_low=lcfg.clip_low, clip_high=lcfg.clip_high, kl_coef=lcfg.kl_coef,
                           kl_estimator=lcfg.kl_estimator, entropy_coef=lcfg.entropy_coef,
                           tis_cap=tis.cap if self.token_correction else None, tis_mode=tis.mode, tis_low=tis.low)

    def prepare(self, micros, gather):
        """(the step's micro-batches with loss.agg's weights and, sequence-level, each token's sequence id; the
        heads' divisor; the step's valid tokens T) over every rank (`gather`)."""
        return agg.prepare(micros, self.agg, self.agg_max_tokens, gather, self.sequence_level)

    def per_token(self, t: dict, mask: torch.Tensor):
        """The objective of one forward from its per-token tensors `t` (advantages, old / ref / gen logprobs,
        importance weights, loss.agg weights, sequence ids)."""
        return objective(self.name, t["advantages"], t["old_logprobs"], t["ref_logprobs"], t["gen_logprobs"],
                         is_weights=t["is_weights"], weights=t["weights"], seq=t["seq"], mask=mask, **self.kwargs)

    def is_weights(self, mb) -> torch.Tensor | None:
        """loss.tis.level=sequence: the micro-batch's per-sequence importance weights (needs its old pass)."""
        if not self.old_before_loss:
            return None
        return sequence_is_weights(mb.old_logprobs, mb.gen_logprobs, mb.mask, mb.input_ids.shape[0], self.tis.mode,
                                   self.tis.cap, self.tis.low)
