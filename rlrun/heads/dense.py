"""Dense head: full [tokens, vocab] logits, log_softmax, gather. The reference every other head must match."""

import torch

from ..losses import masked_total
from .common import ROWS, fix_sequences, fp32, full_weight, logits


def log_softmax(hidden, weight, temperature: float):
    """fp32 logits (common.logits: never rounded to bf16) and their log-softmax."""
    return torch.log_softmax(logits(hidden, fp32(full_weight(weight))) / temperature, dim=-1)


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


def logprobs(hidden, weight, targets, temperature: float = 1.0, size: int | None = None, with_entropy: bool = False):
    """Per-token logprobs; with `with_entropy`, (logprobs, entropies), the entropies without gradient."""
    logp = log_softmax(hidden, weight, temperature)
    lp = logp.gather(-1, targets[:, None]).squeeze(-1)
    return (lp, entropy(logp, grad=False)) if with_entropy else lp


def loss(hidden, weight, targets, mask, objective, num_tokens, temperature: float = 1.0, size: int | None = None):
    logp = log_softmax(hidden, weight, temperature)
    # through autograd only when the loss uses it (loss.entropy_coef): as a metric it adds nothing to backward
    ent = entropy(logp, grad=torch.is_grad_enabled() and bool(getattr(objective, "entropy_coef", 0.0)))
    lp = logp.gather(-1, targets[:, None]).squeeze(-1)
    fix_sequences(objective, lp)  # gspo: each sequence's ratio, from all its tokens
    loss_tokens, stats = objective(lp, slice(None), ent)
    return masked_total(loss_tokens, mask, num_tokens), stats
