"""loss.agg: how the per-token losses of one optimizer step become its loss, over every micro-batch and rank.

Each mode is a weight per valid token, the step's loss being sum_t w_t * loss_t over all its valid tokens
(T: valid tokens of the step, S: its sequences with at least one valid token, L_s: valid tokens of sequence s,
all counted over every micro-batch and rank; L_max: loss.agg_max_tokens, null = rollout.max_new_tokens):

    token_mean                w = 1 / T            DAPO; verl token-mean; TRL loss_type=dapo
    seq_mean_token_mean       w = 1 / (S L_s)      GRPO (DeepSeekMath); verl seq-mean-token-mean; TRL grpo
    seq_mean_token_sum        w = 1 / S            verl seq-mean-token-sum
    seq_mean_token_sum_norm   w = 1 / (S L_max)    Dr. GRPO; TRL dr_grpo; verl seq-mean-token-sum-norm

token_mean keeps the heads' division by T (`num_tokens`), bit for bit as before this module; the others hand the
weights to the objective (rlrun.losses.objective multiplies each token's whole loss by its weight) and the heads
divide by 1. A micro-batch only holds some of the step's sequences, so S, L_s and T are counted here, in the recipe,
where the whole step is known (`counts` on each rank, `totals` over the ranks), and every head stays exact: the
weights travel with the tokens (padded micro-batches or packs), never recomputed from a tile.

`seq` gives each token its sequence's id within the step (rows numbered across the step's micro-batches): what a
sequence-level loss (gspo) needs to find a sequence's tokens in a forward.
"""

from __future__ import annotations

import dataclasses

import torch

MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")


def lengths(micro) -> torch.Tensor:
    """Valid tokens of each row of a padded micro-batch (its flat mask is [rows x response])."""
    return micro.mask.view(micro.input_ids.shape[0], -1).sum(1)


def counts(micros) -> tuple[int, int]:
    """(valid tokens, sequences with a valid token) of this rank's micro-batches of the step."""
    return (sum(int(m.mask.sum()) for m in micros), sum(int((lengths(m) > 0).sum()) for m in micros))


def totals(gathered: list[tuple[int, int]]) -> tuple[int, int]:
    """(T, S) of the step from every rank's `counts`, each at least 1 (a step of masked tokens has loss 0)."""
    return max(sum(c[0] for c in gathered), 1), max(sum(c[1] for c in gathered), 1)


def weights(micro, agg: str, num_seqs: int, max_tokens: int) -> torch.Tensor:
    """[N] the weight of each token of a padded micro-batch under `agg` (module docstring); 0 where masked."""
    n = lengths(micro).to(torch.float64)
    per_row = {"seq_mean_token_mean": 1.0 / (num_seqs * n.clamp(min=1)),
               "seq_mean_token_sum": torch.full_like(n, 1.0 / num_seqs),
               "seq_mean_token_sum_norm": torch.full_like(n, 1.0 / (num_seqs * max_tokens))}[agg]
    width = micro.mask.numel() // max(len(n), 1)
    return torch.where(micro.mask.bool(), per_row.repeat_interleave(width).float(), 0.0)


def sequence_ids(micros) -> list[torch.Tensor]:
    """Per micro-batch, [N] each token's row number in the step (rows counted across the micro-batches)."""
    out, first = [], 0
    for m in micros:
        rows = m.input_ids.shape[0]
        out.append((first + torch.arange(rows, device=m.mask.device)).repeat_interleave(m.mask.numel() // rows))
        first += rows
    return out


def prepare(micros, agg: str, max_tokens: int, gather, with_seq: bool):
    """(the step's micro-batches with `weights` and, `with_seq`, `seq` set (copies), the heads' divisor, T): one
    gather of this rank's counts over the ranks (`gather(obj) -> every rank's obj`)."""
    num_tokens, num_seqs = totals(gather(counts(micros)))
    if agg == "token_mean" and not with_seq:
        return list(micros), num_tokens, num_tokens
    seq = sequence_ids(micros) if with_seq else [None] * len(micros)
    if agg == "token_mean":
        return [dataclasses.replace(m, seq=s) for m, s in zip(micros, seq)], num_tokens, num_tokens
    out = [dataclasses.replace(m, weights=weights(m, agg, num_seqs, max_tokens), seq=s) for m, s in zip(micros, seq)]
    return out, 1, num_tokens
