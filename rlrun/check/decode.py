"""`decode branches`: the configuration's decode loop (its rollout.decode option as a run calls it: ended rows leave
the batch, each prompt prefilled once for its group, grouped KV heads read in place, a compiled decode's buckets)
against the plainest loop over the same model and sampler (every row to the last step, every row prefilled, the
model's own attention), on prompts that take every branch: one prompt alone (a group of one) beside one repeated (a
group of many), of unequal lengths (left padding), and rows made to end at different steps (the sampler picks EOS at a
chosen step where it could draw EOS there), so that the running batch shrinks step by step and a compiled decode
moves to smaller buckets. The probe rollout of a random model never ends a row early, so without this no branch that
runs only when rows end is exercised (issue #70: a bucket move that drew other tokens passed every probe).

Tokens must be equal and the sampler's logprobs within the generator tolerance. Two paths that round differently
may pick different tokens where two of the sampler's scores are within rounding of each other: such a row is
reported (its margin), not failed; a token the plain loop did not have as its first or second choice fails.
"""

from __future__ import annotations

import torch

from .. import registry
from ..rollout import hf
from .probes import GEN_TOL, Row, logprob_tol

TIE = 1e-3  # two of the sampler's scores closer than this: a token flipped by rounding, not a fault
SOURCE = "a decode branch reached only when rows end (issue #70: a bucket move drew other tokens; never probed)"


class Ending(hf.SeededSampler):
    """The seeded sampler, with row b picking EOS from step `ends[b]` on wherever the sampler could draw EOS (its
    logprob finite under top-p / top-k), and each step's two best scores per row kept (a flip on rounding is told
    from a fault by their margin)."""

    def __init__(self, seeds: list[int], cfg, eos: int, ends: dict[int, int]):
        super().__init__(seeds, cfg.temperature, cfg.top_p, cfg.max_new_tokens, getattr(cfg, "top_k", 0))
        self.eos, self.ends, self.step = eos, ends, 0
        self.best: list[tuple[list[int], torch.Tensor, torch.Tensor]] = []  # per step: rows, top-2 ids, margin

    def __call__(self, input_ids, scores):
        out = super().__call__(input_ids, scores)
        assert self.last is not None  # set by the call above: this step's log-distribution
        rows = self.rows.tolist()
        for i, b in enumerate(rows):
            if b in self.ends and self.step >= self.ends[b] and torch.isfinite(self.last[i, self.eos]):
                out[i, self.eos] = float("inf")
        top = out.topk(min(2, out.shape[-1]), -1)
        margin = (top.values[:, 0] - top.values[:, -1]).float().cpu()
        self.best.append((rows, top.indices.cpu(), margin))
        self.step += 1
        return out


def branch_prompts(extremes: tuple[str, str], rows: int) -> list[str]:
    """The data's shortest prompt repeated, then its longest alone, last: `rows` rows, at least three. Last, so that
    as the rows before it end it moves to another place in the batch (and bucket), where a row's position or mask
    taken from the wrong place shows: the rows beside it share one prompt, and one length."""
    shortest, longest = extremes
    return [shortest] * (max(3, rows) - 1) + [longest]


