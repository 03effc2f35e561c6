"""DPO (loss=dpo): batches of (prompt, chosen, rejected), a frozen reference, the sigmoid loss on the log-ratio margin.

Logprob policy: `always` computes the reference logprobs of every batch; `window` computes them once per pair and
reuses them in later epochs (the reference never changes); `skip` is refused by the validator.
Data parallel: every rank reads the same pair stream and takes its slice of each batch; metrics are reduced over
ranks as per-micro-batch means weighted by their pair counts.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass

import torch

from .. import evaluate, models, ranks, registry, tasks
from ..losses.dpo import sequence_logprobs
from ..runner import Frame, check_finite, meter_metrics


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


def pair_logprobs(model, batch: Pairs, head, size, average: bool, entropy: list | None = None):
    """(chosen, rejected) sequence logprobs [B] each, through the head (grad if enabled). `entropy`: a list to
    append this batch's (sum of token entropies, token count) to."""
    backbone, weight = models.split(model)
    hidden = models.hidden_states(backbone, batch.input_ids, batch.attention_mask)[:, :-1][batch.predicts]
    if entropy is None:
        token_lp = head.logprobs(hidden, weight, batch.targets, 1.0, size)
    else:
        token_lp, ent = head.logprobs(hidden, weight, batch.targets, 1.0, size, with_entropy=True)
        entropy.append((ent.double().sum().item(), ent.numel()))
    seq = sequence_logprobs(token_lp, batch.seq_index, len(batch.lengths), batch.lengths, average)
    b = len(batch.ids)
    return seq[:b], seq[b:]


class ReferenceCache:
    """Reference (chosen, rejected) logprobs per pair id of this rank's pairs (`window`: computed once per pair),
    and the count of reference passes run and skipped."""

    def __init__(self):
        self.values: dict[int, tuple[float, float]] = {}
        self.totals: Counter = Counter()

    def state_dict(self) -> dict:
        return {"values": dict(self.values), "totals": dict(self.totals)}

    def load_state_dict(self, state: dict) -> None:
        self.values, self.totals = dict(state["values"]), Counter(state["totals"])


def train(cfg, raw, tracker, resume: dict | None = None) -> dict[str, float]:
    t, lcfg = cfg.train, cfg.loss
    world = ranks.world_size()
    frame = Frame(cfg, raw, tracker, curve="rewards/accuracy")
    train_pairs, eval_pairs = tasks.load_pairs(cfg.task, cfg.seed, frame.tokenizer)
    frame.warn(tasks.check_lengths(train_pairs, frame.tokenizer, None, models.context_size(frame.policy)))
    frame.start(grad_accum=t.batch_size // (t.micro_batch * world), with_reference=True,
                reference_path=lcfg.reference_path, plan_rows=train_pairs,
                warm_rows=[{"prompt": p["prompt"], "answer": p["chosen"]} for p in train_pairs])
    engine = frame.engine
    pairs = [dict(p, id=i) for i, p in enumerate(train_pairs)]
    stream = tasks.prompt_stream(pairs, cfg.seed)  # the same stream on every rank; each takes its slice
    per_rank = t.batch_size // world
    head = registry.get("head", cfg.head.name)
    cache = ReferenceCache()
    stateful = {"pairs": stream, "ref_cache": cache}
    start = frame.restore(resume, stateful)

    with contextlib.closing(frame.steps(start, stateful, "rlrun dpo", held_out(cfg, frame, eval_pairs))) as steps:
        for step in steps:
            batch = [next(stream) for _ in range(t.batch_size)][engine.rank * per_rank : (engine.rank + 1) * per_rank]

            # 1. Reference logprobs: every batch (always) or once per pair (window).
            known, counts = reference_logprobs(cfg, frame, head, cache, batch)

            # 2. Train: one optimizer step over the batch; each micro-batch's loss is its share of the batch mean.
            parts, tokens, entropy = train_step(cfg, frame, head, batch, known, step)
            grad_norm = engine.step()

            # 3. Metrics over all ranks.
            by_rank = frame.reduce({"parts": parts, "tokens": tokens, "counts": counts, "entropy": entropy})
            parts, entropy = [part for p in by_rank for part in p["parts"]], [e for p in by_rank for e in p["entropy"]]
            tokens, counts = sum(p["tokens"] for p in by_rank), sum((p["counts"] for p in by_rank), Counter())
            m = {k: sum(n * mt[k] for n, mt in parts) / t.batch_size for k in parts[0][1] if k != "loss"}
            m.update({"loss": sum(mt["loss"] for _, mt in parts), "grad_norm": grad_norm,
                      "lr": engine.lr(), "train_tokens": tokens,
                      "entropy": sum(s for s, _ in entropy) / max(sum(n for _, n in entropy), 1)})
            cache.totals.update(counts)
            for key in ("ref_run", "ref_skipped"):
                m[f"passes/{key}"] = counts[key]
                m[f"passes/{key}_total"] = cache.totals[key]
            m.update(meter_metrics([p["meter"] for p in by_rank]))
            m["throughput/train_tokens_per_s"] = tokens / m["time/train_s"]
            frame.log(step, m, acc=f"{m['rewards/accuracy']:.2f}", loss=f"{m['loss']:.4f}",
                      tok_s=f"{m['throughput/train_tokens_per_s']:.0f}")
    return frame.summary.result()


