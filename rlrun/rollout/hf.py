"""Generation on the policy itself (rollout=hf): sampled completions plus the sampler's own logprobs.

`decode` is transformers' `generate` loop for decoder-only models (KV cache, left padding, pad after EOS) without
its per-call and per-step overhead, which dominated the embedded model's step; it draws the same tokens bit for bit
(tests/unit/rollout/test_rollout.py). Models it does not cover still go through `generate`.

Sampling is Gumbel-max with one seeded generator per sequence: token = argmax(logits/T (top-p filtered) + Gumbel
noise), which is an exact draw from the tempered, filtered distribution. Because each sequence's noise depends
only on its own seed, the completions do not depend on how the rollout is split into batches or ranks: a 2-rank
run samples exactly what a 1-rank run samples. Only the sampled token's logprob is kept per step (not the
`[batch, vocab]` scores of every step).
"""

from __future__ import annotations

import inspect
import weakref

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from .. import models
from . import Rollout, attention


def top_p_filter(logits: torch.Tensor, top_p: float, top_k: int = 0) -> torch.Tensor:
    """-inf outside the `top_k` most likely tokens (0: all), then outside the smallest set of those whose
    renormalised probability reaches top_p (the top token always stays): transformers' and vLLM's order."""
    if top_p >= 1.0 and not 0 < top_k < logits.shape[-1]:
        return logits
    sorted_logits, order = logits.sort(-1, descending=True)
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if 0 < top_k < logits.shape[-1]:
        drop[..., top_k:] = True
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    if top_p < 1.0:
        probs = sorted_logits.softmax(-1)
        drop |= probs.cumsum(-1) - probs >= top_p  # mass before this token already reaches top_p
    return logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))


AHEAD_FLOATS = 1 << 14  # uniform draws a row takes from its generator at once (64 KiB): a few steps' worth


