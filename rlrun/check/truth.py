"""The truth `rlrun check` holds a run against: every term of rlrun's objectives and the data-side decisions in
front of them, written from their papers' formulas in float64, one sequence at a time, apart from the training
code. This module imports nothing of rlrun (not losses/, heads/, batching/, recipes/): a fault there is not also
here, so it cannot pass by being compared with itself (docs/check.md#the-truth).

Notation (docs/objectives.md): per token t of sequence i, r = exp(logprob - old), A the sequence's advantage,
eps_l = clip_low, eps_h = clip_high, sg() stop-gradient; over the step T valid tokens, S sequences with a valid
token, L_i valid tokens of sequence i.

- DAPO (arXiv:2503.14476 eq. 8): -min(r A, clip(r, 1 - eps_l, 1 + eps_h) A).
- CISPO (MiniMax-M1, arXiv:2506.13585 eq. 4): -sg(clip(r, 1 - eps_l, 1 + eps_h)) A log pi (no floor without eps_l).
- GSPO (arXiv:2507.18071 eq. 7-10, the GSPO-token form): s_i = exp(mean_t (logprob - old)); per token
  s_it = sg(s_i) pi_t / sg(pi_t) and -min(s_it A, clip(s_it, 1 - eps_l, 1 + eps_h) A).
- KL estimators (Schulman, "Approximating KL divergence"), log q = ref - logprob: k1 = -log q, k2 = (log q)^2 / 2,
  k3 = q - 1 - log q; in the loss as + kl_coef * k per token.
- TIS (Yao et al., "Your efficient RL framework secretly brings you off-policy RL"): the policy-gradient term times
  w = min(exp(old - gen), cap), or per sequence min(exp(sum_t (old - gen)), cap); MIS / IcePop's mask: w where it
  lies in [low, cap], else 0.
- Entropy bonus: - entropy_coef * H_t, H_t the entropy of the tempered, filtered distribution at t.
- loss.agg: token_mean 1/T, seq_mean_token_mean 1/(S L_i) (DeepSeekMath), seq_mean_token_sum 1/S,
  seq_mean_token_sum_norm 1/(S L_max) (Dr. GRPO), over every micro-batch and rank of the step.
- Data: GRPO's group advantage (r - mean) / (std + 1e-4) (sample std; none with scale false: Dr. GRPO); DAPO's
  soft overlong punishment (eq. 13); dynamic sampling's kept groups (rewards not all equal, DAPO sec. 3.2); the
  overlong filter (a completion without EOS leaves the loss); the rows a zero-advantage skip may drop.
- DPO (Rafailov et al. eq. 7; label smoothing as conservative DPO): -(1 - ls) log sigmoid(beta m) - ls log
  sigmoid(-beta m), m = (pi_c - ref_c) - (pi_r - ref_r), plus sft_coef times the chosen response's mean NLL.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

F64 = torch.float64


@dataclass(frozen=True)
class Spec:
    """A GRPO objective's settings, as plain numbers (the probe reads them from the loss and rollout config)."""

    loss: str  # dapo | cispo | gspo
    clip_low: float | None
    clip_high: float
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    tis_level: str | None = None  # None (off) | token | sequence
    tis_mode: str = "truncate"  # truncate | mask
    tis_cap: float = 2.0
    tis_low: float | None = None
    agg: str = "token_mean"
    agg_max_tokens: int = 1  # seq_mean_token_sum_norm's L_max
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0


@dataclass
class Seq:
    """One sequence of a step: its prompt and valid response tokens, whether the loss sees them, its advantage, and
    its tokens' old, reference and generator logprobs (float64, one per response token)."""

    prompt: list[int]
    response: list[int]
    trained: bool
    advantage: float
    old: torch.Tensor
    ref: torch.Tensor
    gen: torch.Tensor
    logprobs: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=F64))  # set by `forward`
    entropy: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=F64))  # set by `forward`
    extra: dict = field(default_factory=dict)


# -- the distribution the sampler drew from ----------------------------------------------------------------------