def held_out(cfg, frame, pairs: list[dict]):
    """Reward accuracy and margin on held-out pairs (None when eval.every is 0, or with a warning when none)."""
    if not cfg.eval.every:
        return None
    if not pairs:  # warn, not refuse: eval.every is on by default, and not every data set holds rows out
        frame.warn([f"eval.every={cfg.eval.every} evaluates on held-out pairs, but task={cfg.task.name} has none, so "
                    "there is no evaluation: set task.eval_size=N (pairs held out of training) or, for task=dataset, "
                    "task.eval_split=SPLIT."])
        return None
    rows, head = pairs[: cfg.eval.size] if cfg.eval.size else pairs, registry.get("head", cfg.head.name)
    engine = frame.engine
    return lambda: evaluate.evaluate_pairs(engine.model, lambda: models.reference(engine), frame.tokenizer, rows,
                                           encode_pairs=encode_pairs, pair_logprobs=pair_logprobs,
                                           beta=cfg.loss.beta, average=cfg.loss.average_logprobs, head=head,
                                           size=cfg.head.size, batch_size=cfg.train.micro_batch, show=cfg.log.samples)


def reference_logprobs(cfg, frame, head, cache: ReferenceCache, batch: list[dict]):
    """Reference logprobs of this rank's pairs: (pair id -> (chosen, rejected)), and the pass counts."""
    t, engine = cfg.train, frame.engine
    known = cache.values if cfg.logprob_policy.name == "window" else {}
    todo = [p for p in batch if p["id"] not in known]
    with frame.meter.phase("offload"):
        engine.offload()
    fresh = {}
    with frame.meter.phase("ref_logprobs"), torch.no_grad(), models.reference(engine) as reference:
        for i in range(0, len(todo), t.micro_batch):
            chunk = encode_pairs(frame.tokenizer, todo[i : i + t.micro_batch], engine.device)
            chosen, rejected = pair_logprobs(reference, chunk, head, cfg.head.size, cfg.loss.average_logprobs)
            fresh.update({pid: (c, r) for pid, c, r in zip(chunk.ids, chosen.tolist(), rejected.tolist())})
    known.update(fresh)
    with frame.meter.phase("onload"):
        engine.onload()
    return known, Counter({"ref_run": len(todo), "ref_skipped": len(batch) - len(todo)})


def train_step(cfg, frame, head, batch: list[dict], known: dict, step: int):
    """Forward and backward of this rank's micro-batches: [(pairs, metrics)] per micro-batch, the token count and
    [(entropy sum, tokens)] per micro-batch of the policy pass."""
    t, lcfg, engine = cfg.train, cfg.loss, frame.engine
    parts, tokens, entropy = [], 0, []
    with frame.meter.phase("train"):
        for i in range(0, len(batch), t.micro_batch):
            chunk_pairs = batch[i : i + t.micro_batch]
            mb = encode_pairs(frame.tokenizer, chunk_pairs, engine.device)
            chosen, rejected = pair_logprobs(engine.model, mb, head, cfg.head.size, lcfg.average_logprobs, entropy)
            ref = torch.tensor([known[pid] for pid in mb.ids], device=engine.device, dtype=chosen.dtype)
            nll = None
            if lcfg.sft_coef:  # per-token NLL of the chosen response
                summed = chosen if not lcfg.average_logprobs else chosen * mb.lengths[: len(mb.ids)]
                nll = -summed / mb.lengths[: len(mb.ids)]
            loss, metrics = registry.get("loss", lcfg.name)(chosen, rejected, ref[:, 0], ref[:, 1], beta=lcfg.beta,
                                                            label_smoothing=lcfg.label_smoothing, chosen_nll=nll,
                                                            sft_coef=lcfg.sft_coef, num_pairs=t.batch_size)
            check_finite(loss, step, "lower train.lr.")
            engine.backward(loss)
            parts.append((len(chunk_pairs), metrics))
            tokens += int(mb.lengths.sum())
    return parts, tokens, entropy
