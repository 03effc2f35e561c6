"""Dense head: full [tokens, vocab] logits, log_softmax, gather. The reference every other head must match."""

import torch

from ..losses import masked_total
from .common import full_weight


def logprobs(hidden, weight, targets, temperature: float = 1.0, size: int | None = None):
    logits = (hidden @ full_weight(weight).T).float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).squeeze(-1)


def loss(hidden, weight, targets, mask, objective, num_tokens, temperature: float = 1.0, size: int | None = None):
    loss_tokens, stats = objective(logprobs(hidden, weight, targets, temperature), slice(None))
    return masked_total(loss_tokens, mask, num_tokens), stats
