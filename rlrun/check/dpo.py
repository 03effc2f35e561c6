"""`rlrun check loss=dpo`: the probes that apply to preference pairs, on a probe batch of the configuration's own
pairs, beside its baseline (every axis at its baseline option, the same weights).

DPO draws nothing, so the probes of a rollout (on-policy ratio, generator = trainer, sampler filter) do not apply
and are listed as such; the others run on the DPO recipe's own functions (recipes/dpo.py: encode_pairs,
pair_logprobs, train_step): accumulation, each pair alone vs in its batch or pack, the policy copies (trainer and
reference: one precision path, the same logprobs at the same weights), no [tokens, vocab] tensor from a head that
promises none, and loss and gradients against the baseline.
"""

from __future__ import annotations

import copy
import dataclasses
from types import SimpleNamespace

import torch

from .. import axes, models, plan, policy, precision, tasks
from ..meters import Meter
from ..recipes import dpo
from . import lifecycle, objective, probes, quantities, steps, truth
from .float64 import ROUNDING_SLACK, in_float64
from .probes import BF16_TOL, FP_TOL, RANKS_SOURCE, RATIO_TOL, Row, grad_diff, grads_of, guarded, logprob_tol
from .rows import rel_scalar, within

PROBE_PAIRS = 8  # pairs of the probe batch at most: seconds on the embedded default
MOVED = 1.0  # the policy's trainable weights moved by this times their mean size: beta x margin spreads over ~+-1
NOT_DRAWN = "n/a: DPO draws nothing (its pairs are data)"


def build(cfg, baseline_config) -> SimpleNamespace:
    torch.manual_seed(cfg.seed)
    base_model, tokenizer = models.build(cfg.model, cfg.seed)
    device = next(base_model.parameters()).device
    train_pairs, _ = tasks.load_pairs(cfg.task, cfg.seed, tokenizer)
    tasks.check_lengths(train_pairs, tokenizer, None, models.context_size(base_model))  # refused as the run does
    pairs = [dict(p, id=i) for i, p in enumerate(train_pairs[:PROBE_PAIRS])]
    n = len(pairs)
    # the loss is each micro-batch's share of the batch mean: the probe batch is the whole batch
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, batch_size=n,
                                                             micro_batch=min(cfg.train.micro_batch, n)))
    base_cfg = baseline_config(cfg)
    reference = policy.build(cfg, "reference", base=base_model)
    trainer = policy.build(cfg, "trainer", base=probes.copy_model(base_model))
    baseline = policy.build(base_cfg, "trainer", base=probes.copy_model(base_model))
    baseline.load_state_dict(trainer.state_dict())  # the same weights, LoRA's random adapters included
    first = dpo.encode_pairs(tokenizer, pairs[: cfg.train.micro_batch], device)
    size = plan.resolve_size(cfg, plan.shapes_of(trainer, plan.weight_dtype(cfg)), int(first.targets.numel()),
                             device.type)
    bound = axes.resolve(cfg, head_size=size, device=str(device))
    base_axes = axes.resolve(base_cfg, device=str(device))
    return SimpleNamespace(cfg=cfg, base_cfg=base_cfg, tokenizer=tokenizer, pairs=pairs, trainer=trainer,
                           baseline=baseline, reference=reference, axes=bound, base_axes=base_axes, device=device,
                           meter=Meter(torch.device(device)))


def logprobs(ctx, model, pairs, ax=None, cfg=None) -> torch.Tensor:
    """[chosen..., rejected...] sequence logprobs of `pairs` under `model`, no grad, in micro-batches of the
    configuration's size."""
    cfg, ax = cfg or ctx.cfg, ax or ctx.axes
    out = []
    with torch.no_grad():
        for i in range(0, len(pairs), cfg.train.micro_batch):
            batch = dpo.encode_pairs(ctx.tokenizer, pairs[i : i + cfg.train.micro_batch], ctx.device)
            chosen, rejected = dpo.pair_logprobs(model, batch, ax.head, ax.layout, cfg.loss.average_logprobs)
            out.append(torch.stack([chosen, rejected], 1))
    return torch.cat(out)


def step(ctx, model, ax, cfg, known) -> tuple[float, dict]:
    """(loss, gradients) of one DPO optimizer step of `model` on the probe pairs, as the recipe takes it."""
    engine = probes.engine_of(model, ctx.device)
    s = SimpleNamespace(engine=engine, meter=ctx.meter, axes=ax, tokenizer=ctx.tokenizer)
    model.zero_grad(set_to_none=True)
    parts, _, _, _ = dpo.train_step(cfg, s, ctx.pairs, known, 0)
    return float(sum(m["loss"] for _, m in parts)), grads_of(model)  # each micro-batch's share of the batch mean


