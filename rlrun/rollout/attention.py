"""Grouped-query attention with a padding mask on CPU, without copying the KV cache: what rlrun's decode loops
(rollout/hf.py `decode`, rollout/decoding.py `decode_compiled`) attend with.

A model with fewer KV heads than query heads (SmolLM2: 9 on 3; Qwen2, Llama 3) shares each KV head among a group of
query heads. transformers' SDPA attention repeats every KV head for its group (a copy of the layer's whole cache,
every layer, every decode step) whenever a mask is given: CUDA's fused kernels take grouped heads only without one
(`use_gqa_in_sdpa`). A rollout always has a mask (left padding), so on SmolLM2 the copy cost more than the attention
(docs/speed.md). PyTorch's CPU kernels take grouped heads with a mask (`enable_gqa=True`) and compute the same
numbers bit for bit: each query head reads its group's KV head where the copy would hold the same values
(tests/unit/rollout/test_attention.py compares, float32 and bfloat16, prefill and decode shapes). So the decode
stays exact (eager still draws `generate`'s tokens bit for bit) and only the copy goes.

Scope: forwards without autograd on CPU with a mask and grouped heads; everything else (training, GPUs, models
whose heads are not grouped) goes to transformers' own SDPA function unchanged.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "rlrun_sdpa_grouped"  # the attn_implementation a decode loop sets while it runs


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention-function signature: `enable_gqa` where it is exact and saves the copy, else SDPA's."""
    if (getattr(module, "num_key_value_groups", 1) > 1 and attention_mask is not None and query.device.type == "cpu"
            and not torch.is_grad_enabled() and kwargs.get("position_bias") is None
            and kwargs.get("cache") is None and not kwargs.get("output_attentions")):
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                               dropout_p=dropout, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


def _register() -> None:
    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # the same masks as sdpa's


def applies(lm) -> bool:
    """Whether `lm` is on CPU, its decoder attends with transformers' SDPA and groups its query heads (a decode would
    copy its cache)."""
    text = lm.config.get_text_config(decoder=True)
    heads, kv = getattr(text, "num_attention_heads", None), getattr(text, "num_key_value_heads", None)
    weight = next(lm.parameters(), None)
    on_cpu = weight is not None and weight.device.type == "cpu"
    return on_cpu and text._attn_implementation == "sdpa" and bool(heads and kv and kv < heads)


@contextlib.contextmanager
def grouped(lm, on: bool = True):
    """While a decode loop runs: `lm`'s decoder attends with `attention` (if `on` and it `applies`), then as before,
    even on an error. Only the decoder's config changes (a composite model's other parts keep theirs)."""
    if not (on and applies(lm)):
        yield
        return
    _register()
    text = lm.config.get_text_config(decoder=True)
    text._attn_implementation = NAME
    try:
        yield
    finally:
        text._attn_implementation = "sdpa"  # what `applies` found
