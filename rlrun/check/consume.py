"""`data decisions`' check of the recipe's wiring: the crafted probe step goes through the recipe's own
`grpo.consume` (the rollout scored and shaped, given advantages, split, given the logprob passes its policy runs,
enqueued), and what it enqueues is held to the truth (rlrun/check/truth.py) field by field.

The other data decisions call the data path's functions one by one (sampling.shape, grpo.group_advantages, ...),
so a recipe that wires them wrongly (advantages from the raw reward instead of the shaped one, the zero-advantage
skip's old pass written back to other rows) passed them all. Here, after the trainer's weights have moved off the
reference (objective.moved), the micro-batches that consume enqueues must carry: each row's advantage from its
shaped reward, the loss's tokens, the current policy's logprobs as old ones on every row the loss trains, the
initial policy's as reference ones, the generator's as drawn, the sequence-level importance weights of those, and
`train.num_iterations` copies of the rollout. Everything runs in float64 (KeepFloat64), so the tolerance is
objective.TRUTH_TOL.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch

from .. import models
from ..recipes import grpo, sampling
from ..rollout import Rollout
from . import truth
from .rows import within

TOL = 1e-9  # as objective.TRUTH_TOL (float64 on both sides)


def per_token(seqs: list[truth.Seq], roll: Rollout, key: str, padding: int | None = None) -> torch.Tensor:
    """[rows, width] of each sequence's `key` logprobs at its response positions, 0 elsewhere; `padding`: a seed
    whose logprob-like noise fills the rest instead (a run's old pass computes numbers there too: a term that
    forgets the mask must see them)."""
    out = torch.zeros(roll.response_mask.shape, dtype=torch.float64)
    if padding is not None:
        out = -1.0 - torch.rand(out.shape, generator=torch.Generator().manual_seed(padding), dtype=torch.float64)
    out = out.to(roll.input_ids.device)
    for b, s in enumerate(seqs):
        out[b, : len(s.response)] = getattr(s, key)
    return out


def truth_mask(seqs: list[truth.Seq], width: int) -> torch.Tensor:
    """[rows, width]: the tokens the truth's loss sees (each trained row's response, EOS included)."""
    mask = torch.zeros(len(seqs), width, dtype=torch.bool)
    for b, s in enumerate(seqs):
        mask[b, : len(s.response)] = s.trained
    return mask


def engine(model, reference):
    """What `grpo.consume` uses of an engine, on one process: the model, its reference, offload (nothing here)."""
    nothing = lambda: None  # noqa: E731
    return SimpleNamespace(model=model, reference=reference, device=next(model.parameters()).device, world=1,
                           gather=lambda obj: [obj], offload=nothing, onload=nothing)


def first_old(policy, window: int, grad_accum: int, kl_coef: float, old_before_loss: bool) -> int:
    """The first rollout window (its micro-step) whose rollout the logprob policy gives an old pass, else 0: the
    old pass's wiring is checked wherever the run ever runs it (the schedule repeats every grad_accum rollouts)."""
    for k in range(grad_accum):
        if policy.need(start=k * window, window=window, grad_accum=grad_accum, ref_coef=kl_coef,
                       old_before_loss=old_before_loss).old:
            return k * window
    return 0


