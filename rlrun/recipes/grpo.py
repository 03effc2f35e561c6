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
from collections import Counter, deque
from dataclasses import dataclass, field

import numpy as np
import torch

from .. import activations, evaluate, logprobs, losses, models, pipeline, ranks, tasks
from .. import batching as packing
from ..losses import agg
from ..runner import Data, Frame, check_finite, meter_metrics, no_held_out, setup, timed
from . import sampling
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


def response_hidden(backbone, micro: Micro):
    """Hidden states that predict the response tokens, flattened to [N, H]."""
    h = models.hidden_states(backbone, micro.input_ids, micro.attention_mask)
    p = micro.prompt_len
    return h[:, p - 1 : -1].reshape(-1, h.shape[-1])


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


@torch.no_grad()
def logprob_pass(model, micros: list[Micro], head, size, temperature: float, batching, agree=None,
                 counts: dict | None = None) -> list[torch.Tensor]:
    """Per-token logprobs of each micro-batch's response under `model` (no grad, through the head); packed and
    shared_prompt compute them in packs and put them back in each micro-batch's layout (0 where masked), as many
    packs on every rank (`agree`: n -> the largest n over ranks). `counts`: the pass's layout (packing.count)."""
    backbone, weight = models.split(model)
    if batching.name == "padded":
        for m in micros:
            packing.count(counts, m.input_ids.numel(), m.input_ids.shape[0])
        return [head.logprobs(response_hidden(backbone, m), weight, m.targets, temperature, size) for m in micros]
    out = [torch.zeros_like(m.gen_logprobs) for m in micros]
    for p in packing.packs(micros, batching.name == "shared_prompt", batching.max_tokens, agree):
        packing.count_pack(counts, p)
        targets = packing.gather(p, [m.targets for m in micros])
        packing.scatter(p, head.logprobs(packing.hidden(backbone, p), weight, targets, temperature, size), out)
    return out


FIELDS = ("targets", "advantages", "old_logprobs", "ref_logprobs", "gen_logprobs", "is_weights", "weights", "seq")


def forwards(backbone, micros: list[Micro], batching, counts: dict, agree=None):
    """(hidden states, per-token tensors, mask, boundary) of each forward of a training pass: one per micro-batch
    (padded; boundary None: the engine counts them) or one per pack (rlrun.batching; boundary True on the last);
    `counts` gets the positions computed and the forwards made."""
    if batching.name == "padded":
        for mb in micros:
            packing.count(counts, mb.input_ids.numel(), mb.input_ids.shape[0])
            yield response_hidden(backbone, mb), {f: getattr(mb, f) for f in FIELDS}, mb.mask, None
        return
    for p, t, last in packing.forwards(micros, batching, FIELDS, counts, agree):
        yield packing.hidden(backbone, p), t, torch.ones_like(t["targets"], dtype=torch.bool), last


def mismatch(micros: list[Micro]) -> np.ndarray:
    """Generation vs trainer old-policy logprobs: sums of |diff| and exp|diff| and the token count, to be summed
    over rollouts and ranks; their means are `mismatch/gen_vs_train_abs` and NeMo-RL's token_mult_prob_error."""
    diff = torch.cat([(m.gen_logprobs - m.old_logprobs)[m.mask] for m in micros]).abs().double()
    return np.array([diff.sum().item(), diff.exp().sum().item(), diff.numel()])


