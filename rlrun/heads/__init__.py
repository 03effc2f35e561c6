"""Heads: hidden states + lm-head weight -> per-token logprobs, or the whole objective. Same contract each
(`Head` in protocol.py); the recipes find them with `registry.get("head", name)`:

    logprobs(hidden [N, H], weight [V, H], targets [N], temperature, size) -> logprobs [N]
    logprobs(..., with_entropy=True) -> (logprobs [N], entropies [N]: the entropy as a metric, no gradient)
    loss(hidden, weight, targets, mask [N], objective, num_tokens, temperature, size) -> (loss, stats)

`objective(logprobs, sl, entropy) -> (per-token loss, per-token stats)` comes from `rlrun.losses.objective`; `sl`
says which tokens the logprobs belong to; `entropy` is each token's entropy of the tempered distribution, with
its gradient when `objective.entropy_coef` is non-zero. A sequence-level objective (loss=gspo) has `objective.fix`,
which a head calls with the detached logprobs of all N tokens before any per-token call (common.fix_sequences);
`num_tokens` is 1 when the objective carries loss.agg's per-token weights. `size` is the tile / chunk size in
tokens (ignored by dense).
"""