class SeededSampler(LogitsProcessor):
    """Turns greedy decoding into per-sequence seeded sampling and records the sampled tokens' logprobs."""

    def __init__(self, seeds: list[int], temperature: float, top_p: float, max_steps: int | None = None,
                 top_k: int = 0):
        self.generators = [torch.Generator().manual_seed(int(s)) for s in seeds]
        self.temperature, self.top_p, self.top_k, self.max_steps = temperature, top_p, top_k, max_steps
        self.ahead: torch.Tensor | None = None  # [rows, steps, vocab]: the next steps' draws, taken at once
        self.pick = torch.arange(0)  # the rows of `ahead` still sampled
        self.used = 0  # steps of `ahead` used
        self.size = len(seeds)
        self.rows = torch.arange(self.size)  # the rows still sampled (`decode` drops the rows that have ended)
        self.logprobs: list[torch.Tensor] = []  # [B] per generated token (0 for a row that had ended)
        self.last: torch.Tensor | None = None  # this step's log-distribution, read once the token is known
        self.blocks: list[dict] | None = None  # speculation (`draws`): each row's blocks of uniforms, by number
        self.table: torch.Tensor | None = None  # or, where one block holds every step, all rows' blocks at once

    def collect(self, tokens: torch.Tensor) -> None:
        """Keep the logprob of `tokens`, this step's draw of the rows still sampled."""
        if self.last is not None:
            logp = self.last.gather(-1, tokens[:, None]).squeeze(-1)
            if len(self.rows) < self.size:
                logp = logp.new_zeros(self.size).index_copy_(0, self.rows.to(logp.device), logp)
            self.logprobs.append(logp)
            self.last = None

    def select(self, keep: torch.Tensor, tokens: torch.Tensor) -> None:
        """Only the running rows `keep` go on after this step's draw `tokens`. Their draws are unchanged: each row
        has a generator of its own."""
        self.collect(tokens)
        self.generators = [self.generators[i] for i in keep.tolist()]
        self.rows, self.pick = self.rows[keep.cpu()], self.pick[keep.cpu()]

    def uniform(self, vocab: int) -> torch.Tensor:
        """[rows, vocab]: this step's uniform draws, row i's from its own generator. A row draws the next steps'
        numbers in one call (`AHEAD_FLOATS`), not one call a step: torch's CPU generator gives the same stream
        either way (tests/unit/rollout/test_rollout.py checks it), and a rollout's generators are used by it alone."""
        if self.ahead is None or self.used == self.ahead.shape[1]:
            steps = max(1, min(AHEAD_FLOATS // vocab, self.max_steps or AHEAD_FLOATS))
            self.ahead = torch.stack([torch.rand(steps * vocab, generator=g) for g in self.generators])
            self.ahead, self.used = self.ahead.view(len(self.generators), steps, vocab), 0
            self.pick = torch.arange(len(self.generators))
        self.used += 1
        return self.ahead[self.pick, self.used - 1]

    def __call__(self, input_ids, scores):
        self.collect(input_ids[:, -1])  # the token chosen at the previous step
        logp = torch.log_softmax(top_p_filter(scores.float() / self.temperature, self.top_p, self.top_k), -1)
        self.last = logp
        return perturbed(logp, self.uniform(scores.shape[-1]).to(scores.device))

    # -- speculation (rollout/speculate.py): rows at different steps, several steps of a row in one call ----------

    def draws(self, rows: torch.Tensor, steps: torch.Tensor, width: int, vocab: int) -> torch.Tensor:
        """[len(rows), width, vocab]: the uniforms of steps `steps[i]` to `steps[i] + width - 1` of row `rows[i]` (an
        index into the seeds), read from the blocks each row's generator gives in the order `uniform` takes them, so
        the numbers are `uniform`'s at the same step. Steps past `max_steps` read its last step (never accepted)."""
        per = max(1, min(AHEAD_FLOATS // vocab, self.max_steps or AHEAD_FLOATS))
        at = steps[:, None].cpu() + torch.arange(width)
        if self.max_steps:
            at = at.clamp(max=self.max_steps - 1)
        if self.max_steps and per >= self.max_steps:  # one block holds every step a row draws: read them at once
            if self.table is None:
                self.table = torch.stack([torch.rand(per * vocab, generator=g) for g in self.generators])
            return self.table.view(len(self.generators), per, vocab)[rows.cpu()[:, None], at]
        if self.blocks is None:
            self.blocks = [{} for _ in self.generators]
        out = []
        for row, want in zip(rows.tolist(), at):
            blocks = self.blocks[row]
            for b in range(int(want[0]) // per, int(want[-1]) // per + 1):
                while b not in blocks:  # the next block of this row's stream (blocks are drawn in order)
                    blocks[len(blocks)] = torch.rand(per * vocab, generator=self.generators[row]).view(per, vocab)
            first = int(want[0]) // per
            for old in [b for b in blocks if b < first and blocks[b] is not None]:
                blocks[old] = None  # a block behind the row's step is never read again
            out.append(torch.cat([blocks[b] for b in range(first, int(want[-1]) // per + 1)])[want - first * per])
        return torch.stack(out)

    def choose_at(self, scores: torch.Tensor, rows: torch.Tensor, steps: torch.Tensor):
        """(tokens [R, W], their logprobs [R, W]) of `scores` [R, W, vocab]: position j of row `rows[i]` chooses as
        plain decoding's step `steps[i] + j` would (the same filter, logprob and noise)."""
        logp = torch.log_softmax(top_p_filter(scores.float() / self.temperature, self.top_p, self.top_k), -1)
        u = self.draws(rows, steps, scores.shape[1], scores.shape[-1]).to(scores.device)
        tokens = perturbed(logp, u).argmax(-1)
        return tokens, logp.gather(-1, tokens[..., None]).squeeze(-1)

    def record(self, logprobs: torch.Tensor) -> None:
        """The logprobs [B, steps] of a loop that drew every token through `choose_at` (`generate` reads them)."""
        self.logprobs, self.last = list(logprobs.unbind(1)), None


def perturbed(logp: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """logp + Gumbel(0, 1) noise from uniforms `u`: its argmax is an exact draw from exp(logp)."""
    exponential = -torch.log(u.clamp(min=1e-20))  # Exp(1); logp - log(Exp(1)) = logp + Gumbel(0, 1)
    return logp - torch.log(exponential.clamp_(min=1e-20))


def fast_path(model) -> bool:
    """Whether `decode` can run `model` (a decoder-only LM with transformers' default dynamic cache); other models
    (encoder-decoder, custom caches) go through `generate`, which handles them."""
    return (not model.config.is_encoder_decoder and getattr(model, "_supports_default_dynamic_cache", lambda: False)()
            and "logits_to_keep" in inspect.signature(model.forward).parameters)


def distinct_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """(one index per distinct row, each row's distinct row) of a prompt batch, or None where every row is distinct: a
    rollout repeats each prompt group_size times, and a prompt's prefill is the same for every copy."""
    key = torch.cat([input_ids, attention_mask], 1)
    found, inverse = torch.unique(key, dim=0, return_inverse=True)
    if len(found) == len(key):
        return None
    first = torch.full((len(found),), len(key), dtype=torch.long, device=key.device)
    first.scatter_reduce_(0, inverse, torch.arange(len(key), device=key.device), "amin")
    return first, inverse


def next_scores(lm, x, attention_mask, position_ids, cache, shared=None) -> torch.Tensor:
    """One forward of the decode loop: the last position's logits in fp32, the KV cache extended. `shared` (the
    prompt pass, `distinct_rows`): each distinct prompt computed once, its cache and logits copied to the rows that
    repeat it."""
    pick = shared[0] if shared is not None else slice(None)
    out = lm(input_ids=x[pick], attention_mask=attention_mask[pick], position_ids=position_ids[pick],
             past_key_values=cache, use_cache=True, logits_to_keep=1)
    logits = out.logits[:, -1]
    if shared is not None:
        cache.batch_select_indices(shared[1])
        logits = logits[shared[1]]
    return logits.to(dtype=torch.float32, copy=True)


def choose(processor, ids, scores, unfinished, eos_token_id, pad_token_id):
    """One decode step's tokens (the processor's pick, or greedy; pad where a row had ended) and the rows still
    running after them: the step eager and compiled decoding share."""
    next_tokens = (processor(ids, scores) if processor else scores).argmax(-1)
    next_tokens = torch.where(unfinished, next_tokens, pad_token_id)
    if eos_token_id is not None:
        unfinished = unfinished & (next_tokens != eos_token_id)
    return next_tokens, unfinished


def going_on(processor, unfinished, next_tokens) -> torch.Tensor:
    """The indices of the rows that go on, told to a processor that keeps per-row state (SeededSampler.select)."""
    keep = unfinished.nonzero().squeeze(1)
    if processor is not None:
        processor.select(keep, next_tokens)
    return keep


@torch.no_grad()
def decode(model, input_ids, attention_mask, *, max_new_tokens: int, eos_token_id: int, pad_token_id: int,
           processor=None, drop_ended: bool = True, prefill_once: bool = True, grouped_kv: bool = True) -> torch.Tensor:
    """The response tokens [B, <= max_new_tokens] of greedy decoding over `processor(ids, scores)` (None: raw
    scores): the steps of transformers' `generate` (left padding, dynamic KV cache, last-position logits in fp32,
    pad after EOS, stop when every row has ended), without its per-step configuration and validation work, which
    dominates a small model's decode step. tests/unit/rollout/test_rollout.py checks it token for token against
    `generate`.

    A row that ends leaves the running batch (its KV cache rows too), so the model and the sampler only work on
    the rows still going: on long-tailed lengths most rows end long before the longest. A processor with a
    `select(keep, tokens)` method is told which rows go on (SeededSampler); one without it sees every row, as does
    `drop_ended=False` (every row to the end, as `generate` does: `python -m rlrun.bench generate` compares).

    `prefill_once`: each distinct prompt is prefilled once and its KV cache and first logits copied to the rows that
    repeat it (a group's completions share the prompt: group_size - 1 of every group_size prefills saved). A row's
    prefill is the same computation alone or among others; its numbers may differ in the last bits where the
    matmul library blocks a smaller batch otherwise (tests/unit/rollout/test_rollout.py compares).

    `grouped_kv`: a model whose query heads share KV heads attends without copying its cache per group, on CPU
    (rollout/attention.py: the same numbers bit for bit); False: transformers' SDPA attention, which copies."""
    lm = models.unwrap(model)
    if not fast_path(lm):
        out = lm.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                          logits_processor=LogitsProcessorList([processor] if processor else []),
                          max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, pad_token_id=pad_token_id)
        return out[:, input_ids.shape[1]:]
    with attention.grouped(lm, grouped_kv):
        return _decode(lm, input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id, processor,
                       drop_ended, prefill_once)


def _decode(lm, input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id, processor, drop_ended,
            prefill_once) -> torch.Tensor:
    """`decode`'s loop on a model of the fast path."""
    from transformers import DynamicCache

    cache = DynamicCache(config=lm.config.get_text_config(decoder=True))
    drop = drop_ended and (processor is None or hasattr(processor, "select"))  # may ended rows leave the batch
    position_ids = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
    response = input_ids.new_full((input_ids.shape[0], max_new_tokens), pad_token_id)
    rows = torch.arange(input_ids.shape[0], device=input_ids.device)  # the rows still running, in response
    ids, x, unfinished, length = input_ids, input_ids, torch.ones_like(input_ids[:, 0], dtype=torch.bool), 0
    shared = distinct_rows(input_ids, attention_mask) if prefill_once else None
    for step in range(max_new_tokens):
        scores = next_scores(lm, x, attention_mask, position_ids, cache, shared if step == 0 else None)
        next_tokens, unfinished = choose(processor, ids, scores, unfinished, eos_token_id, pad_token_id)
        response[rows, step], length = next_tokens, step + 1
        if not unfinished.any():
            break
        if drop and not unfinished.all():
            keep = going_on(processor, unfinished, next_tokens)
            cache.batch_select_indices(keep)
            rows, next_tokens, ids, unfinished = rows[keep], next_tokens[keep], ids[keep], unfinished[keep]
            attention_mask, position_ids = attention_mask[keep], position_ids[keep]
        x = next_tokens[:, None]
        ids = torch.cat([ids, x], 1)
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(x.shape)], 1)
        position_ids = position_ids[:, -1:] + 1
    return response[:, :length]


_PROMPT_IDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {prompt: token ids}


def encode(tokenizer, prompts: list[str], device):
    """Left-padded prompt ids and mask, as `tokenizer(prompts, padding=True, add_special_tokens=False)` gives, with
    each distinct prompt tokenized once per tokenizer (a rollout repeats each prompt group_size times)."""
    known = _PROMPT_IDS.setdefault(tokenizer, {})
    todo = list(dict.fromkeys(p for p in prompts if p not in known))
    if todo:
        known.update(zip(todo, tokenizer(todo, add_special_tokens=False)["input_ids"]))
    rows = [known[p] for p in prompts]
    width = max(len(r) for r in rows)
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(r)) + r for r in rows], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long)
    return ids.to(device), mask.to(device)


@torch.no_grad()
def generate(model, tokenizer, prompts: list[str], cfg, device, seeds: list[int], drop_ended: bool = True,
             prefill_once: bool = True, grouped_kv: bool = True, speculation=None) -> Rollout:
    """`seeds`: one sampling seed per prompt (see the module docstring); `drop_ended`, `prefill_once`, `grouped_kv`:
    see `decode`; `speculation`: the rollout.speculate object that runs the decode (rollout/speculate.py; None: a
    new one of `cfg`, its history empty)."""
    input_ids, attention_mask = encode(tokenizer, prompts, device)
    sampler = SeededSampler(seeds, cfg.temperature, cfg.top_p, cfg.max_new_tokens, getattr(cfg, "top_k", 0))
    extra = {} if grouped_kv else {"grouped_kv": False}  # (a decode option written before the flag needs no change)
    speculation = speculation if speculation is not None else speculating(cfg)
    response = speculation.decode(of(cfg), model, input_ids, attention_mask, max_new_tokens=cfg.max_new_tokens,
                                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                  processor=sampler, drop_ended=drop_ended, prefill_once=prefill_once, **extra)
    sampler.collect(response[sampler.rows.to(response.device), -1])  # the last draw of the rows still running
    gen_logprobs = torch.stack(sampler.logprobs, dim=1)
    return Rollout.from_response(input_ids, attention_mask, response, gen_logprobs, tokenizer)


def of(rollout_cfg):
    """The decode object of a rollout config (rollout=vllm and replay have no decode key: the baseline's)."""
    from .. import registry

    return registry.get("decode", getattr(rollout_cfg, "decode", None) or registry.baseline("decode"))


def speculating(rollout_cfg):
    """A new rollout.speculate object of a rollout config (its history empty); a config without the key: off."""
    from .. import registry

    name = getattr(rollout_cfg, "speculate", None) or registry.baseline("speculate")
    return registry.get("speculate", name)(rollout_cfg)


class HFRollout:
    """rollout=hf: transformers' generate on the policy itself, so there are no weights to sync. It keeps one
    rollout.speculate object for the run (`history` drafts from the run's earlier rollouts)."""

    needs_sync = False

    def __init__(self, cfg, tokenizer, device):
        self.cfg, self.tokenizer, self.device = cfg, tokenizer, device
        self.speculation = speculating(cfg)

    def generate(self, model, prompts: list[str], seeds: list[int]) -> Rollout:
        return generate(model, self.tokenizer, prompts, self.cfg, self.device, seeds, speculation=self.speculation)

    def sync(self, model) -> None:
        pass


def reserved(cfg, device_gib: float) -> dict[str, int]:
    """Nothing besides the policy: it samples from the trainer's own copy."""
    return {}


def build(cfg, model, tokenizer, device) -> HFRollout:
    return HFRollout(cfg, tokenizer, device)
