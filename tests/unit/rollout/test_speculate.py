"""rollout.speculate (rlrun/rollout/speculate.py, verify.py, drafts.py): every speculative path draws plain decoding's
tokens, with the sampler's logprobs within 1e-5 of plain decoding's, on Llama and Qwen2 shapes with grouped KV heads,
greedy and sampled, top-p and top-k, rows ending at different steps; forwards are counted (a draft source that
proposes plain decoding's own tokens needs fewer verify passes than tokens, one that proposes wrong tokens needs a
pass a token and still draws the same). Nothing is timed."""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import pytest
import torch
from helpers import tiny_model
from test_rollout import likely_eos, prompts_and_seeds, rows_per_forward

from rlrun import registry
from rlrun.rollout import drafts, hf, speculate

SPECULATING = [n for n in registry.REGISTRY["speculate"] if registry.get("speculate", n).drafts]
# the decode options whose loop runs eagerly: the certificate's quick tier (compiled: below, slow)
EAGER_DECODES = [n for n in registry.REGISTRY["decode"] if not registry.get("decode", n).static]
SAMPLERS = {"greedy": None, "sampled": (1.0, 1.0, 0), "top_p": (0.7, 0.9, 0), "top_k": (1.3, 1.0, 5)}


def grouped_model(arch: str, seed: int = 0):
    """A 2-layer model whose 4 query heads share 2 KV heads (qwen2: tied embeddings too)."""
    return tiny_model(seed, arch=arch, intermediate_size=64, layers=2, heads=4, kv_heads=2, max_positions=160,
                      tie_embeddings=arch == "qwen2")


def rollout_cfg(speculate_name="off", decode="eager", sampler=(1.0, 1.0, 0), new=16, k=4):
    temperature, top_p, top_k = sampler or (1.0, 1.0, 0)
    return SimpleNamespace(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=new, decode=decode,
                           speculate=speculate_name, speculate_k=k)


def groups(n_prompts=5, group=4, seed=3):
    distinct, _ = prompts_and_seeds(n_prompts, seed)
    prompts = [p for p in distinct for _ in range(group)]
    return prompts, [random.Random(i).randrange(2**32) for i in range(len(prompts))]


def draw(model, tok, prompts, seeds, cfg, speculation=None, greedy=False):
    """(token ids, logprobs, finished) of a rollout: seeded (`hf.generate`) or greedy (evaluation's decode)."""
    speculation = speculation if speculation is not None else hf.speculating(cfg)
    if not greedy:
        roll = hf.generate(model, tok, prompts, cfg, "cpu", seeds, speculation=speculation)
        return roll.input_ids, roll.gen_logprobs, roll.finished
    ids, mask = hf.encode(tok, prompts, "cpu")
    response = speculation.decode(hf.of(cfg), model, ids, mask, max_new_tokens=cfg.max_new_tokens,
                                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return torch.cat([ids, response], 1), None, (response == tok.eos_token_id).any(1)


def ends_of(drawn, tok, new: int) -> list[int]:
    """Each row's length: up to its EOS, or `new` where it ran to max_new_tokens."""
    response = drawn[0][:, -new:] if drawn[0].shape[1] >= new else drawn[0]
    eos = response == tok.eos_token_id
    return [int(e.float().argmax()) + 1 if e.any() else new for e in eos]


def eos_after(model, token: int) -> None:
    """Make `model` end a sequence right after `token`: a large EOS logit at every position whose input is `token` (a
    function of the tokens alone, so plain and speculative decoding see the same model)."""
    eos = model.config.eos_token_id

    def hook(module, args, kwargs, out):
        ids = kwargs["input_ids"][:, -out.logits.shape[1]:]
        out.logits[..., eos] += 50.0 * (ids == token)
        return out

    model.register_forward_hook(hook, with_kwargs=True)


def varied_ends(arch, prompts, seeds, cfg, greedy: bool):
    """(model, tokenizer, plain decoding's draw) where rows end at different steps: EOS follows the token whose first
    place in plain decoding's completions varies most over the rows (`eos_after`)."""
    model, tok = grouped_model(arch)
    drawn = draw(model, tok, prompts, seeds, cfg, greedy=greedy)
    response = drawn[0][:, -cfg.max_new_tokens:].tolist()
    tokens = {t for row in response for t in row}
    eos_after(model, max(tokens, key=lambda t: len({row.index(t) if t in row else -1 for row in response})))
    drawn = draw(model, tok, prompts, seeds, cfg, greedy=greedy)
    ends = ends_of(drawn, tok, cfg.max_new_tokens)
    assert len(set(ends)) > 1 and min(ends) < cfg.max_new_tokens, "rows end at different steps"
    return model, tok, drawn


def assert_same(got, want):
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
    if want[1] is not None:
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-5)


