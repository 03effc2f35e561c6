"""Dynamic sampling and overlong completions (rlrun/recipes/sampling.py): unit tests on a scripted sampler (exact
counts: half the groups constant -> dropped, the rollout refilled, ranks choosing what one process chooses), then
seeded runs (slow): the same number of sequences per step, heads that train the same with every new option, and a
run killed mid-way that resumes bit for bit."""

import contextlib
import dataclasses
import signal
import threading
from types import SimpleNamespace

import pytest
import torch
from conftest import TEST_PATH
from helpers import HEAD_ALTERNATIVES

from rlrun.recipes import grpo, sampling
from rlrun.rollout import Rollout


def examples(const: list[bool]) -> list[dict]:
    """Prompts of a few lengths (rounds re-pad), each marked constant (all its completions score 1.0) or not."""
    return [{"prompt": "p" + "x" * (i % 3) + str(i), "answer": "0", "const": c} for i, c in enumerate(const)]


def generate(model, prompts, seeds):
    """A scripted sampler: each row's response, length (1 to 4 = max_new_tokens: cut) and logprobs follow from its
    seed; a call's responses are as wide as its longest, so calls of other rows have other widths."""
    lengths, p = [1 + sd % 4 for sd in seeds], max(len(x) for x in prompts)
    width = max(lengths)
    ids, att, resp, lps = [], [], [], []
    for prompt, sd, n in zip(prompts, seeds, lengths):
        pid = [ord(c) for c in prompt]
        ids.append([0] * (p - len(pid)) + pid + [(sd >> k) % 50 + 1 if k < n else 0 for k in range(width)])
        att.append([0] * (p - len(pid)) + [1] * len(pid) + [int(k < n) for k in range(width)])
        resp.append([k < n for k in range(width)])
        lps.append([-((sd >> k) % 97) / 100 if k < n else 0.0 for k in range(width)])
    return Rollout(input_ids=torch.tensor(ids), attention_mask=torch.tensor(att), prompt_len=p,
                   response_mask=torch.tensor(resp), gen_logprobs=torch.tensor(lps),
                   completions=[f"{prompt}|{sd}" for prompt, sd in zip(prompts, seeds)],
                   finished=torch.tensor([n < 4 for n in lengths]))


def score(completions, rows):
    totals = [1.0 if row["const"] else (int(c.split("|")[1]) % 997) / 997 for c, row in zip(completions, rows)]
    return totals, {"r": list(totals)}


class Ranks:
    """engine.gather for ranks played by threads: every rank's object, in rank order."""

    def __init__(self, world: int):
        self.barrier, self.slots = threading.Barrier(world), [None] * world

    def gather(self, rank, obj):
        self.slots[rank] = obj
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out


def setup(rank=0, world=1, ranks=None, **train):
    t = dict(rollout_batch=16, group_size=4, dynamic_sampling=True, dynamic_sampling_max_rounds=4, overlong="keep",
             overlong_buffer=2, overlong_penalty_factor=1.0) | train
    engine = SimpleNamespace(rank=rank, world=world, main=rank == 0, device=torch.device("cpu"), model=None,
                             generation=contextlib.nullcontext,
                             gather=(lambda obj: [obj]) if ranks is None else (lambda obj: ranks.gather(rank, obj)))
    s = SimpleNamespace(engine=engine, meter=SimpleNamespace(phase=lambda name: contextlib.nullcontext()),
                        rollout=SimpleNamespace(generate=generate), data=SimpleNamespace(score=score),
                        tokenizer=SimpleNamespace(pad_token_id=0))
    cfg = SimpleNamespace(seed=0, train=SimpleNamespace(**t), rollout=SimpleNamespace(max_new_tokens=4))
    return cfg, s


def draw(const, **train):
    cfg, s = setup(**train)
    prompts, stats, totals = iter(examples(const)), {}, sampling.Totals()
    return sampling.draw(cfg, s, prompts, 0, stats, totals), stats, totals, prompts


