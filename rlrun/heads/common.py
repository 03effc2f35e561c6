"""Tile arithmetic shared by the tiled and chunked heads.

For one tile of tokens: z = (h @ W.T) / T in fp32, logprob = z[target] - logsumexp(z). The gradient of a loss
w.r.t. the tile's pre-temperature logits is g * (onehot(target) - softmax(z)) / T, where g = dloss/dlogprob;
`logit_grad_` computes it in place in the logits buffer, so a tile costs one [tile, vocab] fp32 buffer.
"""

from __future__ import annotations

import torch


def tiles(n: int, size: int):
    """Slices of at most `size` tokens covering range(n) (at least one, possibly empty, slice)."""
    size = max(int(size), 1)
    return [slice(i, min(i + size, n)) for i in range(0, n, size)] or [slice(0, 0)]


def tile_logits(h: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """[tile, vocab] fp32 logits divided by temperature (matmul in the weight dtype, softmax math in fp32)."""
    z = (h @ weight.T).float()
    if temperature != 1.0:
        z.div_(temperature)
    return z


def tile_logprobs(z: torch.Tensor, targets: torch.Tensor):
    """(logprobs of targets, logsumexp) of fp32 logits."""
    lse = torch.logsumexp(z, dim=-1)
    return z.gather(-1, targets[:, None]).squeeze(-1) - lse, lse


def logit_grad_(z: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor, g: torch.Tensor, temperature: float):
    """Turn logits `z` in place into dloss/d(h @ W.T) = g * (onehot - softmax(z)) / T."""
    scale = g.float() / temperature
    z.sub_(lse[:, None]).exp_().mul_(-scale[:, None])
    z.scatter_add_(-1, targets[:, None], scale[:, None])
    return z


def accumulate_grads(dz, h, weight, grad_h_out, grad_w):
    """grad_h_out[:] = dz @ W ; grad_w += dz.T @ h (fp32 accumulation for the weight)."""
    if grad_h_out is not None:
        grad_h_out.copy_(dz.to(weight.dtype) @ weight)
    if grad_w is not None:
        grad_w.addmm_(dz.T, h.float())


def chunked_logprobs_nograd(hidden, weight, targets, temperature: float, size: int) -> torch.Tensor:
    out = torch.empty(targets.shape, dtype=torch.float32, device=hidden.device)
    with torch.no_grad():
        for sl in tiles(targets.shape[0], size):
            out[sl] = tile_logprobs(tile_logits(hidden[sl], weight, temperature), targets[sl])[0]
    return out
