"""Tile arithmetic shared by the tiled and chunked heads.

For one tile of tokens: z = (h @ W.T) / T in fp32, logprob = z[target] - logsumexp(z). The gradient of a loss
w.r.t. the tile's pre-temperature logits is g * (onehot(target) - softmax(z)) / T, where g = dloss/dlogprob.
Everything happens in place in the one [tile, vocab] fp32 buffer: `softmax_stats_` turns z into exp(z - max)
(logsumexp would allocate a second tile-sized temporary), and `logit_grad_` turns that into the gradient.

Entropy of the tempered distribution comes from the same buffer: with y = z - max, e = exp(y) and s = sum(e),
H = log s - sum(e y) / s, formed while exponentiating, a block of rows at a time (the extra temporaries are a
fraction of a tile). Its gradient w.r.t. z is -p (log p + H); `logit_grad_` adds it, times dloss/dH, when the
loss uses the entropy (loss.entropy_coef).
"""

from __future__ import annotations

import contextlib

import torch


def partitioned(weight: torch.Tensor) -> bool:
    """A ZeRO-3 parameter: its data is a shard (or empty) outside a gather."""
    return hasattr(weight, "ds_status")


def gathered(weight: torch.Tensor):
    """The full lm-head weight for the duration of a head call under ZeRO-3 (a collective: every rank calls it
    the same number of times). Nothing to do otherwise. The heads gather once per call, never per tile."""
    if not partitioned(weight):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters([weight], modifier_rank=None)


def ready_for_grad(weight: torch.Tensor) -> None:
    """Call in a head's backward before returning the lm-head weight's gradient. Under ZeRO-3 the parameter is a
    shard by then, and autograd accumulates a full-size gradient only into a full-size parameter: gather it now
    and partition it again right after the accumulation, once ZeRO's own post-accumulate hook (registered first,
    so run first) has taken the gradient for reduction. One gradient per head call reaches ZeRO: the tiles'
    gradients are summed in the head, so no per-tile reductions happen and ds_grad_is_ready is not needed."""
    if not partitioned(weight):
        return
    weight.all_gather()  # type: ignore[attr-defined]  # deepspeed adds it to a ZeRO-3 parameter at runtime

    def release(param):
        handle.remove()
        if not param.ds_active_sub_modules:  # tied embeddings: the embedding still uses it; ZeRO releases it then
            param.partition()

    handle = weight.register_post_accumulate_grad_hook(release)


class _FullCopy(torch.autograd.Function):
    """A full copy of a ZeRO-3 weight that the dense head's autograd graph can keep for backward (the parameter's
    own data is released after the gather); its gradient flows back to the parameter, where ZeRO reduces it."""

    @staticmethod
    def forward(ctx, weight):
        ctx.weight = weight
        return weight.detach().clone()

    @staticmethod
    def backward(ctx, grad):
        ready_for_grad(ctx.weight)
        return grad


def full_weight(weight: torch.Tensor) -> torch.Tensor:
    if not partitioned(weight):
        return weight
    with gathered(weight):
        return _FullCopy.apply(weight) if torch.is_grad_enabled() and weight.requires_grad else weight.detach().clone()


def fix_sequences(objective, logprobs: torch.Tensor) -> None:
    """A sequence-level objective (gspo) fixes each sequence's ratio from the detached logprobs of all N tokens,
    before any per-token call (rlrun.losses.objective); nothing for the others."""
    fix = getattr(objective, "fix", None)
    if fix is not None:
        fix(logprobs.detach())


def tiles(n: int, size: int):
    """Slices of at most `size` tokens covering range(n) (at least one, possibly empty, slice)."""
    size = max(int(size), 1)
    return [slice(i, min(i + size, n)) for i in range(0, n, size)] or [slice(0, 0)]


def fp32(weight: torch.Tensor) -> torch.Tensor:
    """The weight in fp32, once per head call: itself when it is fp32 (train.precision=bf16 on engine=single keeps
    fp32 master weights), else a [vocab, hidden] fp32 copy (bf16 weights: DeepSpeed's bf16 mode) that every tile
    reuses, counted by the plan. A float64 weight stays float64: `rlrun check`'s arbiter (check.probes.float64_step)
    runs the dense head in float64. The same for the heads' other operands (hidden states, gradients): their
    arithmetic in fp32, or in float64 on a float64 model."""
    return weight if weight.dtype in (torch.float32, torch.float64) else weight.float()


def wide_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype the heads accumulate in for inputs like `t`: float64 for float64, else fp32 (`fp32`)."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def no_autocast(t: torch.Tensor):
    """The heads choose their own dtypes: autocast, where a caller has it on, would round the logits to bf16."""
    return torch.autocast(t.device.type, enabled=False)


