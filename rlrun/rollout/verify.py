"""The verify loop of a speculative decode (rollout.speculate=prompt|history; rollout/speculate.py): each pass feeds
every running row its last accepted token and its draft (rollout/drafts.py) in one forward, and position j of a row
chooses its token as plain decoding's step (tokens so far + j) would: the same logits up to the rounding of a
(k+1)-position forward, the same filter, logprob and Gumbel noise (hf.SeededSampler.choose_at). A row keeps the longest
prefix of its draft that equals those choices, plus the first choice that differs (or the one after the whole draft),
cut at EOS and at max_new_tokens. Noise of a rejected position is not consumed: a row's step is its count of accepted
tokens. So the tokens are plain decoding's; only the number of forwards changes.

Rows accept different numbers of tokens, so each writes its block of keys and values at columns of its own
(`RowCache`: a row's column is its token count) and attends through a 4-D mask (its prompt, its tokens so far,
causal inside the block): a rejected position's entries are overwritten by the row's next block, never attended.
Eager (`static=False`): the batch shrinks to the running rows and each pass is as wide as the longest draft (one
position where no row has one: a plain step). Static (rollout.decode=compiled): a bucket of a power of 2 rows, the
cache's whole length and k + 1 positions (or 1 where no row drafted) each pass, one compiled graph per shape; rows
move to a smaller bucket once at most half of one runs, as in rollout/decoding.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import decoding, hf

GROW = 16  # columns an eager verify loop's cache grows by at least

@dataclass
class Stats:
    """What speculation did (summed over the rollouts it is passed to): forwards after the prompt pass, the rows
    they computed, the tokens those rows accepted, the drafted tokens verified and those accepted."""

    passes: int = 0
    row_passes: int = 0
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0

    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def per_pass(self) -> float:
        """Tokens a row accepted per verify pass it was computed in (1.0: no gain over plain decoding)."""
        return self.tokens / self.row_passes if self.row_passes else 0.0


class RowCache:
    """Each layer's keys and values [rows, heads, length, dim], written by a forward at each row's own columns
    (`at[i]` onward) and read up to `width` columns: the duck type of a transformers cache a decoder layer calls."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]):
        self.keys, self.values = keys, values
        self.at = torch.zeros(keys[0].shape[0], dtype=torch.long, device=keys[0].device)
        self.width = keys[0].shape[2]

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        columns = self.at[:, None] + torch.arange(key_states.shape[2], device=self.at.device)
        index = columns[:, None, :, None].expand_as(key_states)
        for store, states in ((self.keys, key_states), (self.values, value_states)):
            if store[layer_idx].dtype != states.dtype:  # bf16 autocast: RoPE'd keys fp32, values bf16, the prompt
                # pass's fp32: promoted as plain decoding's cache (torch.cat) promotes them
                dtype = torch.promote_types(store[layer_idx].dtype, states.dtype)
                store[layer_idx], states = store[layer_idx].to(dtype), states.to(dtype)
            store[layer_idx].scatter_(2, index, states)
        return self.keys[layer_idx][:, :, :self.width], self.values[layer_idx][:, :, :self.width]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.width

    def select(self, index: torch.Tensor) -> RowCache:
        return RowCache([k[index] for k in self.keys], [v[index] for v in self.values])

    def reserve(self, columns: int) -> None:
        """At least `columns` columns (eager: the cache grows as the rows do, GROW at a time, zeros: a column no
        row has written is attended by none, and zeros keep its masked products finite)."""
        have = self.keys[0].shape[2]
        if have < columns:
            more = max(columns - have, GROW)
            self.keys = [torch.cat([k, k.new_zeros(*k.shape[:2], more, k.shape[3])], 2) for k in self.keys]
            self.values = [torch.cat([v, v.new_zeros(*v.shape[:2], more, v.shape[3])], 2) for v in self.values]


def _from_prefill(prefill, index: torch.Tensor, length: int) -> RowCache:
    """A RowCache of `length` columns holding the prefill cache's rows `index` in its first columns."""
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for layer in prefill.layers:
        for out, old in ((keys, layer.keys), (values, layer.values)):
            new = old.new_zeros(len(index), old.shape[1], length, old.shape[3])
            new[:, :, :old.shape[2]] = old[index]
            out.append(new)
    return RowCache(keys, values)


def _mask(prompt_mask: torch.Tensor, at: torch.Tensor, width: int, columns: int) -> torch.Tensor:
    """[rows, 1, width, columns] bool: position j of a row attends its prompt (not its padding) and the columns
    from the prompt's end up to its own (`at + j`)."""
    prompt = prompt_mask.shape[1]
    cols = torch.arange(prompt, columns, device=at.device)
    after = cols[None, None, :] <= (at[:, None, None] + torch.arange(width, device=at.device)[None, :, None])
    return torch.cat([prompt_mask[:, None, :].expand(-1, width, -1), after], -1)[:, None]