@pytest.mark.parametrize("sampler", list(SAMPLERS), ids=list(SAMPLERS))
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("decode", EAGER_DECODES)
def test_speculation_draws_plain_decodings_tokens(decode, arch, sampler):
    """Every drafting option, twice each (history's second rollout drafts from its first), against plain decoding
    with the same decode option."""
    prompts, seeds = groups()
    greedy = SAMPLERS[sampler] is None
    model, tok, want = varied_ends(arch, prompts, seeds, rollout_cfg("off", decode, SAMPLERS[sampler]), greedy)
    for name in SPECULATING:
        cfg = rollout_cfg(name, decode, SAMPLERS[sampler])
        speculation = hf.speculating(cfg)
        for _ in range(2):
            assert_same(draw(model, tok, prompts, seeds, cfg, speculation, greedy), want)
        assert speculation.stats.passes > 0 and speculation.stats.drafted > 0, name  # it verified drafts


class Oracle:
    """A draft source that proposes `truth` (plain decoding's completions), or those tokens shifted by one (never
    the token plain decoding chose): 100% and 0% acceptance."""

    def __init__(self, truth: list[list[int]], vocab: int, wrong: bool):
        self.truth, self.vocab, self.wrong = truth, vocab, wrong

    def install(self, monkeypatch):
        oracle = self

        def propose(drafter, rows, k):
            out = []
            for r in rows:
                done = len(drafter.completion(r))
                d = oracle.truth[r][done:done + k]
                out.append([(t + 1) % oracle.vocab for t in d] if oracle.wrong else d)
            return out

        monkeypatch.setattr(drafts.Drafter, "propose", propose)


