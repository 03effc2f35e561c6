"""DAPO policy-gradient term: PPO clipping with asymmetric bounds [1 - clip_low, 1 + clip_high] (clip-higher)."""

import torch


def token_loss(logprobs, old_logprobs, advantages, *, clip_low: float, clip_high: float, **_):
    """Per-token policy-gradient loss and stats; `clipped` marks tokens where the clipped term wins."""
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    return loss, {"ratio": ratio.detach(), "clipped": (clipped > unclipped).float()}
