"""DPO (Rafailov et al.): sigmoid loss on the policy-vs-reference log-ratio margin of a chosen/rejected pair.

logits = beta * ((pi_c - ref_c) - (pi_r - ref_r)); loss = -(1 - ls) * logsigmoid(logits) - ls * logsigmoid(-logits)
(label smoothing `ls`, the conservative DPO of Mitchell 2023), plus an optional SFT term `sft_coef` times the
chosen response's per-token negative log-likelihood. Inputs are per-sequence logprobs ([pairs]).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sequence_logprobs(token_logprobs, seq_index, num_seqs: int, lengths, average: bool = False):
    """Sum (or mean) of per-token logprobs per sequence; `seq_index[i]` is the sequence of token i."""
    out = torch.zeros(num_seqs, dtype=token_logprobs.dtype, device=token_logprobs.device)
    out = out.index_add(0, seq_index, token_logprobs)
    return out / lengths.clamp(min=1) if average else out


def dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, *, beta: float = 0.1,
             label_smoothing: float = 0.0, chosen_nll=None, sft_coef: float = 0.0, num_pairs=None):
    """(loss, metrics) summed over pairs and divided by `num_pairs` (default: the pairs given), so that
    micro-batches of one optimizer step add up to the mean over the step."""
    chosen_reward = beta * (policy_chosen - ref_chosen)
    rejected_reward = beta * (policy_rejected - ref_rejected)
    logits = chosen_reward - rejected_reward
    per_pair = -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
    if sft_coef:
        per_pair = per_pair + sft_coef * chosen_nll
    n = num_pairs if num_pairs is not None else policy_chosen.shape[0]
    loss = per_pair.sum() / n
    metrics = {
        "loss": loss.item(),
        "rewards/chosen": chosen_reward.mean().item(),
        "rewards/rejected": rejected_reward.mean().item(),
        "rewards/margin": logits.mean().item(),
        "rewards/accuracy": (logits > 0).float().mean().item(),
        "logps/chosen": policy_chosen.mean().item(),
        "logps/rejected": policy_rejected.mean().item(),
    }
    return loss, metrics
