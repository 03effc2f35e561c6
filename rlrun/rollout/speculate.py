"""rollout.speculate=off|prompt|history as objects (the registry's `speculate` entries): whether rollout=hf (and
evaluation) decodes a token a forward, or drafts `rollout.speculate_k` tokens per row without a draft model and
verifies them in one forward (rollout/verify.py) under the seeded sampler, so that the tokens are plain decoding's.

- `Off` (the baseline): the decode option's own loop (rollout.decode: eager or compiled).
- `Prompt`: drafts by n-gram lookup in the row's prompt and its group's completions so far (rollout/drafts.py).
- `History`: the same, and in earlier completions of the same prompt in this run (in memory, bounded; a run's
  second epoch drafts from its first). Its memory lives on the object: rollout=hf keeps one per run.

Exactness: fp_tolerance, as rollout.decode=compiled: a verify forward over k + 1 positions rounds in another order
than a forward over one, so the sampler's logprobs agree to fp32 tolerance and the tokens are plain decoding's except
where a draw falls within rounding of a tie (tests/unit/rollout/test_speculate.py; `rlrun check`'s speculation probe,
rlrun/check/speculation.py, compares per configuration). Models the verify loop does not cover (no fast path, a
sliding-window cache) and processors other than the seeded sampler decode plainly: the same tokens, no speculation.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import models
from . import attention, decoding, hf, verify
from . import drafts as lookup  # (`drafts` is the options' fact below)


class Off:
    """rollout.speculate=off: the decode option's loop, a token a forward."""

    exactness = "baseline"
    phases: tuple[str, ...] = ("generate",)
    drafts = False  # whether it drafts and verifies (the speculation probe and bench ask)
    remembers = False  # whether it drafts from earlier rollouts (and so reads rollout.speculate_from)

    def __init__(self, rollout_cfg=None):
        self.k = int(getattr(rollout_cfg, "speculate_k", 4) or 4)
        self.stats = verify.Stats()  # summed over every decode this object ran
        self.logged = verify.Stats()  # `stats` when `step_metrics` last read them

    def decode(self, option, model, input_ids, attention_mask, *, max_new_tokens: int, eos_token_id, pad_token_id,
               processor=None, drop_ended: bool = True, prefill_once: bool = True, grouped_kv: bool = True,
               **kw) -> torch.Tensor:
        """The response tokens of `option` (a rollout.decode object) on these prompts: `option.decode`'s contract."""
        return option.decode(model, input_ids, attention_mask, max_new_tokens=max_new_tokens,
                             eos_token_id=eos_token_id, pad_token_id=pad_token_id, processor=processor,
                             drop_ended=drop_ended, prefill_once=prefill_once, grouped_kv=grouped_kv, **kw)

    def history(self) -> lookup.History | None:
        """The earlier completions it drafts from (`History`'s), or None."""
        return None

    @staticmethod
    def memory(kv_cache_bytes: int, sampler_bytes: int, k: int) -> dict[str, int]:
        """Its terms of the generate phase besides the plan's KV cache and sampler: none."""
        return {}


