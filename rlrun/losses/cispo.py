"""CISPO policy-gradient term (MiniMax-M1): a stop-gradient, clipped importance weight times the logprob.

Peers differ on the clip: rlrun caps the weight at `1 + clip_high` (relative cap, as MiniMax-M1 and TRL) and
applies a lower bound `1 - clip_low` only when `clip_low` is set (default null: no lower bound, as MiniMax-M1).
"""

import torch


def token_loss(logprobs, old_logprobs, advantages, *, clip_high: float, clip_low: float | None = None, **_):
    """Per-token loss -A * sg(clip(ratio)) * logprob; `clipped` marks tokens whose ratio is outside the bounds."""
    ratio = torch.exp(logprobs - old_logprobs)
    low = None if clip_low is None else 1.0 - clip_low
    weight = torch.clamp(ratio, min=low, max=1.0 + clip_high).detach()
    loss = -advantages * weight * logprobs
    outside = ratio > 1.0 + clip_high
    if low is not None:
        outside = outside | (ratio < low)
    return loss, {"ratio": ratio.detach(), "clipped": outside.float()}