@pytest.mark.parametrize("wrong", [False, True], ids=["every draft right", "every draft wrong"])
def test_forwards_counted_with_drafts_always_right_and_always_wrong(wrong, monkeypatch):
    model, tok = grouped_model("llama")
    prompts, seeds = groups(4, 3, seed=8)
    likely_eos(model, tok, prompts)
    plain_forwards = rows_per_forward(model)
    roll = hf.generate(model, tok, prompts, rollout_cfg(new=20), "cpu", seeds)
    want = (roll.input_ids, roll.gen_logprobs, roll.finished)
    plain = len(plain_forwards)  # the prompt pass, then one forward a token of the longest row
    lengths = roll.response_mask.sum(1)
    truth = [row[roll.prompt_len:][:n].tolist() for row, n in zip(roll.input_ids, lengths)]
    Oracle(truth, model.config.vocab_size, wrong).install(monkeypatch)
    cfg = rollout_cfg("prompt", new=20, k=4)
    speculation = hf.speculating(cfg)
    seen = rows_per_forward(model)
    assert_same(draw(model, tok, prompts, seeds, cfg, speculation), want)
    s = speculation.stats
    assert len(seen) == 1 + s.passes and s.drafted > 0
    if wrong:
        assert s.accepted == 0 and s.passes == plain - 1 and s.per_pass() == 1.0
    else:
        assert s.accepted == s.drafted and s.acceptance() == 1.0
        longest = int(lengths.max())
        assert s.passes == -(-(longest - 1) // 5)  # 5 tokens a pass after the prompt pass's first
        assert s.passes < plain - 1 and s.per_pass() > 2


def test_a_second_epoch_drafts_from_the_first_under_history():
    """The same prompts and seeds again (one row a prompt): history drafts each row's whole earlier completion and
    needs fewer verify passes than prompt lookup alone, which has only the row's own text to draft from."""
    model, tok = grouped_model("qwen2")
    prompts, seeds = groups(8, 1, seed=11)
    cfg = {n: rollout_cfg(n, new=24) for n in ("prompt", "history")}
    want = draw(model, tok, prompts, seeds, rollout_cfg("off", new=24))
    second = {}
    for name in ("prompt", "history"):
        speculation = hf.speculating(cfg[name])
        assert_same(draw(model, tok, prompts, seeds, cfg[name], speculation), want)
        first = dataclasses.replace(speculation.stats)
        assert_same(draw(model, tok, prompts, seeds, cfg[name], speculation), want)
        s = speculation.stats
        second[name] = (s.passes - first.passes, (s.accepted - first.accepted) / (s.drafted - first.drafted))
    assert second["history"][0] < second["prompt"][0] and second["history"][1] > 0.5 > second["prompt"][1]
    assert len(hf.speculating(cfg["history"]).seen) == 0  # a new object: its own history


def test_speculation_under_bf16_autocast_draws_plain_decodings_tokens():
    """train.precision=bf16 autocasts the decode: the rotary keys come out fp32, the values bf16, the prompt pass's
    cache fp32; the verify loop's cache refused the bf16 values ("scatter(): Expected self.dtype to be equal to
    src.dtype") and the run crashed at its first rollout."""
    model, tok = grouped_model("llama")
    prompts, seeds = groups(3, 2, seed=7)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = draw(model, tok, prompts, seeds, rollout_cfg("off", new=12))
        speculation = hf.speculating(rollout_cfg("prompt", new=12))
        got = draw(model, tok, prompts, seeds, rollout_cfg("prompt", new=12), speculation)
    assert torch.equal(got[0], want[0]) and speculation.stats.passes > 0


def test_history_seeded_from_a_record_drafts_an_earlier_runs_completions(tmp_path):
    """rollout.speculate_from=DIR: a run's first rollout drafts from a record's completions of the same prompts (here
    the very draws, same weights and seeds): nearly every draft accepted, the tokens plain decoding's."""
    from conftest import make_cfg

    from rlrun.errors import RecordError
    from rlrun.rollout import record

    model, tok = grouped_model("qwen2")
    prompts, seeds = groups(4, 2, seed=5)
    plain = hf.generate(model, tok, prompts, rollout_cfg("off", new=24), "cpu", seeds)
    rec = record.Recorder(str(tmp_path / "rec"), make_cfg("experiment=smoke"), resumed=False)
    rec.write(0, {k: getattr(plain, k) for k in record.TENSORS},
              {"prompt_len": plain.prompt_len, "rows": [{}] * len(prompts), "completions": plain.completions,
               "totals": [0.0] * len(prompts), "by_reward": {}}, version=0, step=0)
    stats = {}
    for name, source in (("history", str(tmp_path / "rec")), ("prompt", None)):
        cfg = SimpleNamespace(**vars(rollout_cfg(name, new=24)), speculate_from=source)
        speculation = hf.speculating(cfg)
        assert_same(draw(model, tok, prompts, seeds, cfg, speculation), (plain.input_ids, plain.gen_logprobs,
                                                                         plain.finished))
        stats[name] = speculation.stats
    assert stats["history"].acceptance() > 0.9 and stats["history"].per_pass() > 2 * stats["prompt"].per_pass()
    with pytest.raises(RecordError, match="rollout.speculate_from='/nowhere' is not a folder"):
        hf.speculating(SimpleNamespace(**vars(rollout_cfg("history")), speculate_from="/nowhere"))


def test_noise_read_across_the_blocks_of_a_rows_stream_is_plain_decodings(monkeypatch):
    """Where a row's generator gives its uniforms in blocks of a few steps (a large vocabulary), a verify pass that
    straddles a block edge reads the next block, as plain decoding does."""
    model, tok = grouped_model("llama")
    prompts, seeds = groups(3, 3, seed=5)
    likely_eos(model, tok, prompts)
    monkeypatch.setattr(hf, "AHEAD_FLOATS", 3 * model.config.vocab_size + 7)  # blocks of 3 steps
    want = draw(model, tok, prompts, seeds, rollout_cfg(new=14))
    assert_same(draw(model, tok, prompts, seeds, rollout_cfg("prompt", new=14, k=5)), want)


def test_the_index_drafts_what_followed_the_longest_suffix_and_history_is_bounded(monkeypatch):
    index = drafts.Index()
    index.add([1, 2, 3, 4, 5, 2, 3, 9], 8)
    assert index.draft([7, 2, 3], 2) == [9]  # "2 3" last seen before 9 (the latest occurrence wins)
    assert index.draft([1, 2, 3], 3) == [4, 5, 2]  # "1 2 3": the 3-gram beats the 2-gram
    assert index.draft([8], 3) == []
    monkeypatch.setattr(drafts.History, "PROMPTS", 2)
    monkeypatch.setattr(drafts.History, "PER_PROMPT", 2)
    h = drafts.History()
    for prompt, completion in [((1,), [5]), ((1,), [6]), ((1,), [7]), ((2,), [8]), ((3,), [9])]:
        h.add(prompt, completion)
    assert h.of((1,)) == [] and h.of((2,)) == [[8]] and h.of((3,)) == [[9]] and len(h) == 2
    d = drafts.Drafter([[4, 5, 6], [4, 5, 6]], [0, 0], None)
    d.extend(0, [7, 8])  # row 0's completion is row 1's draft once row 1 reaches "5 6"
    assert d.propose([1], 4) == [[7, 8]] and d.completion(0) == [7, 8] and d.completion(1) == []


def test_groups_are_the_rows_that_share_a_prompt():
    ids = torch.tensor([[0, 5, 6], [0, 5, 6], [7, 8, 9], [0, 5, 6]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 1], [1, 1, 1], [0, 1, 1]])
    assert speculate.prompt_rows(ids, mask) == ([[5, 6], [5, 6], [7, 8, 9], [5, 6]], [0, 0, 2, 0])