def _forward(lm, x, position_ids, mask, cache):
    return lm(input_ids=x, attention_mask=mask, position_ids=position_ids, past_key_values=cache, use_cache=True,
              logits_to_keep=0).logits.float()


def _choose(processor, scores, rows, n):
    """(tokens, logprobs) [R, W] of scores [R, W, vocab]: the sampler's, or greedy (no processor: logprobs 0)."""
    if processor is None:
        return scores.argmax(-1), scores.new_zeros(scores.shape[:2])
    return processor.choose_at(scores, rows, n)


def _take(choices, drafts, n, max_new_tokens: int, eos_token_id):
    """(tokens each row accepts, drafted tokens it accepted, whether it ended): the drafted prefix equal to the
    choices plus one, cut after its first EOS and at max_new_tokens."""
    width = choices.shape[1]
    agree = (drafts == choices[:, :width - 1]).long().cumprod(1).sum(1)
    take = torch.minimum(agree + 1, max_new_tokens - n)
    ended = n + take >= max_new_tokens
    if eos_token_id is not None:
        j = torch.arange(width, device=choices.device)
        eos = (choices == eos_token_id) & (j[None] < take[:, None])
        first = torch.where(eos, j[None], width).amin(1)
        ended = ended | (first < width)
        take = torch.minimum(take, first + 1)
    return take, torch.minimum(agree, take), ended  # draft j is token j - 1 of the block: kept if j <= take


@dataclass
class Running:
    """The rows still running: their index in the response, tokens accepted, last token and slot in the cache."""

    rows: torch.Tensor
    n: torch.Tensor
    last: torch.Tensor
    slots: torch.Tensor

    def keep(self, keep: torch.Tensor) -> Running:
        return Running(self.rows[keep], self.n[keep], self.last[keep], self.slots[keep])


def _prefill(lm, input_ids, attention_mask, prefill_once: bool):
    """The prompt pass as plain decoding runs it (each distinct prompt once): (first logits [B, vocab], its cache)."""
    from transformers import DynamicCache

    position_ids = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
    cache = DynamicCache(config=lm.config.get_text_config(decoder=True))
    shared = hf.distinct_rows(input_ids, attention_mask) if prefill_once else None
    return hf.next_scores(lm, input_ids, attention_mask, position_ids, cache, shared), cache


