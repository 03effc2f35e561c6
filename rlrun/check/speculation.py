"""`rlrun check`'s speculation probe: the configuration's decode with its rollout.speculate option against the same
decode without it, on the check's probe prompts and seeds (rollout/speculate.py).

Speculation promises plain decoding's tokens, not merely its distribution: each verified position chooses with plain
decoding's own noise, so a row may differ only where a (k + 1)-position forward rounded a near tie the other way. The
probe compares every row's tokens; at the first position where a row differs it takes plain decoding's perturbed
scores of the two tokens (the trainer's forward of plain decoding's text, the row's own noise at that step) and
calls the difference a rounding flip only where they are within FLIP_TOL. It also compares the sampler's logprobs of
the rows that agree, and reports the acceptance (drafted tokens accepted) and tokens a row accepted per verify pass.
`history` is run twice (the second rollout drafts from the first, as a run's second epoch does); both are compared.

"""

from __future__ import annotations

import torch

from .. import models, registry
from ..rollout import hf
from .probes import GEN_TOL, logprob_tol
from .rows import Row

NAME = "speculation"
SOURCE = "vllm-project/vllm#34497 (speculative decoding returned other logprobs than plain decoding)"
FLIP_TOL = 1e-4  # plain decoding's two perturbed scores closer than this: a rounding flip, not a bug


def speculation(ctx) -> Row:
    """The probe's row (module docstring); ok=None where rollout.speculate is off (or the rollout has no such key)."""
    r = ctx.cfg.rollout
    chosen = registry.option_of(ctx.cfg, "speculate") or registry.baseline("speculate")
    speculation = registry.get("speculate", chosen)(r)
    expects = "tokens = plain decoding's (flips only within rounding), logprobs within tolerance"
    if not speculation.drafts:
        return Row(NAME, expects, f"n/a: rollout.speculate={chosen}", None, SOURCE, blocks=False)
    model = ctx.copies["generator"]
    tokenizer = ctx.tokenizer
    device = next(model.parameters()).device
    seeds = list(range(len(ctx.prompts)))  # the probe rollout's seeds (rlrun/check build)
    plain = hf.generate(model, tokenizer, ctx.prompts, r, device, seeds,
                        speculation=registry.get("speculate", registry.baseline("speculate"))(r))
    flips, apart, differ = [], 0.0, 0
    for _ in range(2 if speculation.history() is not None else 1):
        got = hf.generate(model, tokenizer, ctx.prompts, r, device, seeds, speculation=speculation)
        same, round_flips = compare(model, r, seeds, plain, got)
        differ += int((~same).sum())
        flips += round_flips
        if same.any():
            apart = max(apart, float((got.gen_logprobs[same] - plain.gen_logprobs[same]).abs().max()))
    tol = logprob_tol(ctx, GEN_TOL)
    s = speculation.stats
    where = ", ".join(f"row {b} token {t}: gap {g:.0e}" for b, t, g in flips[:4]) or "none"
    measured = (f"rows differing {differ} (first differing token, plain decoding's score gap: {where}), max |logprob "
                f"diff| {apart:.1e}; acceptance {s.acceptance():.2f}, {s.per_pass():.2f} tokens/verify pass "
                f"({s.passes} passes)")
    ok = all(gap <= FLIP_TOL for _, _, gap in flips) and len(flips) == differ and apart <= tol
    return Row(NAME, expects + f" ({tol:.0e})", measured, ok, SOURCE)


def compare(model, cfg, seeds, plain, got):
    """(rows whose tokens equal plain decoding's [B] bool, [(row, token index, gap)] at each differing row's first
    differing token: plain decoding's perturbed score of its token minus that of speculation's)."""
    # a row that differs does so within the shorter response (rows end at EOS or max_new_tokens in both)
    width = min(got.input_ids.shape[1], plain.input_ids.shape[1])
    a, b = plain.input_ids[:, :width], got.input_ids[:, :width]
    same = (a == b).all(1)
    flips = []
    for row in (~same).nonzero().flatten().tolist():
        t = int((a[row] != b[row]).nonzero()[0]) - plain.prompt_len
        flips.append((row, t, gap(model, cfg, seeds[row], plain, row, t, int(a[row, plain.prompt_len + t]),
                                  int(b[row, plain.prompt_len + t]))))
    return same.to(plain.input_ids.device), flips


@torch.no_grad()
def gap(model, cfg, seed: int, plain, row: int, t: int, want: int, other: int) -> float:
    """Plain decoding's perturbed score (logprob + the row's Gumbel noise at step t) of `want` minus `other`'s."""
    lm = models.unwrap(model)
    keep = plain.attention_mask[row, :plain.prompt_len + t].bool()
    ids = plain.input_ids[row, :plain.prompt_len + t][keep][None]
    scores = lm(input_ids=ids).logits[:, -1:].float()
    sampler = hf.SeededSampler([seed], cfg.temperature, cfg.top_p, cfg.max_new_tokens, getattr(cfg, "top_k", 0))
    logp = torch.log_softmax(hf.top_p_filter(scores / cfg.temperature, cfg.top_p, sampler.top_k), -1)
    u = sampler.draws(torch.tensor([0]), torch.tensor([t]), 1, scores.shape[-1]).to(scores.device)
    g = hf.perturbed(logp, u)[0, 0]
    return float(g[want] - g[other])