def test_half_the_groups_constant_are_dropped_and_the_rollout_refilled():
    d, stats, totals, prompts = draw([i % 2 == 0 for i in range(40)])
    assert [r["prompt"] for r in d.rows[::4]] == ["px1", "p3", "pxx5", "px7"]  # rounds 0 and 1, in order
    assert len(d.rows) == len(d.roll.completions) == d.roll.input_ids.shape[0] == 16  # a full rollout
    assert stats == {"groups": 8, "dropped": 4, "filled": 0, "rounds": 2, "extra_s": stats["extra_s"],
                     "sequences": 16} and stats["extra_s"] > 0
    assert (totals.generated, totals.dropped) == (8, 4)
    assert next(prompts)["prompt"] == "pxx8"  # two rounds of 4 prompts read, no more
    assert all(sampling.informative(d.shaped, 4))
    assert (grpo.group_advantages(d.shaped, 4).view(4, 4).abs().sum(1) > 0).all()  # every group carries a signal


def test_rows_of_several_rounds_are_re_padded_to_one_rollout():
    d, *_ = draw([i % 2 == 0 for i in range(40)])
    for b, (ex, completion) in enumerate(zip(d.rows, d.roll.completions)):
        seed = int(completion.split("|")[1])
        prompt = d.roll.input_ids[b, : d.roll.prompt_len][d.roll.attention_mask[b, : d.roll.prompt_len].bool()]
        assert "".join(map(chr, prompt.tolist())) == ex["prompt"]
        n = int(d.roll.response_mask[b].sum())
        response = d.roll.input_ids[b, d.roll.prompt_len :][:n].tolist()
        assert response == [(seed >> k) % 50 + 1 for k in range(n)], b
        assert d.roll.attention_mask[b, d.roll.prompt_len :].tolist() == d.roll.response_mask[b].int().tolist()


def test_the_bound_completes_the_rollout_with_dropped_groups_and_warns(caplog):
    with caplog.at_level("WARNING", logger="rlrun"):
        d, stats, *_ = draw([i % 2 == 0 for i in range(40)], dynamic_sampling_max_rounds=1)
    assert [r["prompt"] for r in d.rows[::4]] == ["p0", "px1", "pxx2", "p3"]  # the round as drawn
    assert stats["filled"] == 2 and stats["rounds"] == 1 and len(d.rows) == 16
    assert "train.dynamic_sampling_max_rounds=1" in caplog.text and "completed with 2 of them" in caplog.text


def test_round_zero_is_what_a_run_without_dynamic_sampling_draws():
    on, stats, *_ = draw([False] * 8)
    off, off_stats, *_ = draw([False] * 8, dynamic_sampling=False)
    assert off_stats == {} and stats["rounds"] == 1 and stats["dropped"] == 0
    assert on.rows == off.rows and on.roll.completions == off.roll.completions and on.totals == off.totals
    for f in ("input_ids", "attention_mask", "response_mask", "gen_logprobs", "finished"):
        assert torch.equal(getattr(on.roll, f), getattr(off.roll, f)), f
    assert torch.equal(on.shaped, off.shaped)


def test_two_ranks_train_on_the_groups_one_process_trains_on():
    """Rank 0 generates only constant groups; the global choice hands it rank 1's groups (sent across)."""
    const = [i % 4 < 2 for i in range(40)]
    one, *_ = draw(const)
    ranks, out = Ranks(2), [None, None]

    def rank(r):
        cfg, s = setup(rank=r, world=2, ranks=ranks)
        out[r] = sampling.draw(cfg, s, iter(examples(const)), 0, {})

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert [r["prompt"] for r in one.rows[::4]] == ["pxx2", "p3", "p6", "px7"]
    assert out[0].rows + out[1].rows == one.rows  # rank 0 trains on groups rank 1 generated
    assert out[0].roll.completions + out[1].roll.completions == one.roll.completions
    assert torch.equal(torch.cat([out[0].shaped, out[1].shaped]), one.shaped)
    for r, part in enumerate(out):  # each row's tokens as one process holds them (up to padding)
        for b in range(8):
            mine, ref = part.roll, one.roll
            n = int(mine.response_mask[b].sum())
            assert n == int(ref.response_mask[8 * r + b].sum())
            assert torch.equal(mine.input_ids[b, mine.prompt_len :][:n], ref.input_ids[8 * r + b, ref.prompt_len :][:n])
            assert torch.equal(mine.gen_logprobs[b][:n], ref.gen_logprobs[8 * r + b][:n])


