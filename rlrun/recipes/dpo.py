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

from .. import batching as packing
from .. import evaluate, logprobs, models, ranks, registry, tasks
from ..losses.dpo import sequence_logprobs
from ..losses.protocol import PairLoss
from ..runner import Data, Frame, check_finite, meter_metrics, no_held_out, rank_slice, setup


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


def pair_logprobs(model, batch: Pairs, head, layout, average: bool, entropy: list | None = None,
                  counts: dict | None = None):
    """(chosen, rejected) sequence logprobs [B] each, through `head` (a heads.Bound; grad if enabled), the hidden
    states laid out by `layout` (a batching option: padded, packed, or each pair's prompt once). `entropy`: a list
    to append this batch's (sum of token entropies, token count) to. `counts`: the pass's layout (positions
    computed, forwards, sequences: rlrun.batching.count)."""
    backbone, weight = models.split(model)
    hidden = layout.pair_hidden(backbone, batch, counts)
    if entropy is None:
        token_lp = head.logprobs(hidden, weight, batch.targets)
    else:
        token_lp, ent = head.logprobs(hidden, weight, batch.targets, with_entropy=True)
        entropy.append((ent.double().sum().item(), ent.numel()))
    seq = sequence_logprobs(token_lp, batch.seq_index, len(batch.lengths), batch.lengths, average)
    b = len(batch.ids)
    return seq[:b], seq[b:]


class ReferenceCache:
    """Reference (chosen, rejected) logprobs per pair id of this rank's pairs (`window`: computed once per pair)."""

    def __init__(self) -> None:
        self.values: dict[int, tuple[float, float]] = {}

    def state_dict(self) -> dict:
        return {"values": dict(self.values)}

    def load_state_dict(self, state: dict) -> None:
        self.values = dict(state["values"])


def train(cfg, raw, tracker, resume: dict | None = None) -> dict[str, float]:
    t = cfg.train

    def load(tokenizer, context):
        train_pairs, eval_pairs = tasks.load_pairs(cfg.task, cfg.seed, tokenizer)
        warm = [{"prompt": p["prompt"], "answer": p["chosen"]} for p in train_pairs]
        return Data((train_pairs, eval_pairs), warm_rows=warm, plan_rows=train_pairs,
                    warnings=tasks.check_lengths(train_pairs, tokenizer, None, context))

    s = setup(cfg, tracker, load=load, grad_accum=t.batch_size // (t.micro_batch * ranks.world_size()),
              with_reference=True, reference_path=cfg.loss.reference_path, resume=resume)
    frame, engine, (train_pairs, eval_pairs) = Frame(cfg, raw, tracker, s, curve="rewards/accuracy"), s.engine, s.data
    stream = tasks.prompt_stream([dict(p, id=i) for i, p in enumerate(train_pairs)], cfg.seed)  # same on every rank
    cache, passes = ReferenceCache(), logprobs.PassCounter(("ref",))
    stateful = {"pairs": stream, "ref_cache": cache, "passes": passes}
    start = frame.restore(resume, stateful)

    with contextlib.closing(frame.steps(start, stateful, "rlrun dpo", held_out(cfg, frame, s, eval_pairs))) as steps:
        for step in steps:
            batch = rank_slice([next(stream) for _ in range(t.batch_size)], engine)

            # 1. Reference logprobs: every batch (always) or once per pair (window).
            known, counts, ref_layout = reference_logprobs(cfg, s, cache, batch)

            # 2. Train: one optimizer step over the batch; each micro-batch's loss is its share of the batch mean.
            parts, tokens, entropy, layout = train_step(cfg, s, batch, known, step)
            grad_norm = engine.step()

            # 3. Metrics over all ranks.
            m = step_metrics(cfg, frame, passes, parts, tokens, counts, entropy, grad_norm,
                             {"train": layout, "ref": ref_layout})
            frame.log(step, m, acc=f"{m['rewards/accuracy']:.2f}", loss=f"{m['loss']:.4f}",
                      tok_s=f"{m['throughput/train_tokens_per_s']:.0f}")
    return frame.finish()


