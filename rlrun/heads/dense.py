"""Dense head: full [tokens, vocab] logits, log_softmax, gather. The reference every other head must match."""

import torch

from ..losses import masked_total
from .common import FP32, MASKED, ROWS, filters, fix_sequences, fp32, full_weight, logits, top_p_drop

EXACTNESS = "baseline"  # the head every other must match (rlrun.axes.EXACTNESS)
PHASES = ("old_logprobs", "ref_logprobs", "train")  # the passes that go through a head
TILED = False  # head.size means nothing to it
SWEEPS_SEQUENCE_LEVEL = False  # a sequence-level loss costs it no extra pass (it has every logprob at once)


def memory(size, tokens: int, vocab: int, *, grad: bool, trainable: bool, entropy_grad: bool = False,
           top_p: float = 1.0, top_k: int = 0) -> dict:
    """The [tokens, vocab] fp32 tensors the pass holds at its peak: logits and log-softmax (2), in backward their
    gradient too (3), and with an entropy gradient exp(logp) and its product (5); top_p < 1: the filtered copy of
    the logits and its [tokens, vocab] bool mask."""
    k = (3 + 2 * entropy_grad) if grad else 2
    k += filters(top_p, top_k)
    parts = {f"dense logits ({k} x {tokens} tokens x vocab {vocab}, fp32)": k * tokens * vocab * FP32}
    if filters(top_p, top_k):
        parts[f"top-p mask ({tokens} tokens x vocab, bool)"] = tokens * vocab
    return parts


def freed_before_weight_grad(tokens: int, vocab: int) -> int:
    """Bytes of logits the backward has freed when the next lm-head gradient is made (two of its three)."""
    return 2 * tokens * vocab * FP32


def log_softmax(hidden, weight, temperature: float, targets=None, top_p: float = 1.0, top_k: int = 0):
    """fp32 logits (common.logits: never rounded to bf16) and their log-softmax; with `top_p` < 1 over each row's
    top-p set (common.top_p_drop), the distribution the sampler drew from."""
    z = logits(hidden, fp32(full_weight(weight))) / temperature
    if filters(top_p, top_k):
        with torch.no_grad():
            drop = torch.cat([top_p_drop(z[r : r + ROWS], targets[r : r + ROWS], top_p, top_k)
                              for r in range(0, z.shape[0], ROWS)]) if z.shape[0] else z.bool()
        z = z.masked_fill(drop, MASKED)  # no gradient to a logit the sampler could not draw
    return torch.log_softmax(z, dim=-1)


def entropy(logp, grad: bool):
    """Per-token entropy from the log-softmax. Without gradient a block of rows at a time into one reused buffer,
    so that the metric adds no [tokens, vocab] temporary to dense's peak (and no trail of freed block-sized
    temporaries, which the allocator may keep: measured +1 full-logits copy of RSS at vocab 16k)."""
    if grad:
        return -(logp.exp() * logp).sum(-1)
    with torch.no_grad():
        out = logp.new_empty(logp.shape[0])
        p = logp.new_empty((min(ROWS, logp.shape[0]), logp.shape[-1]))
        for r in range(0, logp.shape[0], ROWS):
            block = logp[r : r + ROWS]
            e = torch.exp(block, out=p[: block.shape[0]])
            out[r : r + ROWS] = -(e[:, None, :] @ block[:, :, None]).view(-1)  # row dot products, no temporary
        return out


def logprobs(hidden, weight, targets, temperature: float = 1.0, size: int | None = None, with_entropy: bool = False,
             top_p: float = 1.0, top_k: int = 0):
    """Per-token logprobs; with `with_entropy`, (logprobs, entropies), the entropies without gradient."""
    logp = log_softmax(hidden, weight, temperature, targets, top_p, top_k)
    lp = logp.gather(-1, targets[:, None]).squeeze(-1)
    return (lp, entropy(logp, grad=False)) if with_entropy else lp


def loss(hidden, weight, targets, mask, objective, num_tokens, temperature: float = 1.0, size: int | None = None,
         top_p: float = 1.0, top_k: int = 0):
    logp = log_softmax(hidden, weight, temperature, targets, top_p, top_k)
    # through autograd only when the loss uses it (loss.entropy_coef): as a metric it adds nothing to backward
    ent = entropy(logp, grad=torch.is_grad_enabled() and bool(getattr(objective, "entropy_coef", 0.0)))
    lp = logp.gather(-1, targets[:, None]).squeeze(-1)
    fix_sequences(objective, lp)  # gspo: each sequence's ratio, from all its tokens
    loss_tokens, stats = objective(lp, slice(None), ent)
    return masked_total(loss_tokens, mask, num_tokens), stats
