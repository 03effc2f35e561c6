"""The training loops: `train` (GRPO: dapo, cispo) and `train_dpo` (DPO). Read each top to bottom.

Schedule: `train.steps` optimizer steps. Each optimizer step consumes `grad_accum = batch_size / micro_batch`
micro-batches from a queue; when the queue runs short, a rollout of `rollout_batch` sequences is generated with
the current weights, scored, given group-normalised advantages, given whatever old-policy / reference logprobs
the logprob policy says it needs, and enqueued `num_iterations` times. So an optimizer step may span rollouts and
a rollout may span optimizer steps, exactly as in TRL's step schedule, and the window policy's decision is exact.

Everything that touches weights goes through the engine (engine/single.py, engine/deepspeed.py). Data parallel:
batch sizes are global and `micro_batch` is per rank; every rank reads the same prompt stream and takes its slice
of each rollout (whole prompt groups) or DPO batch; the step's token count and the metrics are gathered over ranks.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import random
from collections import Counter, deque
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from . import checkpoint, heads, logprobs, losses, models, registry, tasks
from .losses.dpo import dpo_loss, sequence_logprobs
from .meters import Meter

log = logging.getLogger(__name__)


class NonFiniteLossError(FloatingPointError):
    pass


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


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


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
def logprob_pass(model, micros: list[Micro], head, head_cfg, temperature: float) -> list[torch.Tensor]:
    """Per-token logprobs of each micro-batch's response under `model` (no grad, through the head)."""
    backbone, weight = models.split(model)
    return [head.logprobs(response_hidden(backbone, m), weight, m.targets, temperature, head_cfg.size)
            for m in micros]


def mismatch(micros: list[Micro]) -> np.ndarray:
    """Generation vs trainer old-policy logprobs: sums of |diff| and exp|diff| and the token count, to be summed
    over rollouts and ranks; their means are `mismatch/gen_vs_train_abs` and NeMo-RL's token_mult_prob_error."""
    diff = torch.cat([(m.gen_logprobs - m.old_logprobs)[m.mask] for m in micros]).abs().double()
    return np.array([diff.sum().item(), diff.exp().sum().item(), diff.numel()])


def sample_seed(seed: int, rollout: int, row: int) -> int:
    """The sampling seed of one sequence: fixed by (run seed, rollout number, row in the global rollout), so the
    same sequence is drawn whichever rank generates it."""
    return int(np.random.SeedSequence(seed, spawn_key=(rollout, row)).generate_state(1)[0])


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None:
        torch.cuda.set_rng_state_all(state["cuda"])


def restore(resume: dict | None, engine, stream) -> int:
    """Load a checkpoint's state into the run's objects; returns the step to continue from (0 if none)."""
    if resume is None:
        return 0
    engine.load_state_dict(resume)
    stream.load_state_dict(resume["stream"])
    set_rng_state(resume["rng"])
    return resume["step"]


def maybe_checkpoint(cfg, engine, step: int, stop: bool, state_fn) -> None:
    """Write a checkpoint after `step` when it is due (every N steps, the last step, or a stop signal)."""
    c = cfg.checkpoint
    done = step + 1
    stop = any(engine.gather(stop))  # a signal that reached one rank stops all of them after the same step
    if c.dir and ((c.every and done % c.every == 0) or done == cfg.train.steps or stop):
        path = engine.save(c.dir, done, state_fn(done), c.keep)
        if path:
            log.info("checkpoint %s", path)
    if stop:
        raise KeyboardInterrupt


def snapshot(step, cfg, stream, tracker, **extra) -> dict:
    """The loop's own state; the engine adds the model's and optimizer's when it saves."""
    return {"step": step, "stream": stream.state_dict(), "rng": rng_state(),
            "run_id": tracker.run_id, "config": cfg_flat(cfg), **extra}


def cfg_flat(cfg) -> dict[str, str]:
    from omegaconf import OmegaConf

    from .tracking import flatten

    return flatten(OmegaConf.to_container(cfg, resolve=True))