def test_the_options_facts_and_the_config():
    from conftest import make_cfg

    from rlrun.config import validate

    assert not registry.get("speculate", registry.baseline("speculate")).drafts and SPECULATING
    cfg = validate(make_cfg("experiment=smoke", "rollout.speculate=history", "rollout.speculate_k=6"))
    assert registry.option_of(cfg, "speculate") == "history"
    rollout = registry.get("rollout", "hf").build(cfg.rollout, None, None, "cpu")
    assert isinstance(rollout.speculation, speculate.History) and rollout.speculation.k == 6
    with pytest.raises(Exception, match=r"rollout.speculate_k=0 must be an integer from 1 to 32"):
        validate(make_cfg("experiment=smoke", "rollout.speculate=prompt", "rollout.speculate_k=0"))
    with pytest.raises(Exception, match=r"rollout.speculate='often' is not supported; supported: \['off'"):
        validate(make_cfg("experiment=smoke", "rollout.speculate=often"))
    with pytest.raises(Exception, match=r"only rollout.speculate=history reads \(here: prompt\)"):
        validate(make_cfg("experiment=smoke", "rollout.speculate=prompt", "rollout.speculate_from=/tmp/rec"))


def test_rollout_vllm_refuses_speculation_naming_the_fix(monkeypatch):
    import importlib.util

    from conftest import make_cfg

    from rlrun.config import validate

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "vllm" else real(n, *a))
    with pytest.raises(Exception, match=r"rollout.speculate=prompt .* Use rollout=hf with rollout.speculate"):
        validate(make_cfg("experiment=smoke", "rollout=vllm", "rollout.speculate=prompt"))
    validate(make_cfg("experiment=smoke", "rollout=vllm"))


