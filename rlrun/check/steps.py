"""The probes of `rlrun check` that take real optimizer steps: what one train step on one set of weights cannot
show (issue #53: three silent faults passed every probe of a single step).

- master weights: the trainable weights are fp32, an optimizer step lands as AdamW's first step written apart
  (rlrun/check/truth.py) lands on the same gradients, and the backbone computes in the precision's claimed dtype
  (bf16 weights without master copies lose every update below a bf16 step of a weight, 1/256 of it; a loss and
  gradients within bf16's 5e-2 of the baseline's do not show it);
- logprob schedule: the logprob policy over the run's own schedule (rollouts of `window` micro-steps, an optimizer
  step every `grad_accum`), on the probe's micro-batches: every micro-step's train pass, with the old-policy
  logprobs the policy gave it (or none: the detached current ones), equals the same pass given the logprobs of the
  weights that drew its rollout. A pass skipped where weights moved in between changes the loss (PPO clipping
  silently off: ratio exactly 1);
- generator process: rollout.pipeline=async's worker process as a run starts it (rlrun.pipeline), sent the
  weights after a real step through the run's own publish: the rollout it draws with them has the trainer's
  logprobs at those weights (a worker that ignores weight syncs draws with the old ones).
"""

from __future__ import annotations

import dataclasses

import torch

from .. import models, pipeline, plan, registry
from ..engine import single
from ..recipes import grpo
from . import truth
from .objective import moved
from .probes import FP_TOL, GEN_TOL, Row, copy_model, grad_diff, logprob_tol, old_logprobs, train_step

MASTER_TOL = 1e-3  # relative: an update against AdamW's written apart (a step lost to bf16 rounding is off by ~1)
SCHEDULE_MICRO_STEPS = 24  # micro-steps of the run's schedule the logprob probe runs at most (seconds, tiny model)


def peak_optimizer(ctx, model):
    """The run's AdamW (engine=single's builder) at its peak learning rate: a warm-up's first, smallest step would
    move the weights too little to show what a skipped pass or a lost update does."""
    train = dataclasses.replace(ctx.cfg.train, warmup_steps=0, lr_schedule="constant")
    return single.optimizer(model, train)[0]


def accumulate(acc: dict, grads: dict) -> None:
    for n, g in grads.items():
        acc[n] = acc[n] + g if n in acc else g.clone()


def step_with(model, opt, grads: dict, clip: float) -> None:
    """An optimizer step of `model` on `grads`, clipped as engine=single clips."""
    for n, p in model.named_parameters():
        p.grad = grads.get(n)
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    opt.zero_grad(set_to_none=True)


MASTER_SOURCE = "bf16 weights without fp32 master copies: updates below a bf16 step lost (vs baseline 1.7e-2 passed)"


def master_weights(ctx) -> Row:
    """Trainable weights in fp32, and one optimizer step of the trainer as built equal to AdamW's written apart on
    the same (clipped) gradients."""
    return master_step(ctx, ctx.trainer, lambda model: train_step(model, ctx.micros, ctx.axes, ctx.meter)[2])


def master_step(ctx, trainer, gradients) -> Row:
    """master_weights for any recipe: `gradients(model)` runs the recipe's train step on `model` (its gradients
    left on the parameters). The run's optimizer step (its builder, engine=single's) against AdamW's first step
    written apart (rlrun/check/truth.py) on the same clipped gradients, in float64; and the dtype the backbone's
    matmuls compute in against the precision's claimed one."""
    if registry.get("engine", ctx.cfg.engine.name).OWN_MASTER:
        return Row("master weights", "n/a: engine=deepspeed keeps its master copy in its ZeRO optimizer "
                   "(tests/distributed/test_distributed.py)", "-", None, MASTER_SOURCE)
    model = copy_model(trainer)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    low = sorted({str(p.dtype).removeprefix("torch.") for p in trainable.values() if p.dtype != torch.float32})
    before = {n: p.detach().clone() for n, p in trainable.items()}
    opt = peak_optimizer(ctx, model)
    with computed_in(model) as seen:
        gradients(model)
    torch.nn.utils.clip_grad_norm_(model.parameters(), ctx.cfg.train.grad_clip)
    clipped = {n: p.grad.detach().clone() for n, p in trainable.items() if p.grad is not None}
    opt.step()
    got = {n: trainable[n].detach().double() - before[n].double() for n in clipped}
    t = ctx.cfg.train
    want = {n: truth.adamw_first_step(before[n], clipped[n], lr=t.lr, weight_decay=t.weight_decay) for n in clipped}
    d = grad_diff(got, want)
    claimed = ctx.axes.precision.dtype
    computes = "+".join(sorted(seen)) or "-"
    dtypes = "fp32" if not low else "+".join(low)
    return Row("master weights", f"trainable weights fp32; the update within {MASTER_TOL:.0e} of AdamW's written "
               f"apart; the backbone's matmuls in {claimed}", f"weights {dtypes}; matmuls {computes}; update max rel "
               f"diff {d:.1e}", not low and d <= MASTER_TOL and computes == claimed, MASTER_SOURCE)


