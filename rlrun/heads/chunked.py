"""Chunked head (NeMo-RL fused linear logprobs): per-token logprobs computed chunk by chunk.

The autograd function saves only hidden states, weight and targets; backward recomputes each chunk's logits.
Only one [chunk, vocab] buffer exists at a time, in forward and in backward. Any loss sits on top, because the
function's outputs are just the per-token logprobs and (for the loss) entropies.
"""

import contextlib

import torch

from ..losses import masked_total
from .common import (
    accumulate_grads,
    chunked_logprobs_nograd,
    entropy,
    fix_sequences,
    fp32,
    gathered,
    logit_grad_,
    ready_for_grad,
    softmax_stats_,
    tile_logits,
    tile_memory,
    tiles,
    wide_dtype,
)


class ChunkedLogprobs(torch.autograd.Function):
    """(logprobs, entropies) with `with_entropy`, else (logprobs, an empty tensor)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, size, with_entropy=False, top_p=1.0, top_k=0):
        ctx.save_for_backward(hidden, weight, targets)
        ctx.temperature, ctx.size, ctx.top_p, ctx.top_k = temperature, size, top_p, top_k
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no entropy term to recompute
        if with_entropy:
            return chunked_logprobs_nograd(hidden, weight, targets, temperature, size, with_entropy=True, top_p=top_p,
                                           top_k=top_k)
        return (chunked_logprobs_nograd(hidden, weight, targets, temperature, size, top_p=top_p, top_k=top_k),
                hidden.new_empty(0))

    @staticmethod
    def backward(ctx, grad_lp, grad_ent):
        hidden, weight, targets = ctx.saved_tensors
        if grad_lp is None:
            grad_lp = torch.zeros(targets.shape, dtype=wide_dtype(hidden), device=hidden.device)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        if need_w:
            ready_for_grad(weight)  # ZeRO-3: gathered until its gradient is accumulated
        with gathered(weight) if not need_w else contextlib.nullcontext():  # ZeRO-3: gathered for the recompute
            grad_w = torch.zeros(weight.shape, dtype=wide_dtype(weight), device=weight.device) if need_w else None
            weight32 = fp32(weight)
            for sl in tiles(targets.shape[0], ctx.size):
                z = tile_logits(hidden[sl], weight32, ctx.temperature, targets[sl], ctx.top_p, ctx.top_k)
                _, sums = softmax_stats_(z, targets[sl])
                g_ent, ent = (None, None) if grad_ent is None else (grad_ent[sl], entropy(z, sums))
                dz = logit_grad_(z, sums, targets[sl], grad_lp[sl], ctx.temperature, g_ent, ent)
                accumulate_grads(dz, hidden[sl], weight32, None if grad_h is None else grad_h[sl], grad_w)
                del z, dz
        return grad_h, (None if grad_w is None else grad_w.to(weight.dtype)), None, None, None, None, None, None

EXACTNESS = "fp_tolerance"  # dense's loss and gradients up to summation order (fp32: 1e-5)
PHASES = ("old_logprobs", "ref_logprobs", "train")
TILED = True  # one [head.size, vocab] tile at a time
SWEEPS_SEQUENCE_LEVEL = False  # its forward has every logprob before the loss


def memory(size, tokens: int, vocab: int, *, grad: bool, trainable: bool, entropy_grad: bool = False,
           top_p: float = 1.0, top_k: int = 0) -> dict:
    """One chunk; the entropy's block buffer in its forward, unless the backward holds the [vocab, hidden] lm-head
    gradient instead (larger) when the lm head trains."""
    return tile_memory("chunked", size, tokens, vocab, entropy_block=grad and not trainable, top_p=top_p,
                       top_k=top_k)


def freed_before_weight_grad(tokens: int, vocab: int) -> int:
    return 0


def _logprobs(hidden, weight, targets, temperature: float, size: int, with_entropy: bool, top_p: float = 1.0,
              top_k: int = 0):
    """(logprobs, entropies or an empty tensor), through the autograd function when a gradient is wanted."""
    with gathered(weight):
        if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
            return ChunkedLogprobs.apply(hidden, weight, targets, temperature, size, with_entropy, top_p, top_k)
        if with_entropy:
            return chunked_logprobs_nograd(hidden, weight, targets, temperature, size, with_entropy=True, top_p=top_p,
                                           top_k=top_k)
        return (chunked_logprobs_nograd(hidden, weight, targets, temperature, size, top_p=top_p, top_k=top_k),
                hidden.new_empty(0))


def logprobs(hidden, weight, targets, temperature: float, size: int, with_entropy: bool = False, top_p: float = 1.0,
             top_k: int = 0):
    """Per-token logprobs; with `with_entropy`, (logprobs, entropies), the entropies without gradient."""
    lp, ent = _logprobs(hidden, weight, targets, temperature, size, with_entropy, top_p, top_k)
    return (lp, ent.detach()) if with_entropy else lp


def loss(hidden, weight, targets, mask, objective, num_tokens, temperature: float, size: int, top_p: float = 1.0,
         top_k: int = 0):
    lp, ent = _logprobs(hidden, weight, targets, temperature, size, with_entropy=True, top_p=top_p, top_k=top_k)
    if not getattr(objective, "entropy_coef", 0.0):
        ent = ent.detach()  # a metric only: backward skips the entropy term
    fix_sequences(objective, lp)  # gspo: each sequence's ratio, from all its tokens
    loss_tokens, stats = objective(lp, slice(None), ent)
    return masked_total(loss_tokens, mask, num_tokens), stats