def reference_values(ctx) -> dict:
    lp = logprobs(ctx, ctx.reference, ctx.pairs)
    return {p["id"]: (c, r) for p, (c, r) in zip(ctx.pairs, lp.tolist())}


def accumulation(ctx, known) -> Row:
    n = len(ctx.pairs)
    split = dataclasses.replace(ctx.cfg, train=dataclasses.replace(ctx.cfg.train, micro_batch=max(1, n // 2)))
    whole = dataclasses.replace(ctx.cfg, train=dataclasses.replace(ctx.cfg.train, micro_batch=n))
    _, g_split = step(ctx, ctx.trainer, ctx.axes, split, known)
    _, g_whole = step(ctx, ctx.trainer, ctx.axes, whole, known)
    d, tol = grad_diff(g_split, g_whole), BF16_TOL if ctx.axes.precision.exactness == "approximate" else FP_TOL
    parts = -(-n // max(1, n // 2))
    return Row("accumulation", f"{parts} micro-batches = 1: gradients within {tol:.0e}", f"max rel diff {d:.1e}",
               d <= tol, "modelscope/ms-swift#10117 (gradient accumulation normalised twice)")


def pairs_alone(ctx) -> Row:
    batched = logprobs(ctx, ctx.trainer, ctx.pairs)
    alone = torch.cat([logprobs(ctx, ctx.trainer, [p], ax=ctx.base_axes) for p in ctx.pairs])
    worst, tol = (batched - alone).abs().max().item(), logprob_tol(ctx, RATIO_TOL)
    # sequence logprobs sum a response's tokens: a summed error grows with its length, so the bound is per token
    tokens = max(len(ctx.tokenizer(p[side], add_special_tokens=False).input_ids) + 1 for p in ctx.pairs
                 for side in ("chosen", "rejected"))
    return Row("sequence alone", f"max |in batch - alone| <= {tol:.0e} x {tokens} tokens", f"max {worst:.1e}",
               worst <= tol * tokens, "unslothai/unsloth-zoo#840 (padding shifted positions or leaked into masks)")


def policy_copies(ctx) -> Row:
    copies = {"trainer": ctx.trainer, "reference": ctx.reference}
    paths = {role: precision.autocasting(m) for role, m in copies.items()}
    lp = {role: logprobs(ctx, m, ctx.pairs) for role, m in copies.items()}
    worst, tol = (lp["reference"] - lp["trainer"]).abs().max().item(), logprob_tol(ctx, probes.GEN_TOL)
    shown = ", ".join(f"{r}: {'bf16 autocast' if v else 'as built'}" for r, v in paths.items())
    return Row("policy copies", f"one precision path; logprobs within {tol:.0e} at the same weights",
               f"{shown}; max diff {worst:.1e}", len(set(paths.values())) == 1 and worst <= tol,
               "rlrun #36 (a copy of the policy built in a second place drifts)")


def no_full_logits(ctx, known) -> Row:
    head = ctx.axes.head
    if not head.impl.TILED:
        return Row("no full logits", "n/a: this head builds the [tokens, vocab] logits by design", "-", None,
                   "NVIDIA-NeMo/RL#2871, THUDM/slime#2253")
    weight = models.split(ctx.trainer)[1]
    vocab = weight.shape[0]
    batch = dpo.encode_pairs(ctx.tokenizer, ctx.pairs[: ctx.cfg.train.micro_batch], ctx.device)
    tokens = int(batch.targets.numel())
    size = min(head.size or tokens, max(16, tokens // 4))  # a tile smaller than a micro-batch's tokens
    ax = dataclasses.replace(ctx.axes, head=dataclasses.replace(head, size=size))
    watch = probes.HeadProducts(weight)
    with watch:
        logprobs(ctx, ctx.trainer, ctx.pairs, ax=ax)
        step(ctx, ctx.trainer, ax, ctx.cfg, known)
    return Row("no full logits", f"at most {size} rows (the tile) x vocab in any pass",
               f"largest {watch.rows} rows x vocab {vocab}", watch.rows <= size,
               "NVIDIA-NeMo/RL#2871, THUDM/slime#2253 (chunking not applied in every pass)")


def against_baseline(ctx, known, exactness: set) -> Row:
    """Loss and gradients against the baseline's; past the tolerance, each quantity against the float64 step
    (rlrun/check/quantities.py) as GRPO's `vs baseline` judges it: SmolLM2 with LoRA, chunked and packed was 3.8e-5
    and 7.1e-5 off the baseline on right code (3.6e-15 in float64) and failed DPO's fixed 1e-5."""
    want_loss, want = step(ctx, ctx.baseline, ctx.base_axes, ctx.base_cfg, known)
    got_loss, got = step(ctx, ctx.trainer, ctx.axes, ctx.cfg, known)
    if "objective" in exactness:
        return Row("vs baseline", "n/a: an option changes the objective", "-", None, "")
    source = "every exact option: its equivalence tests, here on your configuration"
    approximate = "approximate" in exactness
    tol = BF16_TOL if approximate else FP_TOL
    d_loss, d_grad = rel_scalar(got_loss, want_loss), grad_diff(got, want)
    expects = f"loss and gradients within {tol:.0e}, else each no further from float64 ({', '.join(sorted(exactness))})"
    measured = f"loss {d_loss:.1e}, gradients {d_grad:.1e}"
    if within(tol, d_loss, d_grad) and not approximate:
        return Row("vs baseline", expects, measured, True, source)
    exact_loss, exact = in_float64(ctx.baseline, lambda model: step(ctx, model, ctx.base_axes, ctx.base_cfg, known))
    own_loss, own = want_loss, want
    if approximate:  # the baseline's options at the configuration's precision: bf16's own rounding
        rounded = probes.copy_model(ctx.baseline)
        ctx.axes.precision.apply(rounded, "trainer")
        own_loss, own = step(ctx, rounded, dataclasses.replace(ctx.base_axes, precision=ctx.axes.precision),
                             ctx.base_cfg, known)
    floor, slack = (probes.PRECISION_FLOOR, probes.PRECISION_SLACK) if approximate else (FP_TOL, ROUNDING_SLACK)
    ok, said = quantities.judge(quantities.quantities(got_loss, got), quantities.quantities(own_loss, own),
                                quantities.quantities(exact_loss, exact), floor=floor, slack=slack)
    return Row("vs baseline", expects, f"{measured}; vs fp64: {said}", ok, source)


def truth_rows(ctx) -> list[Row]:
    """The DPO step and its reference logprobs against the truth (rlrun/check/truth.py), in float64: the recipe's
    own reference pass and cache (recipes/dpo.reference_logprobs, on an engine holding what setup gives it) and its
    train step, after the policy's trainable weights moved off the reference (at a run's start every margin is 0:
    the loss ln 2 whatever its beta, its label smoothing or the cache's order), against the truth's sequence
    logprobs of each pair alone and DPO's loss written from its paper."""
    cfg, tok = ctx.cfg, ctx.tokenizer

    def both(model):
        initial = copy.deepcopy(ctx.reference).double()
        objective.moved(model, cfg.seed + 1, MOVED)
        off = models.adapters_off_reference(cfg.model.lora, cfg.loss.reference_path)
        engine = probes.engine_of(model, ctx.device)
        engine.reference, engine.offload, engine.onload = None if off else initial, lambda: None, lambda: None
        s = SimpleNamespace(engine=engine, meter=ctx.meter, axes=ctx.axes, tokenizer=tok)
        known, _, _ = dpo.reference_logprobs(cfg, s, dpo.ReferenceCache(), ctx.pairs)
        model.zero_grad(set_to_none=True)
        parts, _, _, _ = dpo.train_step(cfg, s, ctx.pairs, known, 0)
        got = (float(sum(m["loss"] for _, m in parts)), grads_of(model))
        return got, dpo_truth(ctx, model, initial), known

    (loss, grads), (want_loss, want, reference, margins), known = in_float64(ctx.trainer, both)
    cached = torch.tensor([known[p["id"]] for p in ctx.pairs], dtype=torch.float64)
    d_ref = (cached - reference).abs().max().item()
    d_loss, d_grad = rel_scalar(loss, want_loss), objective.rel_grads(grads, want)
    return [Row("objective vs truth", f"loss and gradients within {objective.TRUTH_TOL:.0e} of the float64 truth "
                "(rlrun/check/truth.py), the policy off the reference",
                f"loss {d_loss:.1e}, gradients {d_grad:.1e}; beta x margin in [{margins[0]:.2f}, {margins[1]:.2f}]",
                within(objective.TRUTH_TOL, d_loss, d_grad), objective.SOURCE),
            Row("data decisions", "the reference logprobs the step is given (chosen, rejected: by name) as a fresh "
                "pass of the initial policy", f"reference logprobs max {d_ref:.1e}", d_ref <= objective.TRUTH_TOL,
                "DPO's cached reference logprobs (chosen and rejected swapped: step-0 loss 0.436, not ln 2)")]


def dpo_truth(ctx, model, initial):
    """(the truth's loss, its gradients on `model`, [pairs, 2] reference logprobs, the range of beta x margin)."""
    lc, tok = ctx.cfg.loss, ctx.tokenizer
    encode = lambda text: tok(text, add_special_tokens=False).input_ids  # noqa: E731
    policy, reference, nll = [], [], []
    model.zero_grad(set_to_none=True)
    for p in ctx.pairs:
        prompt, sides = encode(p["prompt"]), [encode(p[k]) + [tok.eos_token_id] for k in ("chosen", "rejected")]
        lps = [truth.dpo_sequence_logprob(model, prompt, side, lc.average_logprobs) for side in sides]
        with torch.no_grad():
            reference.append([truth.dpo_sequence_logprob(initial, prompt, side, lc.average_logprobs).item()
                              for side in sides])
        policy.append(torch.stack(lps))
        nll.append(-lps[0] if lc.average_logprobs else -lps[0] / len(sides[0]))  # the chosen's mean NLL
    pi, ref = torch.stack(policy), torch.tensor(reference, dtype=torch.float64, device=policy[0].device)
    loss = truth.dpo(pi[:, 0], pi[:, 1], ref[:, 0], ref[:, 1], beta=lc.beta, label_smoothing=lc.label_smoothing,
                     sft_coef=lc.sft_coef, chosen_nll=torch.stack(nll))
    loss.backward()
    grads = {n: q.grad.detach().clone() for n, q in model.named_parameters() if q.grad is not None}
    model.zero_grad(set_to_none=True)
    m = lc.beta * ((pi[:, 0] - ref[:, 0]) - (pi[:, 1] - ref[:, 1])).detach()
    return loss.item(), grads, ref.cpu(), (m.min().item(), m.max().item())


def rows(cfg, baseline_config, exactness: set, job: bool = False) -> list[Row]:
    ctx = build(cfg, baseline_config)
    known = reference_values(ctx)
    skipped = [Row(name, NOT_DRAWN, "-", None, source) for name, source in (
        ("on-policy ratio", "verl/TRL: old logprobs recomputed under another path than the loss's"),
        ("generator = trainer", "huggingface/trl#5312 (generator weights dropped: ratio mean 0.019)"),
        ("sampler filter", "huggingface/trl#6789 (top_p=0.8: every weight scaled by the kept mass)"))]
    ranks = Row("ranks", "n/a: not probed for DPO (its 2-rank gradients: tests/distributed/test_distributed.py)", "-",
                None, RANKS_SOURCE)
    return [*skipped, *guarded(accumulation, ctx, known, names=("accumulation",)), ranks,
            *guarded(pairs_alone, ctx, names=("sequence alone",)),
            *guarded(policy_copies, ctx, names=("policy copies",)),
            *guarded(no_full_logits, ctx, known, names=("no full logits",)),
            Row("memory plan", "n/a: DPO's plan is an upper bound (the longest pair), not measured here", "-", None,
                "rlrun #38"),
            *guarded(against_baseline, ctx, known, exactness, names=("vs baseline",)),
            *guarded(truth_rows, ctx, names=("objective vs truth", "data decisions")),
            Row("decode branches", NOT_DRAWN, "-", None, "a decode branch reached only when rows end"),
            Row("speculation", NOT_DRAWN, "-", None, "speculative decoding against plain decoding's tokens"),
            *guarded(steps.master_step, ctx, ctx.trainer, lambda model: step(ctx, model, ctx.axes, ctx.cfg, known),
                     names=("master weights",)),
            Row("logprob schedule", "n/a: DPO has no old-policy pass (its reference logprobs: data of the pair)",
                "-", None, steps.SCHEDULE_SOURCE),
            Row("generator process", NOT_DRAWN, "-", None, steps.PROCESS_SOURCE),
            *([lifecycle.in_job("resume")] if job else guarded(lifecycle.resume, ctx, names=("resume",)))]
