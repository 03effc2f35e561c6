"""Chunked head (NeMo-RL fused linear logprobs): per-token logprobs computed chunk by chunk.

The autograd function saves only hidden states, weight and targets; backward recomputes each chunk's logits.
Only one [chunk, vocab] buffer exists at a time, in forward and in backward. Any loss sits on top, because the
function's output is just the per-token logprobs.
"""

import contextlib

import torch

from ..losses import masked_total
from .common import (
    accumulate_grads,
    chunked_logprobs_nograd,
    gathered,
    logit_grad_,
    ready_for_grad,
    softmax_stats_,
    tile_logits,
    tiles,
)


class ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, size):
        ctx.save_for_backward(hidden, weight, targets)
        ctx.temperature, ctx.size = temperature, size
        return chunked_logprobs_nograd(hidden, weight, targets, temperature, size)

    @staticmethod
    def backward(ctx, grad_lp):
        hidden, weight, targets = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        if need_w:
            ready_for_grad(weight)  # ZeRO-3: gathered until its gradient is accumulated
        with gathered(weight) if not need_w else contextlib.nullcontext():  # ZeRO-3: gathered for the recompute
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
            for sl in tiles(targets.shape[0], ctx.size):
                z = tile_logits(hidden[sl], weight, ctx.temperature)
                _, sums = softmax_stats_(z, targets[sl])
                dz = logit_grad_(z, sums, targets[sl], grad_lp[sl], ctx.temperature)
                accumulate_grads(dz, hidden[sl], weight, grad_h[sl] if need_h else None, grad_w)
                del z, dz
        return grad_h, (grad_w.to(weight.dtype) if need_w else None), None, None, None


def logprobs(hidden, weight, targets, temperature: float, size: int):
    with gathered(weight):
        if not torch.is_grad_enabled() or not (hidden.requires_grad or weight.requires_grad):
            return chunked_logprobs_nograd(hidden, weight, targets, temperature, size)
        return ChunkedLogprobs.apply(hidden, weight, targets, temperature, size)


def loss(hidden, weight, targets, mask, objective, num_tokens, temperature: float, size: int):
    loss_tokens, stats = objective(logprobs(hidden, weight, targets, temperature, size), slice(None))
    return masked_total(loss_tokens, mask, num_tokens), stats
