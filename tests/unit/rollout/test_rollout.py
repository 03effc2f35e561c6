"""rollout=hf: rlrun's own decode loop draws exactly what transformers' `generate` draws, token for token."""

import random
from types import SimpleNamespace

import pytest
import torch
from helpers import tiny_model
from transformers import LogitsProcessorList

from rlrun import models
from rlrun.rollout import Rollout, hf


def tiny(arch="llama", tie=False, seed=0):
    return tiny_model(seed, arch=arch, intermediate_size=64, layers=2, heads=2, max_positions=128,
                      tie_embeddings=tie)


def with_generate(model, tok, prompts, cfg, seeds) -> Rollout:
    """The reference: transformers' generate with the same seeded sampler as a logits processor."""
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    sampler = hf.SeededSampler(seeds, cfg.temperature, cfg.top_p)
    out = model.generate(**enc, do_sample=False, logits_processor=LogitsProcessorList([sampler]),
                         max_new_tokens=cfg.max_new_tokens, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    response = out[:, enc.input_ids.shape[1]:]
    sampler.collect(response[:, -1])
    return Rollout.from_response(enc.input_ids, enc.attention_mask, response, torch.stack(sampler.logprobs, 1), tok)


def likely_eos(model, tok, prompts):
    """Point the EOS row of the lm head along the mean last hidden state, so that rows end at different steps
    (the pad-after-EOS path runs)."""
    backbone, weight = models.split(model)
    with torch.no_grad():
        ids, mask = hf.encode(tok, prompts, "cpu")
        h = models.hidden_states(backbone, ids, mask)[:, -1].mean(0)
        weight[tok.eos_token_id] = 2.0 * h / h.norm() * weight.norm(dim=-1).mean()


def prompts_and_seeds(n, seed):
    rng = random.Random(seed)
    prompts = [f"{rng.randint(0, 99)}+{rng.randint(0, 9999)}=" + "x" * rng.randint(0, 5) for _ in range(n)]
    return prompts, [rng.randrange(2**32) for _ in prompts]


@pytest.mark.parametrize("arch,tie", [("llama", False), ("qwen2", True)])
@pytest.mark.parametrize("temperature,top_p,new", [(1.0, 1.0, 4), (0.7, 0.9, 12), (1.5, 1.0, 20)])
def test_decode_samples_what_generate_samples(arch, tie, temperature, top_p, new):
    model, tok = tiny(arch, tie)
    prompts, seeds = prompts_and_seeds(24, new)
    likely_eos(model, tok, prompts)
    cfg = SimpleNamespace(temperature=temperature, top_p=top_p, max_new_tokens=new)
    ref = with_generate(model, tok, prompts, cfg, seeds)
    got = hf.generate(model, tok, prompts, cfg, "cpu", seeds)
    assert 0 < ref.finished.sum() < len(prompts)  # some rows stopped at EOS, some ran to the end
    assert torch.equal(got.input_ids, ref.input_ids) and torch.equal(got.attention_mask, ref.attention_mask)
    assert got.completions == ref.completions and torch.equal(got.finished, ref.finished)
    # the same tokens; their logprobs to the last bit or so: decode runs the rows still going as a smaller batch,
    # and the CPU matmul kernel for a batch of a few rows sums in another order (docs/speed.md)
    torch.testing.assert_close(got.gen_logprobs, ref.gen_logprobs, rtol=0, atol=1e-6)


class StepByStep:
    """The seeded sampler drawn the plain way, the reference for SeededSampler's draws taken ahead: each row's
    generator called once a step for that step's Gumbel noise."""

    def __init__(self, seeds, temperature, top_p):
        self.generators = [torch.Generator().manual_seed(int(s)) for s in seeds]
        self.temperature, self.top_p = temperature, top_p

    def __call__(self, input_ids, scores):
        logp = torch.log_softmax(hf.top_p_filter(scores.float() / self.temperature, self.top_p), -1)
        u = torch.stack([torch.rand(scores.shape[-1], generator=g) for g in self.generators])
        return logp - torch.log((-torch.log(u.clamp(min=1e-20))).clamp(min=1e-20))


@pytest.mark.parametrize("ahead_steps", [None, 3, 1])  # the default (every step at once here), 3 steps, one step
def test_draws_taken_ahead_are_the_draws_of_each_step(monkeypatch, ahead_steps):
    """SeededSampler takes a row's next steps' uniforms in one call; torch's CPU generator must give the same
    numbers as one call a step (if a torch release changed that, the samples would change: this fails first)."""
    model, tok = tiny()
    prompts, seeds = prompts_and_seeds(16, 5)
    likely_eos(model, tok, prompts)
    vocab = model.config.vocab_size
    if ahead_steps:
        monkeypatch.setattr(hf, "AHEAD_FLOATS", ahead_steps * vocab + vocab // 2)
    cfg = SimpleNamespace(temperature=0.8, top_p=0.95, max_new_tokens=12)
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    out = model.generate(**enc, do_sample=False, logits_processor=LogitsProcessorList([StepByStep(seeds, 0.8, 0.95)]),
                         max_new_tokens=12, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    got = hf.generate(model, tok, prompts, cfg, "cpu", seeds)
    ref = Rollout.from_response(enc.input_ids, enc.attention_mask, out[:, enc.input_ids.shape[1]:],
                                torch.zeros(out.shape[0], out.shape[1] - enc.input_ids.shape[1]), tok)
    assert torch.equal(got.input_ids, ref.input_ids) and got.completions == ref.completions
    assert len(set(got.response_mask.sum(1).tolist())) > 1  # rows ended at different steps (and left the batch)


def rows_per_forward(model) -> list[int]:
    """Filled with the number of rows of each forward call of `model`."""
    seen: list[int] = []
    model.register_forward_pre_hook(lambda m, args, kwargs: seen.append(kwargs["input_ids"].shape[0]),
                                    with_kwargs=True)
    return seen


@pytest.mark.parametrize("greedy", [False, True])
def test_rows_that_ended_leave_the_batch_and_the_draws_do_not_change(greedy):
    """A row that ended is not computed again: step t runs exactly the rows longer than t, so the rows computed are
    the tokens generated, not rows x longest. Each row draws with a generator of its own, so what the others draw
    is unchanged (the reference: transformers' generate, which keeps every row to the end)."""
    model, tok = tiny()
    prompts, seeds = prompts_and_seeds(32, 7)
    likely_eos(model, tok, prompts)
    cfg = SimpleNamespace(temperature=1.0, top_p=1.0, max_new_tokens=20)
    seen = rows_per_forward(model)
    if greedy:
        ids, mask = hf.encode(tok, prompts, "cpu")
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=20,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        seen.clear()
        response = hf.decode(model, ids, mask, max_new_tokens=20, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id)
        assert torch.equal(response, out[:, ids.shape[1]:])
        got = Rollout.from_response(ids, mask, response, torch.zeros(response.shape), tok)
    else:
        ref = with_generate(model, tok, prompts, cfg, seeds)
        assert set(seen) == {len(prompts)}  # generate keeps every row to the end
        seen.clear()
        got = hf.generate(model, tok, prompts, cfg, "cpu", seeds)
        assert torch.equal(got.input_ids, ref.input_ids) and got.completions == ref.completions
        torch.testing.assert_close(got.gen_logprobs, ref.gen_logprobs, rtol=0, atol=1e-6)
    lengths = got.response_mask.sum(1)
    assert len(set(lengths.tolist())) > 1  # rows ended at different steps
    assert seen == [int((lengths > t).sum()) for t in range(int(lengths.max()))]
    assert sum(seen) == int(lengths.sum()) < len(prompts) * len(seen)


def test_greedy_decode_matches_generate_and_stops_when_every_row_ended():
    model, tok = tiny()
    prompts, _ = prompts_and_seeds(16, 1)
    ids, mask = hf.encode(tok, prompts, "cpu")
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=10,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    got = hf.decode(model, ids, mask, max_new_tokens=10, eos_token_id=tok.eos_token_id,
                    pad_token_id=tok.pad_token_id)
    assert torch.equal(got, out[:, ids.shape[1]:])
    # every row ends at its first token: decoding stops there, as generate does
    eos_first = lambda ids, scores: scores.index_fill(-1, torch.tensor([tok.eos_token_id]), 1e9)  # noqa: E731
    got = hf.decode(model, ids, mask, max_new_tokens=10, eos_token_id=tok.eos_token_id,
                    pad_token_id=tok.pad_token_id, processor=eos_first)
    assert got.shape == (16, 1) and (got == tok.eos_token_id).all()


def test_a_model_without_the_fast_path_goes_through_generate(monkeypatch):
    model, tok = tiny()
    prompts, seeds = prompts_and_seeds(8, 2)
    cfg = SimpleNamespace(temperature=1.0, top_p=1.0, max_new_tokens=6)
    fast = hf.generate(model, tok, prompts, cfg, "cpu", seeds)
    monkeypatch.setattr(hf, "fast_path", lambda lm: False)
    slow = hf.generate(model, tok, prompts, cfg, "cpu", seeds)
    assert torch.equal(fast.input_ids, slow.input_ids) and torch.equal(fast.gen_logprobs, slow.gen_logprobs)


def test_encode_pads_on_the_left_like_the_tokenizer_and_tokenizes_each_prompt_once(monkeypatch):
    _, tok = tiny()
    prompts = ["12+3=", "1+1=", "12+3=", ""]
    ids, mask = hf.encode(tok, prompts, "cpu")
    ref = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    assert torch.equal(ids, ref.input_ids) and torch.equal(mask, ref.attention_mask)
    calls = []
    original = type(tok).__call__
    monkeypatch.setattr(type(tok), "__call__", lambda self, *a, **k: calls.append(a) or original(self, *a, **k))
    hf.encode(tok, ["1+1=", "7+7="], "cpu")
    assert calls == [(["7+7="],)]  # only the prompt not seen before


@pytest.mark.parametrize("arch,tie", [("llama", False), ("qwen2", True)])
def test_each_prompt_is_prefilled_once_per_group_and_draws_what_every_row_prefilled_draws(arch, tie):
    """A rollout repeats each prompt group_size times (here 6 prompts x 4): the first forward runs the 6 distinct
    prompts, their KV cache and first logits copied to the 24 rows; the tokens are those of prefilling every row
    (and of transformers' generate), their logprobs within the matmul's last bits."""
    model, tok = tiny(arch, tie)
    distinct, seeds = prompts_and_seeds(6, 3)
    prompts = [p for p in distinct for _ in range(4)]
    seeds = [random.Random(i).randrange(2**32) for i in range(len(prompts))]
    likely_eos(model, tok, prompts)
    cfg = SimpleNamespace(temperature=1.0, top_p=1.0, max_new_tokens=16)
    seen = rows_per_forward(model)
    once = hf.generate(model, tok, prompts, cfg, "cpu", seeds)
    assert seen[0] == len(distinct) and seen[1] <= len(prompts)  # prefill: each prompt once; then every row
    seen.clear()
    ids, mask = hf.encode(tok, prompts, "cpu")
    sampler = hf.SeededSampler(seeds, cfg.temperature, cfg.top_p, cfg.max_new_tokens)
    every = hf.decode(model, ids, mask, max_new_tokens=16, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, processor=sampler, prefill_once=False)
    assert seen[0] == len(prompts)
    sampler.collect(every[sampler.rows, -1])
    every = Rollout.from_response(ids, mask, every, torch.stack(sampler.logprobs, 1), tok)
    assert torch.equal(once.input_ids, every.input_ids)  # the same tokens, row for row
    ref = with_generate(model, tok, prompts, cfg, seeds)
    assert once.completions == ref.completions and torch.equal(once.finished, ref.finished)
    assert 0 < ref.finished.sum() < len(prompts)
    torch.testing.assert_close(once.gen_logprobs, every.gen_logprobs, rtol=0, atol=1e-6)
    torch.testing.assert_close(once.gen_logprobs, ref.gen_logprobs, rtol=0, atol=1e-6)
    assert hf.distinct_rows(ids[:6:4], mask[:6:4]) is None  # every row distinct: nothing to share
