"""Held-out evaluation: GRPO tasks (generate, score, accuracy / pass@k) and DPO pairs (reward accuracy, margin).

`evaluate` decodes every held-out prompt (greedy, or `samples` seeded draws per prompt), scores the completions
with the task's scorer and returns `Evaluation(metrics, samples)`:
- `eval/reward_mean`: mean total reward over all completions;
- `eval/accuracy`: share of completions solved: total reward (or the reward named by `accuracy_reward`) at least
  `accuracy_threshold` (1.0 by default; with samples > 1 this is pass@1);
- `eval/pass_at_k` (samples = k > 1): share of prompts with at least one solved completion (not `pass@k`:
  MLflow refuses `@` in a metric name);
- `eval/response_len_mean`: response tokens up to and including EOS, as the training metric counts them;
- `eval/rewards/<name>/mean`: each named reward the scorer returns;
and `samples`, the first `show` rows as {prompt, completion, answer, reward, rewards/<name> (several rewards)}
for a samples table.

Deterministic: greedy decoding has no randomness; sampling reuses the rollout's seeded sampler
(rlrun.rollout.hf.generate) with one seed per (row, sample) drawn from `seed`, so the draws do not depend on the
batch size. Under ZeRO-3 call it inside `engine.generation()` (the weights must be whole for generate).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import torch

from .batching.layouts import Padded
from .errors import TaskError

EVAL_KEY = 0x65766131  # spawn-key prefix: eval seeds never coincide with a training rollout's seeds


@dataclass
class Evaluation:
    metrics: dict[str, float]
    samples: list[dict] = field(default_factory=list)


def scorer(reward_fn):
    """A per-completion `reward(completion, answer)` as a batch scorer `(completions, rows) -> (totals, {})`."""
    def score(completions, rows):
        return [float(reward_fn(c, r["answer"])) for c, r in zip(completions, rows)], {}
    return score


def sample_seed(seed: int, row: int, sample: int) -> int:
    return int(np.random.SeedSequence(seed, spawn_key=(EVAL_KEY, row, sample)).generate_state(1)[0])


@torch.no_grad()
def complete(model, tokenizer, prompts: list[str], *, max_new_tokens: int, seeds: list[int] | None,
             temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, decode: str = "eager",
             speculation=None):
    """(completions, response lengths) for one batch: greedy when `seeds` is None, else seeded sampling; `decode`:
    the rollout.decode option that runs the loop (rollout/decoding.py); `speculation`: the rollout.speculate object
    that drives it (rollout/speculate.py; None: off)."""
    from .rollout import Rollout, decoding, hf

    device = next(model.parameters()).device
    speculation = speculation if speculation is not None else hf.speculating(None)
    if seeds is not None:
        cfg = SimpleNamespace(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens,
                              decode=decode)
        roll = hf.generate(model, tokenizer, prompts, cfg, device, seeds, speculation=speculation)
    else:
        ids, mask = hf.encode(tokenizer, prompts, device)
        option = decoding.of(SimpleNamespace(decode=decode))
        response = speculation.decode(option, model, ids, mask, max_new_tokens=max_new_tokens,
                                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        roll = Rollout.from_response(ids, mask, response, torch.zeros(response.shape, device=device), tokenizer)
    return roll.completions, roll.response_mask.sum(1).tolist()


def evaluate(model, tokenizer, rows: list[dict], score_fn, *, max_new_tokens: int, greedy: bool = True,
             samples: int = 1, temperature: float = 1.0, top_p: float = 1.0, seed: int = 0, batch_size: int = 256,
             show: int = 4, accuracy_reward: str | None = None, accuracy_threshold: float = 1.0,
             top_k: int = 0, decode: str = "eager", speculate: str | None = None,
             speculate_k: int = 4) -> Evaluation:
    """Evaluate `model` on `rows` ({"prompt", "answer", ...}); see the module docstring. `speculate`, `speculate_k`:
    rollout.speculate's option and draft length (None: off), one object for the whole evaluation (so `history`
    drafts from this evaluation's earlier batches only)."""
    from .rollout import hf

    speculation = hf.speculating(SimpleNamespace(speculate=speculate, speculate_k=speculate_k))
    if not rows:
        raise ValueError("evaluate: no rows to evaluate on")
    if greedy and samples != 1:
        raise ValueError(f"greedy decoding gives one completion per prompt; got samples={samples} (use greedy=False "
                         "for pass@k)")
    k = samples
    flat = [(i, j) for i in range(len(rows)) for j in range(k)]  # prompt-major: row i's samples are adjacent
    completions, lengths = [], []
    was_training, side = model.training, tokenizer.padding_side
    model.eval()
    tokenizer.padding_side = "left"  # generation appends on the right
    try:
        for b in range(0, len(flat), batch_size):
            chunk = flat[b : b + batch_size]
            seeds = None if greedy else [sample_seed(seed, i, j) for i, j in chunk]
            c, n = complete(model, tokenizer, [rows[i]["prompt"] for i, _ in chunk], max_new_tokens=max_new_tokens,
                            seeds=seeds, temperature=temperature, top_p=top_p, top_k=top_k, decode=decode,
                            speculation=speculation)
            completions += c
            lengths += n
    finally:
        model.train(was_training)
        tokenizer.padding_side = side
    totals, per_reward = score_fn(completions, [rows[i] for i, _ in flat])
    solved = torch.tensor(deciding(totals, per_reward, accuracy_reward), dtype=torch.float64).view(len(rows), k)
    solved = solved >= accuracy_threshold
    metrics = {"eval/reward_mean": float(np.mean(totals)), "eval/accuracy": solved.double().mean().item(),
               "eval/response_len_mean": float(np.mean(lengths))}
    if k > 1:
        metrics[f"eval/pass_at_{k}"] = solved.any(1).double().mean().item()
    for name, values in (per_reward or {}).items():
        metrics[f"eval/rewards/{name}/mean"] = float(np.mean(values))
    table = [sample_row(rows[i], completions[n], totals[n], per_reward, n)
             for n, (i, j) in enumerate(flat) if j == 0 and i < show]
    return Evaluation(metrics, table)


