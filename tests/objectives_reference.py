"""A reference for the GRPO objectives of docs/objectives.md, written from the formulas, not from rlrun's code: one
sequence at a time, float64, autograd through everything (the GSPO sequence ratio included), then the step's
aggregation over every sequence of every micro-batch and rank. And a seeded optimizer step to compare with:
micro-batches of different shapes and token counts, split over ranks (tests/unit/losses/test_objectives.py,
objectives_ranks.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

V, H = 53, 16
# (rows, response width) of each micro-batch, per rank: different token counts on every micro-batch and rank
SHAPES = [[(3, 7), (2, 11), (4, 5)], [(2, 9), (3, 6)]]
CLIPS = {"dapo": (0.2, 0.28), "cispo": (None, 0.28), "gspo": (0.05, 0.08)}  # gspo wider than its defaults: both
# sides of its per-sequence clip are hit by this step's sequences


@dataclass
class Step:
    """One optimizer step: per rank, per micro-batch, padded [rows x width] tensors flattened to tokens."""

    hidden: list[list[torch.Tensor]]  # [rows * width, H]
    weight: torch.Tensor  # [V, H]
    targets: list[list[torch.Tensor]]
    mask: list[list[torch.Tensor]]  # valid tokens: a prefix of each row (one row has none: a filtered completion)
    adv: list[list[torch.Tensor]]  # per token (one value per row)
    old: list[list[torch.Tensor]]
    ref: list[list[torch.Tensor]]
    gen: list[list[torch.Tensor]]
    temperature: float


def make_step(seed: int = 0, temperature: float = 0.8) -> Step:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(V, H, generator=g) * 0.3
    out = {k: [] for k in ("hidden", "targets", "mask", "adv", "old", "ref", "gen")}
    for r, shapes in enumerate(SHAPES):
        for k in out:
            out[k].append([])
        for m, (rows, width) in enumerate(shapes):
            n = rows * width
            hidden = torch.randn(n, H, generator=g)
            targets = torch.randint(0, V, (n,), generator=g)
            lengths = torch.randint(1, width + 1, (rows,), generator=g)
            if (r, m) == (0, 1):
                lengths[0] = 0  # a row with no valid token: no sequence of the step (overlong=filter)
            mask = (torch.arange(width)[None, :] < lengths[:, None]).reshape(-1)
            adv = torch.randn(rows, generator=g).repeat_interleave(width)
            with torch.no_grad():
                cur = torch.log_softmax(hidden @ weight.T / temperature, -1).gather(-1, targets[:, None]).squeeze(-1)
            old = cur + 0.3 * torch.randn(n, generator=g)
            ref = cur + 0.2 * torch.randn(n, generator=g)
            gen = old + 0.1 * torch.randn(n, generator=g)
            for k, v in zip(out, (hidden, targets, mask, adv, old, ref, gen)):
                out[k][r].append(v)
    return Step(weight=weight, temperature=temperature, **out)


def sequences(step: Step, hidden64, weight64):
    """Every sequence of the step with a valid token, in order: its valid tokens' (logprob with grad, old, ref, gen)
    and its advantage, float64; `hidden64[r][m]` are the float64 leaves of the micro-batches' hidden states."""
    out = []
    for r, shapes in enumerate(SHAPES):
        for m, (rows, width) in enumerate(shapes):
            logp = torch.log_softmax(hidden64[r][m] @ weight64.T / step.temperature, -1)
            lp = logp.gather(-1, step.targets[r][m][:, None]).squeeze(-1)
            entropy = -(logp.exp() * logp).sum(-1).detach()  # of the tempered distribution: a metric
            for b in range(rows):
                sl = slice(b * width, (b + 1) * width)
                valid = step.mask[r][m][sl]
                if not valid.any():
                    continue
                out.append({"lp": lp[sl][valid], "adv": step.adv[r][m][sl][0].double(), "entropy": entropy[sl][valid],
                            **{k: getattr(step, k)[r][m][sl][valid].double() for k in ("old", "ref", "gen")}})
    return out


def pg_terms(loss: str, s: dict, clip_low, clip_high, form: str):
    """(per-token policy-gradient terms, per-token ratio, per-token clipped flag) of one sequence."""
    lp, old, a = s["lp"], s["old"], s["adv"]
    if loss == "dapo":
        r = torch.exp(lp - old)
        unclipped, clipped = -a * r, -a * torch.clamp(r, 1 - clip_low, 1 + clip_high)
        return torch.maximum(unclipped, clipped), r, clipped > unclipped
    if loss == "cispo":
        r = torch.exp(lp - old)
        low = None if clip_low is None else 1 - clip_low
        outside = (r > 1 + clip_high) | ((r < low) if low is not None else torch.zeros_like(r, dtype=torch.bool))
        return -a * torch.clamp(r, min=low, max=1 + clip_high).detach() * lp, r, outside
    # gspo: s = exp(mean(lp - old)); token form s_t = sg(s) p_t / sg(p_t); sequence form: s itself, one term
    s_seq = torch.exp((lp - old).mean())
    ratio = s_seq.detach() * torch.exp(lp - lp.detach()) if form == "token" else s_seq.expand(len(lp))
    unclipped, clipped = -a * ratio, -a * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    return torch.maximum(unclipped, clipped), ratio, clipped > unclipped