def train(cfg, raw, tracker, resume: dict | None = None) -> dict[str, float]:
    """GRPO. `resume`: a checkpoint's state, to continue that run exactly where it stopped."""
    t = cfg.train
    world = ranks.world_size()
    grad_accum = t.batch_size // (t.micro_batch * world)  # micro-batches per rank per optimizer step
    window = (t.rollout_batch // world // t.micro_batch) * t.num_iterations  # a rollout's micro-steps per rank

    def load(tokenizer, context):
        task = tasks.load(cfg.task, cfg.seed, tokenizer)
        warnings = tasks.check_lengths(task, tokenizer, cfg.rollout.max_new_tokens, context)
        return Data(task, warm_rows=task.train, plan_rows=task.train, warnings=warnings)

    s = setup(cfg, tracker, load=load, grad_accum=grad_accum, resume=resume,
              with_rollout=cfg.rollout.pipeline == "sync",  # async: the generator builds its own
              with_reference=logprobs.needs_reference_model(cfg.logprob_policy.name, cfg.loss.kl_coef))
    frame, engine, task = Frame(cfg, raw, tracker, s, curve="reward_mean"), s.engine, s.data
    prompts = tasks.prompt_stream(task.train, cfg.seed)  # the same stream on every rank; each takes its slice
    buffer, passes = RolloutBuffer(window), logprobs.PassCounter()
    stateful = {"prompts": prompts, "buffer": buffer, "passes": passes}
    pipe = None  # rollout.pipeline=async: the generator process, ahead of the trainer (rlrun/pipeline)
    if cfg.rollout.pipeline == "async":
        pipe = stateful["pipeline"] = pipeline.Pipeline(cfg, window=window, grad_accum=grad_accum,
                                                        device=engine.device)
    drawn = sampling.Totals() if t.dynamic_sampling else None  # groups generated and dropped over the run
    if drawn is not None:
        stateful["sampling"] = drawn
    start = frame.restore(resume, stateful)
    synced_at = start  # the rollout engine holds the weights after this many optimizer steps

    # the rewards run in a worker process: bounded, and unable to end or hold up the run (rlrun/tasks/worker.py)
    with tasks.isolated(task, cfg.task.reward_timeout_s, cfg.seed), \
            contextlib.closing(frame.steps(start, stateful, "rlrun", held_out(cfg, frame, s))) as steps, \
            contextlib.ExitStack() as cleanup:
        if pipe is not None:
            cleanup.callback(pipe.close)  # however the loop ends (error, Ctrl-C, SIGTERM): no process left behind
            with timed(tracker, "generator_start"):  # its own interpreter, model and rollout engine
                pipe.start(engine.model, start)
        for step in steps:
            # 1. Refill: generate (or take from the generator process), score, advantages, the logprob passes needed.
            got, synced_at = refill(cfg, s, prompts, buffer, pipe, step, synced_at, drawn)

            # 2. Train: one optimizer step over grad_accum micro-batches, loss normalised by the step's token count.
            micros = buffer.take(grad_accum)
            got.ages = [step - mb.version for mb in micros]
            loss_total, num_tokens, parts, layout = train_step(cfg, s, micros, step)
            grad_norm = engine.step()

            # 3. Metrics over all ranks. A metric that needs a skipped pass is absent, never a zero that looks real.
            m = step_metrics(frame, passes, got, loss_total, num_tokens, parts, grad_norm, layout, drawn)
            frame.log(step, m, reward=f"{m.get('reward_mean', float('nan')):.3f}", loss=f"{m['loss']:.4f}",
                      tok_s=f"{m['throughput/train_tokens_per_s']:.0f}")
            if cfg.log.samples_every and step % cfg.log.samples_every == 0 and got.samples:
                frame.samples(step, got.samples, "train")
        return frame.finish()


def refill(cfg, s, prompts, buffer: RolloutBuffer, pipe, step: int, synced_at: int, drawn=None):
    """Rollouts until the buffer holds this optimizer step's micro-batches: generated here with the current weights
    (sync; with train.dynamic_sampling, as many rounds as needed), or taken in order from the generator process
    (async). Returns what they contribute to the step's metrics, and the step whose weights the rollout engine
    holds. `drawn`: dynamic sampling's totals over the run."""
    got, meter = StepRollouts(), s.meter
    if pipe is not None:  # request what the next steps train on, publishing these weights if needed
        pipe.ahead(step, s.engine.model, lambda r: sampling.prompts_of(cfg, s, prompts, r), meter)
    while len(buffer) < s.grad_accum:
        if pipe is not None:
            with meter.phase("wait"):  # the trainer idles until the generator has it
                g = pipe.take()
            got.worker.append((g.busy_s, g.idle_s))
            consume(cfg, s, sampling.scored(cfg, s, g.rows, g.rollout), buffer, got, g.version)
            continue
        if s.rollout.needs_sync and synced_at != step and cfg.rollout.sync_weights:
            with meter.phase("sync"), s.engine.generation():  # only when a step changed the weights
                s.rollout.sync(s.engine.model)
            synced_at = step
        # generated and scored; with train.dynamic_sampling, more rounds until the rollout's groups carry a signal
        consume(cfg, s, sampling.draw(cfg, s, prompts, buffer.rollouts, got.sampling, drawn), buffer, got, step)
    return got, synced_at


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
                                     top_p=r.top_p, seed=cfg.seed, show=cfg.log.samples,
                                     accuracy_reward=cfg.eval.accuracy_reward,
                                     accuracy_threshold=cfg.eval.accuracy_threshold)

    return run