def filtered_log_softmax(z: torch.Tensor, top_p: float, top_k: int, drawn: torch.Tensor | None = None) -> torch.Tensor:
    """log-probabilities [rows, vocab] of tempered logits `z` renormalised over each row's kept set: the `top_k`
    most likely tokens (0: all), then of those the most likely ones until their mass reaches `top_p` (a token is
    kept when the mass of the tokens more likely than it is below top_p; the most likely one always). Written per
    token from the definition (Holtzman et al. 2020; the order transformers and vLLM apply). `drawn` [rows]: each
    row's drawn token, kept in its set as rlrun chooses (docs/objectives.md): weights that moved since the draw may
    rank it outside, and its logprob is then that of the set with it, not -inf."""
    vocab = z.shape[-1]
    keep = torch.ones_like(z, dtype=torch.bool)
    if 0 < top_k < vocab:
        kth = z.topk(top_k, -1).values[:, -1:]
        keep = z >= kth
    if top_p < 1.0:
        p = torch.softmax(z.masked_fill(~keep, float("-inf")), -1)
        # mass strictly more likely than each token (ties: by index, as a stable descending sort orders them)
        order = torch.sort(p, dim=-1, descending=True, stable=True).indices
        before = torch.zeros_like(p).scatter_(-1, order, torch.cumsum(p.gather(-1, order), -1) - p.gather(-1, order))
        keep = keep & (before < top_p)
    if drawn is not None:
        keep = keep.scatter(-1, drawn[:, None], True)
    return torch.log_softmax(z.masked_fill(~keep, float("-inf")), -1)


def forward(model, seqs: list[Seq], spec: Spec, grad: bool = True) -> None:
    """Each sequence's response logprobs and entropies, computed by `model` on the sequence alone (no padding, no
    neighbour: positions 0..n-1), the tempered and filtered distribution of `spec`; set on the sequences."""
    with torch.set_grad_enabled(grad):
        for s in seqs:
            ids = torch.tensor([s.prompt + s.response], device=next(model.parameters()).device)
            logits = model(input_ids=ids).logits[0, len(s.prompt) - 1 : -1].to(F64) / spec.temperature
            drawn = ids[0, len(s.prompt):]
            logp = filtered_log_softmax(logits, spec.top_p, spec.top_k, drawn)
            s.logprobs = logp.gather(-1, drawn[:, None]).squeeze(-1)
            p = logp.exp()
            s.entropy = -(p * torch.where(p > 0, logp, torch.zeros_like(logp))).sum(-1)


def drawable(model, prompt: list[int], response: list[int], spec: Spec, token: int) -> list[bool]:
    """Per response position, whether the sampler could draw `token` there (it is in the kept set of `spec`'s
    filtered distribution): a crafted rollout may only end a row with an EOS the sampler could have drawn."""
    if spec.top_p >= 1.0 and spec.top_k <= 0:
        return [True] * len(response)
    with torch.no_grad():
        ids = torch.tensor([prompt + response], device=next(model.parameters()).device)
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].to(F64) / spec.temperature
        return (filtered_log_softmax(logits, spec.top_p, spec.top_k)[:, token] > float("-inf")).tolist()


# -- the objective -----------------------------------------------------------------------------------------------

def clip(x: torch.Tensor, low: float | None, high: float) -> torch.Tensor:
    return torch.clamp(x, min=None if low is None else 1.0 - low, max=1.0 + high)


def dapo_term(spec: Spec, s: Seq) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r = torch.exp(s.logprobs - s.old)
    loss = -torch.minimum(r * s.advantage, clip(r, spec.clip_low, spec.clip_high) * s.advantage)
    return loss, r.detach(), binds(r.detach(), s.advantage, spec)


def cispo_term(spec: Spec, s: Seq) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r = torch.exp(s.logprobs - s.old)
    outside = r > 1 + spec.clip_high
    if spec.clip_low is not None:
        outside = outside | (r < 1 - spec.clip_low)
    loss = -clip(r, spec.clip_low, spec.clip_high).detach() * s.advantage * s.logprobs
    return loss, r.detach(), outside.to(F64)


def gspo_term(spec: Spec, s: Seq) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    seq_ratio = torch.exp((s.logprobs - s.old).mean())
    r = seq_ratio.detach() * torch.exp(s.logprobs - s.logprobs.detach())  # value s_i, gradient s_i per token
    loss = -torch.minimum(r * s.advantage, clip(r, spec.clip_low, spec.clip_high) * s.advantage)
    return loss, r.detach(), binds(r.detach(), s.advantage, spec)


# The truth's own table: each GRPO loss's per-token term, by the loss's name (the module docstring's formulas)
TERMS = {"dapo": dapo_term, "cispo": cispo_term, "gspo": gspo_term}