def logits(h: torch.Tensor, weight32: torch.Tensor) -> torch.Tensor:
    """h @ W.T in fp32 from the fp32 weight: bf16 hidden states are cast up first (exact), so the logits are never
    rounded to bf16 on the way (Liger #1432: a bf16 matmul then an fp32 cast gave 4-23% gradient error). fp32
    inputs: the plain fp32 matmul; float64 (check's arbiter) stays float64."""
    with no_autocast(h):
        return fp32(h) @ weight32.T


def tile_logits(h: torch.Tensor, weight32: torch.Tensor, temperature: float, targets: torch.Tensor | None = None,
                top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """[tile, vocab] fp32 logits divided by temperature (`weight32`: `fp32(weight)`; softmax math in fp32); with
    `top_p` < 1, MASKED outside each row's top-p set (`top_p_`), so that every softmax of the tile is the sampler's
    renormalised distribution."""
    z = logits(h, weight32)
    if temperature != 1.0:
        z.div_(temperature)
    return top_p_(z, targets, top_p, top_k)


def filters(top_p: float, top_k: int) -> bool:
    """Whether the sampler filters its distribution (rollout.top_p < 1 or rollout.top_k > 0): the heads then
    compute logprobs of the filtered, renormalised distribution, with one sort of ROWS rows at a time."""
    return top_p < 1.0 or top_k > 0


ROWS = 16  # rows per block of the entropy's temporaries (and of the top-p filter's sort)
FP32 = 4
# A logit outside the sampler's top-p set: exp() of it is 0, and 0 times it stays finite (the entropy's sums).
MASKED = -1e30


def top_p_drop(z: torch.Tensor, targets: torch.Tensor | None, top_p: float, top_k: int = 0) -> torch.Tensor:
    """[rows, vocab] True where a tempered logit of `z` lies outside its row's top-p set: the smallest run of the
    distribution, most likely first, whose mass reaches `top_p`, as the sampler filters (rollout/hf.top_p_filter,
    vLLM's processed logprobs; tests/unit/heads/test_heads.py checks they agree). The row's target stays in: the sampler
    drew it, and a rounding difference at the set's edge must not make its logprob -inf here. With `top_k` > 0 the
    set is first cut to the k most likely tokens, and top-p taken of them renormalised (the sampler's order)."""
    ordered, order = z.sort(-1, descending=True)
    cut = torch.zeros_like(ordered, dtype=torch.bool)
    if 0 < top_k < z.shape[-1]:
        cut[:, top_k:] = True
        ordered = ordered.masked_fill(cut, MASKED)
    if top_p < 1.0:
        probs = ordered.softmax(-1)
        cut |= probs.cumsum(-1) - probs >= top_p
    drop = torch.empty_like(order, dtype=torch.bool).scatter_(-1, order, cut)
    if targets is not None:
        drop.scatter_(-1, targets[:, None], False)
    return drop


def top_p_(z: torch.Tensor, targets: torch.Tensor | None, top_p: float, top_k: int = 0) -> torch.Tensor:
    """`z` (tempered logits) with MASKED outside each row's top-p set, in place, ROWS rows at a time (the sort's
    temporaries stay [ROWS, vocab]); unchanged at top_p=1. The heads' softmax, logprobs, entropy and gradients are
    then those of the renormalised distribution the sampler drew from: what the importance ratio compares."""
    if not filters(top_p, top_k):
        return z
    with torch.no_grad():
        for r in range(0, z.shape[0], ROWS):
            block = z[r : r + ROWS]
            block.masked_fill_(top_p_drop(block, None if targets is None else targets[r : r + ROWS], top_p, top_k),
                               MASKED)
    return z


def tile_memory(name: str, size: int, tokens: int, vocab: int, entropy_block: bool,
                top_p: float = 1.0, top_k: int = 0) -> dict[str, int]:
    """The working set of a head that holds one [tile, vocab] fp32 block at a time (tiled, chunked), plus the
    entropy's block buffer where the head fills it in the pass the plan counts, and top_p < 1's sort of ROWS rows
    (sorted logits and probabilities and their running sum, fp32; the order, int64; the mask, bool)."""
    row = vocab * FP32
    parts = {f"one {name} tile ({min(size, tokens)} tokens x vocab {vocab}, fp32)": min(size, tokens) * row}
    if entropy_block:
        parts["entropy block buffer (16 rows x vocab, fp32)"] = min(ROWS, tokens) * row
    if filters(top_p, top_k):
        parts["top-p filter of 16 rows (sort, order, mass, mask)"] = min(ROWS, tokens) * vocab * (3 * FP32 + 8 + 1)
    return parts


def softmax_stats_(z: torch.Tensor, targets: torch.Tensor, with_entropy: bool = False):
    """Logprobs of `targets` and row sums (and, `with_entropy`, each row's entropy); `z` becomes exp(z - rowmax) in
    place (fp32 throughout). The entropy needs sum(e * (z - rowmax)): formed while exponentiating, a block of rows
    at a time, so it costs a multiply-add per logit and no [tile, vocab] temporary."""
    picked = z.gather(-1, targets[:, None]).squeeze(-1)
    rowmax = z.amax(-1)
    z.sub_(rowmax[:, None])
    if with_entropy:  # one block buffer, reused: the allocator keeps no trail of block-sized temporaries
        e_y, e = torch.empty_like(rowmax), z.new_empty((min(ROWS, z.shape[0]), z.shape[1]))
        for r in range(0, z.shape[0], ROWS):
            y = z[r : r + ROWS]
            block = torch.exp(y, out=e[: y.shape[0]])
            e_y[r : r + ROWS] = (block[:, None, :] @ y[:, :, None]).view(-1)  # row dot products, no temporary
            y.copy_(block)
    else:
        z.exp_()
    sums = z.sum(-1)
    logprobs = picked - rowmax - sums.log()
    if not with_entropy:
        return logprobs, sums
    return logprobs, sums, sums.log() - e_y / sums


def entropy(e: torch.Tensor, sums: torch.Tensor) -> torch.Tensor:
    """Per-token entropy from `e` = exp(z - rowmax) and its row sums: log s - sum(e log e) / s (the backward of
    the entropy bonus, where z itself is gone)."""
    e_log_e = torch.empty_like(sums)
    for r in range(0, e.shape[0], ROWS):
        block = e[r : r + ROWS]
        e_log_e[r : r + ROWS] = torch.xlogy(block, block).sum(-1)
    return sums.log() - e_log_e / sums


def logit_grad_(e: torch.Tensor, sums: torch.Tensor, targets: torch.Tensor, g: torch.Tensor, temperature: float,
                g_ent: torch.Tensor | None = None, ent: torch.Tensor | None = None):
    """Turn `e` = exp(z - rowmax) in place into dloss/d(h @ W.T) = g * (onehot - softmax(z)) / T, plus, with
    `g_ent` = dloss/dH and `ent` = H, g_ent * dH/dz / T = -g_ent * p (log p + H) / T."""
    scale = fp32(g) / temperature
    if g_ent is None:
        e.mul_((-scale / sums)[:, None])
    else:  # -p * (g + g_ent (log p + H)) with log p = log e - log s: a per-row factor of e, and one of e log e
        if ent is None:
            raise ValueError("logit_grad_: the entropy's gradient (g_ent) needs the entropy (ent)")
        g_ent = fp32(g_ent) / temperature
        factor, factor_log = -(scale + g_ent * (ent - sums.log())) / sums, -g_ent / sums
        for r in range(0, e.shape[0], ROWS):
            block = e[r : r + ROWS]
            e_log_e = torch.xlogy(block, block).mul_(factor_log[r : r + ROWS, None])
            block.mul_(factor[r : r + ROWS, None]).add_(e_log_e)
    e.scatter_add_(-1, targets[:, None], scale[:, None])
    return e


def accumulate_grads(dz, h, weight32, grad_h_out, grad_w):
    """grad_h_out[:] = dz @ W ; grad_w += dz.T @ h, both in fp32 (`weight32`: `fp32(weight)`), rounded to the
    hidden states' dtype only when stored."""
    with no_autocast(dz):
        if grad_h_out is not None:
            grad_h_out.copy_(dz @ weight32)
        if grad_w is not None:
            grad_w.addmm_(dz.T, fp32(h))


def chunked_logprobs_nograd(hidden, weight, targets, temperature: float, size: int, with_entropy: bool = False,
                            top_p: float = 1.0, top_k: int = 0):
    """Per-token logprobs, tile by tile; with `with_entropy`, (logprobs, entropies); `top_p`: of the sampler's
    renormalised top-p distribution."""
    out = torch.empty(targets.shape, dtype=wide_dtype(hidden), device=hidden.device)
    ent = torch.empty_like(out) if with_entropy else None
    with torch.no_grad():
        weight32 = fp32(weight)
        for sl in tiles(targets.shape[0], size):
            z = tile_logits(hidden[sl], weight32, temperature, targets[sl], top_p, top_k)
            if ent is not None:  # with_entropy
                out[sl], _, ent[sl] = softmax_stats_(z, targets[sl], with_entropy=True)
            else:
                out[sl] = softmax_stats_(z, targets[sl])[0]
            del z  # else the last tile lives on while the next one is computed: two tiles at the peak
    return (out, ent) if with_entropy else out