class computed_in:
    """The dtypes of the backbone's linear layers' outputs while in the block (a precision's claimed compute
    dtype: a knob that casts what it says, not only part of it, huggingface/trl#4867)."""

    def __init__(self, model):
        self.linears = [m for m in models.split(model)[0].modules() if isinstance(m, torch.nn.Linear)]
        self.seen: set[str] = set()

    def __enter__(self) -> set[str]:
        hook = lambda module, args, out: self.seen.add(str(out.dtype).removeprefix("torch."))  # noqa: E731
        self.handles = [m.register_forward_hook(hook) for m in self.linears]
        return self.seen

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()


SCHEDULE_SOURCE = "a window policy that never recomputes old logprobs: PPO clipping silently off (ratio 1, clipfrac 0)"


def schedule(cfg) -> tuple[int, int]:
    """(window, grad_accum) of the run by their definition, written apart from the recipe's `grpo.schedule`: a
    rollout of rollout_batch sequences, each rank's share split in micro_batch rows and passed over num_iterations
    times; an optimizer step of batch_size sequences, each rank's share split the same way."""
    t, world = cfg.train, plan.world_size(cfg)
    per_rank_rollout, per_rank_step = t.rollout_batch // world, t.batch_size // world
    return (per_rank_rollout // t.micro_batch) * t.num_iterations, max(per_rank_step // t.micro_batch, 1)


def logprob_schedule(ctx) -> Row:
    """The logprob policy over the run's schedule, on real steps: each micro-step trains on one of the probe's
    micro-batches (in turn), its rollout's old-policy logprobs computed at the rollout's start where the policy
    asks for them; each train pass is compared with the same pass given the logprobs of the weights that drew the
    rollout (what the ratio must be taken against)."""
    window, grad_accum = schedule(ctx.cfg)
    recipe_accum, recipe_window = grpo.schedule(ctx.cfg.train, plan.world_size(ctx.cfg))
    if (recipe_window, recipe_accum) != (window, grad_accum):  # the schedule the run trains by is not this one
        return Row("logprob schedule", f"the recipe's schedule (grpo.schedule) as defined: window {window}, "
                   f"{grad_accum} micro-batch(es) a step", f"window {recipe_window}, {recipe_accum} micro-batch(es) "
                   "a step", False, SCHEDULE_SOURCE)
    # a pass given the drawing weights' logprobs is the same computation as the one it is compared with (fp32 or
    # bf16 alike): any difference past the fp tolerance is the old logprobs it was given
    ax, tol = ctx.axes, FP_TOL
    micros = ctx.micros
    model = copy_model(ctx.trainer)
    opt = peak_optimizer(ctx, model)
    total = min(SCHEDULE_MICRO_STEPS, max(2 * grad_accum, window + grad_accum))
    worst, crossing, skipped = 0.0, 0, 0
    acc: dict[str, torch.Tensor] = {}
    drawn: list[torch.Tensor] = []
    given: list[torch.Tensor] | None = None
    for m in range(total):
        j = m % window  # the micro-step's place in its rollout's window
        if j == 0:  # a new rollout, drawn by the weights as they are now (the synchronous schedule)
            drawn = old_logprobs(model, micros, ax)
            need = ax.logprobs.need(start=m, window=window, grad_accum=grad_accum, ref_coef=ctx.cfg.loss.kl_coef,
                                    old_before_loss=ax.objective.old_before_loss)
            given = drawn if need.old else None
            skipped += not need.old
            start_step = m // grad_accum
        i = j % len(micros)
        mb = [micros[i]]
        _, _, got = train_step(model, mb, ax, ctx.meter, None if given is None else [given[i]])
        if m // grad_accum != start_step:  # weights moved since the rollout was drawn
            crossing += 1
            _, _, want = train_step(model, mb, ax, ctx.meter, [drawn[i]])
            worst = max(worst, grad_diff(got, want))
        accumulate(acc, got)
        if (m + 1) % grad_accum == 0:
            step_with(model, opt, acc, ctx.cfg.train.grad_clip)
            acc = {}
    what = f"window {window}, {grad_accum} micro-batch(es) a step, {total} micro-steps"
    if not crossing:
        return Row("logprob schedule", f"n/a: no rollout spans an optimizer step ({what})", "-", None,
                   SCHEDULE_SOURCE)
    return Row("logprob schedule", f"passes after a step: gradients within {tol:.0e} of old logprobs' ({what})",
               f"{crossing} such pass(es), old pass skipped for {skipped} rollout(s); max rel diff {worst:.1e}",
               worst <= tol, SCHEDULE_SOURCE)


PROCESS_SOURCE = "an async generator process that ignores weight syncs (check built it in-process: never probed)"


def generator_process(ctx) -> Row:
    """rollout.pipeline=async: the generator process the run starts (rlrun.pipeline.Pipeline, its worker in a
    fresh interpreter), run through the run's own schedule with no staleness for two steps: weights v0 at start,
    then the trainer's weights after a real step published (v1). The rollout drawn for step 1 must carry v1 and the
    trainer's logprobs at v1."""
    if not registry.get("pipeline", ctx.cfg.rollout.pipeline).generator_process:
        return Row("generator process", f"n/a: rollout.pipeline={ctx.cfg.rollout.pipeline} starts no generator "
                   "process", "-", None, PROCESS_SOURCE)
    cfg = dataclasses.replace(ctx.cfg, rollout=dataclasses.replace(ctx.cfg.rollout, max_staleness=0),
                              train=dataclasses.replace(ctx.cfg.train, steps=2))
    model = copy_model(ctx.trainer)
    # moved first: LoRA's adapters start at 0, so a worker serving the base model (unslothai/unsloth#8701) would
    # draw the trainer's tokens with the trainer's logprobs until the adapters had moved far
    moved(model, ctx.cfg.seed + 2)
    opt = peak_optimizer(ctx, model)
    pipe = pipeline.Pipeline(cfg, window=1, grad_accum=1, device=ctx.meter.device)
    prompts, seeds = ctx.prompts, list(range(len(ctx.prompts)))

    def draw(r: int):  # the probe's prompts for every rollout
        return [{} for _ in prompts], prompts, seeds

    try:
        pipe.start(model, 0)
        pipe.ahead(0, model, draw, ctx.meter)
        pipe.take()
        _, _, grads = train_step(model, ctx.micros, ctx.axes, ctx.meter)
        step_with(model, opt, grads, ctx.cfg.train.grad_clip)
        pipe.ahead(1, model, draw, ctx.meter)
        g = pipe.take()
        loaded = pipe.loaded
    finally:
        pipe.close()
    from ..recipes import grpo

    micros = grpo.split_rollout(g.rollout, ctx.advantages[: g.rollout.input_ids.shape[0]], len(prompts))
    old = torch.cat([lp[mb.mask] for lp, mb in zip(old_logprobs(model, micros, ctx.axes), micros)])
    gen = torch.cat([mb.gen_logprobs[mb.mask] for mb in micros])
    diff, tol = (gen - old).abs().max().item(), logprob_tol(ctx, GEN_TOL)
    return Row("generator process", f"after a sync: version 1, max |gen - trainer| <= {tol:.0e}",
               f"version {g.version} (loaded {loaded}); max {diff:.1e}", g.version == 1 and loaded == 1 and diff <= tol,
               PROCESS_SOURCE)