def policy_term(spec: Spec, s: Seq) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-token policy-gradient loss, ratio, clipped flag) of one sequence."""
    if spec.loss not in TERMS:
        raise ValueError(f"the truth has no formula for loss={spec.loss!r}")
    return TERMS[spec.loss](spec, s)


def binds(r: torch.Tensor, a: float, spec: Spec) -> torch.Tensor:
    """1.0 where PPO's clip binds (the clipped term is the one taken): above 1 + eps_h with A > 0, below 1 - eps_l
    with A < 0."""
    high = (r > 1 + spec.clip_high) & (a > 0)
    low = (r < 1 - spec.clip_low) & (a < 0) if spec.clip_low is not None else torch.zeros_like(high)
    return (high | low).to(F64)


def kl_estimate(lp: torch.Tensor, ref: torch.Tensor, estimator: str) -> torch.Tensor:
    log_q = ref - lp
    if estimator == "k1":
        return -log_q
    if estimator == "k2":
        return log_q**2 / 2
    if estimator == "k3":
        return torch.exp(log_q) - 1 - log_q
    raise ValueError(f"the truth has no KL estimator {estimator!r}")


def importance_weight(spec: Spec, s: Seq) -> torch.Tensor | None:
    """Per-token weight of the policy-gradient term (detached), or None without TIS."""
    if spec.tis_level is None:
        return None
    ratio = {"token": lambda: torch.exp(s.old - s.gen),  # each token's own, or its sequence's product
             "sequence": lambda: torch.exp((s.old - s.gen).sum()).expand(len(s.old))}[spec.tis_level]()
    if spec.tis_mode == "truncate":
        return torch.clamp(ratio, max=spec.tis_cap)
    if spec.tis_low is None:
        raise ValueError("TIS's mask needs its floor (tis_low)")
    kept = (ratio >= spec.tis_low) & (ratio <= spec.tis_cap)
    return torch.where(kept, ratio, torch.zeros_like(ratio))


def aggregation_weight(spec: Spec, length: int, T: int, S: int) -> float:
    return {"token_mean": 1.0 / T, "seq_mean_token_mean": 1.0 / (S * length), "seq_mean_token_sum": 1.0 / S,
            "seq_mean_token_sum_norm": 1.0 / (S * spec.agg_max_tokens)}[spec.agg]


def objective(spec: Spec, seqs: list[Seq], stats_of=None) -> tuple[torch.Tensor, dict[str, float], dict]:
    """(the step's loss with gradient, its metrics, counts of what acted) over `seqs` (their `forward` done).

    Only trained sequences with a valid token are terms; `stats_of(seq)` says whose tokens the per-token metrics
    (ratio, clipfrac, kl, entropy, is_weight) average over (default: every term); pg_loss is over every term."""
    terms = [s for s in seqs if s.trained and len(s.response)]
    T, S = max(sum(len(s.response) for s in terms), 1), max(len(terms), 1)
    # 0 with a gradient of 0 where every row left the loss
    total = torch.stack([0.0 * s.logprobs.sum() for s in seqs]).sum()
    stats: dict[str, list] = {k: [] for k in ("pg_loss", "clipped", "ratio", "kl", "is_weight", "entropy",
                                              "is_masked")}
    acted = {"tokens": 0, "clip_low": 0, "clip_high": 0, "tis_capped": 0, "tis_masked": 0}
    for s in terms:
        pg, ratio, clipped = policy_term(spec, s)
        stats["pg_loss"].append(pg.detach())
        seen = stats_of is None or stats_of(s)
        if seen:
            stats["ratio"].append(ratio)
            stats["clipped"].append(clipped)
            stats["entropy"].append(s.entropy.detach())
        acted["tokens"] += len(ratio)
        acted["clip_low"] += int(((ratio < 1 - (spec.clip_low or 0.0)) & (clipped > 0)).sum()) if spec.clip_low \
            is not None else 0
        acted["clip_high"] += int(((ratio > 1 + spec.clip_high) & (clipped > 0)).sum())
        term = pg
        w = importance_weight(spec, s)
        if w is not None:
            term = term * w
            acted["tis_capped"] += int((w >= spec.tis_cap).sum()) if spec.tis_mode == "truncate" else 0
            acted["tis_masked"] += int((w == 0).sum()) if spec.tis_mode == "mask" else 0
            if seen:
                stats["is_weight"].append(w)
                if spec.tis_mode == "mask":
                    stats["is_masked"].append((w == 0).to(F64))
        k = kl_estimate(s.logprobs, s.ref, spec.kl_estimator)
        if seen:
            stats["kl"].append(k.detach())
        term = term + spec.kl_coef * k - spec.entropy_coef * s.entropy
        total = total + term.sum() * aggregation_weight(spec, len(s.response), T, S)
    return total, metrics_of(stats), acted


def metrics_of(stats: dict[str, list]) -> dict[str, float]:
    """Token means (and ranges) of the per-token stats, as rlrun names its metrics."""
    names = {"pg_loss": "pg_loss", "clipped": "clipfrac", "ratio": "ratio_mean", "kl": "kl",
             "is_weight": "is_weight_mean", "entropy": "entropy", "is_masked": "mismatch/masked_frac"}
    out = {}
    for key, name in names.items():
        if stats[key]:
            values = torch.cat(stats[key])
            if values.numel():
                out[name] = values.mean().item()
                if key in ("ratio", "is_weight"):
                    out[f"{key}_min"], out[f"{key}_max"] = values.min().item(), values.max().item()
    return out


# -- the data-side decisions --------------------------------------------------------------------------------------

def group_advantages(rewards: list[float], group_size: int, scale: bool) -> list[float]:
    """GRPO's (DeepSeekMath eq. 3 with outcome supervision) advantage of each completion against its group of
    `group_size` consecutive completions: (r - mean) / (std + 1e-4), std the sample standard deviation; without
    `scale`, r - mean (Dr. GRPO)."""
    out = []
    for g in range(0, len(rewards), group_size):
        group = [float(r) for r in rewards[g : g + group_size]]
        mean = sum(group) / len(group)
        std = (sum((r - mean) ** 2 for r in group) / (len(group) - 1)) ** 0.5 if len(group) > 1 else float("nan")
        out += [(r - mean) / (std + 1e-4) if scale else r - mean for r in group]
    return out


def overlong_penalty(length: int, max_new_tokens: int, buffer: int, factor: float) -> float:
    """DAPO eq. 13 (soft overlong punishment) times `factor`, for a response of `length` tokens (EOS included):
    0 up to L_max - L_cache, then (L_max - L_cache - |y|) / L_cache, -1 past L_max."""
    start = max_new_tokens - buffer
    if length <= start:
        return 0.0
    if length <= max_new_tokens:
        return (start - length) / buffer * factor
    return -1.0 * factor


def informative_groups(rewards: list[float], group_size: int) -> list[bool]:
    """Dynamic sampling's kept groups (DAPO sec. 3.2: 0 < |correct| < G, i.e. rewards not all equal)."""
    return [len(set(rewards[g : g + group_size])) > 1 for g in range(0, len(rewards), group_size)]


def skips_zero_advantage(asked: bool, kl_coef: float, entropy_coef: float) -> bool:
    """Whether a run may drop its rows of advantage 0 from the train pass: asked, and no term of the objective has a
    gradient there (a KL term or an entropy bonus has one at advantage 0)."""
    return asked and not kl_coef and not entropy_coef


# -- the optimizer -----------------------------------------------------------------------------------------------

def adamw_first_step(weight: torch.Tensor, grad: torch.Tensor, *, lr: float, weight_decay: float,
                     eps: float = 1e-8) -> torch.Tensor:
    """The update of AdamW's first step (Loshchilov & Hutter, Algorithm 2; eps as PyTorch's default): with zero
    moments and bias correction, m_hat = g and v_hat = g^2, so the step is -lr (g / (|g| + eps) + weight_decay w),
    whatever the betas. Float64."""
    w, g = weight.to(F64), grad.to(F64)
    return -lr * (g / (g.abs() + eps) + weight_decay * w)


# -- DPO ----------------------------------------------------------------------------------------------------------

def dpo_sequence_logprob(model, prompt: list[int], response: list[int], average: bool) -> torch.Tensor:
    """The response's logprob (sum over its tokens, or mean with `average`) under `model`, alone, float64."""
    ids = torch.tensor([prompt + response], device=next(model.parameters()).device)
    logp = torch.log_softmax(model(input_ids=ids).logits[0, len(prompt) - 1 : -1].to(F64), -1)
    lp = logp.gather(-1, ids[0, len(prompt):, None]).squeeze(-1)
    return lp.mean() if average else lp.sum()


def dpo(policy_c, policy_r, ref_c, ref_r, *, beta: float, label_smoothing: float, sft_coef: float = 0.0,
        chosen_nll=None) -> torch.Tensor:
    """The mean over pairs of DPO's loss (module docstring) from [pairs] sequence logprobs."""
    m = (policy_c - ref_c) - (policy_r - ref_r)
    logsig = torch.nn.functional.logsigmoid
    per_pair = -(1 - label_smoothing) * logsig(beta * m) - label_smoothing * logsig(-beta * m)
    if sft_coef:
        per_pair = per_pair + sft_coef * chosen_nll
    return per_pair.mean()