def setup(cfg, tracker, grad_accum: int, with_reference: bool, reference_path: str | None = None):
    """Seeded policy (and frozen reference), tokenizer, and the engine that owns them (shared by both loops)."""
    seed_everything(cfg.seed)
    policy, tokenizer = models.build(cfg.model, cfg.seed)
    reference = frozen_reference(policy, reference_path, cfg.model.dtype) if with_reference else None
    engine = registry.get("engine", cfg.engine.name).Engine(cfg, policy, reference, grad_accum)
    tracker.tags({"rlrun.device": engine.device.type, "rlrun.torch": torch.__version__,
                  "rlrun.world_size": str(engine.world)})
    if cfg.offload.enabled and not engine.offload_effective():
        log.info("offload=on on a CPU-only run: optimizer state already lives in host memory, nothing moves.")
        tracker.tags({"offload.effective": "false"})
    return engine, tokenizer


def frozen_reference(policy, path: str | None, dtype: str):
    """The reference model: a frozen copy of the initial policy, or a local checkpoint."""
    ref = models.load_hf(path, dtype)[0] if path else copy.deepcopy(policy)
    return ref.requires_grad_(False)


def meter_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """Per-rank meter readings -> the slowest rank's times, the largest peak, and each rank's peaks (world > 1)."""
    out = {k: max(p[k] for p in parts if k in p) for k in {k for p in parts for k in p}}
    if len(parts) > 1:
        for r, p in enumerate(parts):
            out.update({f"{k.replace('mem/', f'mem/rank{r}/')}": v for k, v in p.items() if k.startswith("mem/")})
    return out