def test_overlong_penalty_is_dapos_soft_punishment():
    mask = torch.tensor([[True] * n + [False] * (8 - n) for n in (5, 6, 7, 8)])
    roll = SimpleNamespace(response_mask=mask)
    # L_max 8, buffer 2: no penalty up to 6 tokens, then linear down to -factor at 8
    assert sampling.overlong_penalty(roll, 8, 2, 1.0).tolist() == [0.0, 0.0, -0.5, -1.0]
    assert sampling.overlong_penalty(roll, 8, 2, 0.5).tolist() == [0.0, 0.0, -0.25, -0.5]


def test_overlong_filter_masks_the_completions_cut_at_max_new_tokens():
    cfg, s = setup(dynamic_sampling=False)
    d = sampling.generate(cfg, s, iter(examples([False] * 4)), 0, 0)
    kept = sampling.trained(d.roll, SimpleNamespace(overlong="filter"))
    assert (~d.roll.finished).any() and d.roll.finished.any()  # the case has both
    assert (kept.response_mask.sum(1) == torch.where(d.roll.finished, d.roll.response_mask.sum(1), 0)).all()
    for keep in ("penalty", "keep"):
        assert sampling.trained(d.roll, SimpleNamespace(overlong=keep)) is d.roll
    cfg, s = setup(dynamic_sampling=False, overlong="penalty", overlong_buffer=2)
    p = sampling.generate(cfg, s, iter(examples([False] * 4)), 0, 0)
    penalty = torch.tensor(p.by_reward["overlong_penalty"])
    assert torch.equal(p.shaped, torch.tensor(p.totals) + penalty) and (penalty <= 0).all()


def test_overlong_filter_logs_the_share_filtered_and_warns_once_per_run_when_it_is_everything(caplog):
    """train.overlong=filter that filters every completion trains nothing: said once per run, and the share
    filtered is a metric of every step."""
    cfg, s = setup(dynamic_sampling=False)
    roll = sampling.generate(cfg, s, iter(examples([False] * 4)), 0, 0).roll
    stats, train = {}, SimpleNamespace(overlong="filter")
    sampling.trained(roll, train, stats)
    cut = int((~roll.finished).sum())
    assert 0 < cut < 16 and sampling.metrics([stats], None) == {"overlong/filtered_frac": cut / 16}
    all_cut = dataclasses.replace(roll, finished=torch.zeros_like(roll.finished))
    with caplog.at_level("WARNING", logger="rlrun"):
        for _ in range(3):
            stats = {}
            assert sampling.trained(all_cut, train, stats).response_mask.sum() == 0
            assert sampling.metrics([stats, stats], None) == {"overlong/filtered_frac": 1.0}  # over ranks
    said = "train.overlong=filter filtered every completion of a rollout (all 16 were cut"
    assert caplog.text.count(said) == 1 and "Raise rollout.max_new_tokens" in caplog.text
    with caplog.at_level("WARNING", logger="rlrun"):
        sampling.trained(all_cut, SimpleNamespace(overlong="filter"), {})  # another run: said again
    assert caplog.text.count(said) == 2


def test_dynamic_sampling_says_how_its_rounds_go(caplog, monkeypatch):
    """A rollout that takes many rounds says so while it runs (every PROGRESS_S; here every round)."""
    monkeypatch.setattr(sampling, "PROGRESS_S", 0.0)
    with caplog.at_level("INFO", logger="rlrun"):
        draw([True] * 40, dynamic_sampling_max_rounds=3)
    for k in (2, 3):
        assert (f"dynamic sampling, rollout 0: round {k} of at most 3 (train.dynamic_sampling_max_rounds), 0 of 4 "
                "prompt groups with a reward signal so far") in caplog.text
    assert "round 4" not in caplog.text


@pytest.mark.parametrize("override, says", [
    ("train.dynamic_sampling_max_rounds=100000", "train.dynamic_sampling_max_rounds=100000 must be in [1, 64]"),
    ("loss.clip_low=1.0", "loss.clip_low=1.0 must be in [0, 1) (the ratio's lower bound 1 - clip_low must stay"),
    ("loss=cispo loss.clip_low=1.5", "loss.clip_low=1.5 must be in [0, 1)"),
    ("loss=gspo loss.clip_low=2", "loss.clip_low=2 must be in [0, 1)"),
])
def test_the_schema_bounds_the_rounds_and_the_lower_clip(override, says):
    from conftest import make_cfg

    from rlrun.config import ConfigError, validate

    with pytest.raises(ConfigError) as e:
        validate(make_cfg("train.dynamic_sampling=true", *override.split()))
    assert says in str(e.value), str(e.value)
    validate(make_cfg("loss=cispo", "loss.clip_low=null"))  # no lower bound at all is still allowed


