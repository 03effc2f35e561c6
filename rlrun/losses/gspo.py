"""GSPO policy-gradient term (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071).

The importance ratio is the sequence's: s_i = exp(mean over its valid tokens of (logprob - old_logprob)), clipped
per sequence to [1 - clip_low, 1 + clip_high]. It is written in the paper's GSPO-token form, as verl's
`compute_policy_loss_gspo` does: s_i,t = sg[s_i] * p_t / sg[p_t], whose value is s_i at every token of the sequence
and whose gradient w.r.t. logprob_t is s_i. With one advantage per sequence and aggregation weights that are equal
within a sequence (every `loss.agg`), the loss and its gradient are GSPO's sequence-level ones exactly:
d/dlogprob_t [w_i |y_i| l(s_i)] = w_i l'(s_i) s_i, as in the token form (tests/unit/losses/test_objectives.py checks it
against autograd through s_i). A per-token TIS weight multiplies each token's term, as verl applies rollout IS weights.

`seq_log_ratio` is each token's log s_i (detached), fixed by `rlrun.losses.objective` before the per-token calls
(a sequence's tokens may lie in different tiles); that is the one thing this loss needs beyond DAPO's.
"""

from .dapo import token_loss as clipped_token_loss

CLIP_LOW, CLIP_HIGH = 3e-4, 4e-4  # GSPO's clipping range (section 5.1); conf/loss/gspo.yaml's defaults


class TokenLoss:
    """Per-token GSPO-token loss: DAPO's clipped term on the ratio exp(logprob - (sg[logprob] - log s_i)) = s_i.
    `old_logprobs` enters through `seq_log_ratio` only. A class for its flag: a function's attribute has no type."""

    sequence_level = True  # rlrun.losses.objective fixes seq_log_ratio before the per-token calls

    def __call__(self, logprobs, old_logprobs, advantages, *, clip_low: float, clip_high: float, seq_log_ratio, **_):
        return clipped_token_loss(logprobs, logprobs.detach() - seq_log_ratio, advantages, clip_low=clip_low,
                                  clip_high=clip_high)


token_loss = TokenLoss()  # the loss group's object for gspo (rlrun.registry)