def deciding(totals: list[float], per_reward: dict | None, name: str | None) -> list[float]:
    """The values `eval/accuracy` thresholds: the weighted totals, or the named reward's (eval.accuracy_reward)."""
    if name is None:
        return totals
    if per_reward is None or name not in per_reward:
        raise TaskError(f"eval.accuracy_reward={name!r} is not a reward of this task; its rewards: "
                        f"{sorted(per_reward or {})}. Name one of them, or null for the weighted total.")
    return per_reward[name]


def sample_row(row: dict, completion: str, total: float, per_reward: dict | None, n: int) -> dict:
    """A samples-table row: prompt, completion, answer, the total reward and, with several rewards, each one."""
    out = {"prompt": row["prompt"], "completion": completion, "answer": row.get("answer"), "reward": total}
    if per_reward and len(per_reward) > 1:
        out.update({f"rewards/{name}": values[n] for name, values in per_reward.items()})
    return out


@torch.no_grad()
def evaluate_pairs(policy, reference, tokenizer, pairs: list[dict], *, encode_pairs, pair_logprobs, beta: float,
                   average: bool = False, head=None, batch_size: int = 64, show: int = 4) -> Evaluation:
    """DPO on held-out pairs ({prompt, chosen, rejected}): `eval/accuracy` = share of pairs whose implicit reward
    margin beta*((pi_c - ref_c) - (pi_r - ref_r)) is positive, `eval/margin` its mean.

    `encode_pairs(tokenizer, pairs, device)` and `pair_logprobs(model, batch, head, layout, average)` are the DPO
    recipe's own (rlrun.recipes.dpo passes them), so evaluation scores sequences exactly as training does; they
    are arguments because this module sits below the recipes (tests/unit/test_code_shape.py: no upward imports); the
    pairs are laid out padded. `head`: the run's bound head (heads.Bound; default dense). `reference`: a model, or
    a function returning a
    context that yields one (rlrun.models.reference: LoRA's adapters-off reference is the policy itself, so the
    policy's pass must run outside that context)."""
    if not pairs:
        raise ValueError("evaluate_pairs: no pairs to evaluate on")
    if head is None:
        from .heads import Bound, dense

        head = Bound(dense, None)
    layout = Padded(None)
    device = next(policy.parameters()).device
    reference_of = (lambda: contextlib.nullcontext(reference)) if isinstance(reference, torch.nn.Module) else reference
    was_training = policy.training
    policy.eval()
    margins = []
    try:
        for b in range(0, len(pairs), batch_size):
            chunk = [dict(p, id=b + i) for i, p in enumerate(pairs[b : b + batch_size])]
            batch = encode_pairs(tokenizer, chunk, device)
            pc, pr = pair_logprobs(policy, batch, head, layout, average)
            with reference_of() as ref:
                rc, rr = pair_logprobs(ref, batch, head, layout, average)
            margins.append((beta * ((pc - rc) - (pr - rr))).double().cpu())
    finally:
        policy.train(was_training)
    margin = torch.cat(margins)
    metrics = {"eval/accuracy": (margin > 0).double().mean().item(), "eval/margin": margin.mean().item()}
    table = [{"prompt": p["prompt"], "chosen": p["chosen"], "rejected": p["rejected"], "margin": m.item()}
             for p, m in zip(pairs[:show], margin[:show])]
    return Evaluation(metrics, table)
