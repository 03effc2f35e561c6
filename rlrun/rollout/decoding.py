"""rollout.decode=eager|compiled as objects (the registry's `decode` entries): how rollout=hf (and evaluation) runs
its decode loop. Both draw with the same seeded sampler (rollout/hf.py) and end rows the same way.

- `Eager` (the baseline): rollout/hf.py `decode`, a dynamic KV cache that grows a token a step and a batch that
  shrinks to the rows still running, every operator launched from Python.
- `Compiled`: the prompt pass as `Eager` runs it (each prompt prefilled once per group), copied into a KV cache
  allocated once for the rollout's whole length (transformers' StaticCache), then each decode step's forward is
  one compiled graph of fixed shapes: inductor on CPU, CUDA graphs on a GPU. The batch is a bucket of a power of 2
  rows; rows that end stay in it until at most half of it runs on, then the running rows move to the next smaller
  bucket (one compile per bucket size and cache length, reused by every later rollout: the cache length is rounded
  up to LENGTH_STEP). Where compiling fails, the same static loop runs eagerly after one warning.

Exactness: the prefill and the sampler are `Eager`'s; the compiled forward rounds in another order than eager's
kernels (and computes a bucket's rows, not the running rows alone), so the sampler's logprobs agree to fp32
tolerance and the tokens are the same except where a draw falls within rounding of a tie
(tests/unit/rollout/test_decoding.py compares tokens and logprobs with `Eager` and transformers' `generate`;
`rlrun check`'s `generator = trainer` probe bounds the logprobs per configuration).
"""

from __future__ import annotations

import logging
import time
import warnings
import weakref
from dataclasses import dataclass

import torch

from .. import models
from . import attention, hf

log = logging.getLogger("rlrun")
LENGTH_STEP = 64  # the static cache's length is the rollout's (prompt + max_new_tokens) rounded up to this


@dataclass
class Compiles:
    """Process-wide: how many graphs the decode step compiled and the seconds the steps that compiled took."""

    count: int = 0
    seconds: float = 0.0
    failed: int = 0  # models whose compile failed (decoded eagerly since)


COMPILES = Compiles()


def bucket(rows: int) -> int:
    """The batch size a compiled step runs `rows` rows at: the next power of 2."""
    return 1 << max(0, rows - 1).bit_length()


def _backend(device_type: str):
    """inductor, counting each graph it compiles (tests count compiles; none times them); CUDA graphs on a GPU (what
    `torch.compile(mode="reduce-overhead")` sets)."""
    from torch._inductor.compile_fx import compile_fx

    def compile_counted(gm, example_inputs):
        COMPILES.count += 1
        patches = {"triton.cudagraphs": True} if device_type == "cuda" else {}
        return compile_fx(gm, example_inputs, config_patches=patches)

    return compile_counted


def _forward(lm, x, position_ids, cache_position, attention_mask, cache):
    out = lm(input_ids=x, attention_mask=attention_mask, position_ids=position_ids, cache_position=cache_position,
             past_key_values=cache, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1].float()


_STEPS: dict = {}  # (device type, function) -> the compiled function (dynamo keeps one graph per shape)
_FAILED: weakref.WeakSet = weakref.WeakSet()  # models whose compile failed: they decode with `_forward` as it is


def _step(lm, device_type: str, fn=_forward):
    """`fn` compiled for `device_type` (`_forward`, or the verify forward of rollout/verify.py), or `fn` itself for a
    model whose compile failed."""
    if lm in _FAILED:
        return fn
    if (device_type, fn) not in _STEPS:
        import torch._dynamo

        # one graph per bucket and cache length: more than dynamo's default 8 shapes of one function
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        _STEPS[device_type, fn] = torch.compile(fn, backend=_backend(device_type), dynamic=False, fullgraph=True)
    return _STEPS[device_type, fn]


_STATIC_OK: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> static_ok's answer


def static_ok(lm) -> bool:
    """Whether every layer's cache is a plain static one (no sliding window, no linear attention): the layouts
    `_static_cache` copies. Asked once per model (a small StaticCache is built to ask its layers' types)."""
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer

    if lm not in _STATIC_OK:
        cache = StaticCache(config=lm.config.get_text_config(decoder=True), max_cache_len=1)
        _STATIC_OK[lm] = all(type(layer) is StaticLayer for layer in cache.layers)
    return _STATIC_OK[lm]