def consume(cfg, s, d, buffer: RolloutBuffer, got: StepRollouts, version: int) -> None:
    """One generated and scored rollout (`d`: recipes/sampling.Drawn, drawn by the weights after `version` optimizer
    steps): given advantages and the logprob passes the policy needs, enqueued. Adds what it contributes to the
    step's metrics to `got`."""
    t, engine, meter = cfg.train, s.engine, s.meter
    d = sampling.balanced(cfg, s, d, got.layout)  # ranks' token loads even (packed / shared_prompt)
    rows, roll, totals, by_reward = d.rows, d.roll, d.totals, d.by_reward
    reward = torch.tensor(totals, dtype=torch.float32)
    advantages = group_advantages(d.shaped, t.group_size, t.scale_advantages).to(engine.device)  # + overlong penalty
    micros = split_rollout(sampling.trained(roll, t, got.sampling), advantages, t.micro_batch)  # overlong=filter
    tis = cfg.loss.tis
    need = logprobs.plan(cfg.logprob_policy.name, start=buffer.enqueued, window=buffer.window,
                         grad_accum=s.grad_accum, ref_coef=cfg.loss.kl_coef,
                         old_before_loss=tis.enabled and tis.level == "sequence")
    temperature = cfg.rollout.temperature
    got.counts.update({"old_run": int(need.old), "old_skipped": int(not need.old), "ref_run": int(need.ref),
                       "ref_skipped": int(not need.ref)})
    got.gen_tokens += int(roll.response_mask.sum())
    with meter.phase("offload"):
        engine.offload()
    if need.old:
        with meter.phase("old_logprobs"):
            for mb, lp in zip(micros, logprob_pass(engine.model, micros, s.head, s.head_size, temperature, cfg.batching,
                                                   packing.agree(engine), got.layout.setdefault("old", {}))):
                mb.old_logprobs = lp
        got.mismatch += mismatch(micros)
    if need.ref:
        with meter.phase("ref_logprobs"):
            with models.reference(engine) as reference:
                for mb, lp in zip(micros, logprob_pass(reference, micros, s.head, s.head_size, temperature,
                                                       cfg.batching, packing.agree(engine),
                                                       got.layout.setdefault("ref", {}))):
                    mb.ref_logprobs = lp
    with meter.phase("onload"):
        engine.onload()
    for mb in micros:
        mb.version = version
        if tis.enabled and tis.level == "sequence":
            mb.is_weights = losses.sequence_is_weights(mb.old_logprobs, mb.gen_logprobs, mb.mask,
                                                       mb.input_ids.shape[0], tis.mode, tis.cap, tis.low)
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
    lcfg, engine = cfg.loss, s.engine
    backbone, weight = models.split(engine.model)
    tis = lcfg.tis
    loss_kwargs = dict(clip_low=lcfg.clip_low, clip_high=lcfg.clip_high, kl_coef=lcfg.kl_coef,
                       kl_estimator=lcfg.kl_estimator, entropy_coef=lcfg.entropy_coef,
                       tis_cap=tis.cap if tis.enabled and tis.level == "token" else None, tis_mode=tis.mode,
                       tis_low=tis.low)
    # loss.agg's weights over the step's micro-batches and ranks (token_mean: the heads divide by the token count)
    micros, divisor, num_tokens = agg.prepare(micros, lcfg.agg, lcfg.agg_max_tokens or cfg.rollout.max_new_tokens,
                                              engine.gather, lcfg.name == "gspo")
    stats_parts, masks, loss_total = [], [], 0.0
    layout = {"real": sum(int(mb.attention_mask.sum()) for mb in micros)}  # tokens that are not padding
    with s.meter.phase("train"), activations.saving(cfg.activations, engine.device):
        for hidden, t, mask, boundary in forwards(backbone, micros, cfg.batching, layout, packing.agree(engine)):
            objective = losses.objective(lcfg.name, t["advantages"], t["old_logprobs"], t["ref_logprobs"],
                                         t["gen_logprobs"], is_weights=t["is_weights"], weights=t["weights"],
                                         seq=t["seq"], mask=mask, **loss_kwargs)
            loss, stats = s.head.loss(hidden, weight, t["targets"], mask, objective, divisor,
                                      cfg.rollout.temperature, s.head_size)
            check_finite(loss, step, "lower train.lr or train.grad_clip, or check the reward function.")
            engine.backward(loss, boundary)
            loss_total += loss.item()
            stats_parts.append({k: v.detach().cpu() for k, v in stats.items()})
            masks.append(mask.cpu())
    stats = {k: torch.cat([s[k] for s in stats_parts]) for k in stats_parts[0]}
    return loss_total, num_tokens, losses.partials(stats, torch.cat(masks)), layout


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
    mism = sum(p["mismatch"] for p in by_rank)
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
    m.update(sampling.metrics([p["sampling"] for p in by_rank], drawn))  # dynamic sampling, when on
    return m
