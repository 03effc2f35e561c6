"""The probes of `rlrun check` that hold a GRPO configuration against the truth written apart (rlrun/check/truth.py)
instead of its baseline: the baseline shares the objective code and the data decisions, so a fault there is on both
sides and passes every comparison between them.

The probe step is off-policy and crafted to reach every branch: rows end at different steps (EOS forced on chosen
rows, so the overlong filter and penalty act), the rewards give one group rows at its mean (advantage exactly 0:
the zero-advantage skip acts) and one group of equal rewards where there are several, and each row's old,
generator and reference logprobs are the trainer's own plus seeded noise of a scale chosen per row (`SIGMAS`: none,
inside GSPO's narrow clip, and far enough for every PPO / CISPO clip, TIS cap and mask to act on some tokens; the row
says how many did). The step is split in at least two micro-batches, so the step-wide normalisers are exercised.

Everything runs on one float64 copy of the trainer in float64 throughout (check/float64.KeepFloat64): the run's
data path (recipes/sampling.shape, grpo.group_advantages, sampling.trained, grpo.split_rollout) and its train step
(its head, layout, activations, objective, skip) on one side, the truth on each sequence alone on the other.
Rounding vanishes there, so they must agree to `TRUTH_TOL`: a fault of any size in a term, a weight, a normaliser or a
decision does not.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from types import SimpleNamespace

import torch

from .. import models
from ..recipes import grpo, sampling, skipping
from ..rollout import Rollout
from . import consume, draws, truth
from .consume import per_token, truth_mask
from .float64 import in_float64
from .probes import train_step
from .rows import Row, within

TRUTH_TOL = 1e-9  # relative, in float64 (a 30-layer model's float64 rounding is ~1e-13)
# per row, in turn over the rows of negative and positive advantage alternately, then those of advantage 0: the
# noise of its old, generator and reference logprobs (a log-ratio): two that PPO's and CISPO's clips, TIS's cap 2 and
# its mask's floor reach on both signs of advantage, one inside GSPO's clip (3e-4), one between, none
SIGMAS = (1.0, 0.4, 1e-4, 0.1, 0.0)
SOURCE = ("an objective compared with itself: huggingface/trl#5619, #6369, modelscope/ms-swift#10117, "
          "verl-project/verl#7225")
DATA_SOURCE = "a data-side decision no numeric probe sees: the wrong rows or reference trained (docs/check.md)"


def spec_of(cfg) -> truth.Spec:
    """The truth's settings from the configuration's own keys (not from rlrun's objects for them)."""
    lc, r = cfg.loss, cfg.rollout
    tis = lc.tis
    return truth.Spec(loss=lc.name, clip_low=lc.clip_low, clip_high=lc.clip_high, kl_coef=lc.kl_coef,
                      kl_estimator=lc.kl_estimator, entropy_coef=lc.entropy_coef,
                      tis_level=tis.level if tis.enabled else None, tis_mode=tis.mode, tis_cap=tis.cap,
                      tis_low=tis.low, agg=lc.agg, agg_max_tokens=lc.agg_max_tokens or r.max_new_tokens,
                      temperature=r.temperature, top_p=r.top_p, top_k=r.top_k)


def crafted(model, roll: Rollout, spec: truth.Spec, tokenizer) -> tuple[Rollout, int]:
    """(the probe rollout with EOS forced on chosen rows, the rows it ended): of every three rows, the first as drawn
    (a random model's rows run to max_new_tokens: cut, no EOS), the second ending part-way (at its first token,
    then later ones), the third ending with EOS on the last position (finished at exactly the limit); an EOS only
    where the sampler could draw it (top-p, top-k: `truth.drawable`), else at the next position where it could."""
    eos, p = tokenizer.eos_token_id, roll.prompt_len
    width = roll.response_mask.shape[1]
    response = roll.input_ids[:, p:].clone()
    ended = 0
    for b in range(response.shape[0]):
        end = {1: (b // 3) % width, 2: width - 1}.get(b % 3)
        if end is None:
            continue
        prompt = roll.input_ids[b, :p][roll.attention_mask[b, :p].bool()].tolist()
        can = truth.drawable(model, prompt, response[b].tolist(), spec, eos)
        end = next((t for t in range(end, width) if can[t]), None)
        if end is not None:
            response[b, end], ended = eos, ended + 1
    return Rollout.from_response(roll.input_ids[:, :p], roll.attention_mask[:, :p], response, roll.gen_logprobs,
                                 tokenizer), ended


def crafted_rewards(rows: int, group_size: int) -> list[float]:
    """Per group, rewards of mean 0.5 exactly with one row at 0.5 (advantage exactly 0: the zero-advantage skip
    acts on it) and the others spread; where there are three groups or more, the first is all 1 (no signal)."""
    out = []
    for g in range(0, rows, group_size):
        n = min(group_size, rows - g)
        if g == 0 and rows >= 3 * group_size:
            out += [1.0] * n
        elif n % 2:
            out += [0.5] + [0.0, 1.0] * (n // 2)
        else:  # 0.5 + 0.75 + 0.75 + 0 = 2 for the first four: mean 0.5 with the pairs after them
            out += ([0.5, 0.75, 0.75, 0.0] + [0.0, 1.0] * ((n - 4) // 2)) if n >= 4 else [0.0, 1.0][:n]
    return out


def sequences(roll: Rollout, eos: int, rewards: list[float], cfg) -> list[truth.Seq]:
    """The truth's reading of the crafted rollout: each row's prompt (without padding) and response (up to and
    including its first EOS, else the whole width: cut at max_new_tokens), shaped rewards, advantages, and whether
    the loss sees it."""
    t, p = cfg.train, roll.prompt_len
    seqs, shaped = [], []
    for b in range(roll.input_ids.shape[0]):
        prompt = roll.input_ids[b, :p][roll.attention_mask[b, :p].bool()].tolist()
        response = roll.input_ids[b, p:].tolist()
        finished = eos in response
        response = response[: response.index(eos) + 1] if finished else response
        shaped.append(rewards[b] + (truth.overlong_penalty(len(response), cfg.rollout.max_new_tokens,
                                                           t.overlong_buffer, t.overlong_penalty_factor)
                                    if t.overlong == "penalty" else 0.0))
        none = torch.zeros(len(response), dtype=torch.float64)
        seqs.append(truth.Seq(prompt, response, finished or t.overlong != "filter", 0.0, none, none, none,
                              extra={"shaped": shaped[-1]}))
    for s, a in zip(seqs, truth.group_advantages(shaped, min(t.group_size, len(seqs)), t.scale_advantages)):
        s.advantage = a
    return seqs


def off_policy(model, seqs: list[truth.Seq], spec: truth.Spec, seed: int) -> None:
    """Each sequence's old, generator and reference logprobs: its own at `model`'s weights plus seeded noise of the
    row's scale (`SIGMAS`); the generator's off the old ones, so TIS acts on their difference."""
    truth.forward(model, seqs, spec, grad=False)
    g = torch.Generator().manual_seed(seed)
    # a clip binds on one side per sign of advantage (PPO): the large scales go to both signs first
    negative, positive = ([b for b, s in enumerate(seqs) if sign(s.advantage)] for sign in (
        lambda a: a < 0, lambda a: a > 0))
    order = [b for pair in itertools.zip_longest(negative, positive) for b in pair if b is not None]
    order += [b for b, s in enumerate(seqs) if s.advantage == 0 or s.advantage != s.advantage]
    for k, b in enumerate(order):
        s, sigma = seqs[b], SIGMAS[k % len(SIGMAS)]
        # half-normal sizes of alternating sign: every row's ratios on both sides of 1 (both clips, cap and floor)
        sign = torch.tensor([(-1.0) ** (i + k) for i in range(len(s.response))], dtype=torch.float64)
        s.old = s.logprobs + noise(sigma * sign, g).to(s.logprobs.device)
        s.gen = s.old + noise(sigma * sign, g).to(s.logprobs.device)
        s.ref = s.logprobs + noise(sigma * sign, g).to(s.logprobs.device)


def noise(scale: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    return scale * torch.randn(scale.shape, generator=g, dtype=torch.float64).abs()


def run_side(ctx, model, roll: Rollout, rewards: list[float], seqs: list[truth.Seq]):
    """The configuration's data path and train step on `roll`: (advantages, micro-batches, loss, metrics, grads)."""
    cfg, t = ctx.cfg, ctx.cfg.train
    roll = dataclasses.replace(roll, gen_logprobs=per_token(seqs, roll, "gen", padding=cfg.seed + 3))
    d = sampling.shape(cfg, [{} for _ in seqs], roll, rewards, {})
    advantages = grpo.group_advantages(d.shaped, min(t.group_size, len(seqs)), t.scale_advantages)
    trained = sampling.trained(d.roll, t)
    whole = grpo.split_rollout(trained, advantages, len(seqs))
    size = ctx.micros[0].input_ids.shape[0] if len(ctx.micros) > 1 else max(1, len(seqs) // 2)
    micros = grpo.split_rollout(trained, advantages, size)
    old = per_token(seqs, roll, "old", padding=cfg.seed + 4).view(-1)
    ref = per_token(seqs, roll, "ref", padding=cfg.seed + 5).view(-1)
    n = roll.response_mask.shape[1]
    for i, mb in enumerate(micros):
        mb.ref_logprobs = ref[i * size * n : i * size * n + mb.targets.numel()]
    olds = [old[i * size * n : i * size * n + mb.targets.numel()] for i, mb in enumerate(micros)]
    loss, parts, grads = train_step(model, micros, ctx.axes, ctx.meter, olds)
    from .. import losses

    return (advantages, d.shaped), whole[0], loss, losses.combine([parts]), grads


def truth_side(model, seqs: list[truth.Seq], spec: truth.Spec, stats_rows: list[bool]):
    """The truth's step on the same model: (loss, metrics, what acted, gradients)."""
    model.zero_grad(set_to_none=True)
    truth.forward(model, seqs, spec)
    seen = {id(s) for s, keep in zip(seqs, stats_rows) if keep}
    loss, metrics, acted = truth.objective(spec, seqs, stats_of=lambda s: id(s) in seen)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.item(), metrics, acted, grads


def rel_grads(got: dict, want: dict) -> float:
    """The largest difference of any parameter's gradient relative to the largest gradient entry of the step (a
    parameter whose gradient is 0 on both sides adds nothing; one present on one side only is inf)."""
    if got.keys() != want.keys() or not want:
        return float("inf")
    scale = max(w.abs().max().item() for w in want.values()) or 1.0
    return max((got[n].double() - want[n].double()).abs().max().item() for n in want) / scale


def metric_diffs(got: dict, want: dict) -> dict[str, float]:
    """Per truth metric: |run - truth| relative to max(1, |truth|); inf where the run has no such metric."""
    return {k: abs(got[k] - v) / max(1.0, abs(v)) if k in got else float("inf") for k, v in want.items()}


def truth_rows(ctx) -> list[Row]:
    """The objective and the data decisions of the configuration against the truth: two rows (module docstring)."""
    cfg, tok = ctx.cfg, ctx.tokenizer
    spec, eos = spec_of(cfg), tok.eos_token_id
    rows = ctx.roll.input_ids.shape[0]
    rewards = crafted_rewards(rows, min(cfg.train.group_size, rows))

    def both(model):
        roll, ended = crafted(model, ctx.roll, spec, tok)
        seqs = sequences(roll, eos, rewards, cfg)
        off_policy(model, seqs, spec, cfg.seed)
        (advantages, shaped), whole, loss, metrics, grads = run_side(ctx, model, roll, rewards, seqs)
        skips = truth.skips_zero_advantage(cfg.train.skip_zero_advantage, cfg.loss.kl_coef, cfg.loss.entropy_coef)
        # the metrics of a skipping run are over its trained rows: those of the run's own advantage != 0
        stats_rows = [bool(a != 0) or not skips for a in advantages.tolist()]
        want_loss, want_metrics, acted, want = truth_side(model, seqs, spec, stats_rows)
        acted["ended"] = ended
        initial = copy.deepcopy(ctx.copies["reference"]).double()
        reference = reference_pass(ctx, model, initial, seqs, whole, spec)  # it moves the trainable weights
        wiring = consume.consumed(ctx, model, initial, roll, rewards, seqs, spec)  # on the moved weights
        checks = [*against(seqs, advantages, shaped, cfg.train.overlong == "penalty"), loss_tokens(cfg, seqs, whole),
                  zero_advantage_skip(ctx, advantages, whole, skips), dynamic_sampling(cfg, rows),
                  draws.rounds(cfg, tok, ctx.meter), draws.seeds(cfg),
                  (f"reference pass {reference:.1e}", reference <= TRUTH_TOL), wiring]
        return (loss, metrics, grads), (want_loss, want_metrics, want), acted, [c for c in checks if c]

    (loss, metrics, grads), (want_loss, want_metrics, want), acted, checks = in_float64(ctx.trainer, both)
    d_loss = abs(loss - want_loss) / max(abs(want_loss), 1e-12)
    d_grad, d_metrics = rel_grads(grads, want), metric_diffs(metrics, want_metrics)
    worst = max(d_metrics.items(), key=lambda kv: kv[1], default=("", 0.0))
    measured = (f"loss {d_loss:.1e}, gradients {d_grad:.1e}, {len(d_metrics)} metrics {worst[1]:.1e}"
                + (f" ({worst[0]})" if worst[1] > TRUTH_TOL else ""))
    objective = Row("objective vs truth", f"loss, gradients and metrics within {TRUTH_TOL:.0e} of the float64 "
                    "truth (rlrun/check/truth.py) on an off-policy step",
                    f"{measured}; off-policy: {coverage(spec, acted, want_metrics)}",
                    within(TRUTH_TOL, d_loss, d_grad, *d_metrics.values()), SOURCE)
    failed = [said.split(" ")[0].rstrip(":") for said, ok in checks if not ok]
    decisions = Row("data decisions", "the rewards, advantages, the loss's tokens, the zero-advantage skip, dynamic "
                    "sampling and its rounds, the rows' seeds, the reference pass and the recipe's wiring of them "
                    "(grpo.consume) as their definitions "
                    "(rlrun/check/truth.py)",
                    "; ".join(said for said, _ in checks) + (f"; FAILED: {', '.join(failed)}" if failed else ""),
                    not failed, DATA_SOURCE)
    return [objective, decisions]


def coverage(spec: truth.Spec, acted: dict, metrics: dict) -> str:
    """What the off-policy probe step made act: a clip, a cap, a mask is only tested where it acts."""
    out = (f"{acted['tokens']} tokens ({acted['ended']} rows ended by a forced EOS), ratio "
           f"{metrics.get('ratio_min', 1):.2f}-{metrics.get('ratio_max', 1):.2f}, clipped {acted['clip_low']} low / "
           f"{acted['clip_high']} high")
    if spec.tis_level is not None:
        truncate = spec.tis_mode == "truncate"
        out += f", {spec.tis_level} TIS {acted['tis_capped' if truncate else 'tis_masked']}"
        out += " capped" if truncate else " masked"
    return out + f", KL {spec.kl_estimator} x {spec.kl_coef:g}"


def moved(model, seed: int, size: float = 0.05) -> None:
    """Move `model`'s trainable weights by seeded noise of `size` times their mean magnitude (LoRA's adapters start
    at 0: adapters on and off would give the same logprobs, and a reference pass that left them on would pass)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                scale = size * max(p.abs().mean().item(), 0.1)
                p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype).to(p.device))


def reference_pass(ctx, model, initial, seqs: list[truth.Seq], whole, spec: truth.Spec) -> float:
    """The run's reference pass (models.reference on an engine holding what setup gives it: the frozen copy, or none
    under LoRA's adapters_off) after the trainer's weights moved, against the truth's logprobs of the initial
    policy (the check's reference copy, rlrun.policy): max |run - truth| over the loss's tokens."""
    moved(model, ctx.cfg.seed + 1)
    off = models.adapters_off_reference(ctx.cfg.model.lora, getattr(ctx.cfg.loss, "reference_path", None))
    engine = SimpleNamespace(model=model, reference=None if off else initial)
    with torch.no_grad(), models.reference(engine) as reference:
        got = torch.cat(ctx.axes.layout.logprobs(reference, [whole], ctx.axes.head))
    truth.forward(initial, seqs, spec, grad=False)
    rows = len(seqs)
    want = per_token(seqs, dataclasses.replace(ctx.roll, response_mask=whole.mask.view(rows, -1)), "logprobs")
    return (got.double() - want.view(-1))[whole.mask].abs().max().item() if whole.mask.any() else 0.0


# -- the data decisions: each (what it measured, whether it is its definition), or None where the run has it off ---

def against(seqs: list[truth.Seq], advantages: torch.Tensor, shaped: torch.Tensor, penalty: bool) -> list:
    """The run's shaped rewards (the overlong penalty) and advantages against the truth's."""
    out = []
    for name, got, values in (("rewards", shaped, [s.extra["shaped"] for s in seqs]),
                              ("advantages", advantages, [s.advantage for s in seqs])):
        want = torch.tensor(values, dtype=torch.float64)
        d = ((got.double().cpu() - want).abs() / want.abs().clamp(min=1.0)).max().item()
        out.append((f"{name} {d:.1e}" + (" (overlong penalty)" if penalty and name == "rewards" else ""),
                    d <= TRUTH_TOL))
    return out


def loss_tokens(cfg, seqs: list[truth.Seq], whole) -> tuple[str, bool]:
    """The tokens the run's loss sees (the overlong filter, the response up to EOS) against the truth's."""
    got, want = whole.mask.view(len(seqs), -1).cpu(), truth_mask(seqs, whole.mask.numel() // len(seqs))
    return (f"loss tokens {int(got.sum())} (truth {int(want.sum())}, overlong={cfg.train.overlong})",
            torch.equal(got, want))


def zero_advantage_skip(ctx, advantages: torch.Tensor, whole, skips: bool) -> tuple[str, bool] | None:
    """The rows the run's zero-advantage skip trains against those with a valid token and advantage != 0, and that it
    skips exactly where the truth says it may."""
    if not skips:
        return None if not ctx.axes.objective.skip_zero_advantage else ("skip on with a gradient at 0", False)
    rows = whole.input_ids.shape[0]
    kept = skipping.trained_rows(whole).cpu()
    want = (advantages.cpu() != 0) & whole.mask.view(rows, -1).cpu().any(1)
    return (f"skip keeps {int(kept.sum())} of {rows} rows (truth {int(want.sum())})",
            torch.equal(kept, want) and bool(ctx.axes.objective.skip_zero_advantage))


def dynamic_sampling(cfg, rows: int) -> tuple[str, bool] | None:
    """Dynamic sampling's kept groups on crafted rewards (all equal, all but one equal, spread)."""
    if not cfg.train.dynamic_sampling:
        return None
    g = max(1, min(cfg.train.group_size, rows))
    rewards = [1.0] * g + [1.0] * (g - 1) + [0.0] + [float(i % 3) for i in range(g)]
    got, want = list(sampling.informative(torch.tensor(rewards), g)), truth.informative_groups(rewards, g)
    return f"dynamic sampling keeps {sum(got)} of 3 groups (truth {sum(want)})", got == want
