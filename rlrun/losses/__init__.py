"""Objectives as plain tensor functions.

Every GRPO objective is a per-token function (see dapo.py, cispo.py, gspo.py) wrapped by `objective`, which adds
the KL term and the truncated importance-sampling weight and returns per-token losses and stats. Heads call the
objective on slices of tokens (a tile, a chunk, or everything), so all heads compute the same numbers; `summarize`
turns the per-token stats into metrics. `dapo_loss` / `cispo_loss` / `gspo_loss` are the one-call library form;
their keyword defaults equal conf/loss/dapo.yaml, cispo.yaml and gspo.yaml (tests/unit/losses/test_losses.py checks it).

Aggregation (`loss.agg`, agg.py): token_mean divides the sum over the step's valid tokens by their count (the heads'
`num_tokens`); the per-sequence modes give each token a weight (`weights`: e.g. 1 / (S * L_s)), which the objective
multiplies into the token's whole loss, and the heads divide by 1. Weights are equal within a sequence.

Sequence-level losses (gspo): a token's term depends on its sequence's ratio, a mean over all the sequence's
tokens, which may lie in other tiles. `seq` (each token's sequence id) and `mask` (valid tokens) name the
sequences; the head calls `f.fix(logprobs)` with the detached logprobs of all N tokens first (dense and chunked
have them; tiled runs a no-grad sweep over its tiles), which fixes each sequence's ratio; then the per-token calls
are as for any loss. `f.fix` is None for per-token losses and without an old-policy pass (every ratio is 1).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import registry
from . import gspo
from .kl import ESTIMATORS, kl
from .protocol import TokenLoss


def objective(name: str, advantages: torch.Tensor, old_logprobs: torch.Tensor | None = None,
              ref_logprobs: torch.Tensor | None = None, gen_logprobs: torch.Tensor | None = None, *,
              clip_low: float | None = 0.2, clip_high: float = 0.28, kl_coef: float = 0.0, kl_estimator: str = "k3",
              tis_cap: float | None = None, entropy_coef: float = 0.0, tis_mode: str = "truncate",
              tis_low: float | None = None, is_weights: torch.Tensor | None = None,
              weights: torch.Tensor | None = None, seq: torch.Tensor | None = None, mask: torch.Tensor | None = None):
    """A per-token objective `f(logprobs, sl, entropy=None) -> (loss_tokens, stats)` over flat [tokens] inputs.

    `sl` selects the tokens `logprobs` belongs to. `old_logprobs=None` means the old-policy pass was skipped: the
    ratio is taken against `logprobs.detach()` (value 1, gradient intact). `tis_cap` turns on truncated importance
    sampling: the policy-gradient term is weighted by min(exp(old - gen), tis_cap), detached; `tis_mode="mask"` weights
    it by exp(old - gen) where that lies in [tis_low, tis_cap] and drops the token elsewhere (MIS / IcePop).
    `is_weights`: per-token weights computed beforehand (sequence level: `sequence_is_weights`), used as they are.
    `entropy`: the per-token entropy of the tempered distribution (the heads compute it), reported as the `entropy`
    stat and, with `entropy_coef`, rewarded: loss - entropy_coef * entropy. `f.entropy_coef` tells the heads whether
    the loss depends on the entropy (then they carry its gradient). `weights`, `seq`, `mask` and `f.fix`: loss.agg
    and the sequence-level losses (module docstring).
    """
    token_loss: TokenLoss = registry.get("loss", name)  # the per-token term of loss=name (dapo.py, cispo.py, gspo.py)
    sequence_level = getattr(token_loss, "sequence_level", False)
    fixed: dict[str, torch.Tensor] = {}
    fix: Callable[[torch.Tensor], None] | None = None
    if sequence_level and old_logprobs is not None:
        def fix_ratios(logprobs: torch.Tensor) -> None:
            fixed["log_ratio"] = sequence_mean(logprobs.detach() - old_logprobs, seq, mask)

        fix = fix_ratios

    def f(logprobs: torch.Tensor, sl=slice(None), entropy: torch.Tensor | None = None):
        old = logprobs.detach() if old_logprobs is None else old_logprobs[sl]
        extra = {}
        if sequence_level:  # each token's log s_i; 0 (ratio 1) without an old-policy pass
            if old_logprobs is not None and "log_ratio" not in fixed:
                raise RuntimeError(f"loss={name} is sequence-level: call objective.fix(logprobs of every token) "
                                   "before the per-token calls")
            extra["seq_log_ratio"] = 0.0 if old_logprobs is None else fixed["log_ratio"][sl]
        loss, stats = token_loss(logprobs, old, advantages[sl], clip_low=clip_low, clip_high=clip_high, **extra)
        stats["pg_loss"] = loss.detach()
        if old_logprobs is None and gen_logprobs is not None:  # no old pass: the gap from these (generator_gap)
            stats.update(generator_gap(gen_logprobs[sl], logprobs))
        weight = importance_weight(old, gen_logprobs, sl, is_weights, tis_cap, tis_mode, tis_low)
        if weight is not None:
            loss = loss * weight
            stats["is_weight"] = weight
            if tis_mode == "mask":
                stats["is_masked"] = (weight == 0).float()
        if ref_logprobs is not None:
            k = kl(logprobs, ref_logprobs[sl], kl_estimator)
            stats["kl"] = k.detach()
            if kl_coef:
                loss = loss + kl_coef * k
        if entropy is not None:
            stats["entropy"] = entropy.detach()
            if entropy_coef:
                loss = loss - entropy_coef * entropy
        if weights is not None:  # loss.agg other than token_mean: the heads then divide by 1
            loss = loss * weights[sl]
        return loss, stats

    return PerToken(f, entropy_coef, fix)


def generator_gap(gen_logprobs: torch.Tensor, logprobs: torch.Tensor) -> dict[str, torch.Tensor]:
    """|generator - trainer| logprob per token and its exp (NeMo-RL's token_mult_prob_error), as stats. Where the
    old-policy pass is left out, the train pass's logprobs are at the weights it would have run at (the logprob
    policies skip it only there), so the gap it logs comes from them (the recipe sums it with the pass's)."""
    gap = (gen_logprobs - logprobs.detach()).abs()
    return {"gen_gap": gap, "gen_gap_exp": gap.exp()}


class PerToken:
    """What `objective` returns: called as `f(logprobs, sl=slice(None), entropy=None) -> (loss_tokens, stats)`;
    `entropy_coef` (the loss depends on the entropy when non-zero) and `fix` (a sequence-level loss's ratios, or
    None) as `objective` says."""

    __slots__ = ("per_token", "entropy_coef", "fix")

    def __init__(self, per_token: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]], entropy_coef: float,
                 fix: Callable[[torch.Tensor], None] | None):
        self.per_token, self.entropy_coef, self.fix = per_token, entropy_coef, fix

    def __call__(self, logprobs: torch.Tensor, sl=slice(None),
                 entropy: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.per_token(logprobs, sl, entropy)


def importance_weight(old: torch.Tensor, gen_logprobs: torch.Tensor | None, sl, is_weights: torch.Tensor | None,
                      tis_cap: float | None, tis_mode: str, tis_low: float | None) -> torch.Tensor | None:
    """The tokens' (`sl`) importance weight in `objective`: `is_weights` as given, else TIS's from the old and the
    generator's logprobs when `tis_cap` is set (detached), else None."""
    if is_weights is not None:
        return is_weights[sl]
    if tis_cap is None:
        return None
    if gen_logprobs is None:
        raise ValueError("tis_cap: the importance weight needs the generator's logprobs (gen_logprobs)")
    return tis_weight(old - gen_logprobs[sl], tis_mode, tis_cap, tis_low).detach()


def tis_weight(log_ratio: torch.Tensor, mode: str, cap: float, low: float | None) -> torch.Tensor:
    """The importance weight of trainer over generator, exp(log_ratio): `truncate` caps it at `cap` (TIS);
    `mask` keeps it where it lies in [low, cap] and is 0 elsewhere (the token or sequence leaves the loss)."""
    ratio = torch.exp(log_ratio)
    if mode == "truncate":
        return torch.clamp(ratio, max=cap)
    if low is None:
        raise ValueError("tis mode=mask needs its lowest ratio kept (low)")
    return torch.where((ratio >= low) & (ratio <= cap), ratio, torch.zeros_like(ratio))


def sequence_is_weights(old: torch.Tensor, gen: torch.Tensor, mask: torch.Tensor, rows: int, mode: str, cap: float,
                        low: float | None) -> torch.Tensor:
    """loss.tis.level=sequence: each sequence's weight from the product of its tokens' ratios, exp(sum over its
    valid tokens of (old - gen)), truncated or masked as `tis_weight`, then given to each of its tokens. Inputs are
    a micro-batch's flat [rows x R] tensors; needs the old-policy logprobs before the loss (the old pass)."""
    log_ratio = torch.where(mask.bool(), old - gen, 0.0).view(rows, -1).sum(1, keepdim=True)
    weight = tis_weight(log_ratio, mode, cap, low)
    return weight.expand(rows, mask.numel() // rows).reshape(-1).detach()


def sequence_mean(values: torch.Tensor, seq: torch.Tensor | None, mask: torch.Tensor | None) -> torch.Tensor:
    """Each token's mean of `values` over the valid tokens (`mask`) of its sequence (ids in `seq`); 0 for a
    sequence without a valid token."""
    if seq is None or mask is None:
        raise ValueError("a sequence-level loss needs each token's sequence id (seq) and the valid tokens (mask)")
    valid = mask.bool()
    n = int(seq.max()) + 1 if seq.numel() else 0
    sums = values.new_zeros(n).index_add_(0, seq, torch.where(valid, values, 0.0))
    counts = values.new_zeros(n).index_add_(0, seq, valid.to(values.dtype))
    return (sums / counts.clamp(min=1))[seq]


# How each per-token stat becomes metrics: token-weighted mean, and for some also min / max.
MEAN = {"pg_loss": "pg_loss", "clipped": "clipfrac", "kl": "kl", "ratio": "ratio_mean", "is_weight": "is_weight_mean",
        "entropy": "entropy", "is_masked": "mismatch/masked_frac"}
RANGE = {"ratio": "ratio", "is_weight": "is_weight"}


def partials(stats: dict[str, torch.Tensor], mask: torch.Tensor) -> dict[str, tuple[float, int, float, float]]:
    """Per stat, (sum, count, min, max) over the tokens where `mask` is true, in float64: what micro-batches and
    ranks combine instead of exchanging per-token tensors."""
    valid = mask.bool()
    out = {}
    for key, values in stats.items():
        v = values[valid].double()
        if v.numel():
            out[key] = (v.sum().item(), v.numel(), v.min().item(), v.max().item())
    return out


def combine(parts: list[dict[str, tuple[float, int, float, float]]]) -> dict[str, float]:
    """Token-weighted means (and for some stats min / max) from the `partials` of several ranks."""
    out = {}
    for key in dict.fromkeys(k for p in parts for k in p):
        rows = [p[key] for p in parts if key in p]
        if key in MEAN:
            out[MEAN[key]] = sum(r[0] for r in rows) / sum(r[1] for r in rows)
        if key in RANGE:
            out[RANGE[key] + "_min"] = min(r[2] for r in rows)
            out[RANGE[key] + "_max"] = max(r[3] for r in rows)
    return out


def summarize(stats: dict[str, torch.Tensor], mask: torch.Tensor) -> dict[str, float]:
    """Token-weighted metrics of per-token `stats` over the tokens where `mask` is true."""
    return combine([partials(stats, mask)])


def masked_total(loss_tokens: torch.Tensor, mask: torch.Tensor, num_tokens: int | float) -> torch.Tensor:
    """Sum of per-token losses over valid tokens, divided by the global valid-token count of the optimizer step.

    Dividing by the global count inside each micro batch (not a per-micro-batch mean) makes gradient accumulation
    give exactly the token-level mean over the whole step (DAPO).
    """
    return torch.where(mask.bool(), loss_tokens, 0.0).sum() / num_tokens


def _loss(name, logprobs, old_logprobs, advantages, mask, num_tokens=None, **kwargs):
    f = objective(name, advantages, old_logprobs, kwargs.pop("ref_logprobs", None),
                  kwargs.pop("gen_logprobs", None), mask=mask, **kwargs)
    if f.fix is not None:
        f.fix(logprobs)
    loss_tokens, stats = f(logprobs)
    total = masked_total(loss_tokens, mask, num_tokens if num_tokens is not None else mask.sum().clamp(min=1))
    return total, {"loss": total.item(), **summarize(stats, mask)}


def dapo_loss(logprobs, old_logprobs, advantages, mask, num_tokens=None, **kwargs):
    """DAPO loss over flat tokens; returns (loss, metrics). kwargs: clip_low, clip_high, ref_logprobs, kl_coef,
    kl_estimator, gen_logprobs, tis_cap."""
    return _loss("dapo", logprobs, old_logprobs, advantages, mask, num_tokens, **kwargs)


def cispo_loss(logprobs, old_logprobs, advantages, mask, num_tokens=None, **kwargs):
    """CISPO loss over flat tokens; returns (loss, metrics). Same kwargs as `dapo_loss` (clip_low default None)."""
    kwargs.setdefault("clip_low", None)
    return _loss("cispo", logprobs, old_logprobs, advantages, mask, num_tokens, **kwargs)


def gspo_loss(logprobs, old_logprobs, advantages, mask, seq, num_tokens=None, **kwargs):
    """GSPO loss over flat tokens (`seq`: each token's sequence id); returns (loss, metrics). Same kwargs as
    `dapo_loss` (clip defaults GSPO's: clip_low 3e-4, clip_high 4e-4); `weights` for loss.agg (agg.py)."""
    kwargs.setdefault("clip_low", gspo.CLIP_LOW)
    kwargs.setdefault("clip_high", gspo.CLIP_HIGH)
    return _loss("gspo", logprobs, old_logprobs, advantages, mask, num_tokens, seq=seq, **kwargs)


__all__ = ["ESTIMATORS", "objective", "tis_weight", "sequence_is_weights", "sequence_mean", "partials", "combine",
           "summarize", "masked_total", "PerToken", "dapo_loss", "cispo_loss", "gspo_loss", "kl"]