class Prompt(Off):
    """rollout.speculate=prompt: drafts from the prompt and the group's completions so far."""

    exactness = "fp_tolerance"
    drafts = True

    def decode(self, option, model, input_ids, attention_mask, *, max_new_tokens: int, eos_token_id, pad_token_id,
               processor=None, drop_ended: bool = True, prefill_once: bool = True, grouped_kv: bool = True,
               **kw) -> torch.Tensor:
        lm = models.unwrap(model)
        if (not hf.fast_path(lm) or not decoding.static_ok(lm)
                or (processor is not None and not hasattr(processor, "choose_at"))):
            return super().decode(option, model, input_ids, attention_mask, max_new_tokens=max_new_tokens,
                                  eos_token_id=eos_token_id, pad_token_id=pad_token_id, processor=processor,
                                  drop_ended=drop_ended, prefill_once=prefill_once, grouped_kv=grouped_kv, **kw)
        prompts, groups = prompt_rows(input_ids, attention_mask)
        drafter = lookup.Drafter(prompts, groups, self.history())
        with attention.grouped(lm, grouped_kv):
            response = verify.run(lm, input_ids, attention_mask, max_new_tokens=max_new_tokens,
                                  eos_token_id=eos_token_id, pad_token_id=pad_token_id, processor=processor,
                                  drafter=drafter, k=self.k, static=getattr(option, "static", False),
                                  stats=self.stats, prefill_once=prefill_once)
        self.remember(prompts, [drafter.completion(r) for r in range(len(prompts))])
        return response

    def remember(self, prompts: list[list[int]], completions: list[list[int]]) -> None:
        """What a decode drew, for later drafts: nothing here (`History` keeps it)."""

    @staticmethod
    def memory(kv_cache_bytes: int, sampler_bytes: int, k: int) -> dict[str, int]:
        """The verify loop's cache is copied as it grows (and from the prompt pass's): two at once for a moment, at
        most the plan's KV cache again; the sampler works on k + 1 positions a row (`sampler_bytes`: one's)."""
        return {"speculation: the KV cache while it is copied": kv_cache_bytes,
                f"speculation: the sampler over {k + 1} positions a row": k * sampler_bytes}


class History(Prompt):
    """rollout.speculate=history: drafts from the prompt, the group, and earlier completions of the same prompt."""

    remembers = True

    def __init__(self, rollout_cfg=None):
        super().__init__(rollout_cfg)
        self.seen = lookup.History()
        path = getattr(rollout_cfg, "speculate_from", None)
        if path:
            self.recorded = seed(self.seen, path)

    def history(self) -> lookup.History | None:
        return self.seen

    def remember(self, prompts: list[list[int]], completions: list[list[int]]) -> None:
        for prompt, completion in zip(prompts, completions):
            self.seen.add(tuple(prompt), completion)


def seed(history: lookup.History, path: str) -> int:
    """`history` given every completion of the rollout.record folder at `path` (in the order it was trained on),
    as a run's own rollouts would give it: how many. A record of another model's tokenizer only drafts badly: a
    draft never changes what is drawn."""
    import os

    from . import record

    rec, n = record.Record(os.path.expanduser(path), key="rollout.speculate_from"), 0
    for i in range(len(rec)):
        tensors, meta = rec.read(i, "cpu")
        p = meta["prompt_len"]
        prompts, _ = prompt_rows(tensors["input_ids"][:, :p], tensors["attention_mask"][:, :p])
        for prompt, ids, mask in zip(prompts, tensors["input_ids"][:, p:].tolist(), tensors["response_mask"].tolist()):
            history.add(tuple(prompt), [t for t, m in zip(ids, mask) if m])
            n += 1
    return n


def step_metrics(rollout) -> dict[str, float]:
    """`rollout/speculation/*`: what the run's speculation did since the last step logged (its rollouts), where its
    rollouts are drawn in this process by a decode that drafts (rollout=hf, rollout.pipeline=sync); {} otherwise
    (the async generator process keeps its own counts, not logged)."""
    spec = getattr(rollout, "speculation", None)
    if spec is None or not spec.drafts:
        return {}
    now = dataclasses.astuple(spec.stats)
    step = verify.Stats(*(a - b for a, b in zip(now, dataclasses.astuple(spec.logged))))
    spec.logged = verify.Stats(*now)
    if not step.row_passes:
        return {}
    return {"rollout/speculation/acceptance": step.acceptance(), "rollout/speculation/tokens_per_pass": step.per_pass(),
            "rollout/speculation/verify_passes": float(step.passes)}


def prompt_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[list[list[int]], list[int]]:
    """(each row's prompt tokens without its padding, each row's group: the index of the first row with the same
    prompt): rows that share a prompt (a GRPO group, evaluation's samples of one prompt) draft from each other."""
    prompts = [[t for t, m in zip(ids, mask) if m] for ids, mask in zip(input_ids.tolist(), attention_mask.tolist())]
    first: dict[tuple, int] = {}
    return prompts, [first.setdefault(tuple(p), i) for i, p in enumerate(prompts)]