@torch.no_grad()
def run(lm, input_ids, attention_mask, *, max_new_tokens: int, eos_token_id, pad_token_id: int, processor, drafter,
        k: int, static: bool, stats: Stats, prefill_once: bool = True) -> torch.Tensor:
    """The response [B, <= max_new_tokens] plain decoding draws (the module docstring); `processor`: a
    SeededSampler (its `choose_at` chooses; the logprobs are `record`ed on it) or None (greedy)."""
    rows_in, prompt = input_ids.shape
    device = input_ids.device
    length = prompt + max_new_tokens + k
    if static:  # the static length rounded up as the compiled decode's, so later rollouts reuse its graphs
        length = -(-length // decoding.LENGTH_STEP) * decoding.LENGTH_STEP
    else:  # grown as the rows go (RowCache.reserve)
        length = prompt + GROW
    scores, prefill = _prefill(lm, input_ids, attention_mask, prefill_once)
    size = decoding.bucket(rows_in) if static else rows_in
    index = decoding._padded(torch.arange(rows_in, device=device), size)
    cache = _from_prefill(prefill, index, length)
    slot_mask, slot_start = attention_mask[index].bool(), attention_mask.sum(1)[index]  # prompt mask, length
    response = input_ids.new_full((rows_in, max_new_tokens), pad_token_id)
    logprobs = torch.zeros(rows_in, max_new_tokens, device=device)
    now = Running(torch.arange(rows_in, device=device), torch.zeros_like(index[:rows_in]), input_ids[:, -1],
                  torch.arange(rows_in, device=device))
    drafts, lens, lengths = input_ids.new_zeros(rows_in, 0), None, torch.zeros_like(now.n)
    choices, logp = _choose(processor, scores[:, None], now.rows, now.n)  # token 0: the prompt pass's
    while True:
        now, keep = _accept(choices, logp, drafts, lens, now, (response, logprobs, lengths), drafter, stats,
                            max_new_tokens, eos_token_id)
        if not len(now.rows):
            break
        if not static:  # the batch is the running rows
            if len(keep) < cache.keys[0].shape[0]:
                cache, slot_mask, slot_start = cache.select(keep), slot_mask[keep], slot_start[keep]
                now.slots = torch.arange(len(now.rows), device=device)
        elif len(now.rows) <= size // 2:  # to a smaller bucket
            size = decoding.bucket(len(now.rows))
            index = decoding._padded(now.slots, size)
            cache, slot_mask, slot_start = cache.select(index), slot_mask[index], slot_start[index]
            now.slots = torch.arange(len(now.rows), device=device)
        drafts, lens = _drafts(drafter, now, k, max_new_tokens, pad_token_id, static)
        x = torch.cat([now.last[:, None], drafts], 1)
        scores = _verify(lm, x, now, cache, slot_mask, slot_start, prompt, static, pad_token_id)
        stats.passes += 1
        choices, logp = _choose(processor, scores, now.rows, now.n)
    done = int(lengths.max())
    if processor is not None:
        processor.record(logprobs[:, :done])
    return response[:, :done]


def _accept(choices, logp, drafts, lens, now: Running, out, drafter, stats: Stats, max_new_tokens: int,
            eos_token_id):
    """Write each row's accepted tokens (and logprobs, and its length) into `out`, tell the drafter, count them
    (`lens`: the true draft lengths; None for the prompt pass's token); (the rows still running, their indices)."""
    response, logprobs, lengths = out
    take, agreed, ended = _take(choices, drafts, now.n, max_new_tokens, eos_token_id)
    j = torch.arange(choices.shape[1], device=choices.device)
    ok = j[None] < take[:, None]
    rows, columns = now.rows[:, None].expand_as(choices)[ok], (now.n[:, None] + j)[ok]
    response[rows, columns], logprobs[rows, columns] = choices[ok], logp[ok]
    if lens is not None:
        stats.row_passes += len(now.rows)
        stats.tokens += int(take.sum())
        stats.drafted += int(lens.sum())
        stats.accepted += int(torch.minimum(agreed, lens).sum())
    for row, tokens, t in zip(now.rows.tolist(), choices.tolist(), take.tolist()):
        drafter.extend(row, tokens[:t])
    n = now.n + take
    lengths[now.rows] = n
    last = choices.gather(1, (take - 1)[:, None])[:, 0]
    keep = (~ended).nonzero().squeeze(1)
    return Running(now.rows, n, last, now.slots).keep(keep), keep


def _drafts(drafter, now: Running, k: int, max_new_tokens: int, pad_token_id: int, static: bool):
    """([R, width] drafts padded with pad_token_id, [R] their lengths): each row's draft, cut where it could not be
    accepted (past max_new_tokens). width: the longest draft (eager), or k (static: its graph's shape; 0 where no
    row drafted, a plain step)."""
    room = (max_new_tokens - 1 - now.n).clamp(max=k).tolist()
    props = [p[:r] for p, r in zip(drafter.propose(now.rows.tolist(), k), room)]
    longest = max(map(len, props), default=0)
    width = (k if longest else 0) if static else longest
    drafts = torch.tensor([p + [pad_token_id] * (width - len(p)) for p in props], dtype=torch.long)
    return drafts.view(len(props), width).to(now.rows.device), torch.tensor([len(p) for p in props])


def _verify(lm, x, now: Running, cache: RowCache, slot_mask, slot_start, prompt: int, static: bool,
            pad_token_id: int) -> torch.Tensor:
    """The logits [R, width, vocab] of one verify forward: row i's block at columns prompt + n - 1 on, its
    positions its prompt's length + n - 1 on (a static bucket's other slots compute a copy, never read)."""
    width = x.shape[1]
    at, pos = prompt + now.n - 1, slot_start[now.slots] + now.n - 1
    steps = torch.arange(width, device=x.device)
    if static:
        size = cache.keys[0].shape[0]
        xs = torch.full((size, width), pad_token_id, dtype=x.dtype, device=x.device)
        ats = torch.full((size,), prompt, dtype=at.dtype, device=x.device)
        poss = slot_start.clone()
        xs[now.slots], ats[now.slots], poss[now.slots] = x, at, pos
        x, at, pos = xs, ats, poss
        cache.width = cache.keys[0].shape[2]
    else:
        cache.width = int(at.max()) + width
        cache.reserve(cache.width)
    cache.at = at
    mask = _mask(slot_mask, at, width, cache.width)
    inputs = (x, pos[:, None] + steps, mask, cache)
    scores = decoding.run_compiled(lm, *inputs, fn=_forward) if static else _forward(lm, *inputs)
    return scores[now.slots]