def enqueued(ctx, model, reference, roll, rewards: list[float]) -> tuple[list, int, int]:
    """(the micro-batches `grpo.consume` enqueues for one copy of the rollout, how many it enqueued, the micro-step
    its window started at) on the crafted `roll` (its generator logprobs set) scored `rewards`."""
    cfg, ax = ctx.cfg, ctx.axes
    rows = roll.input_ids.shape[0]
    t = dataclasses.replace(cfg.train, group_size=min(cfg.train.group_size, rows),
                            micro_batch=min(cfg.train.micro_batch, max(1, rows // 2)))
    run = dataclasses.replace(cfg, train=t)
    grad_accum = max(1, cfg.train.batch_size // cfg.train.micro_batch)
    window = max(1, cfg.train.rollout_batch // cfg.train.micro_batch) * t.num_iterations
    buffer = grpo.RolloutBuffer(window)
    buffer.enqueued = first_old(ax.logprobs, window, grad_accum, cfg.loss.kl_coef, ax.objective.old_before_loss)
    start = buffer.enqueued
    s = SimpleNamespace(engine=engine(model, reference), meter=ctx.meter, axes=ax, grad_accum=grad_accum,
                        tokenizer=ctx.tokenizer)
    d = sampling.shape(run, [{"prompt": ""} for _ in range(rows)], roll, rewards, {})
    grpo.consume(run, s, d, buffer, grpo.StepRollouts(), version=0)
    per_copy = -(-rows // t.micro_batch)
    return list(buffer.queue)[:per_copy], len(buffer.queue) // per_copy, start


def by_row(micros, key: str) -> torch.Tensor | None:
    """[rows, width] of a per-token field over the micro-batches (None where consume left it unset)."""
    values = [getattr(m, key) for m in micros]
    if any(v is None for v in values):
        return None
    return torch.cat([v.view(m.input_ids.shape[0], -1) for v, m in zip(values, micros)]).double().cpu()


def held(got: torch.Tensor | None, want: torch.Tensor, where: torch.Tensor) -> float:
    """max |got - want| over `where` (inf where consume left the field unset)."""
    if got is None:
        return float("inf")
    return (got - want).abs()[where].max().item() if where.any() else 0.0


def consumed(ctx, model, initial, roll, rewards: list[float], seqs: list[truth.Seq], spec: truth.Spec):
    """The wiring check (module docstring): (what it measured, whether it is the truth's)."""
    gen = per_token(seqs, roll, "gen", padding=ctx.cfg.seed + 3)
    off = models.adapters_off_reference(ctx.cfg.model.lora, getattr(ctx.cfg.loss, "reference_path", None))
    micros, copies, start = enqueued(ctx, model, None if off else initial,
                                     dataclasses.replace(roll, gen_logprobs=gen), rewards)
    mask = truth_mask(seqs, roll.response_mask.shape[1])
    advantage = torch.tensor([s.advantage for s in seqs], dtype=torch.float64)
    # the rows a skipping run trains (its old pass computes only those): a valid token and advantage != 0
    trained = mask & ((advantage != 0) | (not ctx.axes.objective.skip_zero_advantage))[:, None]
    truth.forward(model, seqs, spec, grad=False)
    current = per_token(seqs, roll, "logprobs").cpu()
    got = {k: by_row(micros, k) for k in ("advantages", "mask", "gen_logprobs", "old_logprobs", "ref_logprobs")}
    d = {"advantages": float("inf") if got["advantages"] is None else
         (got["advantages"][:, 0] - advantage).abs().max().item(),
         "generator": held(got["gen_logprobs"], gen.double().cpu(), mask)}
    same_mask = got["mask"] is not None and torch.equal(got["mask"].bool(), mask)
    said = [f"advantages {d['advantages']:.1e}", "mask " + ("=" if same_mask else "!="),
            f"generator {d['generator']:.1e}"]
    if got["old_logprobs"] is not None:
        d["old"] = held(got["old_logprobs"], current, trained)
        said.append(f"old {d['old']:.1e} on {int(trained.any(1).sum())} trained rows (the window at micro-step "
                    f"{start})")
        d["TIS weights"] = weights_held(ctx, micros, seqs, spec, got["old_logprobs"], trained.any(1), said)
    else:
        said.append("old pass not run by logprob_policy")
    if got["ref_logprobs"] is not None:
        truth.forward(initial, seqs, spec, grad=False)
        d["reference"] = held(got["ref_logprobs"], per_token(seqs, roll, "logprobs").cpu(), mask)
        said.append(f"reference {d['reference']:.1e}")
    want = ctx.cfg.train.num_iterations
    said.append(f"{copies} of {want} copies enqueued")
    return "consume: " + ", ".join(said), same_mask and copies == want and within(TOL, *d.values())


def weights_held(ctx, micros, seqs: list[truth.Seq], spec: truth.Spec, old: torch.Tensor, rows: torch.Tensor,
                 said: list) -> float:
    """loss.tis.level=sequence: the largest relative difference of the importance weights consume set from the
    truth's, of the old logprobs it passed and the generator's, over the trained `rows` (0 where the objective
    reads none before the loss)."""
    if not ctx.axes.objective.old_before_loss:
        return 0.0
    got = [m.is_weights for m in micros]
    if any(w is None for w in got):
        said.append("sequence TIS weights unset")
        return float("inf")
    first = torch.cat([w.view(m.input_ids.shape[0], -1)[:, 0] for w, m in zip(got, micros)]).double().cpu()
    worst = 0.0
    for b, s in enumerate(seqs):
        if rows[b]:
            weight = truth.importance_weight(spec, dataclasses.replace(
                s, old=old[b, : len(s.response)].to(s.gen.device)))
            if weight is None:  # the objective reads weights the configuration's TIS does not ask for
                said.append("sequence TIS weights where TIS is off")
                return float("inf")
            want = weight[0].item()
            worst = max(worst, abs(first[b].item() - want) / max(1.0, abs(want)))
    said.append(f"sequence TIS weights {worst:.1e}")
    return worst
