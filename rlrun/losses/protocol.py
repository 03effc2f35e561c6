"""The contracts of a `loss` option, one per algorithm (rlrun/algorithms.py names which: `loss_protocol`): GRPO's
per-token term, which losses.objective wraps (a sequence-level one reads its sequence's ratio), and DPO's loss over
a batch of pairs' sequence logprobs."""

from __future__ import annotations

from typing import Protocol

import torch


class TokenLoss(Protocol):
    """loss=dapo|cispo|gspo: per-token losses [N] and per-token stats ({name: [N]}) of flat token tensors. Extra
    keywords are the objective's (a sequence-level loss's `seq_log_ratio`); a loss takes what it reads."""

    def __call__(self, logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, *,
                 clip_low: float | None, clip_high: float,
                 **extra) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...


class SequenceTokenLoss(Protocol):
    """loss=gspo: a TokenLoss whose token terms read their sequence's ratio, which losses.objective fixes first over
    every token of the sequence and passes as `seq_log_ratio` (each token's log s_i)."""

    sequence_level: bool

    def __call__(self, logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, *,
                 clip_low: float | None, clip_high: float, seq_log_ratio,
                 **extra) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...


class PairLoss(Protocol):
    """loss=dpo: (the loss summed over pairs and divided by `num_pairs`, its metrics) from the policy's and the
    reference's sequence logprobs of each pair's chosen and rejected completions."""

    def __call__(self, policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
                 ref_rejected: torch.Tensor, *, beta: float = 0.1, label_smoothing: float = 0.0, chosen_nll=None,
                 sft_coef: float = 0.0, num_pairs=None) -> tuple[torch.Tensor, dict]: ...
