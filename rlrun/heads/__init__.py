"""Heads: hidden states + lm-head weight -> per-token logprobs, or the whole objective. Same contract each:

    logprobs(hidden [N, H], weight [V, H], targets [N], temperature, size) -> logprobs [N]
    loss(hidden, weight, targets, mask [N], objective, num_tokens, temperature, size) -> (loss, stats)

`objective(logprobs, sl) -> (per-token loss, per-token stats)` comes from `rlrun.losses.objective`; `sl` says
which tokens the logprobs belong to. `size` is the tile / chunk size in tokens (ignored by dense).
"""

from . import chunked, dense, tiled

HEADS = {"dense": dense, "tiled": tiled, "chunked": chunked}
