"""Warm start: deterministic, a cache hit gives bit-identical weights, and the cache key follows every input."""

from pathlib import Path

import pytest
import torch
from helpers import tiny_model
from omegaconf import OmegaConf

from rlrun import warmstart

CFG = {"steps": 4, "lr": 3e-3, "batch_size": 16, "weight_decay": 0.1, "wrong_prob": 0.5, "offsets": [1]}
ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)][:60]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    with monkeypatch.context() as m:  # undone when this fixture ends: the environment is as it was
        m.setenv("RLRUN_CACHE", str(tmp_path / "cache"))
        yield


def weights(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_identical(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_deterministic_and_it_trains():
    init = weights(tiny_model()[0])
    runs = []
    for _ in range(2):
        model, tok = tiny_model()
        warmstart.warm_start(model, tok, ROWS, CFG, seed=0, cache=False)
        runs.append(weights(model))
    assert_identical(runs[0], runs[1])
    assert any(not torch.equal(init[k], runs[0][k]) for k in init)
    assert not list(warmstart.cache_dir().glob("*")) if warmstart.cache_dir().exists() else True


def test_cache_hit_is_bit_identical_to_a_fresh_warm_start():
    model, tok = tiny_model()
    warmstart.warm_start(model, tok, ROWS, CFG, seed=0)
    fresh = weights(model)
    files = list(warmstart.cache_dir().glob("*.pt"))
    assert len(files) == 1 and not list(warmstart.cache_dir().glob("*.tmp*"))  # written atomically
    model, tok = tiny_model()
    calls = []
    real_fit = warmstart.fit
    warmstart.fit = lambda *a, **k: calls.append(1) or real_fit(*a, **k)
    try:
        warmstart.warm_start(model, tok, ROWS, CFG, seed=0)
    finally:
        warmstart.fit = real_fit
    assert not calls  # loaded, not trained
    assert_identical(weights(model), fresh)


def test_a_warm_start_shows_its_steps_and_a_cached_one_shows_none(capsys):
    """Minutes on CPU when not cached: the run shows a bar (here the plain lines a log gets), step by step, and the
    weights are those of a warm start without one."""
    from rlrun.runner import console

    shown = []

    def bar(n):
        shown.append(n)
        return console.progress(0, n, "warm start", enabled=True, every=2)

    model, tok = tiny_model()
    warmstart.warm_start(model, tok, ROWS, CFG, seed=0, progress=bar)
    quiet, _ = tiny_model()
    warmstart.warm_start(quiet, tok, ROWS, CFG, seed=0, cache=False)
    assert_identical(weights(model), weights(quiet))
    assert shown == [4]
    err = capsys.readouterr().err
    assert "warm start: step 2/4" in err and "warm start: step 4/4" in err
    again, _ = tiny_model()
    warmstart.warm_start(again, tok, ROWS, CFG, seed=0, progress=bar)  # cached: loaded at once, no bar
    assert shown == [4]


def test_the_rng_outside_is_left_alone():
    model, tok = tiny_model()
    torch.manual_seed(123)
    before = torch.get_rng_state()
    warmstart.warm_start(model, tok, ROWS, CFG, seed=0, cache=False)
    assert torch.equal(torch.get_rng_state(), before)


def key(model=None, rows=ROWS, cfg=CFG, seed=0):
    return warmstart.cache_key(model if model is not None else tiny_model()[0], rows, cfg, seed)


def test_cache_key_changes_with_every_input():
    base = key()
    assert key() == base  # stable
    assert key(seed=1) != base
    assert key(cfg={**CFG, "steps": 5}) != base
    assert key(cfg={**CFG, "wrong_prob": 0.4}) != base
    assert key(rows=ROWS[:-1]) != base
    assert key(rows=[dict(r, answer="9") if i == 0 else r for i, r in enumerate(ROWS)]) != base
    assert key(model=tiny_model(seed=1)[0]) != base  # other initial weights
    assert key(model=tiny_model(hidden_size=64, heads=2)[0]) != base  # other model config


def test_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    assert warmstart.cache_dir() == tmp_path / "cache" / "warmstart"
    with monkeypatch.context() as m:
        m.delenv("RLRUN_CACHE")
        m.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
        assert warmstart.cache_dir() == tmp_path / "xdg" / "rlrun" / "warmstart"
        m.delenv("XDG_CACHE_HOME")
        assert warmstart.cache_dir() == Path.home() / ".cache" / "rlrun" / "warmstart"


def test_options_from_a_config_node():
    node = OmegaConf.create({"enabled": True, "cache": False, "steps": 7, "offsets": [1, 2]})
    opts = warmstart.options(node)
    assert opts == {**warmstart.DEFAULTS, "steps": 7, "offsets": [1, 2]}  # enabled / cache: not part of the result
    model, tok = tiny_model()
    assert warmstart.cache_key(model, ROWS, node, 0) == warmstart.cache_key(model, ROWS, opts, 0)
    assert warmstart.distinct(ROWS + ROWS[:3]) == ROWS  # repeats do not change the data or the key
    assert warmstart.cache_key(model, ROWS + ROWS[:3], opts, 0) == warmstart.cache_key(model, ROWS, opts, 0)


def test_noisy_answers():
    import random

    rng = random.Random(0)
    labels = [warmstart.noisy_answer("7", rng, 0.6, [1]) for _ in range(2000)]
    assert set(labels) == {"7", "8"}
    assert abs(labels.count("8") / 2000 - 0.6) < 0.05
    assert warmstart.noisy_answer("abc", rng, 1.0, [1]) == "abc"  # not a number: kept
    assert {warmstart.noisy_answer("0", rng, 1.0, [-1, 1]) for _ in range(50)} == {"1"}  # stays non-negative


SCENARIO_MODEL = {"hidden_size": 32, "intermediate_size": 128, "layers": 3, "heads": 1, "kv_heads": 1}
SCENARIO_TASK = ["task=arith", "task.size=1000", "task.max_operand=9", "task.ops=[+]", "task.eval_size=20",
                 "task.reward=rlrun.tasks:partial_credit"]


@pytest.mark.slow
def test_the_default_scenario_starts_wrong_but_within_reach():
    """The warm start of the default run does not solve the held-out problems (greedy), yet samples the right
    answer often enough for GRPO's groups to see it: RL has something to learn and a signal to learn it from."""
    from conftest import make_cfg

    from rlrun import evaluate, tasks
    from rlrun.config import validate

    task = tasks.load(validate(make_cfg(*SCENARIO_TASK)).task, 0)
    assert not {r["prompt"] for r in task.eval} & {r["prompt"] for r in task.train}
    model, tok = tiny_model(**SCENARIO_MODEL)
    # the session's cache: the default run's own warm start when a test already ran it (the key hashes the weights,
    # rows, options and seed, so a hit is this very computation; the cache's own tests are below)
    warmstart.warm_start(model, tok, task.train, warmstart.DEFAULTS, seed=0)
    greedy = evaluate.evaluate(model, tok, task.eval, task.score, max_new_tokens=4).metrics
    sampled = evaluate.evaluate(model, tok, task.eval, task.score, max_new_tokens=4, greedy=False, samples=16,
                                seed=0).metrics
    assert greedy["eval/accuracy"] <= 0.4  # measured 0.0 (seed 0)
    assert sampled["eval/pass_at_16"] >= 0.5  # measured 0.7
    assert greedy["eval/response_len_mean"] <= 3  # the format is learned: digits then EOS


def test_auto_warm_starts_the_embedded_model_on_its_own_task_only(caplog):
    """warm_start.enabled=auto: model=tiny on task=arith; the user's data (task=jsonl|dataset) only when asked,
    and then the run says what the warm start trains on."""
    from types import SimpleNamespace

    from rlrun.warmstart import applies as warm_applies
    from rlrun.warmstart import notice as warm_notice

    def cfg(enabled, task, model="tiny"):
        return SimpleNamespace(warm_start=SimpleNamespace(enabled=enabled, steps=300, wrong_prob=0.75, offsets=[1]),
                               task=SimpleNamespace(name=task), model=SimpleNamespace(name=model))

    assert warm_applies(cfg("auto", "arith"))
    assert not warm_applies(cfg("auto", "dataset")) and not warm_applies(cfg("auto", "jsonl"))
    assert not warm_applies(cfg("auto", "arith", model="hf")) and not warm_applies(cfg(False, "arith"))
    assert warm_applies(cfg(True, "dataset"))
    note = warm_notice(cfg(True, "dataset"), 188)
    assert "300 supervised steps on 188 training rows, prompt -> answer" in note and "75% of the labels" in note
    assert "warm_start.enabled=false turns it off" in note


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "not rlrun's", "empty"])
def test_a_bad_cache_entry_is_named_and_recomputed(caplog, damage):
    """Was: every later run failed with torch's "your checkpoint file is corrupted", not naming the file."""
    model, tok = tiny_model()
    warmstart.warm_start(model, tok, ROWS, CFG, seed=0)
    fresh = weights(model)
    [entry] = warmstart.cache_dir().glob("*.pt")
    data = bytearray(entry.read_bytes())
    assert data.startswith(warmstart.HEADER)  # checksummed
    if damage == "flipped byte":
        data[len(data) // 2] ^= 0xFF
    elif damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "not rlrun's":  # a plain torch.save of the same weights: no checksum, not trusted
        import io

        buf = io.BytesIO()
        torch.save(fresh, buf)
        data = buf.getvalue()
    else:
        data = b""
    entry.write_bytes(bytes(data))
    model, tok = tiny_model()
    with caplog.at_level("WARNING", logger="rlrun"):
        warmstart.warm_start(model, tok, ROWS, CFG, seed=0)
    assert f"warm-start cache entry {entry} is unusable" in caplog.text and "recomputing it" in caplog.text
    assert_identical(weights(model), fresh)  # recomputed: the same weights
    caplog.clear()
    model, tok = tiny_model()
    with caplog.at_level("WARNING", logger="rlrun"):
        warmstart.warm_start(model, tok, ROWS, CFG, seed=0)  # the entry was rewritten: a clean hit
    assert "unusable" not in caplog.text
    assert_identical(weights(model), fresh)


def test_a_cache_that_cannot_be_written_is_a_warning(caplog, monkeypatch):
    monkeypatch.setattr(warmstart.os, "replace", lambda a, b: (_ for _ in ()).throw(OSError(28, "No space left")))
    model, tok = tiny_model()
    with caplog.at_level("WARNING", logger="rlrun"):
        warmstart.warm_start(model, tok, ROWS, CFG, seed=0)
    assert "could not write the warm-start cache entry" in caplog.text and "No space left" in caplog.text
    assert not list(warmstart.cache_dir().glob("*"))  # no temporary file left