def step_metrics(cfg, frame, passes, parts, tokens: int, counts: Counter, entropy, grad_norm: float,
                 layout: dict) -> dict:
    """The step's metrics from every rank's per-micro-batch means (weighted by their pair counts) and counts;
    `layout`: the train and reference passes' (rlrun.batching.metrics)."""
    by_rank = frame.reduce({"parts": parts, "tokens": tokens, "counts": counts, "entropy": entropy,
                            "layout": layout})
    parts, entropy = [part for p in by_rank for part in p["parts"]], [e for p in by_rank for e in p["entropy"]]
    tokens, counts = sum(p["tokens"] for p in by_rank), sum((p["counts"] for p in by_rank), Counter())
    m = {k: sum(n * mt[k] for n, mt in parts) / cfg.train.batch_size for k in parts[0][1] if k != "loss"}
    m.update({"loss": sum(mt["loss"] for _, mt in parts), "grad_norm": grad_norm,
              "lr": frame.engine.lr(), "train_tokens": tokens,
              "entropy": sum(s for s, _ in entropy) / max(sum(n for _, n in entropy), 1)})
    m.update(passes.metrics(counts))
    m.update(meter_metrics([p["meter"] for p in by_rank]))
    m["throughput/train_tokens_per_s"] = tokens / m["time/train_s"]
    ref = [{"ref": p["layout"]["ref"]} if p["layout"]["ref"] else {} for p in by_rank]  # none: every pair known
    m.update(packing.metrics([p["layout"]["train"] for p in by_rank], ref))
    return m


def held_out(cfg, frame, s, pairs: list[dict]):
    """Reward accuracy and margin on held-out pairs (None when eval.every is 0, or with a warning when none)."""
    if not cfg.eval.every:
        return None
    if not pairs:
        frame.warn([no_held_out(cfg, "pairs")])
        return None
    rows, engine = pairs[: cfg.eval.size] if cfg.eval.size else pairs, s.engine
    return lambda: evaluate.evaluate_pairs(engine.model, lambda: models.reference(engine), s.tokenizer, rows,
                                           encode_pairs=encode_pairs, pair_logprobs=pair_logprobs,
                                           beta=cfg.loss.beta, average=cfg.loss.average_logprobs, head=s.axes.head,
                                           batch_size=cfg.train.micro_batch, show=cfg.log.samples)


def reference_logprobs(cfg, s, cache: ReferenceCache, batch: list[dict]):
    """Reference logprobs of this rank's pairs: (pair id -> (chosen, rejected)), the pass counts and the pass's
    layout (rlrun.batching.count)."""
    t, engine = cfg.train, s.engine
    known = cache.values if s.axes.logprobs.caches_reference else {}
    todo = [p for p in batch if p["id"] not in known]
    with s.meter.phase("offload"):
        engine.offload()
    fresh: dict[int, tuple[float, float]] = {}
    layout: dict[str, int] = {}
    with s.meter.phase("ref_logprobs"), torch.no_grad(), models.reference(engine) as reference:
        for i in range(0, len(todo), t.micro_batch):
            chunk = encode_pairs(s.tokenizer, todo[i : i + t.micro_batch], engine.device)
            chosen, rejected = pair_logprobs(reference, chunk, s.axes.head, s.axes.layout,
                                             cfg.loss.average_logprobs, counts=layout)
            fresh.update({pid: (c, r) for pid, c, r in zip(chunk.ids, chosen.tolist(), rejected.tolist())})
    known.update(fresh)
    with s.meter.phase("onload"):
        engine.onload()
    return known, Counter({"ref_run": len(todo), "ref_skipped": len(batch) - len(todo)}), layout


def train_step(cfg, s, batch: list[dict], known: dict, step: int):
    """Forward and backward of this rank's micro-batches: [(pairs, metrics)] per micro-batch, the token count,
    [(entropy sum, tokens)] per micro-batch of the policy pass, and its layout (rlrun.batching.metrics)."""
    t, lcfg, engine = cfg.train, cfg.loss, s.engine
    pair_loss: PairLoss = registry.get("loss", lcfg.name)
    parts, tokens, layout = [], 0, {"real": 0}
    entropy: list[tuple[float, int]] = []
    with s.meter.phase("train"), s.axes.activations.saving():
        for i in range(0, len(batch), t.micro_batch):
            chunk_pairs = batch[i : i + t.micro_batch]
            mb = encode_pairs(s.tokenizer, chunk_pairs, engine.device)
            chosen, rejected = pair_logprobs(engine.model, mb, s.axes.head, s.axes.layout, lcfg.average_logprobs,
                                             entropy, layout)
            layout["real"] += int(mb.attention_mask.sum())  # tokens that are not padding
            ref = torch.tensor([known[pid] for pid in mb.ids], device=engine.device, dtype=chosen.dtype)
            nll = None
            if lcfg.sft_coef:  # per-token NLL of the chosen response
                summed = chosen if not lcfg.average_logprobs else chosen * mb.lengths[: len(mb.ids)]
                nll = -summed / mb.lengths[: len(mb.ids)]
            loss, metrics = pair_loss(chosen, rejected, ref[:, 0], ref[:, 1], beta=lcfg.beta,
                                      label_smoothing=lcfg.label_smoothing, chosen_nll=nll, sft_coef=lcfg.sft_coef,
                                      num_pairs=t.batch_size)
            check_finite(loss, step, "lower train.lr.")
            engine.backward(loss)
            parts.append((len(chunk_pairs), metrics))
            tokens += int(mb.lengths.sum())
    return parts, tokens, entropy, layout
