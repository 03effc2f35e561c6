"""`rlrun check`'s decode branches probe (rlrun/check/decode.py): the configuration's decode loop against the
plainest one on prompts and forced endings that take every branch. It passes on both decode options and on the
grouped-KV path, and fails on a fault in each branch that runs only when rows end or prompts repeat."""

import pytest
import torch
from conftest import make_cfg
from helpers import rewritten

from rlrun import check, registry
from rlrun.check import decode
from rlrun.config import validate
from rlrun.rollout import decoding, hf

CONTEXTS: dict = {}


def row(*overrides):
    if overrides not in CONTEXTS:
        with torch.random.fork_rng():
            CONTEXTS[overrides] = check.build(validate(make_cfg("experiment=varied_lengths", *overrides)))
    with torch.random.fork_rng():
        return decode.decode_branches(CONTEXTS[overrides])


def test_the_probe_prompts_hold_a_group_of_one_beside_a_group_of_many_and_rows_end_at_different_steps():
    assert decode.branch_prompts(("a b", "a b c d"), 4) == ["a b", "a b", "a b", "a b c d"]
    assert decode.branch_prompts(("a", "b c"), 1) == ["a", "a", "b c"]
    ends = decode.endings(8, 10)
    assert ends == {1: 0, 2: 1, 3: 5, 5: 0, 6: 2} and 0 not in ends and 4 not in ends and 7 not in ends


@pytest.mark.slow  # a check build each (~5 s), a compile for the compiled decode
@pytest.mark.parametrize("overrides", [[], ["rollout.decode=compiled"], ["model.kv_heads=1", "rollout.top_p=0.8"],
                                       ["rollout.decode=compiled", "model.kv_heads=1", "rollout.top_k=5"]],
                         ids=["eager", "compiled", "grouped-kv-top_p", "compiled-grouped-top_k"])
def test_the_decode_branches_probe_passes_where_the_decode_is_right(overrides):
    got = row(*overrides)
    assert got.ok, got.measured
    assert "ended early" in got.measured and int(got.measured.split("(")[1].split()[0]) >= 4, got.measured


def wrong_rows_after_a_bucket_move(monkeypatch):
    """The compiled decode's move to a smaller bucket copies the caches of other rows (every fill after the
    prompt's: only the branch that runs when rows end)."""
    real, calls = decoding._fill, []

    def fill(cache, source, index, filled):
        calls.append(filled)
        real(cache, source, index.flip(0) if len(calls) > 1 else index, filled)

    monkeypatch.setattr(decoding, "_fill", fill)


def sampler_told_other_rows(monkeypatch):
    """Eager decoding drops ended rows but tells the sampler other rows went on: their noise is another row's."""
    def going_on(processor, unfinished, next_tokens):
        keep = unfinished.nonzero().squeeze(1)
        if processor is not None:
            processor.select(keep.flip(0), next_tokens)
        return keep

    monkeypatch.setattr(hf, "going_on", going_on)


def prefill_shared_with_the_wrong_rows(monkeypatch):
    """Each distinct prompt prefilled once, its cache given to the rows of another prompt."""
    real = hf.distinct_rows

    def distinct_rows(input_ids, attention_mask):
        found = real(input_ids, attention_mask)
        return None if found is None else (found[0], found[1].flip(0))

    monkeypatch.setattr(hf, "distinct_rows", distinct_rows)


positions_after_a_drop = rewritten(hf, "_decode", "position_ids = attention_mask[keep], position_ids[keep]",
                                   "position_ids = attention_mask[keep], position_ids[: len(keep)]")
positions_after_a_bucket_move = rewritten(decoding, "_decode", "mask[index], last[index]", "mask[index], last[:size]")


FAULTS = [(wrong_rows_after_a_bucket_move, ["rollout.decode=compiled"]), (sampler_told_other_rows, []),
          (prefill_shared_with_the_wrong_rows, []), (positions_after_a_drop, []),
          (positions_after_a_bucket_move, ["rollout.decode=compiled"])]


@pytest.mark.slow  # a check build each (~5 s)
@pytest.mark.parametrize("inject,overrides", FAULTS, ids=[f.__name__ for f, _ in FAULTS])
def test_a_fault_in_a_branch_that_runs_only_when_rows_end_or_prompts_repeat_fails_the_probe(monkeypatch, inject,
                                                                                           overrides):
    assert row(*overrides).ok
    inject(monkeypatch)
    got = row(*overrides)
    assert got.ok is False, got.measured  # other tokens, or the same tokens with other logprobs


def test_a_rollout_without_rlruns_decode_loop_is_not_probed():
    ctx = type("C", (), {"cfg": type("Cfg", (), {"rollout": type("R", (), {"name": "vllm"})()})()})()
    assert decode.decode_branches(ctx).ok is None
    assert registry.get("decode", "eager").decode is hf.decode  # what the probe runs for rollout.decode=eager
