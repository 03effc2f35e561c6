"""Supervised warm start: seconds of teacher-forced training before RL, deterministic, cached per seed.

Why: real RL post-training starts from a model that already knows the task's format (pretraining / SFT). A
random-init tiny model asked to discover arithmetic from reward alone sits on a reward plateau for hundreds of
steps (docs/default-run.md). The default run therefore starts from a warm start that teaches the
format and a *biased* answer, and lets RL remove the bias:

- the teacher's label is the answer with probability 1 - `wrong_prob`, else the answer plus one of `offsets`
  (default: 75% "one too many"), drawn fresh each time a row is used; only the training rows are used, never
  the held-out ones;
- after it, greedy decoding answers one too many on most prompts (held-out accuracy 0.0-0.3 at step 0 for seeds
  0-4), while the correct answer keeps a quarter of the probability mass, so a group of 16 samples holds
  correct answers and their rewards differ: GRPO's advantages point at the fix from the first step;
- GRPO with the task's reward then lifts held-out greedy accuracy to 0.95-1.0 within 200 steps (the numbers, the
  configuration and the controls are in the module's report / docs/default-run.md). What RL learns is a property of the
  policy (stop adding one), so it carries over to held-out prompts it never trained on; the warm start alone
  never gets there.

Determinism: rows are drawn and labels noised from `random.Random("rlrun-warmstart-<seed>")`; torch's global
RNG is seeded inside `fork_rng`, so the caller's RNG state is untouched. The result is cached under
`cache_dir()/<key>.pt`, the key hashing the initial weights, the model config, the rows, the options, the seed and
the torch / transformers versions; the file is written to a temporary name and renamed (atomic), and a cache hit
loads exactly the saved tensors, so it is bit-identical to the fresh warm start that wrote it. (Two fresh warm
starts agree bit for bit on the same CPU and thread count; on GPU, kernels may round differently.)

A cache entry carries the sha256 of its payload (first line); an entry that fails the check, cannot be decoded
(weights only: nothing in it runs) or does not fit the model is named in a warning and recomputed, and a cache
that cannot be written (disk full, read-only) is a warning: the run goes on with the warm start it computed.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import logging
import os
import random
from pathlib import Path

import torch

from . import nofollow
from .config.warm_start import DEFAULTS, applies, on_embedded_task, options  # noqa: F401 - config-level: a record fixes them
from .errors import LinkError

log = logging.getLogger("rlrun")
VERSION = 2  # bump when the warm start's computation changes: old cache entries stop matching
HEADER = b"rlrun-warmstart sha256 "  # then the payload's hex digest and a newline (VERSION 2 on)


def cache_dir() -> Path:
    """$RLRUN_CACHE/warmstart, else $XDG_CACHE_HOME/rlrun/warmstart, else ~/.cache/rlrun/warmstart."""
    root = os.environ.get("RLRUN_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "rlrun")
    return Path(root) / "warmstart"


def noisy_answer(answer: str, rng: random.Random, wrong_prob: float, offsets) -> str:
    """The teacher's label: with probability `wrong_prob` a wrong number (the answer plus one of `offsets`, kept
    non-negative and different from the answer), else the answer. Non-numeric answers are kept as they are."""
    if not answer.lstrip("-").isdigit() or rng.random() >= wrong_prob:
        return answer
    value = int(answer)
    choices = [value + o for o in offsets if o != 0 and value + o >= 0] or [value + 1]
    return str(rng.choice(choices))


def batch_tensors(tokenizer, prompts: list[str], answers: list[str], encode=None):
    """Right-padded prompt + answer + EOS; labels only on the answer and EOS (-100 elsewhere). `encode`: text ->
    token ids (default: the tokenizer without special tokens; `fit` passes a memoised one)."""
    encode = encode or (lambda text: tokenizer(text, add_special_tokens=False).input_ids)
    seqs, starts = [], []
    for p, a in zip(prompts, answers):
        ids = list(encode(p))
        seqs.append(ids + list(encode(a)) + [tokenizer.eos_token_id])
        starts.append(len(ids))
    width = max(map(len, seqs))
    input_ids = torch.full((len(seqs), width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    for i, (s, st) in enumerate(zip(seqs, starts)):
        input_ids[i, : len(s)] = torch.tensor(s)
        labels[i, st : len(s)] = torch.tensor(s[st:])
    mask = (torch.arange(width)[None] < torch.tensor([len(s) for s in seqs])[:, None]).long()
    return input_ids, mask, labels


def fit(model, tokenizer, rows: list[dict], cfg: dict, seed: int, progress=None) -> float:
    """`cfg["steps"]` AdamW steps on batches of rows drawn with the seed, noisy labels; returns the last loss.
    `progress(total)`: an iterator over range(total) that shows it (the run's console bar); none by default."""
    rng = random.Random(f"rlrun-warmstart-{seed}")
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=(0.9, 0.99), weight_decay=cfg["weight_decay"],
                            foreach=False)
    encode = functools.lru_cache(maxsize=None)(lambda text: tuple(tokenizer(text, add_special_tokens=False).input_ids))
    was_training = model.training
    model.train()
    loss = torch.tensor(float("nan"))
    steps = progress(cfg["steps"]) if progress is not None else range(cfg["steps"])
    for _ in steps:
        batch = [rows[rng.randrange(len(rows))] for _ in range(cfg["batch_size"])]
        answers = [noisy_answer(r["answer"], rng, cfg["wrong_prob"], cfg["offsets"]) for r in batch]
        prompts = [r["prompt"] for r in batch]
        ids, mask, labels = (t.to(device) for t in batch_tensors(tokenizer, prompts, answers, encode))
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    getattr(steps, "close", lambda: None)()  # a bar ends its line before the run's own starts
    model.train(was_training)
    return loss.item()