# -- seeded runs ----------------------------------------------------------------------------------------------------
HALF = ["experiment=smoke", "task.reward=helpers:half_constant_reward", "task.max_operand=6"]


@pytest.mark.slow
def test_a_run_drops_the_constant_groups_and_trains_full_rollouts(tmp_path):
    from conftest import make_cfg, new_store
    from helpers import history, runs

    from rlrun.cli import run

    new_store(tmp_path)
    run(make_cfg(*HALF, "train.steps=4", "train.dynamic_sampling=true", tmp_path=tmp_path))
    client, (r,) = runs(tmp_path / "mlflow.db")
    keys = ("dynamic_sampling/dropped_frac", "dynamic_sampling/rounds", "dynamic_sampling/sequences",
            "dynamic_sampling/filled_groups", "equal_reward_groups_frac", "time/dynamic_sampling_extra_s")
    h = {k: history(client, r.info.run_id, k) for k in keys}
    assert h["dynamic_sampling/sequences"] == [8.0] * 4  # rollout_batch sequences trained at every step
    assert max(h["dynamic_sampling/dropped_frac"]) > 0 and max(h["dynamic_sampling/rounds"]) >= 2
    for filled, equal in zip(h["dynamic_sampling/filled_groups"], h["equal_reward_groups_frac"]):
        assert equal == (0.0 if filled == 0 else pytest.approx(filled / 2))  # no tie trained unless at the bound
    assert len(h["time/dynamic_sampling_extra_s"]) == 4


# Every new option through every head: the same seeded curve (rlrun's test_heads_give_the_same_curve, per option)
OPTIONS = {"gspo-filter": ["loss=gspo", "loss.clip_low=0.05", "loss.clip_high=0.08", "train.num_iterations=2",
                           "logprob_policy=always", "loss.kl_coef=0.05", "loss.tis.enabled=true",
                           "train.overlong=filter", "rollout.max_new_tokens=24"],  # long enough that some end
           "dapo-sum-norm-penalty": ["loss.agg=seq_mean_token_sum_norm", "train.overlong=penalty",
                                     "train.overlong_buffer=3"],
           # token sums: gradients ~ response length x token_mean's, so a smaller step keeps 5 steps comparable
           "cispo-seq-sum": ["loss=cispo", "loss.agg=seq_mean_token_sum", "train.lr=2e-3"],
           # on-policy, seq_mean_token_mean's loss is 0 (a group's advantages sum to 0): a second pass moves it
           "dapo-seq-mean-dynamic": ["loss.agg=seq_mean_token_mean", "train.dynamic_sampling=true",
                                     "train.num_iterations=2", *HALF[1:]]}


@pytest.mark.slow
@pytest.mark.parametrize("option", OPTIONS)
def test_heads_give_the_same_curve_with_every_new_option(tmp_path, option):
    from test_runs import assert_same_curves, loss_curve

    _, dense, _ = loss_curve(tmp_path / "dense", *OPTIONS[option])
    for head in HEAD_ALTERNATIVES:
        _, got, _ = loss_curve(tmp_path / head, *OPTIONS[option], f"head={head}")
        assert_same_curves(got, dense)


@pytest.mark.slow
def test_a_dynamic_sampling_run_killed_mid_way_resumes_bit_for_bit(tmp_path, monkeypatch):

    import test_checkpoint as tc
    from test_checkpoint import KILL_SEED, curve, kill_after, kill_point, rlrun

    from rlrun import checkpoint

    monkeypatch.setattr(tc, "ENV", {**tc.ENV, "PYTHONPATH": TEST_PATH})  # the runs' reward: tests/helpers.py
    args = [*HALF, "loss=gspo", "loss.agg=seq_mean_token_mean", "train.dynamic_sampling=true",
            "train.overlong=penalty", "train.steps=16", f"checkpoint.dir={tmp_path}/run/ckpt", "checkpoint.every=3"]
    (tmp_path / "base").mkdir()
    (tmp_path / "run").mkdir()
    base = rlrun(tmp_path / "base", *args[:-2])
    assert base.wait(timeout=600) == 0, base.stderr.read()[-2000:]
    at = kill_point("sigkill-dynamic-sampling", 4, 13)
    _, logged = kill_after(tmp_path / "run", args, at, signal.SIGKILL)
    where = f"SIGKILL once {at} steps were logged (RLRUN_TEST_KILL_SEED={KILL_SEED}), {logged} logged by then"
    saved = checkpoint.load_latest(str(tmp_path / "run" / "ckpt"))[0]
    assert saved["step"] % 3 == 0 and 3 <= saved["step"] <= logged, where
    assert saved["sampling"]["generated"] > saved["sampling"]["dropped"] > 0, where  # dynamic sampling's state
    r = rlrun(tmp_path / "run", *args, "resume=true")
    assert r.wait(timeout=600) == 0, f"{where}: " + r.stderr.read()[-2000:]
    run_, steps, values = curve(tmp_path / "run" / "mlflow.db")
    _, base_steps, base_values = curve(tmp_path / "base" / "mlflow.db")
    assert run_.info.status == "FINISHED" and steps == base_steps == list(range(16)), where
    assert values == base_values, f"{where}, resumed from the checkpoint after step {saved['step']}"