def endings(rows: int, max_new_tokens: int) -> dict[int, int]:
    """Row -> the step it ends at: of the group of many (all but the last row), every fourth runs as drawn, the
    others end at once, part-way (each at another step) and half-way; the last row runs as drawn."""
    out = {}
    for b in range(rows - 1):
        kind = b % 4
        if kind == 1:
            out[b] = 0
        elif kind == 2:
            out[b] = 1 + (b // 4) % max(1, max_new_tokens - 1)
        elif kind == 3:
            out[b] = max_new_tokens // 2
    return out


def run(decode, model, ids, mask, cfg, tok, ends, **kwargs):
    """(response [rows, steps], the sampler's logprobs [rows, steps], the sampler) of one decode loop."""
    sampler = Ending(list(range(ids.shape[0])), cfg, tok.eos_token_id, ends)
    response = decode(model, ids, mask, max_new_tokens=cfg.max_new_tokens, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, processor=sampler, **kwargs)
    sampler.collect(response[sampler.rows.to(response.device), -1])
    return response.cpu(), torch.stack(sampler.logprobs, 1).cpu(), sampler


def decode_branches(ctx) -> Row:
    """The configuration's decode loop against the plainest one on branch-reaching prompts (module docstring)."""
    r = ctx.cfg.rollout
    if getattr(r, "decode", None) is None:
        return Row("decode branches", f"n/a: rollout={r.name} has no decode loop of rlrun's (its own engine)", "-",
                   None, SOURCE)
    option, tok = registry.get("decode", r.decode), ctx.tokenizer
    model = ctx.copies["generator"]
    prompts = branch_prompts(ctx.extremes, len(ctx.prompts))
    lengths = {len(tok(p, add_special_tokens=False).input_ids) for p in ctx.extremes}
    ids, mask = hf.encode(tok, prompts, next(model.parameters()).device)
    ends = endings(len(prompts), r.max_new_tokens)
    with torch.no_grad():
        want, want_lp, plain = run(hf.decode, model, ids, mask, r, tok, ends, drop_ended=False, prefill_once=False,
                                   grouped_kv=False)
        got, got_lp, _ = run(option.decode, model, ids, mask, r, tok, ends)
    row = compare(ctx, want, want_lp, got, got_lp, plain, tok.eos_token_id)
    if len(lengths) == 1:  # the data's prompts are of one length: no left padding to shift (say so, not hide it)
        row.measured += f"; the data's prompts all {lengths.pop()} tokens: no left padding probed"
    return row


def valid(row: torch.Tensor, eos: int) -> int:
    """The tokens of a response row up to and including its first EOS."""
    hits = (row == eos).nonzero()
    return int(hits[0]) + 1 if len(hits) else len(row)


def compare(ctx, want, want_lp, got, got_lp, plain: Ending, eos: int) -> Row:
    """Row by row: the same tokens, else a first difference on a near tie of the plain loop's scores; the
    logprobs of the tokens both drew within tolerance."""
    tol, worst = logprob_tol(ctx, GEN_TOL), 0.0
    flips: list[int] = []
    wrong: list[int] = []
    lengths: list[int] = []
    for b in range(want.shape[0]):
        n = valid(want[b], eos)
        lengths.append(n)
        m = valid(got[b], eos) if b < got.shape[0] else 0
        same = m == n and torch.equal(want[b, :n], got[b, :n])
        k = n if same else next((t for t in range(min(n, m)) if want[b, t] != got[b, t]), min(n, m))
        if k:
            worst = max(worst, (want_lp[b, :k] - got_lp[b, :k]).abs().max().item())
        if not same:
            margin = tie_at(plain, b, k, int(got[b, k]) if k < got.shape[1] else None)
            (flips if margin is not None and margin < TIE else wrong).append(b)
    ended = int((want == eos).any(1).sum())
    expects = (f"the plainest loop's tokens (a flip within {TIE:.0e} of a tie reported), logprobs within {tol:.0e}; "
               f"a group of {want.shape[0] - 1} ending at different steps beside the data's longest prompt alone")
    measured = (f"{want.shape[0] - len(flips) - len(wrong)} of {want.shape[0]} rows equal ({ended} ended early, "
                f"lengths {min(lengths)}-{max(lengths)}), logprobs max {worst:.1e}"
                + (f"; {len(flips)} flipped on a near tie" if flips else "")
                + (f"; rows {wrong[:4]} drew other tokens" if wrong else ""))
    return Row("decode branches", expects, measured, not wrong and worst <= tol, SOURCE)


def tie_at(plain: Ending, row: int, step: int, token: int | None) -> float | None:
    """The plain loop's margin between its two best scores for `row` at `step` where `token` was its second
    choice; None where it was not (a real difference)."""
    if token is None or step >= len(plain.best):
        return None
    rows, top, margin = plain.best[step]
    if row not in rows:
        return None
    i = rows.index(row)
    return float(margin[i]) if top.shape[1] > 1 and int(top[i, 1]) == token else None

