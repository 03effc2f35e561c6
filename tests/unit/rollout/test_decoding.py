"""rollout.decode=compiled (rlrun/rollout/decoding.py): a static KV cache and a compiled decode step draw the tokens
that eager decoding and transformers' `generate` draw, with the sampler's logprobs to fp32 tolerance; it compiles
once per bucket of rows (never again for a later rollout, nor after the weights change in place), and a compile
that fails decodes eagerly after one warning. Compiles are counted; nothing is timed."""

import random
import warnings
from types import SimpleNamespace

import pytest
import torch
from test_rollout import likely_eos, prompts_and_seeds, tiny, with_generate

from rlrun import registry
from rlrun.config import validate
from rlrun.rollout import decoding, hf

pytestmark = pytest.mark.slow  # inductor compiles a graph per bucket: seconds each on this CPU


def rollout_cfg(decode, new=16, temperature=1.0, top_p=1.0):
    return SimpleNamespace(temperature=temperature, top_p=top_p, max_new_tokens=new, decode=decode)


def grouped(n_prompts=6, group=4, seed=3):
    distinct, _ = prompts_and_seeds(n_prompts, seed)
    prompts = [p for p in distinct for _ in range(group)]
    return prompts, [random.Random(i).randrange(2**32) for i in range(len(prompts))]


@pytest.mark.parametrize("arch,tie", [("llama", False), ("qwen2", True)])
def test_compiled_draws_what_eager_and_generate_draw_and_compiles_once_per_bucket(arch, tie):
    model, tok = tiny(arch, tie)
    prompts, seeds = grouped()  # 24 rows: bucket 32, rows end at different steps and move to smaller buckets
    likely_eos(model, tok, prompts)
    eager = hf.generate(model, tok, prompts, rollout_cfg("eager"), "cpu", seeds)
    before = decoding.COMPILES.count
    got = hf.generate(model, tok, prompts, rollout_cfg("compiled"), "cpu", seeds)
    compiled = decoding.COMPILES.count - before
    assert 0 < eager.finished.sum() < len(prompts)  # some rows ended early: the buckets shrank
    assert compiled >= 2  # the first bucket and at least one smaller one
    assert torch.equal(got.input_ids, eager.input_ids) and torch.equal(got.finished, eager.finished)
    torch.testing.assert_close(got.gen_logprobs, eager.gen_logprobs, rtol=0, atol=1e-5)
    ref = with_generate(model, tok, prompts, rollout_cfg("eager"), seeds)
    assert got.completions == ref.completions
    torch.testing.assert_close(got.gen_logprobs, ref.gen_logprobs, rtol=0, atol=1e-5)
    # the same shapes again: every graph is reused
    before = decoding.COMPILES.count
    again = hf.generate(model, tok, prompts, rollout_cfg("compiled"), "cpu", seeds)
    assert decoding.COMPILES.count == before and torch.equal(again.input_ids, got.input_ids)


def test_a_weight_update_in_place_is_seen_without_a_recompile():
    """The optimizer changes the parameters in place between rollouts: the compiled step reads them as inputs."""
    model, tok = tiny()
    prompts, seeds = grouped(4, 2, seed=5)
    hf.generate(model, tok, prompts, rollout_cfg("compiled"), "cpu", seeds)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    before = decoding.COMPILES.count
    got = hf.generate(model, tok, prompts, rollout_cfg("compiled"), "cpu", seeds)
    eager = hf.generate(model, tok, prompts, rollout_cfg("eager"), "cpu", seeds)
    assert decoding.COMPILES.count == before
    assert torch.equal(got.input_ids, eager.input_ids)
    torch.testing.assert_close(got.gen_logprobs, eager.gen_logprobs, rtol=0, atol=1e-5)


def test_greedy_compiled_decode_is_evaluations_decode():
    from rlrun import evaluate

    model, tok = tiny(seed=1)
    prompts, _ = prompts_and_seeds(10, 7)
    likely_eos(model, tok, prompts)
    args = dict(max_new_tokens=12, seeds=None)
    assert evaluate.complete(model, tok, prompts, decode="compiled", **args) == evaluate.complete(
        model, tok, prompts, decode="eager", **args)


def test_a_compile_that_fails_warns_once_and_decodes_eagerly(monkeypatch):
    def broken(device_type):
        def backend(gm, example_inputs):
            raise RuntimeError("no C++ compiler here")
        return backend

    monkeypatch.setattr(decoding, "_backend", broken)
    monkeypatch.setattr(decoding, "_STEPS", {})
    model, tok = tiny(seed=2)
    prompts, seeds = grouped(3, 2, seed=9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = hf.generate(model, tok, prompts, rollout_cfg("compiled"), "cpu", seeds)
        second = hf.generate(model, tok, prompts, rollout_cfg("compiled"), "cpu", seeds)
    said = [w for w in caught if "rollout.decode=compiled" in str(w.message)]
    assert len(said) == 1 and "no C++ compiler here" in str(said[0].message)
    eager = hf.generate(model, tok, prompts, rollout_cfg("eager"), "cpu", seeds)
    assert torch.equal(first.input_ids, eager.input_ids) and torch.equal(second.input_ids, eager.input_ids)


def test_buckets_are_powers_of_two_and_the_option_is_found_from_the_config(cfg_factory):
    assert [decoding.bucket(n) for n in (1, 2, 3, 5, 8, 9, 24, 128)] == [1, 2, 4, 8, 8, 16, 32, 128]
    cfg = validate(cfg_factory("rollout.decode=compiled"))
    assert decoding.of(cfg.rollout) is decoding.Compiled and registry.option_of(cfg, "decode") == "compiled"
    assert decoding.of(validate(cfg_factory()).rollout) is decoding.Eager
    assert decoding.of(SimpleNamespace(name="vllm")) is decoding.Eager  # rollout=vllm has no decode key
    assert decoding.Compiled.exactness == "fp_tolerance" and decoding.Eager.exactness == "baseline"


def test_whether_a_model_decodes_with_a_static_cache_is_asked_once(monkeypatch):
    # static_ok builds a small StaticCache to ask its layers' types: once per model, not once per rollout
    from transformers import StaticCache

    model, _ = tiny("llama", False)
    built, init = [], StaticCache.__init__
    monkeypatch.setattr(StaticCache, "__init__", lambda self, *a, **k: built.append(1) or init(self, *a, **k))
    assert all(decoding.static_ok(model) for _ in range(3)) and len(built) == 1
