"""rlrun/rollout/attention.py: grouped-query attention with a mask reads each KV head in place on CPU (no copy of
the cache per group) and computes transformers' SDPA numbers bit for bit; the decode loops use it while they run and
leave the model as it was. The copy is counted (calls of transformers' `repeat_kv`); nothing is timed."""

from types import SimpleNamespace

import pytest
import torch
import transformers.integrations.sdpa_attention as sdpa
from test_rollout import prompts_and_seeds, tiny

from rlrun.rollout import attention, hf


@pytest.fixture
def copies(monkeypatch):
    """How many times transformers repeated a KV head for its group (a copy of the cache each time)."""
    count = {"n": 0}
    repeat = sdpa.repeat_kv

    def counted(x, n_rep):
        count["n"] += n_rep > 1
        return repeat(x, n_rep)

    monkeypatch.setattr(sdpa, "repeat_kv", counted)
    return count


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# decode steps (1 query) and prefills
@pytest.mark.parametrize("queries,keys,dim", [(1, 77, 64), (1, 128, 128), (20, 20, 64), (7, 300, 32)])
def test_grouped_heads_with_a_mask_compute_sdpas_numbers_bit_for_bit_without_the_copy(dtype, queries, keys, dim,
                                                                                      copies):
    g = torch.Generator().manual_seed(queries * 1000 + keys)
    q = torch.randn(3, 9, queries, dim, generator=g).to(dtype)
    k, v = (torch.randn(3, 3, keys, dim, generator=g).to(dtype) for _ in range(2))
    mask = torch.rand(3, 1, queries, keys, generator=g) > 0.3
    mask[..., 0] = True
    module = SimpleNamespace(num_key_value_groups=3, is_causal=True)
    with torch.no_grad():
        ours, _ = attention.attention(module, q, k, v, mask, scaling=dim ** -0.5)
        assert copies["n"] == 0
        theirs, _ = sdpa.sdpa_attention_forward(module, q, k, v, mask, scaling=dim ** -0.5)
        assert copies["n"] == 2  # transformers copies the keys and the values
    assert torch.equal(ours, theirs)


def test_with_autograd_or_a_position_bias_it_is_transformers_own_function(copies):
    module = SimpleNamespace(num_key_value_groups=2, is_causal=True)
    q, k, v = torch.randn(2, 4, 5, 32), torch.randn(2, 2, 5, 32), torch.randn(2, 2, 5, 32)
    mask = torch.ones(2, 1, 5, 5, dtype=torch.bool).tril()
    attention.attention(module, q.requires_grad_(), k, v, mask)  # training: its gradients are transformers'
    assert copies["n"] == 2
    with torch.no_grad():
        attention.attention(module, q, k, v, mask, position_bias=torch.zeros(1, 4, 5, 5))
        assert copies["n"] == 4
        attention.attention(module, q, k, v, None)  # no mask: transformers groups the heads itself
    assert copies["n"] == 4


def decode(model, tok, prompts, seeds):
    return hf.generate(model, tok, prompts, SimpleNamespace(temperature=1.0, top_p=1.0, max_new_tokens=12), "cpu",
                       seeds)


def test_a_decode_of_a_grouped_model_copies_no_cache_and_draws_the_same_numbers(copies, monkeypatch):
    model, tok = tiny()  # 2 query heads on 1 KV head
    assert attention.applies(model)
    prompts, seeds = prompts_and_seeds(6, 11)
    got = decode(model, tok, prompts, seeds)
    assert copies["n"] == 0 and model.config._attn_implementation == "sdpa"
    monkeypatch.setattr(attention, "applies", lambda lm: False)  # transformers' attention, copying the cache
    ref = decode(model, tok, prompts, seeds)
    assert copies["n"] > 0
    assert torch.equal(got.input_ids, ref.input_ids) and torch.equal(got.gen_logprobs, ref.gen_logprobs)


def test_a_model_whose_heads_are_not_grouped_is_left_alone():
    from helpers import tiny_model

    model, _ = tiny_model(0, intermediate_size=64, layers=2, heads=2, kv_heads=2, max_positions=128)
    assert not attention.applies(model)
    with attention.grouped(model):
        assert model.config._attn_implementation == "sdpa"


def test_a_grouped_model_off_the_cpu_is_left_alone():
    """CUDA's kernels take grouped heads with a mask only on a slower path: off the CPU nothing changes (the meta
    device stands in for a GPU here)."""
    model, _ = tiny()
    assert attention.applies(model)
    assert not attention.applies(model.to("meta"))


def test_the_model_attends_as_before_after_a_decode_that_failed():
    model, _ = tiny()
    with pytest.raises(RuntimeError, match="stop"), attention.grouped(model):
        assert model.config._attn_implementation == attention.NAME
        raise RuntimeError("stop")
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.slow  # inductor compiles the decode step's buckets
def test_the_compiled_decode_traces_the_grouped_path(copies):
    """A model the compiled step has not met is traced anew: no KV head copied in its graph."""
    from rlrun.rollout import decoding

    model, tok = tiny(seed=7)
    prompts, seeds = prompts_and_seeds(4, 5)
    before = decoding.COMPILES.count
    hf.generate(model, tok, prompts, SimpleNamespace(temperature=1.0, top_p=1.0, max_new_tokens=6,
                                                     decode="compiled"), "cpu", seeds)
    assert decoding.COMPILES.count > before and copies["n"] == 0