def _static_cache(lm, rows: int, length: int, like):
    """A StaticCache of `rows` x `length` positions, its layers laid out as `like`'s keys and values."""
    from transformers import StaticCache

    cache = StaticCache(config=lm.config.get_text_config(decoder=True), max_cache_len=length)
    k = like.layers[0].keys
    cache.early_initialization(rows, k.shape[1], k.shape[-1], k.dtype, k.device)
    return cache


def _fill(cache, source, index: torch.Tensor, filled: int) -> None:
    """`cache`'s rows := `source`'s rows `index`, its first `filled` positions (a dynamic cache: all it holds)."""
    for new, old in zip(cache.layers, source.layers):
        new.keys[:, :, :filled].copy_(old.keys[index, :, :filled])
        new.values[:, :, :filled].copy_(old.values[index, :, :filled])
        new.cumulative_length.fill_(filled)


def _padded(index: torch.Tensor, size: int) -> torch.Tensor:
    """`index` filled up to `size` entries with its first (the extra rows compute a copy and are never read)."""
    return torch.cat([index, index[:1].expand(size - len(index))])


def _run(lm, x, position_ids, cache_position, mask, cache):
    """One decode step's logits [bucket, vocab]; a compile that fails warns once, then the model decodes eagerly."""
    return run_compiled(lm, x, position_ids, cache_position, mask, cache)


def run_compiled(lm, x, *inputs, fn=_forward):
    """`fn(lm, x, *inputs)` compiled (one graph per shape); a compile that fails warns once, then the model runs
    `fn` eagerly from then on (rollout/verify.py's verify forward runs here too)."""
    step = _step(lm, x.device.type, fn)
    before = COMPILES.count
    start = time.perf_counter()
    try:
        out = step(lm, x, *inputs)
    except Exception as e:  # noqa: BLE001 - any compiler failure (no C++ compiler, an unsupported op): run eagerly
        if step is fn:
            raise
        _FAILED.add(lm)
        COMPILES.failed += 1
        cause = getattr(e, "inner_exception", None) or e  # dynamo wraps the compiler's own error
        said = next((line for line in str(cause).splitlines() if line.strip()), "")
        warnings.warn(f"rollout.decode=compiled: compiling the decode step failed ({type(cause).__name__}: {said}); "
                      "this model decodes eagerly from now on (rollout.decode=eager says so up front)",
                      RuntimeWarning, stacklevel=2)
        return fn(lm, x, *inputs)
    if COMPILES.count > before:
        seconds = time.perf_counter() - start
        COMPILES.seconds += seconds
        log.info("rollout.decode=compiled: compiled the decode step for %d rows x %d tokens in %.1f s",
                 x.shape[0], x.shape[1], seconds)
    return out


def _prefill(lm, input_ids, attention_mask, length: int, prefill_once: bool):
    """(the first logits, the static cache of the rollout's bucket holding the prompts, its attention mask, each
    row's last prompt position): the prompt pass as `Eager` runs it (a dynamic cache), copied into the static one."""
    from transformers import DynamicCache

    rows, prompt = input_ids.shape
    position_ids = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
    prefill = DynamicCache(config=lm.config.get_text_config(decoder=True))
    shared = hf.distinct_rows(input_ids, attention_mask) if prefill_once else None
    scores = hf.next_scores(lm, input_ids, attention_mask, position_ids, prefill, shared)
    index = _padded(torch.arange(rows, device=input_ids.device), bucket(rows))
    cache = _static_cache(lm, len(index), length, prefill)
    _fill(cache, prefill, index, prompt)
    # every position after the prompt is attended once written: the causal mask (cache_position) hides the rest
    mask = torch.ones(len(index), length, dtype=attention_mask.dtype, device=input_ids.device)
    mask[:, :prompt] = attention_mask[index]
    return scores, cache, mask, position_ids[index, -1:]


