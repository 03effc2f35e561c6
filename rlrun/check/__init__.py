"""`rlrun check <overrides>`: the user's own configuration proven on a probe rollout, beside its baseline.

Each axis is proven equal to its baseline alone by rlrun's tests; a user runs a combination, on their model and
data, and the worst bugs of this field are silent (the curves look fine). `check` builds the configuration as a
run would (its model, its data, every copy of the policy through rlrun.policy, its axes through rlrun.axes), draws
one probe rollout with its own generator, and runs one probe per failure class (rlrun/check/probes.py), plus the
memory plan against the probe's measured peak. The baseline is the same configuration with every axis at its
baseline option (the registry's first: dense, always, off, padded, keep, fp32, sync). It prints one table (probe,
what it expects, what it measured, the verdict, the public report of the failure class) and exits 1 when a probe
fails. Nothing is trained or written; the rewards are not called (the probe's advantages are seeded noise).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import re
import statistics
import sys
from dataclasses import dataclass
from typing import Any

import torch

from .. import algorithms, axes, models, plan, policy, registry, render, tasks
from ..axes import Axes
from ..meters import MIB, Meter
from ..recipes import grpo
from . import decode, lifecycle, objective, probes, speculation, steps, watch
from .probes import Row

PROBE_ROWS = 16  # sequences of the probe rollout at most (whole groups): seconds on the embedded default
PLAN_STEPS = 3  # train steps the memory-plan probe measures (their median)


@dataclass
class Context:
    cfg: Any
    trainer: Any  # the configuration's trainer copy
    baseline: Any  # the baseline's trainer copy, the same weights
    copies: dict  # role -> the copy of the policy a run of this configuration computes with
    axes: Axes  # (not `axes.Axes`: in the class body, `axes` is this field, not the module)
    base_axes: Axes
    roll: Any  # the probe rollout, drawn by the configuration's generator
    micros: list  # it split as the recipe splits it (train.micro_batch)
    advantages: torch.Tensor
    meter: Meter
    exactness: set  # what the options that differ from the baseline's are
    prompts: list  # the probe rollout's prompts (the generator process draws them again)
    tokenizer: Any = None  # the configuration's (the truth's crafted rollout decodes and ends rows with it)
    extremes: tuple = ()  # the data's shortest and longest prompts (decode branches: unequal lengths)


def baseline_config(cfg):
    """`cfg` with every axis at its baseline option (the shipped YAML's keys; batching keeps its max_tokens)."""
    from ..plan.text import option

    changes = {g: option(g, registry.baseline(g)) for g in registry.EFFICIENCY if g != "batching"}
    changes["batching"] = option("batching", registry.baseline("batching"), max_tokens=cfg.batching.max_tokens)
    base = dataclasses.replace(cfg, **changes)
    for group in registry.AXES:
        node, _, key = registry.key_of(group).partition(".")
        if key == "name" or not hasattr(getattr(base, node), key):  # set above from its YAML; or an option without
            continue  # the key (rollout=replay has no rollout.decode)
        base = dataclasses.replace(base, **{node: dataclasses.replace(getattr(base, node),
                                                                      **{key: registry.baseline(group)})})
    return base


def probe_prompts(cfg, task, tokenizer) -> list[str]:
    """Whole groups, at most PROBE_ROWS sequences (at least one group, itself cut to PROBE_ROWS: a group_size of
    65,536 kept the check busy for minutes at gigabytes, against the seconds it documents; the probes check
    arithmetic, not a group's statistics), of the task's shortest and longest prompts in turn: where the data's
    prompts differ in length, the probe's rows are left-padded as a run's are."""
    t = cfg.train
    groups = max(1, min(t.rollout_batch, PROBE_ROWS) // t.group_size)
    prompts = sorted(dict.fromkeys(r["prompt"] for r in task.train), key=lambda p: len(tokenizer(p).input_ids))
    ends = [prompts[i // 2] if i % 2 == 0 else prompts[-1 - i // 2] for i in range(groups)]
    return [p for p in ends for _ in range(min(t.group_size, PROBE_ROWS))]


def extremes(task, tokenizer) -> tuple[str, str]:
    """The shortest and the longest of the task's training prompts (in tokens)."""
    prompts = sorted(dict.fromkeys(r["prompt"] for r in task.train), key=lambda p: len(tokenizer(p).input_ids))
    return prompts[0], prompts[-1]


def build(cfg) -> Context:
    """Every object the probes need, built as a run builds them."""
    torch.manual_seed(cfg.seed)
    base_model, tokenizer = models.build(cfg.model, cfg.seed)
    device = registry.get("engine", cfg.engine.name).check_device(cfg.engine)
    task = tasks.load(cfg.task, cfg.seed, tokenizer)
    # the run refuses prompts that with max_new_tokens overflow the model's context: so does its check (a check
    # that passed a configuration its run refuses said less than the run)
    tasks.check_lengths(task, tokenizer, cfg.rollout.max_new_tokens, models.context_size(base_model))
    base_cfg = baseline_config(cfg)
    reference = policy.build(cfg, "reference", base=base_model)
    trainer = policy.build(cfg, "trainer", base=probes.copy_model(base_model)).to(device)
    baseline = policy.build(base_cfg, "trainer", base=probes.copy_model(base_model)).to(device)
    baseline.load_state_dict(trainer.state_dict())  # the same weights, LoRA's random adapters included
    source = registry.get("pipeline", cfg.rollout.pipeline)
    generator = trainer if source.generates_here else policy.build(
        cfg, "generator", base=models.build(cfg.model, cfg.seed)[0], state=trainer.state_dict(), device=device)
    prompts = probe_prompts(cfg, task, tokenizer)
    # a rollout option with no sampler of its own (rollout=replay) names the one that draws the probe, at the same
    # temperature, top_p and length (a record's rollouts were drawn by other weights than the probe's)
    name = getattr(registry.get("rollout", cfg.rollout.name), "PROBE_SAMPLER", cfg.rollout.name)
    sampler = registry.get("rollout", name).build(cfg.rollout, generator, tokenizer, torch.device(device))
    with torch.no_grad():
        roll = sampler.generate(generator, prompts, list(range(len(prompts))))
    advantages = torch.randn(len(prompts), generator=torch.Generator().manual_seed(cfg.seed)).to(device)
    micros = grpo.split_rollout(roll, advantages, min(cfg.train.micro_batch, len(prompts)))
    size = plan.resolve_size(cfg, plan.shapes_of(trainer, plan.weight_dtype(cfg)), micros[0].targets.numel(),
                             torch.device(device).type)
    r = cfg.rollout
    bound = axes.resolve(cfg, head_size=size, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, device=device)
    base_axes = axes.resolve(base_cfg, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, device=device)
    changed = exactness_of(cfg)
    copies = {"trainer": trainer, "reference": reference.to(device), "generator": generator}
    return Context(cfg, trainer, baseline, copies, bound, base_axes, roll, micros, advantages,
                   Meter(torch.device(device)), changed, prompts, tokenizer, extremes(task, tokenizer))


def exactness_of(cfg) -> set:
    """What the options that differ from the baseline's are (rlrun.axes.EXACTNESS)."""
    chosen = {g: registry.option_of(cfg, g) for g in registry.AXES}
    return {axes.exactness(g, o) for g, o in chosen.items() if o is not None and o != registry.baseline(g)}


def plan_probe(ctx: Context) -> Row:
    """8. The memory plan of the probe's step (its sizes) against the step's measured growth: 15% or 32 MiB, the
    target of `python -m rlrun.bench plan`. As the configuration's steps are: where its micro-batches accumulate,
    the step measured accumulates too (its peak is in a micro-batch after the first, the gradients made already).
    On CUDA the growth is the allocator's tensors. On CPU RSS also holds the heap blocks glibc keeps, which the plan
    estimates (its heap term) but which at a probe's small tensors are most of RSS's growth and vary step to step
    (SmolLM2: 264-315 MiB over 135 of tensors): there the plan's tensors are judged against the step's live tensors
    (`watch.LiveTensors`, exact), and RSS is shown beside."""
    rows, t = sum(m.input_ids.shape[0] for m in ctx.micros), ctx.cfg.train
    accumulates = plan.grad_accum(ctx.cfg, plan.world_size(ctx.cfg)) > 1
    cfg = dataclasses.replace(ctx.cfg, train=dataclasses.replace(
        t, batch_size=rows * (2 if accumulates else 1), rollout_batch=rows,
        micro_batch=ctx.micros[0].input_ids.shape[0]))
    first = ctx.micros[0]
    predicted = plan.predict(cfg, plan.shapes_of(ctx.trainer, plan.weight_dtype(cfg)), first.input_ids.shape[0],
                             first.input_ids.shape[1], first.targets.numel(), device_type=ctx.meter.device.type,
                             head_size=ctx.axes.head.size)
    # accumulating: the probe's micro-batches twice in one step, so its peak is where a run's is
    micros = ctx.micros * 2 if accumulates else ctx.micros
    cpu = ctx.meter.device.type == "cpu"
    grown = []
    # on CPU the last step's live tensors are counted too (RSS counts the allocator's heap besides)
    tensors = watch.LiveTensors(ignore=[*ctx.trainer.parameters(), *ctx.trainer.buffers()]) if cpu else None
    for i in range(PLAN_STEPS):  # the median step, as bench plan measures (CPU RSS: one step can catch another's)
        ctx.meter.new_step()
        counting = tensors if tensors is not None and i == PLAN_STEPS - 1 else contextlib.nullcontext()
        with ctx.meter.phase("train"), counting:
            probes.train_step(ctx.trainer, micros, ctx.axes, ctx.meter, copy_grads=False)
        grown.append(ctx.meter.growth["train"])
    train = predicted.phases["train"]
    want, got = train.growth / MIB, statistics.median(grown) / MIB
    source = "rlrun #38 (combinations the planner's tests do not use)"
    if not cpu:
        return Row("memory plan", "train growth within 15% or 32 MiB of the plan", f"plan {want:.1f}, measured "
                   f"{got:.1f} MiB", plan.within(want, got), source, blocks=False)
    heap = train.parts.get(plan.HEAP, 0) / MIB
    assert tensors is not None  # built on CPU, the only place this row reads it
    live = tensors.peak / MIB
    return Row("memory plan", "the train step's tensors within 15% or 32 MiB of the plan's",
               f"plan {want - heap:.1f}, live tensors {live:.1f} MiB; RSS {got:.1f} against the plan's "
               f"{want:.1f} with its heap term", plan.within(want - heap, live), source, blocks=False)


def run_probes(ctx: Context, progress: bool = False, job: bool = False) -> list[Row]:
    """Every probe, in the table's order; one that raises is that probe's FAIL row (probes.guarded). `progress`:
    a bar on a terminal, a line per probe otherwise (stderr; `rlrun check` itself, minutes on a real model). `job`:
    a sweep job's check, which leaves out the probes that train runs of their own (IN_JOB_SKIPPED)."""
    from tqdm import tqdm

    rows: list[Row] = []
    total = sum(len(names) for _, names in PROBES)  # the table's rows: one count from the first line to the last
    bar = tqdm(total=total, desc="rlrun check", unit="probe", disable=not (progress and sys.stderr.isatty()),
               dynamic_ncols=True)
    for probe, names in PROBES:
        bar.set_postfix_str(names[0])
        if progress and not sys.stderr.isatty():
            first = len(rows) + 1
            at = f"{first}" if len(names) == 1 else f"{first}-{first + len(names) - 1}"
            print(f"rlrun check: probe{'s' if len(names) > 1 else ''} {at} of {total}: {', '.join(names)}",
                  file=sys.stderr, flush=True)
        rows += [in_job(names[0])] if job and names[0] in IN_JOB_SKIPPED else probes.guarded(probe, ctx, names=names)
        bar.update(len(names))
    bar.close()
    return rows


IN_JOB_SKIPPED = lifecycle.IN_JOB_SKIPPED
in_job = lifecycle.in_job
# (probe, the rows it returns): the names stand in a FAIL row when the probe raises
PROBES = [(probes.on_policy_ratio, ("on-policy ratio",)),
          (probes.generator_vs_trainer, ("generator = trainer", "sampler filter")),
          (probes.accumulation, ("accumulation",)), (probes.ranks, ("ranks",)),
          (probes.sequences_alone, ("sequence alone",)), (probes.policy_copies, ("policy copies",)),
          (probes.no_full_logits, ("no full logits",)), (plan_probe, ("memory plan",)),
          (probes.against_baseline, ("vs baseline",)),
          (objective.truth_rows, ("objective vs truth", "data decisions")),
          (decode.decode_branches, ("decode branches",)), (speculation.speculation, ("speculation",)),
          (steps.master_weights, ("master weights",)),
          (steps.logprob_schedule, ("logprob schedule",)), (steps.generator_process, ("generator process",)),
          (lifecycle.resume, ("resume",))]

VERDICT = {True: "pass", False: "FAIL", None: "-"}


def table(rows: list[Row]) -> str:
    return render.table(["probe", "expects", "measured", "verdict", "failure class"],
                        [[r.probe, r.expects, r.measured, VERDICT[r.ok], r.source] for r in rows], left=5)


def rows_of(cfg, progress: bool = False, job: bool = False) -> list[Row]:
    """The probes of a validated config (DPO's: rlrun/check/dpo.py), the caller's random state untouched; `job`: a
    sweep job's (run_probes)."""
    with torch.random.fork_rng():
        own = algorithms.of(cfg).probes
        if own:
            rows = importlib.import_module(own).rows(cfg, baseline_config, exactness_of(cfg), job=job)
            return rows
        return run_probes(build(cfg), progress, job)


# What to try next when a probe fails (the console's "try:" line): the quickest way to find which setting is at
# fault, as docs/check.md#the-probes explains each probe.
TRY = {"on-policy ratio": "logprob_policy=always and head=dense: if that passes, the option you changed computes the "
                          "old pass unlike the train pass",
       "generator = trainer": "rollout=hf and train.precision=fp32: if that passes, the generator's weights or "
                              "numbers are not the trainer's (docs/vllm.md for vLLM's weight sync)",
       "sampler filter": "rollout.top_p=1.0 rollout.top_k=0: the trainer scores the whole vocabulary, the sampler "
                         "drew from a filtered one",
       "accumulation": "train.micro_batch=<train.batch_size> (one micro-batch): if that passes, the loss is "
                       "normalised per micro-batch; check loss.agg",
       "ranks": "loss.agg=token_mean: if that passes, loss.agg's normaliser is counted on each rank alone (it must "
                "be gathered over every rank's tokens, rlrun/losses/agg.py); head=dense: if that passes, the head's "
                "backward ignores the scale of the loss it is given (grad_out)",
       "sequence alone": "batching=padded: if that passes, the layout's positions or masks let a neighbour in",
       "policy copies": "train.precision=fp32: a copy of the policy was built outside rlrun.policy",
       "no full logits": "head=chunked, or a head.size below the micro-batch's tokens",
       "memory plan": "rlrun plan with the same overrides: its terms (a forecast: the run trains; docs/plan.md)",
       "vs baseline": "set one axis back to its baseline at a time (rlrun check ... head=dense, ...): the option "
                      "whose return makes it pass changes the numbers",
       "objective vs truth": "the loss's terms one at a time (loss.kl_coef=0, loss.tis.enabled=false, "
                             "loss.agg=token_mean, loss.entropy_coef=0): the term whose removal makes it pass is "
                             "computed unlike its formula (docs/objectives.md)",
       "data decisions": "the FAILED part names the decision: train.overlong, train.skip_zero_advantage, "
                         "train.dynamic_sampling or model.lora.reference set back to its default; consume alone: "
                         "the recipe passes a decision on wrongly (rlrun/recipes/grpo.py consume, the skip's old "
                         "pass in recipes/skipping.py)",
       "speculation": "rollout.speculate=off: plain decoding's tokens; if speculation's differ, its verify pass reads "
                       "another step's noise or rolls back the cache wrongly (docs/speculate.md)",
       "decode branches": "rollout.decode=eager: if that passes, the decode option's branch for ended rows or shared "
                          "prefills is at fault",
       "master weights": "keep the weights fp32 (train.precision=bf16 autocasts over fp32 master weights)",
       "logprob schedule": "logprob_policy=always: old logprobs recomputed for every rollout",
       "resume": "checkpoint.every=1 and a run killed and resumed by hand (docs/resume.md): the state that differs "
                 "is not saved or not restored (its owner's state_dict / load_state_dict)",
       "generator process": "rollout.pipeline=sync: if that passes, the generator process misses weight syncs"}


def lines(rows: list[Row], width: int = 100) -> str:
    """The check for a console of `width` columns: one line per probe (its verdict, name, what it measured); under a
    failed one what it expects, its failure class and what to try next; an n/a probe says why (check.txt keeps the
    full table)."""
    import textwrap

    name = max(len(r.probe) for r in rows) if rows else 0
    out = [f"{'':4}  {'probe':<{name}}  measured (what each expects and catches: docs/check.md#the-probes)"]
    for r in rows:
        said = r.measured if r.ok is not None else r.expects
        head = f"{VERDICT[r.ok]:<4}  {r.probe:<{name}}  "
        out += textwrap.wrap(said, width, initial_indent=head, subsequent_indent=" " * len(head)) or [head.rstrip()]
        if r.ok is False:
            for label, text in (("expects", r.expects), ("failure class", r.source), ("try", TRY.get(r.probe))):
                if text:
                    out += textwrap.wrap(f"{label}: {text}", width, initial_indent=" " * len(head),
                                         subsequent_indent=" " * (len(head) + 2))
    return "\n".join(out)


def summary(rows: list[Row]) -> str:
    failed = [r.probe for r in rows if r.ok is False]
    na = sum(r.ok is None for r in rows)  # said, so that the counts add up to the table's rows
    return (f"{sum(r.ok is True for r in rows)} of {sum(r.ok is not None for r in rows)} probes pass"
            + (f" ({na} n/a)" if na else "") + (f"; FAILED: {', '.join(failed)}" if failed else ""))


def metrics(rows: list[Row]) -> dict[str, float]:
    """check/<probe> = 1 (pass) or 0 (fail) for the probes that apply (MLflow's names: letters and _)."""
    return {"check/" + "_".join(re.findall(r"[a-z0-9]+", r.probe.lower())): float(r.ok) for r in rows
            if r.ok is not None}


def report(cfg, progress: bool = False) -> tuple[str, bool]:
    """The check of a validated config: (its lines for a 100-column console with the summary line, whether every
    probe passed)."""
    rows = rows_of(cfg, progress)
    return f"{lines(rows)}\n{summary(rows)}", all(r.ok is not False for r in rows)
