"""GRPO (loss=dapo | cispo | gspo): generate -> reward -> group advantages -> the logprob passes needed -> update.

Schedule: `train.steps` optimizer steps. Each optimizer step consumes `grad_accum = batch_size / micro_batch`
micro-batches from the rollout buffer; when the buffer runs short, a rollout of `rollout_batch` sequences is
generated with the current weights, scored, given group-normalised advantages, given whatever old-policy /
reference logprobs the logprob policy says it needs, and enqueued `num_iterations` times. So an optimizer step may
span rollouts and a rollout may span optimizer steps, exactly as in TRL's step schedule, and the window policy's
decision is exact.

Data parallel: batch sizes are global and `micro_batch` is per rank; every rank reads the same prompt stream and
takes its slice of each rollout (whole prompt groups); token counts and metrics are reduced over ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections import Counter, deque
from dataclasses import dataclass, field

import numpy as np
import torch

from .. import axes, evaluate, logprobs, losses, models, plan, ranks, registry, tasks
from .. import batching as packing
from ..meters import MIB
from ..rollout import record, speculate
from ..runner import Data, Frame, check_finite, meter_metrics, no_held_out, setup
from . import sampling, skipping, sources
from .sampling import sample_seed  # noqa: F401 (rlrun.recipes.grpo.sample_seed, as before)


@dataclass
class Micro:
    """One micro-batch of a rollout, flattened to response tokens where the heads need it."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    prompt_len: int
    targets: torch.Tensor  # [N] response tokens
    mask: torch.Tensor  # [N] valid response tokens
    advantages: torch.Tensor  # [N]
    gen_logprobs: torch.Tensor  # [N]
    old_logprobs: torch.Tensor | None = None  # [N], None: old pass skipped
    ref_logprobs: torch.Tensor | None = None  # [N], None: reference pass skipped
    is_weights: torch.Tensor | None = None  # [N] sequence-level importance weights (loss.tis.level=sequence)
    version: int = 0  # the optimizer steps taken by the weights that generated it
    weights: torch.Tensor | None = None  # [N] loss.agg's per-token weights, set per step (losses/agg.py)
    seq: torch.Tensor | None = None  # [N] each token's sequence in the step, set per step for gspo (losses/agg.py)


class RolloutBuffer:
    """Micro-batches waiting to be trained on, and the micro-step where the next rollout's window starts."""

    def __init__(self, window: int):
        self.window = window  # micro-steps per rank that one rollout provides (num_iterations passes)
        self.queue: deque[Micro] = deque()
        self.enqueued = 0  # micro-steps enqueued so far = start of the next rollout's window

    def __len__(self) -> int:
        return len(self.queue)

    @property
    def rollouts(self) -> int:
        return self.enqueued // self.window

    def add(self, micros: list[Micro], iterations: int) -> None:
        for _ in range(iterations):
            self.queue.extend(micros)
        self.enqueued += self.window

    def take(self, n: int) -> list[Micro]:
        return [self.queue.popleft() for _ in range(n)]

    def state_dict(self) -> dict:
        return {"queue": [dataclasses.asdict(m) for m in self.queue], "enqueued": self.enqueued}

    def load_state_dict(self, state: dict) -> None:
        self.queue = deque(Micro(**m) for m in state["queue"])
        self.enqueued = state["enqueued"]


@dataclass
class StepRollouts:
    """What this rank's rollouts of one optimizer step contribute to its metrics (reduced over ranks)."""

    counts: Counter = field(default_factory=Counter)  # logprob passes run / skipped
    rewards: list[torch.Tensor] = field(default_factory=list)  # [rows] total reward, per rollout
    by_reward: list[dict] = field(default_factory=list)  # per rollout: reward name -> (sum, count)
    lengths: list[torch.Tensor] = field(default_factory=list)  # [rows] response tokens, per rollout
    finished: list[torch.Tensor] = field(default_factory=list)  # [rows] 1.0 where the row ended with EOS
    gen_tokens: int = 0
    mismatch: np.ndarray = field(default_factory=lambda: np.zeros(3))  # see `mismatch`
    samples: list[dict] = field(default_factory=list)  # a few rows of the step's first rollout
    ages: list[int] = field(default_factory=list)  # per micro-batch trained: step - the version that generated it
    worker: list[tuple[float, float]] = field(default_factory=list)  # async: (busy, idle) s of the generator
    sampling: dict = field(default_factory=dict)  # what dynamic sampling did (recipes/sampling.py)
    layout: dict = field(default_factory=dict)  # "old" / "ref": the logprob passes' layout; "exchange": moves

    def reducible(self) -> dict:
        """The small numbers every rank sends (frame.reduce)."""
        return {"rewards": self.rewards, "by_reward": self.by_reward, "lengths": self.lengths,
                "finished": self.finished, "gen_tokens": self.gen_tokens, "mismatch": self.mismatch,
                "ages": self.ages, "worker": self.worker, "sampling": self.sampling, "logprob_layout": self.layout}