def kl_term(lp, ref, estimator: str):
    log_r = ref - lp
    return {"k1": -log_r, "k2": 0.5 * log_r**2, "k3": torch.exp(log_r) - 1 - log_r}[estimator]


def reference(step: Step, loss: str, agg: str, *, kl: str | None, tis: float | None, max_tokens: int = 12,
              form: str = "token"):
    """(loss, grad hidden [per rank][micro-batch], grad weight, metrics) in float64. `form`: gspo through its token
    form or through the sequence ratio itself (sequence: one term per sequence, counted at each of its tokens)."""
    hidden64 = [[h.double().requires_grad_() for h in per_rank] for per_rank in step.hidden]
    weight64 = step.weight.double().requires_grad_()
    seqs = sequences(step, hidden64, weight64)
    clip_low, clip_high = CLIPS[loss]
    T, S = sum(len(s["lp"]) for s in seqs), len(seqs)
    total, stats = 0.0, {"pg_loss": [], "clipped": [], "ratio": [], "kl": [], "is_weight": [],
                         "entropy": [s["entropy"] for s in seqs]}
    for s in seqs:
        pg, ratio, clipped = pg_terms(loss, s, clip_low, clip_high, form)
        stats["pg_loss"].append(pg.detach()), stats["ratio"].append(ratio.detach())
        stats["clipped"].append(clipped.double())
        term = pg
        if tis is not None:
            w = torch.clamp(torch.exp(s["old"] - s["gen"]), max=tis)
            term, _ = term * w, stats["is_weight"].append(w)
        if kl is not None:
            k = kl_term(s["lp"], s["ref"], kl)
            term = term + 0.05 * k
            stats["kl"].append(k.detach())
        n = len(s["lp"])
        total = total + {"token_mean": term.sum() / T, "seq_mean_token_mean": term.sum() / (S * n),
                         "seq_mean_token_sum": term.sum() / S,
                         "seq_mean_token_sum_norm": term.sum() / (S * max_tokens)}[agg]
    total.backward()
    metrics = {"loss": total.item()}
    for key, name in (("pg_loss", "pg_loss"), ("clipped", "clipfrac"), ("kl", "kl"), ("ratio", "ratio_mean"),
                      ("is_weight", "is_weight_mean"), ("entropy", "entropy")):
        if stats[key]:
            metrics[name] = torch.cat(stats[key]).mean().item()
    for key in ("ratio", "is_weight"):
        if stats[key]:
            metrics[f"{key}_min"], metrics[f"{key}_max"] = (torch.cat(stats[key]).min().item(),
                                                            torch.cat(stats[key]).max().item())
    return total.detach(), [[h.grad for h in per_rank] for per_rank in hidden64], weight64.grad, metrics


def micros_of(step: Step, rank: int):
    """The rank's micro-batches as the GRPO recipe holds them (rlrun.recipes.grpo.Micro)."""
    from rlrun.recipes.grpo import Micro

    out = []
    for m, (rows, width) in enumerate(SHAPES[rank]):
        mask = step.mask[rank][m]
        out.append(Micro(input_ids=torch.zeros(rows, width + 1, dtype=torch.long),
                         attention_mask=torch.ones(rows, width + 1, dtype=torch.long), prompt_len=1,
                         targets=step.targets[rank][m], mask=mask, advantages=step.adv[rank][m],
                         gen_logprobs=step.gen[rank][m], old_logprobs=step.old[rank][m],
                         ref_logprobs=step.ref[rank][m]))
    return out


def rank_step(step: Step, rank: int, head: str, loss: str, agg_mode: str, *, kl, tis, size: int, gather,
              max_tokens: int = 12, skip_old: bool = False):
    """What one rank of the GRPO recipe computes for this step (train_step's calls): agg.prepare over the ranks
    (`gather`), the objective and the head on each micro-batch, backward. -> (loss sum, grad hidden per micro-batch,
    grad weight, stats partials)."""
    from rlrun import losses, registry
    from rlrun.losses import agg

    micros, divisor, _ = agg.prepare(micros_of(step, rank), agg_mode, max_tokens, gather, loss == "gspo")
    clip_low, clip_high = CLIPS[loss]
    weight = step.weight.clone().requires_grad_()
    total, grads_h, parts = 0.0, [], []
    for m, mb in enumerate(micros):
        h = step.hidden[rank][m].clone().requires_grad_()
        f = losses.objective(loss, mb.advantages, None if skip_old else mb.old_logprobs,
                             mb.ref_logprobs if kl else None, mb.gen_logprobs, clip_low=clip_low, clip_high=clip_high,
                             kl_coef=0.05 if kl else 0.0, kl_estimator=kl or "k3", tis_cap=tis, weights=mb.weights,
                             seq=mb.seq, mask=mb.mask)
        out, stats = registry.get("head", head).loss(h, weight, mb.targets, mb.mask, f, divisor, step.temperature, size)
        out.backward()
        total += out.item()
        grads_h.append(h.grad)
        parts.append(losses.partials(stats, mb.mask))
    return total, grads_h, weight.grad, parts


def rel_err(a, b) -> float:
    """Max absolute error over the largest reference magnitude."""
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()