@pytest.mark.slow  # a 3-step run
def test_a_run_that_filters_every_completion_says_so_and_logs_the_share(tmp_path, caplog):
    from conftest import make_cfg, new_store
    from helpers import history, runs

    from rlrun.cli import run

    new_store(tmp_path)
    cfg = make_cfg("experiment=smoke", "train.steps=3", "eval.every=0", "train.overlong=filter",
                   "rollout.max_new_tokens=1", "task.max_operand=9", tmp_path=tmp_path)
    with caplog.at_level("WARNING", logger="rlrun"):
        run(cfg, "filtered")
    client, [r] = runs(tmp_path / "mlflow.db")
    shares = history(client, r.info.run_id, "overlong/filtered_frac")
    assert shares == [1.0, 1.0, 1.0]  # one token: the answer's digit, never its EOS (seed 0)
    assert caplog.text.count("train.overlong=filter filtered every completion") == 1  # once, not every step


def test_rounds_of_different_prompt_lengths_concat_to_one_rollout():
    """Two rounds whose longest prompts differ (experiment=varied_lengths): the prompts are left-padded to the
    longest, the response columns (response_mask, gen_logprobs) keep their width (issue #53: they were padded by
    the prompt-length difference, and the rollout's columns no longer lined up)."""
    short = generate(None, ["p1", "p2"], [3, 5])
    long = generate(None, ["pxxxxx1", "pxxxxx2"], [6, 7])
    parts = [sampling.Drawn([{"prompt": "p"}] * 2, r, [0.0, 1.0], {"r": [0.0, 1.0]}, torch.zeros(2))
             for r in (short, long)]
    out = sampling.concat(parts, 0).roll
    width = max(short.response_mask.shape[1], long.response_mask.shape[1])
    assert out.prompt_len == long.prompt_len
    assert out.input_ids.shape[1] == out.prompt_len + width
    assert out.response_mask.shape == out.gen_logprobs.shape == (4, width)
    for b, r in enumerate([short, short, long, long]):
        i = b % 2
        n = int(r.response_mask[i].sum())
        pad = [False] * (width - r.response_mask.shape[1])
        assert out.response_mask[b].tolist() == r.response_mask[i].tolist() + pad
        assert out.input_ids[b, out.prompt_len:][:n].tolist() == r.input_ids[i, r.prompt_len:][:n].tolist()
        assert torch.equal(out.gen_logprobs[b, :n], r.gen_logprobs[i, :n])


@pytest.mark.slow  # a 4-step run (~15 s)
def test_dynamic_sampling_runs_on_prompts_of_different_lengths(tmp_path):
    """issue #53: experiment=varied_lengths train.dynamic_sampling=true crashed at step 3, when a rollout joined
    groups of rounds whose longest prompts differ (the default task's equal-length prompts hid it): sums of 2 to 12
    operands here, as varied_lengths has (its worked answers are not the test reward's integers)."""
    from conftest import make_cfg, new_store
    from helpers import history, runs

    from rlrun.cli import run

    new_store(tmp_path)
    run(make_cfg(*HALF, "task.max_terms=12", "train.steps=4", "train.dynamic_sampling=true", tmp_path=tmp_path))
    client, (r,) = runs(tmp_path / "mlflow.db")
    assert history(client, r.info.run_id, "dynamic_sampling/sequences") == [8.0] * 4