def group_advantages(rewards: torch.Tensor, group_size: int, scale: bool = True) -> torch.Tensor:
    """(reward - group mean) / (group std + 1e-4), per prompt group of consecutive completions (GRPO)."""
    grouped = rewards.view(-1, group_size)
    adv = grouped - grouped.mean(1, keepdim=True)
    if scale:
        adv = adv / (grouped.std(1, keepdim=True) + 1e-4)
    return adv.reshape(-1)


def split_rollout(roll, advantages: torch.Tensor, micro_batch: int) -> list[Micro]:
    out = []
    R = roll.response_mask.shape[1]
    for i in range(0, roll.input_ids.shape[0], micro_batch):
        rows = slice(i, i + micro_batch)
        out.append(Micro(
            input_ids=roll.input_ids[rows],
            attention_mask=roll.attention_mask[rows],
            prompt_len=roll.prompt_len,
            targets=roll.input_ids[rows, roll.prompt_len:].reshape(-1),
            mask=roll.response_mask[rows].reshape(-1),
            advantages=advantages[rows, None].expand(-1, R).reshape(-1),
            gen_logprobs=roll.gen_logprobs[rows].reshape(-1),
        ))
    return out


FIELDS = ("targets", "advantages", "old_logprobs", "ref_logprobs", "gen_logprobs", "is_weights", "weights", "seq")


def mismatch(micros: list[Micro], old: list[torch.Tensor]) -> np.ndarray:
    """Generation vs trainer old-policy logprobs (`old`, one per micro-batch): sums of |diff| and exp|diff| and the
    token count, to be summed over rollouts and ranks; their means are `mismatch/gen_vs_train_abs` and NeMo-RL's
    token_mult_prob_error."""
    diff = torch.cat([(m.gen_logprobs - lp)[m.mask] for m, lp in zip(micros, old)]).abs().double()
    return np.array([diff.sum().item(), diff.exp().sum().item(), diff.numel()])