def test_evaluation_with_speculation_scores_the_same_completions():
    from rlrun import evaluate

    model, tok = grouped_model("llama")
    rows = [{"prompt": p, "answer": "1"} for p in prompts_and_seeds(6, 2)[0]]
    likely_eos(model, tok, [r["prompt"] for r in rows])

    def score(completions, rows):
        return [float(len(c)) for c in completions], {}

    for greedy, samples in ((True, 1), (False, 3)):
        kw = dict(max_new_tokens=12, greedy=greedy, samples=samples, show=len(rows) * samples)
        want = evaluate.evaluate(model, tok, rows, score, **kw)
        for name in SPECULATING:
            got = evaluate.evaluate(model, tok, rows, score, speculate=name, speculate_k=3, **kw)
            assert got.metrics == want.metrics and got.samples == want.samples


@pytest.mark.slow  # inductor compiles a verify graph per bucket and width: seconds each
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_compiled_speculation_draws_the_compiled_decodes_tokens(arch):
    from rlrun.rollout import decoding

    model, tok = grouped_model(arch)
    prompts, seeds = groups(5, 4)  # 20 rows: bucket 32, rows end and move to smaller buckets
    likely_eos(model, tok, prompts)
    for sampler in ("sampled", "top_k"):
        want = draw(model, tok, prompts, seeds, rollout_cfg("off", "compiled", SAMPLERS[sampler]))
        eager = draw(model, tok, prompts, seeds, rollout_cfg("off", "eager", SAMPLERS[sampler]))
        cfg = rollout_cfg("history", "compiled", SAMPLERS[sampler])
        speculation = hf.speculating(cfg)
        before = decoding.COMPILES.count
        for _ in range(2):
            got = draw(model, tok, prompts, seeds, cfg, speculation)
            assert_same(got, want)
            assert_same(got, eager)
        assert decoding.COMPILES.failed == 0 and decoding.COMPILES.count >= before
        assert speculation.stats.passes > 0 and speculation.stats.accepted > 0


def test_the_check_probe_compares_speculation_with_plain_decoding_and_says_na_when_off(monkeypatch):
    """rlrun/check/speculation.py on `rlrun check`'s own context: pass with the configuration's speculation, n/a when
    off, and FAIL when the verify pass chooses another token than plain decoding would (a wrong noise step)."""
    from conftest import make_cfg

    from rlrun import check
    from rlrun.check import speculation as speculation_probe
    from rlrun.config import validate

    ctx = check.build(validate(make_cfg("experiment=smoke", "rollout.max_new_tokens=12")))
    off = speculation_probe.speculation(ctx)
    assert off.ok is None and "n/a: rollout.speculate=off" in off.measured
    for name in SPECULATING:
        ctx.cfg = validate(make_cfg("experiment=smoke", "rollout.max_new_tokens=12", f"rollout.speculate={name}"))
        row = speculation_probe.speculation(ctx)
        assert row.ok is True and "rows differing 0" in row.measured and "tokens/verify pass" in row.measured, row
    real = hf.SeededSampler.choose_at
    monkeypatch.setattr(hf.SeededSampler, "choose_at", lambda self, scores, rows, steps: real(
        self, scores, rows, steps + (steps > 0).long()))  # a verify pass that reads the next step's noise
    broken = speculation_probe.speculation(ctx)
    assert broken.ok is False and "rows differing 0" not in broken.measured, broken
