"""train.skip_zero_advantage: completions with nothing to learn leave the training forward and backward, exactly.

A GRPO group whose rewards are all equal gives each of its completions advantage 0 (`grpo.group_advantages`), and
with no KL term and no entropy bonus every GRPO objective here (dapo, cispo, gspo, with or without loss.tis) is
advantage x something per token, so such a completion adds exactly zero to the loss and to every gradient. It
still counts in the step's normaliser (token_mean's T, loss.agg's S and L_s, gspo's sequence ids): those are
counted over the whole step first (`Objective.prepare`), and only then are the rows dropped, so the loss and the
gradients equal the run that computes them, up to summation order (verl#5770 measured the same skip: actor update
-55%). A row whose tokens are all masked (train.overlong=filter) is dropped too: it adds nothing either.

What changes: the train pass computes fewer rows. `padded` keeps every micro-batch's forward (the engine counts
them, and ZeRO's collectives run in each): one left with no row to train keeps a single row, masked; `packed` and
`shared_prompt` never lay the dropped rows out. The old-policy pass computes only the rows that will be trained
(the others' old logprobs stay 0, never read). So the per-token statistics of the step (`ratio_mean`, `clipfrac`,
`entropy`, `kl`, `is_weight_mean`, `mismatch/*`) are over the trained tokens, and a step whose rows are all dropped
logs none of them; `pg_loss`, exactly 0 on a dropped token, is still the mean over every valid token
(`with_dropped`). `passes/skipped_rows_frac` and `passes/skipped_tokens_frac` say how much was dropped.

Where a zero-advantage completion still has a gradient (loss.kl_coef > 0, loss.entropy_coef != 0) the rows stay in
and the run's tag `rlrun.skip_zero_advantage` says why (`Objective.skip_zero_advantage`).
"""

from __future__ import annotations

import dataclasses

import torch

# a Micro's per-token fields, flat [rows x response] (grpo.Micro)
PER_TOKEN = ("targets", "mask", "advantages", "gen_logprobs", "old_logprobs", "ref_logprobs", "is_weights", "weights",
             "seq")


def trained_rows(micro) -> torch.Tensor:
    """[rows] True where a row of a padded micro-batch has something to learn: a valid token and advantage != 0."""
    rows = micro.input_ids.shape[0]
    adv = micro.advantages.view(rows, -1)[:, 0]  # one advantage per row, given to each of its tokens
    return (adv != 0) & micro.mask.view(rows, -1).any(1)


def keep(micro, rows: torch.Tensor):
    """A copy of `micro` with only the rows where `rows` is true (every per-token field cut alike)."""
    n = micro.input_ids.shape[0]

    def cut(x):
        return None if x is None else x.view(n, -1)[rows].reshape(-1)

    return dataclasses.replace(micro, input_ids=micro.input_ids[rows], attention_mask=micro.attention_mask[rows],
                               **{f: cut(getattr(micro, f)) for f in PER_TOKEN})


def cut(micro, rows: torch.Tensor):
    """`micro` with only the rows where `rows` is true; with none, its first row with every token masked, so the
    pass makes as many forwards as before (padded: one row instead of micro_batch; packed: nothing laid out)."""
    if bool(rows.all()):
        return micro
    if bool(rows.any()):
        return keep(micro, rows)
    first = keep(micro, torch.arange(len(rows), device=rows.device) == 0)
    return dataclasses.replace(first, mask=torch.zeros_like(first.mask))


def drop(micros, trained: list[torch.Tensor] | None = None) -> tuple[list, dict[str, int]]:
    """(the micro-batches with only their trained rows (`cut`), the counts dropped); `trained`: each one's
    `trained_rows`, when already known."""
    trained = trained if trained is not None else [trained_rows(m) for m in micros]
    counts = {"rows": 0, "skipped_rows": 0, "skipped_tokens": 0}
    for m, rows in zip(micros, trained):
        n = m.input_ids.shape[0]
        counts["rows"] += n
        counts["skipped_rows"] += n - int(rows.sum())
        counts["skipped_tokens"] += int(m.mask.view(n, -1)[~rows].sum())
    return [cut(m, rows) for m, rows in zip(micros, trained)], counts


def logprobs(layout, model, micros, head, counts: dict) -> tuple[list, list[torch.Tensor], list[torch.Tensor]]:
    """A logprob pass (`layout.logprobs`) over the rows that will be trained only: (those rows' micro-batches,
    their logprobs, the logprobs back in each micro-batch's full layout: 0 for a dropped row, which is never
    trained, so never read)."""
    trained = [trained_rows(m) for m in micros]
    kept, _ = drop(micros, trained)
    passed = layout.logprobs(model, kept, head, counts)
    full = []
    for m, rows, lp in zip(micros, trained, passed):
        out = torch.zeros_like(m.gen_logprobs)
        if bool(rows.any()):
            out.view(m.input_ids.shape[0], -1)[rows] = lp.view(int(rows.sum()), -1)
        full.append(out)
    return kept, passed, full


def with_dropped(parts: dict, tokens: int) -> dict:
    """The step's stat partials (losses.partials) with the dropped rows' `tokens` valid tokens added where their
    value is known without computing them: the policy-gradient term, exactly 0 at advantage 0."""
    if not tokens:
        return parts
    total, n, lo, hi = parts.get("pg_loss", (0.0, 0, 0.0, 0.0))
    return {**parts, "pg_loss": (total, n + tokens, min(lo, 0.0), max(hi, 0.0))}


def metrics(by_rank: list[dict], num_tokens: int) -> dict[str, float]:
    """The share of the step's rows and valid tokens dropped, over every rank (each rank's `drop` counts)."""
    rows = sum(r["rows"] for r in by_rank)
    return {"passes/skipped_rows_frac": sum(r["skipped_rows"] for r in by_rank) / max(rows, 1),
            "passes/skipped_tokens_frac": sum(r["skipped_tokens"] for r in by_rank) / max(num_tokens, 1)}