def train(cfg, tracker, resume: dict | None = None) -> dict[str, float]:
    """GRPO. `resume`: a checkpoint's state, to continue that run exactly where it stopped."""
    if cfg.loss.name == "dpo":
        return train_dpo(cfg, tracker, resume)
    t, lcfg = cfg.train, cfg.loss
    world = registry.get("engine", cfg.engine.name).world_size()
    grad_accum = t.batch_size // (t.micro_batch * world)  # micro-batches per rank per optimizer step
    window = (t.rollout_batch // world // t.micro_batch) * t.num_iterations  # a rollout's micro-steps per rank
    policy_name = cfg.logprob_policy.name
    engine, tokenizer = setup(cfg, tracker, grad_accum, logprobs.needs_reference_model(policy_name, lcfg.kl_coef))
    policy, reference, device = engine.model, engine.reference, engine.device
    examples, reward_fn = tasks.build(cfg.task, cfg.seed)
    prompts = tasks.prompt_stream(examples, cfg.seed)  # the same stream on every rank; each takes its slice
    per_rank = t.rollout_batch // t.group_size // world  # prompts per rank per rollout (groups never split)
    head = heads.HEADS[cfg.head.name]
    backbone, weight = models.split(policy)

    temperature = cfg.rollout.temperature
    loss_kwargs = dict(clip_low=lcfg.clip_low, clip_high=lcfg.clip_high, kl_coef=lcfg.kl_coef,
                       kl_estimator=lcfg.kl_estimator, tis_cap=lcfg.tis.cap if lcfg.tis.enabled else None)
    queue: deque[Micro] = deque()
    enqueued = 0  # micro-steps enqueued so far = start of the next rollout's window
    totals: Counter = Counter()
    pass_seconds: Counter = Counter()  # time spent in each kind of logprob pass, for the saved-time estimate
    history: list[dict[str, float]] = []
    meter = Meter(device)
    start = restore(resume, engine, prompts)
    with engine.generation():  # ZeRO-3: the engine copies full weights
        rollout = registry.get("rollout", cfg.rollout.name).build(cfg.rollout, policy, tokenizer, device)
    synced_at = start  # the rollout engine holds the weights after this many optimizer steps
    if resume is not None:
        queue.extend(Micro(**m) for m in resume["queue"])
        enqueued, history = resume["enqueued"], resume["history"]
        totals, pass_seconds = Counter(resume["totals"]), Counter(resume["pass_seconds"])

    def state(done):
        return snapshot(done, cfg, prompts, tracker, history=history,
                        queue=[dataclasses.asdict(m) for m in queue], enqueued=enqueued, totals=dict(totals),
                        pass_seconds=dict(pass_seconds))

    bar = tqdm(range(start, t.steps), desc="rlrun", unit="step", dynamic_ncols=True,
               disable=not (cfg.progress and engine.main), initial=start, total=t.steps)
    with checkpoint.deferred_interrupts() as signals:
        for step in bar:
            meter.new_step()
            m: dict[str, float] = {}
            rewards, lengths, gen_tokens, finished, mism, counts = [], [], 0, [], np.zeros(3), Counter()

            # 1. Refill: generate, score, advantages, and only the logprob passes this rollout needs.
            while len(queue) < grad_accum:
                batch = [next(prompts) for _ in range(t.rollout_batch // t.group_size)]
                batch = batch[engine.rank * per_rank : (engine.rank + 1) * per_rank]
                first_row = engine.rank * per_rank * t.group_size
                rollout_index = enqueued // window
                seeds = [sample_seed(cfg.seed, rollout_index, first_row + i) for i in range(len(batch) * t.group_size)]
                if rollout.needs_sync and synced_at != step and cfg.rollout.get("sync_weights", True):
                    with meter.phase("sync"), engine.generation():  # only when a step changed the weights
                        rollout.sync(policy)
                    synced_at = step
                with meter.phase("generate"), engine.generation():
                    roll = rollout.generate(policy, [ex["prompt"] for ex in batch for _ in range(t.group_size)], seeds)
                answers = [ex["answer"] for ex in batch for _ in range(t.group_size)]
                reward = torch.tensor([reward_fn(c, a) for c, a in zip(roll.completions, answers)], dtype=torch.float32)
                advantages = group_advantages(reward, t.group_size, t.scale_advantages).to(device)
                micros = split_rollout(roll, advantages, t.micro_batch)
                need = logprobs.plan(policy_name, start=enqueued, window=window, grad_accum=grad_accum,
                                     ref_coef=lcfg.kl_coef)
                with meter.phase("offload"):
                    engine.offload()
                if need.old:
                    with meter.phase("old_logprobs"):
                        for mb, lp in zip(micros, logprob_pass(policy, micros, head, cfg.head, temperature)):
                            mb.old_logprobs = lp
                    mism += mismatch(micros)
                if need.ref:
                    with meter.phase("ref_logprobs"):
                        for mb, lp in zip(micros, logprob_pass(reference, micros, head, cfg.head, temperature)):
                            mb.ref_logprobs = lp
                with meter.phase("onload"):
                    engine.onload()
                counts.update({"old_run": need.old, "old_skipped": not need.old,
                               "ref_run": need.ref, "ref_skipped": not need.ref})
                rewards.append(reward)
                lengths.append(roll.response_mask.sum(1).float())
                finished.append(roll.finished.float())
                gen_tokens += int(roll.response_mask.sum())
                for _ in range(t.num_iterations):
                    queue.extend(micros)
                enqueued += window

            # 2. Train: one optimizer step over grad_accum micro-batches, loss normalised by the step's token count.
            step_micros = [queue.popleft() for _ in range(grad_accum)]
            num_tokens = max(sum(engine.gather(sum(int(mb.mask.sum()) for mb in step_micros))), 1)  # all ranks
            stats_parts, masks, loss_total = [], [], 0.0
            with meter.phase("train"):
                for mb in step_micros:
                    objective = losses.objective(lcfg.name, mb.advantages, mb.old_logprobs, mb.ref_logprobs,
                                                 mb.gen_logprobs, **loss_kwargs)
                    hidden = response_hidden(backbone, mb)
                    loss, stats = head.loss(hidden, weight, mb.targets, mb.mask, objective, num_tokens,
                                            temperature, cfg.head.size)
                    if not torch.isfinite(loss):
                        raise NonFiniteLossError(f"loss is {loss.item()} at step {step}; lower train.lr or "
                                                 "train.grad_clip, or check the reward function.")
                    engine.backward(loss)
                    loss_total += loss.item()
                    stats_parts.append({k: v.detach().cpu() for k, v in stats.items()})
                    masks.append(mb.mask.cpu())
                grad_norm = engine.step()

            # 3. Metrics over all ranks. A metric that needs a skipped pass is absent, never a zero that looks real.
            ranks = engine.gather({
                "loss": loss_total, "stats": {k: torch.cat([s[k] for s in stats_parts]) for k in stats_parts[0]},
                "mask": torch.cat(masks), "rewards": rewards, "lengths": lengths, "finished": finished,
                "gen_tokens": gen_tokens, "mism": mism, "meter": meter.metrics()})
            stats = {k: torch.cat([p["stats"][k] for p in ranks]) for k in ranks[0]["stats"]}
            mask = torch.cat([p["mask"] for p in ranks])
            m.update({"loss": sum(p["loss"] for p in ranks), **losses.summarize(stats, mask),
                      "grad_norm": grad_norm, "lr": engine.lr()})
            if rewards:
                r = torch.cat([x for p in ranks for x in p["rewards"]])
                m.update({"reward_mean": r.mean().item(), "reward_std": r.std().item(),
                          "solved_frac": (r >= 1.0).float().mean().item(),  # completions with full reward
                          "response_len_mean": torch.cat([x for p in ranks for x in p["lengths"]]).mean().item(),
                          "finished_frac": torch.cat([x for p in ranks for x in p["finished"]]).mean().item()})
            mism = sum(p["mism"] for p in ranks)
            if mism[2]:
                m["mismatch/gen_vs_train_abs"], m["mismatch/token_mult_prob_error"] = mism[:2] / mism[2]
            gen_tokens = sum(p["gen_tokens"] for p in ranks)
            totals.update(counts)
            for key in ("old_run", "old_skipped", "ref_run", "ref_skipped"):
                m[f"passes/{key}"] = counts[key]
                m[f"passes/{key}_total"] = totals[key]
            for kind in ("old", "ref"):
                pass_seconds[kind] += meter.seconds.get(f"{kind}_logprobs", 0.0)
                if counts[f"{kind}_skipped"] and totals[f"{kind}_run"]:
                    # estimated from this run's own passes of that kind; a run that never ran one (skip) has no
                    # estimate: compare it with an `always` run instead (sweeps/logprob_policies.yaml)
                    per_pass = pass_seconds[kind] / totals[f"{kind}_run"]
                    m[f"passes/{kind}_saved_s_est"] = counts[f"{kind}_skipped"] * per_pass
            m.update(meter_metrics([p["meter"] for p in ranks]))
            if gen_tokens:
                m["throughput/gen_tokens_per_s"] = gen_tokens / m["time/generate_s"]
            m["throughput/train_tokens_per_s"] = num_tokens / m["time/train_s"]
            m["train_tokens"] = num_tokens
            history.append(m)
            tracker.log(step, m)
            bar.set_postfix(reward=f"{m.get('reward_mean', float('nan')):.3f}", loss=f"{m['loss']:.4f}",
                            tok_s=f"{m['throughput/train_tokens_per_s']:.0f}")
            maybe_checkpoint(cfg, engine, step, signals["stop"], state)
    return summarize_run(history, "reward_mean")


@dataclass
class Pairs:
    """Chosen then rejected sequences of a batch of preference pairs, right-padded, response tokens flattened."""

    ids: list[int]  # pair ids (for the reference cache)
    input_ids: torch.Tensor  # [2B, T]
    attention_mask: torch.Tensor  # [2B, T]
    predicts: torch.Tensor  # [2B, T-1] bool: hidden state at t predicts a response token at t+1
    targets: torch.Tensor  # [N] response tokens (EOS included)
    seq_index: torch.Tensor  # [N] which of the 2B sequences each token belongs to
    lengths: torch.Tensor  # [2B] response tokens per sequence


def encode_pairs(tokenizer, pairs: list[dict], device) -> Pairs:
    rows, starts = [], []
    for side in ("chosen", "rejected"):
        for p in pairs:
            prompt = tokenizer(p["prompt"], add_special_tokens=False).input_ids
            rows.append(prompt + tokenizer(p[side], add_special_tokens=False).input_ids + [tokenizer.eos_token_id])
            starts.append(len(prompt))
    width = max(map(len, rows))
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    response = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, (row, start) in enumerate(zip(rows, starts)):
        input_ids[i, : len(row)] = torch.tensor(row)
        response[i, start : len(row)] = True
    attention = (torch.arange(width)[None] < torch.tensor(list(map(len, rows)))[:, None]).long()
    predicts = response[:, 1:]
    return Pairs(
        ids=[p["id"] for p in pairs],
        input_ids=input_ids.to(device),
        attention_mask=attention.to(device),
        predicts=predicts.to(device),
        targets=input_ids[:, 1:][predicts].to(device),
        seq_index=torch.arange(len(rows))[:, None].expand_as(predicts)[predicts].to(device),
        lengths=response.sum(1).to(device),
    )


def pair_logprobs(model, batch: Pairs, head, head_cfg, average: bool):
    """(chosen, rejected) sequence logprobs [B] each, through the head (grad if enabled)."""
    backbone, weight = models.split(model)
    hidden = models.hidden_states(backbone, batch.input_ids, batch.attention_mask)[:, :-1][batch.predicts]
    token_lp = head.logprobs(hidden, weight, batch.targets, 1.0, head_cfg.size)
    seq = sequence_logprobs(token_lp, batch.seq_index, len(batch.lengths), batch.lengths, average)
    b = len(batch.ids)
    return seq[:b], seq[b:]


def train_dpo(cfg, tracker, resume: dict | None = None) -> dict[str, float]:
    """DPO: batches of (prompt, chosen, rejected), a frozen reference, the sigmoid loss on the log-ratio margin.

    Logprob policy: `always` computes the reference logprobs of every batch; `window` computes them once per pair
    and reuses them in later epochs (the reference never changes); `skip` is refused by the validator.
    """
    t, lcfg = cfg.train, cfg.loss
    world = registry.get("engine", cfg.engine.name).world_size()
    engine, tokenizer = setup(cfg, tracker, t.batch_size // (t.micro_batch * world), True, lcfg.reference_path)
    policy, reference, device = engine.model, engine.reference, engine.device
    pairs = [dict(p, id=i) for i, p in enumerate(tasks.build_pairs(cfg.task, cfg.seed))]
    stream = tasks.prompt_stream(pairs, cfg.seed)  # the same stream on every rank; each takes its slice
    per_rank = t.batch_size // world
    head = heads.HEADS[cfg.head.name]
    cache: dict[int, tuple[float, float]] = {}  # window: reference logprobs per pair id (this rank's pairs)
    meter, history, totals = Meter(device), [], Counter()
    start = restore(resume, engine, stream)
    if resume is not None:
        cache, history, totals = resume["cache"], resume["history"], Counter(resume["totals"])

    def state(done):
        return snapshot(done, cfg, stream, tracker, history=history, cache=cache, totals=dict(totals))

    bar = tqdm(range(start, t.steps), desc="rlrun dpo", unit="step", dynamic_ncols=True,
               disable=not (cfg.progress and engine.main), initial=start, total=t.steps)
    with checkpoint.deferred_interrupts() as signals:
        for step in bar:
            meter.new_step()
            batch = [next(stream) for _ in range(t.batch_size)][engine.rank * per_rank : (engine.rank + 1) * per_rank]
            micro_pairs = [batch[i : i + t.micro_batch] for i in range(0, len(batch), t.micro_batch)]

            # 1. Reference logprobs: every batch (always) or once per pair (window).
            known = cache if cfg.logprob_policy.name == "window" else {}
            todo = [p for p in batch if p["id"] not in known]
            with meter.phase("offload"):
                engine.offload()
            fresh = {}
            with meter.phase("ref_logprobs"), torch.no_grad():
                for i in range(0, len(todo), t.micro_batch):
                    chunk = encode_pairs(tokenizer, todo[i : i + t.micro_batch], device)
                    chosen, rejected = pair_logprobs(reference, chunk, head, cfg.head, lcfg.average_logprobs)
                    fresh.update({pid: (c, r) for pid, c, r in zip(chunk.ids, chosen.tolist(), rejected.tolist())})
            known.update(fresh)
            with meter.phase("onload"):
                engine.onload()
            counts = Counter({"ref_run": len(todo), "ref_skipped": len(batch) - len(todo)})

            # 2. Train: one optimizer step over the batch; each micro-batch's loss is its share of the batch mean.
            parts, tokens = [], 0
            with meter.phase("train"):
                for chunk_pairs in micro_pairs:
                    mb = encode_pairs(tokenizer, chunk_pairs, device)
                    chosen, rejected = pair_logprobs(policy, mb, head, cfg.head, lcfg.average_logprobs)
                    ref = torch.tensor([known[pid] for pid in mb.ids], device=device, dtype=chosen.dtype)
                    nll = None
                    if lcfg.sft_coef:  # per-token NLL of the chosen response
                        summed = chosen if not lcfg.average_logprobs else chosen * mb.lengths[: len(mb.ids)]
                        nll = -summed / mb.lengths[: len(mb.ids)]
                    loss, metrics = dpo_loss(chosen, rejected, ref[:, 0], ref[:, 1], beta=lcfg.beta,
                                             label_smoothing=lcfg.label_smoothing, chosen_nll=nll,
                                             sft_coef=lcfg.sft_coef, num_pairs=t.batch_size)
                    if not torch.isfinite(loss):
                        raise NonFiniteLossError(f"loss is {loss.item()} at step {step}; lower train.lr.")
                    engine.backward(loss)
                    parts.append((len(chunk_pairs), metrics))
                    tokens += int(mb.lengths.sum())
                grad_norm = engine.step()

            ranks = engine.gather({"parts": parts, "tokens": tokens, "counts": counts, "meter": meter.metrics()})
            parts = [part for p in ranks for part in p["parts"]]
            tokens, counts = sum(p["tokens"] for p in ranks), sum((p["counts"] for p in ranks), Counter())
            m = {k: sum(n * mt[k] for n, mt in parts) / t.batch_size for k in parts[0][1] if k != "loss"}
            m.update({"loss": sum(mt["loss"] for _, mt in parts), "grad_norm": grad_norm,
                      "lr": engine.lr(), "train_tokens": tokens})
            totals.update(counts)
            for key in ("ref_run", "ref_skipped"):
                m[f"passes/{key}"] = counts[key]
                m[f"passes/{key}_total"] = totals[key]
            m.update(meter_metrics([p["meter"] for p in ranks]))
            m["throughput/train_tokens_per_s"] = tokens / m["time/train_s"]
            history.append(m)
            tracker.log(step, m)
            bar.set_postfix(acc=f"{m['rewards/accuracy']:.2f}", loss=f"{m['loss']:.4f}",
                            tok_s=f"{m['throughput/train_tokens_per_s']:.0f}")
            maybe_checkpoint(cfg, engine, step, signals["stop"], state)
    return summarize_run(history, "rewards/accuracy")


def summarize_run(history: list[dict[str, float]], curve: str) -> dict[str, float]:
    """Run-level numbers: mean throughput, max peak memory per phase, pass counts, first and last of `curve`."""
    def mean(key):
        vals = [h[key] for h in history if key in h and math.isfinite(h[key])]
        return float(np.mean(vals)) if vals else None

    out = {"gen_tokens_per_s": mean("throughput/gen_tokens_per_s"),
           "train_tokens_per_s": mean("throughput/train_tokens_per_s"),
           "step_s": mean("time/step_s")}
    for key in {k for h in history for k in h if k.startswith("mem/")}:
        out[key.replace("mem/", "max_")] = max(h[key] for h in history if key in h)
    last = history[-1]
    for key in last:
        if key.startswith("passes/") and key.endswith("_total"):
            out["passes_" + key.removeprefix("passes/").removesuffix("_total")] = last[key]
    values = [h[curve] for h in history if curve in h]
    if values:
        name = curve.split("/")[-1].replace("_mean", "")
        out[f"{name}_first"] = float(np.mean(values[:3]))
        out[f"{name}_last"] = float(np.mean(values[-3:]))
    out["loss_last"] = last["loss"]
    return {k: v for k, v in out.items() if v is not None}