@torch.no_grad()
def decode_compiled(model, input_ids, attention_mask, *, max_new_tokens: int, eos_token_id: int, pad_token_id: int,
                    processor=None, drop_ended: bool = True, prefill_once: bool = True,
                    grouped_kv: bool = True) -> torch.Tensor:
    """rollout/hf.py `decode`'s contract (the same response tensor, the same processor calls), with the decode
    steps compiled at static shapes (the module docstring). Models `decode` sends to `generate`, and models whose
    caches are not plain static ones, go to `hf.decode`."""
    lm = models.unwrap(model)
    if not hf.fast_path(lm) or not static_ok(lm):
        return hf.decode(model, input_ids, attention_mask, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                         pad_token_id=pad_token_id, processor=processor, drop_ended=drop_ended,
                         prefill_once=prefill_once, grouped_kv=grouped_kv)
    with attention.grouped(lm, grouped_kv):  # grouped KV heads read in place, not copied a step (attention.py)
        return _decode(lm, input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id, processor,
                       drop_ended and (processor is None or hasattr(processor, "select")), prefill_once)


def _decode(lm, input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id, processor, drop: bool,
            prefill_once: bool) -> torch.Tensor:
    """`decode_compiled`'s loop (`drop`: ended rows may leave the bucket)."""
    rows_in, prompt = input_ids.shape
    device = input_ids.device
    length = -(-(prompt + max_new_tokens) // LENGTH_STEP) * LENGTH_STEP
    scores, cache, mask, last = _prefill(lm, input_ids, attention_mask, length, prefill_once)
    size = cache.layers[0].keys.shape[0]
    response = input_ids.new_full((rows_in, max_new_tokens), pad_token_id)
    rows = torch.arange(rows_in, device=device)  # the rows still running, in response
    slots = torch.arange(rows_in, device=device)  # where each running row sits in the bucket
    ids, unfinished, done = input_ids, torch.ones(rows_in, dtype=torch.bool, device=device), 0
    next_tokens = input_ids[:, -1]  # (set by each step before the next reads it)
    for step in range(max_new_tokens):
        if step:
            x = torch.full((size, 1), pad_token_id, dtype=input_ids.dtype, device=device)
            x[slots, 0] = next_tokens
            at = torch.tensor([prompt + step - 1], device=device)
            scores = _run(lm, x, last + step, at, mask, cache)[slots]
        next_tokens, unfinished = hf.choose(processor, ids, scores, unfinished, eos_token_id, pad_token_id)
        response[rows, step], done = next_tokens, step + 1
        if not unfinished.any():
            break
        if drop and not unfinished.all():
            keep = hf.going_on(processor, unfinished, next_tokens)
            rows, next_tokens, ids, unfinished, slots = (rows[keep], next_tokens[keep], ids[keep], unfinished[keep],
                                                         slots[keep])
            if len(slots) <= size // 2:  # the running rows move to a smaller bucket
                size, index = bucket(len(slots)), _padded(slots, bucket(len(slots)))
                smaller = _static_cache(lm, size, length, cache)
                _fill(smaller, cache, index, prompt + step)
                cache, mask, last = smaller, mask[index], last[index]
                slots = torch.arange(len(rows), device=device)
        ids = torch.cat([ids, next_tokens[:, None]], 1)
    return response[:, :done]


class Eager:
    """rollout.decode=eager: rollout/hf.py `decode` (the baseline)."""

    exactness = "baseline"
    phases: tuple[str, ...] = ("generate",)
    decode = staticmethod(hf.decode)
    static = False  # whether its forwards run at fixed shapes (speculation verifies at them: rollout/verify.py)

    @staticmethod
    def memory(kv_cache_bytes: int) -> dict[str, int]:
        """Its term of the generate phase besides the plan's KV cache at the rollout's length: none."""
        return {}


class Compiled(Eager):
    """rollout.decode=compiled: `decode_compiled`."""

    exactness = "fp_tolerance"
    decode = staticmethod(decode_compiled)
    static = True

    @staticmethod
    def memory(kv_cache_bytes: int) -> dict[str, int]:
        """The static cache is the plan's KV cache (at the rollout's length from the start, rounded up to
        LENGTH_STEP: within the plan's margin); while the running rows move to a smaller bucket both are held, the
        smaller at most half the rows."""
        return {"static KV cache: the smaller bucket while rows move (half)": kv_cache_bytes // 2}


of = hf.of  # the decode option of a rollout config: defined where hf.generate asks for it