def distinct(rows: list[dict]) -> list[dict]:
    """One row per prompt (the first), in order: how often a problem repeats in the task does not matter."""
    first: dict[str, dict] = {}
    for r in rows:
        first.setdefault(r["prompt"], r)
    return list(first.values())


def cache_key(model, rows: list[dict], cfg, seed: int) -> str:
    """Everything the warm start's result depends on: initial weights and config of the model, the rows, the
    options, the seed, and the library versions (another torch may round differently)."""
    import transformers

    h = hashlib.sha256()
    meta = {"v": VERSION, "cfg": options(cfg), "seed": seed, "torch": torch.__version__,
            "transformers": transformers.__version__, "config": model.config.to_json_string(use_diff=False),
            "rows": [[r["prompt"], r["answer"]] for r in distinct(rows)]}
    h.update(json.dumps(meta, sort_keys=True, default=str).encode())
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:32]


def _load_cached(path: Path) -> dict | None:
    """The weights of a cache entry, or None (with a warning naming the file) when it is not a sound one."""
    try:
        data = path.read_bytes()
        head, _, payload = data.partition(b"\n")
        if not head.startswith(HEADER) or hashlib.sha256(payload).hexdigest() != head[len(HEADER):].decode():
            raise ValueError("checksum mismatch (truncated or corrupted)")
        state = torch.load(io.BytesIO(payload), weights_only=True)
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise ValueError("not a state dict of tensors")
        return state
    except Exception as e:  # noqa: BLE001 - any bad entry is recomputed, whatever the reason
        log.warning("warm-start cache entry %s is unusable (%s: %s); recomputing it", path, type(e).__name__,
                    str(e).splitlines()[0][:200] if str(e) else "")
        return None


def _save_cached(path: Path, model) -> None:
    """Write the entry atomically (a per-process temporary name, then a rename); a failed write is a warning."""
    buf = io.BytesIO()
    torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, buf)
    payload = buf.getvalue()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # atomic: a reader sees the whole file or none; never written through a link planted in the cache
        nofollow.write_replacing(str(path), HEADER + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload)
    except (OSError, LinkError) as e:
        log.warning("could not write the warm-start cache entry %s (%s); the run goes on (set RLRUN_CACHE to a "
                    "writable folder, or warm_start.cache=false)", path, getattr(e, "strerror", None) or e)


def warm_start(model, tokenizer, rows: list[dict], cfg, seed: int, cache: bool = True, progress=None):
    """Warm-start `model` in place on the training `rows` ({"prompt", "answer"}), or load the cached result of
    the same warm start; returns the model. `cfg`: the options (see DEFAULTS), a dict or an OmegaConf node.
    `progress`: as `fit`'s (a cached warm start shows none: it loads in a moment).
    Call it on the plain model before any engine wraps or partitions it, and copy the reference model after."""
    opts, rows = options(cfg), distinct(rows)
    path = cache_dir() / f"{cache_key(model, rows, opts, seed)}.pt" if cache else None
    state = _load_cached(path) if path is not None and path.is_file() else None
    if state is not None:
        shapes = {k: v.shape for k, v in model.state_dict().items()}
        if {k: v.shape for k, v in state.items()} == shapes:  # checked first: a failed load would leave it half-set
            model.load_state_dict(state)
            return model
        log.warning("warm-start cache entry %s does not fit the model (other weights); recomputing it", path)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        fit(model, tokenizer, rows, opts, seed, progress)
    if path is not None:
        _save_cached(path, model)
    return model


def notice(cfg, rows: int) -> str | None:
    """What a warm start on the user's data does, said when it runs (None on the embedded task, where it is the
    default)."""
    if on_embedded_task(cfg):
        return None
    w = cfg.warm_start
    return (f"warm start: {w.steps} supervised steps on {rows} training rows, prompt -> answer (DPO: the chosen "
            f"response), {w.wrong_prob:.0%} of the labels made wrong on purpose (the answer with one of "
            f"{list(w.offsets)} added, where it is a number); it is meant for task=arith's short numeric answers. "
            "warm_start.enabled=false turns it off.")