def schedule(t, world: int) -> tuple[int, int]:
    """(grad_accum, window) of a run of `t` (cfg.train) on `world` ranks: micro-batches per rank per optimizer step,
    and a rollout's micro-steps per rank (its num_iterations passes). `rlrun check`'s logprob schedule probe holds it
    to the definition."""
    grad_accum = t.batch_size // (t.micro_batch * world)
    window = (t.rollout_batch // world // t.micro_batch) * t.num_iterations
    return grad_accum, window


def train(cfg, raw, tracker, resume: dict | None = None) -> dict[str, float]:
    """GRPO. `resume`: a checkpoint's state, to continue that run exactly where it stopped."""
    t = cfg.train
    grad_accum, window = schedule(t, ranks.world_size())

    def load(tokenizer, context):
        task = tasks.load(cfg.task, cfg.seed, tokenizer)
        warnings = tasks.check_lengths(task, tokenizer, cfg.rollout.max_new_tokens, context)
        return Data(task, warm_rows=task.train, plan_rows=task.train, warnings=warnings)

    a = axes.resolve(cfg)  # the options as objects; setup binds them to the engine and the plan
    # the trainer's logprobs are the sampler's distribution (temperature, top-p renormalised): ratios compare alike
    s = setup(cfg, tracker, load=load, grad_accum=grad_accum, resume=resume, temperature=cfg.rollout.temperature,
              top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k, with_rollout=a.pipeline.generates_here,
              with_reference=a.logprobs.builds_reference(cfg.loss.kl_coef))
    frame, engine, task = Frame(cfg, raw, tracker, s, curve="reward_mean"), s.engine, s.data
    prompts = tasks.prompt_stream(task.train, cfg.seed)  # the same stream on every rank; each takes its slice
    buffer, passes = RolloutBuffer(window), logprobs.PassCounter()
    drawn = sampling.Totals() if t.dynamic_sampling else None  # groups generated and dropped over the run
    # where the rollouts come from: generated here (sync) or by the generator process, ahead (async)
    source = s.axes.pipeline(cfg, s, prompts, window=window, grad_accum=grad_accum, drawn=drawn)
    if getattr(cfg.rollout, "record", None):  # rollout.record=DIR: each rollout written as it is trained on
        recorder = record.Recorder(os.path.expanduser(cfg.rollout.record), cfg, resumed=resume is not None) \
            if engine.main else None  # rank 0 writes the whole rollout; the other ranks send it their shares
        source = sources.Recording(source, recorder, engine, s.tokenizer.pad_token_id)
    stateful = {"prompts": prompts, "buffer": buffer, "passes": passes, **source.stateful()}
    if drawn is not None:
        stateful["sampling"] = drawn
    start = frame.restore(resume, stateful)
    skips = bool(s.axes.objective is not None and s.axes.objective.skip_zero_advantage)  # rows of advantage 0 left out

    # the rewards run in a worker process: bounded, and unable to end or hold up the run (rlrun/tasks/worker.py)
    with tasks.isolated(task, cfg.task.reward_timeout_s, cfg.seed), \
            contextlib.closing(frame.steps(start, stateful, "rlrun", held_out(cfg, frame, s))) as steps, \
            contextlib.ExitStack() as cleanup:
        source.open(cleanup, tracker, start)
        for step in steps:
            # 1. Refill: generate (or take from the generator process), score, advantages, the logprob passes needed.
            got = refill(cfg, s, source, buffer, step)

            # 2. Train: one optimizer step over grad_accum micro-batches, loss normalised by the step's token count.
            micros = buffer.take(grad_accum)
            got.ages = [step - mb.version for mb in micros]
            kept = [int(skipping.trained_rows(mb).sum()) for mb in micros] if skips else None  # the rows trained
            loss_total, num_tokens, parts, layout = train_step(cfg, s, micros, step)
            grad_norm = engine.step()

            # 3. Metrics over all ranks. A metric that needs a skipped pass is absent, never a zero that looks real.
            m = step_metrics(frame, passes, got, loss_total, num_tokens, parts, grad_norm, layout, drawn)
            m.update(trained_plan(cfg, s, micros, kept))
            m.update(speculate.step_metrics(getattr(s, "rollout", None)))  # acceptance, tokens per verify pass
            frame.log(step, m, reward=f"{m.get('reward_mean', float('nan')):.3f}", loss=f"{m['loss']:.4f}",
                      tok_s=f"{m['throughput/train_tokens_per_s']:.0f}")
            if cfg.log.samples_every and step % cfg.log.samples_every == 0 and got.samples:
                frame.samples(step, got.samples, "train")
        return frame.finish()


def trained_plan(cfg, s, micros: list[Micro], kept: list[int] | None) -> dict[str, float]:
    """plan/<phase>_trained_growth_mib: the memory plan of the micro-batches this step trained on, at their lengths
    (a real model's completions end before rollout.max_new_tokens, where the step-0 plan runs every one: the bound
    a run must fit) and, with train.skip_zero_advantage, the rows the train and old-policy passes computed. How
    long the completions are and how many rows are left out is the model's and the rewards' to decide, so this is
    what the planner's accuracy is measured against (python -m rlrun.bench plan)."""
    if s.memory is None:
        return {}
    seq_len = max(mb.input_ids.shape[1] for mb in micros)  # prompt and the longest response slot, padded
    tokens = max(mb.targets.numel() for mb in micros)  # rows x the response slot: what the heads compute over
    again = plan.trained(cfg, s.memory, kept, s.head_size, seq_len=seq_len, tokens=tokens)
    return {f"plan/{name}_trained_growth_mib": again.phases[name].growth / MIB
            for name in ("train", "old_logprobs", "ref_logprobs") if name in again.phases}


def refill(cfg, s, source, buffer: RolloutBuffer, step: int) -> StepRollouts:
    """Rollouts from `source` (recipes/sources.py: generated here with the current weights, or taken in order from
    the generator process) until the buffer holds this optimizer step's micro-batches. Returns what they
    contribute to the step's metrics."""
    got = StepRollouts()
    source.ahead(step)
    while len(buffer) < s.grad_accum:
        d, version = source.next(step, buffer.rollouts, got)
        consume(cfg, s, d, buffer, got, version)
    return got


def held_out(cfg, frame, s):
    """The evaluation of the held-out rows (None when eval.every is 0, or with a warning when there are none)."""
    if not cfg.eval.every:
        return None
    if not s.data.eval:
        frame.warn([no_held_out(cfg, "rows")])
        return None
    rows = s.data.eval[: cfg.eval.size] if cfg.eval.size else s.data.eval
    r = cfg.rollout

    def run():
        with s.engine.generation():  # ZeRO-3: whole weights for generate (the heads gather their own)
            return evaluate.evaluate(s.engine.model, s.tokenizer, rows, s.data.score,
                                     max_new_tokens=cfg.eval.max_new_tokens or r.max_new_tokens,
                                     greedy=cfg.eval.greedy, samples=cfg.eval.samples, temperature=r.temperature,
                                     top_p=r.top_p, top_k=r.top_k, seed=cfg.seed, show=cfg.log.samples,
                                     accuracy_reward=cfg.eval.accuracy_reward,
                                     accuracy_threshold=cfg.eval.accuracy_threshold,
                                     decode=registry.option_of(cfg, "decode") or registry.baseline("decode"),
                                     speculate=registry.option_of(cfg, "speculate"),
                                     speculate_k=getattr(r, "speculate_k", 4))

    return run


def consume(cfg, s, d, buffer: RolloutBuffer, got: StepRollouts, version: int) -> None:
    """One generated and scored rollout (`d`: recipes/sampling.Drawn, drawn by the weights after `version` optimizer
    steps): given advantages and the logprob passes the policy needs, enqueued. Adds what it contributes to the
    step's metrics to `got`."""
    t, engine, meter, ax = cfg.train, s.engine, s.meter, s.axes
    d = sampling.balanced(cfg, s, d, got.layout)  # ranks' token loads even (packed / shared_prompt)
    rows, roll, totals, by_reward = d.rows, d.roll, d.totals, d.by_reward
    reward = torch.tensor(totals, dtype=torch.float32)
    advantages = group_advantages(d.shaped, t.group_size, t.scale_advantages).to(engine.device)  # + overlong penalty
    micros = split_rollout(sampling.trained(roll, t, got.sampling), advantages, t.micro_batch)  # overlong=filter
    need = ax.logprobs.need(start=buffer.enqueued, window=buffer.window, grad_accum=s.grad_accum,
                            ref_coef=cfg.loss.kl_coef, old_before_loss=ax.objective.old_before_loss)
    got.counts.update({"old_run": int(need.old), "old_skipped": int(not need.old), "ref_run": int(need.ref),
                       "ref_skipped": int(not need.ref)})
    got.gen_tokens += int(roll.response_mask.sum())
    with meter.phase("offload"):
        engine.offload()
    if need.old:
        with meter.phase("old_logprobs"), torch.no_grad():
            counts = got.layout.setdefault("old", {})
            if ax.objective.skip_zero_advantage:  # only the rows that will be trained (recipes/skipping.py)
                passed, passed_old, old = skipping.logprobs(ax.layout, engine.model, micros, ax.head, counts)
            else:
                passed = micros
                passed_old = old = ax.layout.logprobs(engine.model, micros, ax.head, counts)
        for mb, lp in zip(micros, old):
            mb.old_logprobs = lp
        got.mismatch += mismatch(passed, passed_old)
    if need.ref:
        with meter.phase("ref_logprobs"), torch.no_grad(), models.reference(engine) as reference:
            ref = ax.layout.logprobs(reference, micros, ax.head, got.layout.setdefault("ref", {}))
        for mb, lp in zip(micros, ref):
            mb.ref_logprobs = lp
    with meter.phase("onload"):
        engine.onload()
    for mb in micros:
        mb.version = version
        mb.is_weights = ax.objective.is_weights(mb)  # loss.tis.level=sequence: per sequence; else None
    got.rewards.append(reward)
    if not got.samples:  # a few rows of the step's first rollout, for the samples table
        got.samples = [evaluate.sample_row(ex, c, float(r), by_reward, n)
                       for n, (ex, c, r) in enumerate(zip(rows, roll.completions, totals))][: cfg.log.samples]
    got.by_reward.append({name: (sum(v), len(v)) for name, v in by_reward.items()})
    got.lengths.append(roll.response_mask.sum(1).float())
    got.finished.append(roll.finished.float())
    buffer.add(micros, t.num_iterations)


def train_step(cfg, s, micros: list[Micro], step: int):
    """Forward and backward of this rank's micro-batches of one optimizer step (the engine steps after)."""
    engine, ax = s.engine, s.axes
    backbone, weight = models.split(engine.model)
    # loss.agg's weights over the step's micro-batches and ranks (token_mean: the heads divide by the token count)
    micros, divisor, num_tokens = ax.objective.prepare(micros, engine.gather)
    skipped: dict[str, int] = {}
    if ax.objective.skip_zero_advantage:  # after prepare: the dropped rows still count in the normalisers
        micros, skipped = skipping.drop(micros)
    stats_parts, masks, loss_total = [], [], 0.0
    layout = {"real": sum(int(mb.attention_mask.sum()) for mb in micros), **skipped}  # real: not padding
    with s.meter.phase("train"), ax.activations.saving():
        for hidden, t, mask, boundary in ax.layout.forwards(backbone, micros, FIELDS, layout):
            loss, stats = ax.head.loss(hidden, weight, t["targets"], mask, ax.objective.per_token(t, mask), divisor)
            check_finite(loss, step, "lower train.lr or train.grad_clip, or check the reward function.")
            engine.backward(loss, boundary)
            loss_total += loss.item()
            stats_parts.append({k: v.detach().cpu() for k, v in stats.items()})
            masks.append(mask.cpu())
    parts = {}
    for key in dict.fromkeys(k for s in stats_parts for k in s):  # gen_gap: only the forwards without an old pass
        have = [i for i, s in enumerate(stats_parts) if key in s]
        parts.update(losses.partials({key: torch.cat([stats_parts[i][key] for i in have])},
                                     torch.cat([masks[i] for i in have])))
    parts = skipping.with_dropped(parts, skipped.get("skipped_tokens", 0))
    return loss_total, num_tokens, parts, layout


def step_metrics(frame, passes: logprobs.PassCounter, got: StepRollouts, loss_total: float, num_tokens: int, parts,
                 grad_norm: float, layout: dict, drawn=None) -> dict[str, float]:
    """The step's metrics from every rank's sums, counts, min/max and per-sequence rewards."""
    by_rank = frame.reduce({"loss": loss_total, "stats": parts, "layout": layout, **got.reducible()})
    m = {"loss": sum(p["loss"] for p in by_rank), **losses.combine([p["stats"] for p in by_rank]),
         "grad_norm": grad_norm, "lr": frame.engine.lr()}
    if got.rewards:
        r = torch.cat([x for p in by_rank for x in p["rewards"]])
        grouped = r.view(-1, frame.cfg.train.group_size)  # whole groups on every rank, in order
        m["equal_reward_groups_frac"] = (grouped.amax(1) == grouped.amin(1)).float().mean().item()  # no signal
        m.update({"reward_mean": r.mean().item(), "reward_std": r.std().item(),
                  "solved_frac": (r >= 1.0).float().mean().item(),  # completions with full reward
                  "response_len_mean": torch.cat([x for p in by_rank for x in p["lengths"]]).mean().item(),
                  "finished_frac": torch.cat([x for p in by_rank for x in p["finished"]]).mean().item()})
    for name in dict.fromkeys(k for p in by_rank for part in p["by_reward"] for k in part):  # each reward's mean
        parts = [part[name] for p in by_rank for part in p["by_reward"]]
        m[f"rewards/{name}/mean"] = sum(s for s, _ in parts) / sum(n for _, n in parts)
    mism = sum(p["mismatch"] for p in by_rank)  # the old-policy pass's sums (`mismatch`), and where it was left out
    for st in (p["stats"] for p in by_rank if "gen_gap" in p["stats"]):  # the train pass's, at the same weights
        mism = mism + np.array([st["gen_gap"][0], st["gen_gap_exp"][0], st["gen_gap"][1]])
    if mism[2]:
        m["mismatch/gen_vs_train_abs"], m["mismatch/token_mult_prob_error"] = mism[:2] / mism[2]
    m.update(passes.metrics(got.counts, frame.meter.seconds))
    m.update(meter_metrics([p["meter"] for p in by_rank]))
    gen_tokens = sum(p["gen_tokens"] for p in by_rank)
    ages = [a for p in by_rank for a in p["ages"]]
    m["staleness_mean"], m["staleness_max"] = sum(ages) / len(ages), max(ages)
    if by_rank[0]["worker"]:  # async: the generator's seconds for this step's rollouts (the slowest rank's)
        m["pipeline/gen_busy_s"] = max(sum(b for b, _ in p["worker"]) for p in by_rank)
        m["pipeline/gen_idle_s"] = max(sum(i for _, i in p["worker"]) for p in by_rank)
    gen_seconds = m.get("time/generate_s", m.get("pipeline/gen_busy_s"))
    if gen_tokens and gen_seconds:
        m["throughput/gen_tokens_per_s"] = gen_tokens / gen_seconds
    m["throughput/train_tokens_per_s"] = num_tokens / m["time/train_s"]
    m["train_tokens"] = num_tokens
    m.update(packing.metrics([p["layout"] for p in by_rank], [p["logprob_layout"] for p in by_rank]))
    if "rows" in layout:  # train.skip_zero_advantage: what the step left out (recipes/skipping.py)
        m.update(skipping.metrics([p["layout"] for p in by_rank], num_tokens))
    m.update(sampling.metrics([p["sampling"] for p in by_rank], drawn))  # dynamic sampling, when on
    return m
