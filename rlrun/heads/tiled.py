"""Tiled head (DeepSpeed TiledFusedLogitsLoss pattern, as open-instruct's tiled GRPO loss uses it).

The whole objective is computed tile by tile inside one autograd function. For each tile, forward computes the
logits, the tile's share of the loss (already divided by the GLOBAL valid-token count, so the lm-head gradient
is right without rescaling), and its gradients at once: dloss/dlogprob through the small per-token objective
graph, then the hand-written softmax backward into the hidden-state gradient buffer and the fp32 weight-gradient
accumulator. backward only scales what forward stored. FLOPs equal dense; one tile's logits exist at a time.

A sequence-level loss (loss=gspo with an old-policy pass) needs each sequence's ratio before any token's gradient,
and a sequence's tokens may lie in several tiles: a first no-grad sweep computes every token's logprob (one more
[tile, vocab] matmul and softmax per tile, no more memory than a tile; docs/objectives.md has its measured cost),
the objective fixes the per-sequence coefficients from it, then the fused pass runs as for any loss.
"""

import torch

from ..losses import masked_total
from .chunked import logprobs as _chunked_logprobs
from .common import (
    accumulate_grads,
    chunked_logprobs_nograd,
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


class TiledLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, mask, num_tokens, objective, temperature, size, stats_out, top_p=1.0,
                top_k=0):
        need_h, need_w = hidden.requires_grad, weight.requires_grad
        need_ent = bool(getattr(objective, "entropy_coef", 0.0))  # the loss uses the entropy: its gradient too
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=wide_dtype(weight), device=weight.device) if need_w else None
        total = torch.zeros((), dtype=wide_dtype(hidden), device=hidden.device)
        parts: dict[str, list] = {}
        weight32 = fp32(weight)
        for sl in tiles(targets.shape[0], size):
            z = tile_logits(hidden[sl], weight32, temperature, targets[sl], top_p, top_k)
            lp, sums, ent = softmax_stats_(z, targets[sl], with_entropy=True)
            with torch.enable_grad():
                leaf, ent_leaf = lp.detach().requires_grad_(True), ent.detach().requires_grad_(need_ent)
                loss_tokens, stats = objective(leaf, sl, ent_leaf)
                part = masked_total(loss_tokens, mask[sl], num_tokens)
                grads = torch.autograd.grad(part, [leaf, ent_leaf] if need_ent else [leaf])
                g, g_ent = grads[0], (grads[1] if need_ent else None)
            total += part.detach()
            for k, v in stats.items():
                parts.setdefault(k, []).append(v.detach())
            dz = logit_grad_(z, sums, targets[sl], g, temperature, g_ent, ent)
            accumulate_grads(dz, hidden[sl], weight32, None if grad_h is None else grad_h[sl], grad_w)
            del z, dz
        del weight32
        stats_out.update({k: torch.cat(v) for k, v in parts.items()})
        ctx.save_for_backward(grad_h, None if grad_w is None else grad_w.to(weight.dtype))
        ctx.weight = weight
        return total

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        if grad_w is not None:
            ready_for_grad(ctx.weight)
        if grad_out.item() != 1.0:  # scale in place: a copy would add a second weight-sized gradient
            for g in (grad_h, grad_w):
                if g is not None:
                    g.mul_(grad_out.to(g.dtype))
        return grad_h, grad_w, None, None, None, None, None, None, None, None, None


EXACTNESS = "fp_tolerance"  # dense's loss and gradients up to summation order (fp32: 1e-5)
PHASES = ("old_logprobs", "ref_logprobs", "train")
TILED = True  # one [head.size, vocab] tile at a time
SWEEPS_SEQUENCE_LEVEL = True  # a sequence-level loss (gspo) adds a no-grad sweep over the tiles first


def memory(size, tokens: int, vocab: int, *, grad: bool, trainable: bool, entropy_grad: bool = False,
           top_p: float = 1.0, top_k: int = 0) -> dict:
    """One tile; in a pass with a gradient also the entropy's block buffer (filled while taking each tile's
    gradient)."""
    return tile_memory("tiled", size, tokens, vocab, entropy_block=grad, top_p=top_p, top_k=top_k)


def freed_before_weight_grad(tokens: int, vocab: int) -> int:
    return 0


def logprobs(hidden, weight, targets, temperature: float, size: int, with_entropy: bool = False, top_p: float = 1.0,
             top_k: int = 0):
    # Logprob-only passes (old policy, reference) need no fused loss: the chunked function computes them tile by
    # tile too, so no path of a tiled run builds the full logits.
    return _chunked_logprobs(hidden, weight, targets, temperature, size, with_entropy, top_p, top_k)


def loss(hidden, weight, targets, mask, objective, num_tokens, temperature: float, size: int, top_p: float = 1.0,
         top_k: int = 0):
    stats: dict = {}
    with gathered(weight):  # backward needs no weight: every gradient is computed here, handed to ZeRO once
        if getattr(objective, "fix", None) is not None:
            # gspo: a token's gradient needs its sequence's ratio, a mean over tokens that may lie in later tiles;
            # a first no-grad sweep over the tiles gives every logprob (one more logits matmul per tile)
            fix_sequences(objective, chunked_logprobs_nograd(hidden.detach(), weight.detach(), targets, temperature,
                                                             size, top_p=top_p, top_k=top_k))
        total = TiledLoss.apply(hidden, weight, targets, mask, num_tokens, objective, temperature, size, stats, top_p,
                                top_k)
    return total, stats
