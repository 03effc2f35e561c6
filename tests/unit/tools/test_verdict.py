"""A sweep's answer (rlrun/tools/verdict.py): timed on the phases the varying options change, with their noise, and
a same-result verdict set by the options' exactness. Made-up histories: what a busy machine does to them is the
point (a slow generation phase must not rank a head)."""

import re

import pytest

from rlrun.tools import verdict


def run(train, generate=None, loss=None, reward=None, old=None):
    """A made-up history: per-step seconds of train (and generate, old_logprobs), loss and reward curves."""
    n = len(train)
    h = {"time/train_s": (list(range(n)), train),
         "time/step_s": (list(range(n)), [t + (generate[i] if generate else 0.0) for i, t in enumerate(train)])}
    if generate:
        h["time/generate_s"] = (list(range(n)), generate)
    if old:
        h["time/old_logprobs_s"] = (list(range(n)), old)
    h["loss"] = (list(range(n)), loss or [0.1] * n)
    h["reward_mean"] = (list(range(n)), reward or [0.5] * n)
    return h


def params(**axes):
    return {f"{k}.name": v for k, v in axes.items()} | {"seed": "0"}


def test_a_busy_machine_slowing_one_jobs_generation_does_not_rank_the_heads():
    """The batching sweep that ranked padded fastest: the whole step is generation, which a head does not change."""
    same = [0.010, 0.011, 0.010, 0.012, 0.011, 0.010, 0.011, 0.012]
    data = [run(same, generate=[0.5] * 8), run(same[::-1], generate=[2.0] * 8)]  # the second ran while loaded
    headline, rows = verdict.answer(["dense", "tiled"], data, [params(head="dense"), params(head="tiled")], {1: 0})
    assert headline.startswith("Cost of old_logprobs + ref_logprobs + train against dense (head): "
                               "tiled: no difference measured.")
    assert rows["tiled"]["step_s"] > 3 * rows["dense"]["step_s"]  # the whole step, shown beside: 4x
    assert rows["tiled"]["phase_s"] == pytest.approx(rows["dense"]["phase_s"], rel=0.1)


def test_a_difference_beyond_both_spreads_is_a_ratio():
    data = [run([1.0, 1.1, 0.9, 1.0, 1.05, 0.95, 1.0]), run([0.5, 0.52, 0.48, 0.5, 0.51, 0.49, 0.5])]
    headline, _ = verdict.answer(["padded", "packed"], data, [params(batching="padded"), params(batching="packed")],
                                 {1: 0})
    assert "packed: 0.50x [0.47, 0.55]" in headline  # medians after the warm-up: 0.5 / 1.0; the quartiles' ratio


def test_without_a_baseline_the_fastest_is_named_only_beyond_the_others_spread():
    data = [run([1.0, 1.1, 0.9, 1.0] * 2), run([0.99, 1.12, 0.92, 1.01] * 2), run([0.4, 0.41, 0.4, 0.42] * 2)]
    names = ["loss=dapo", "loss=cispo", "loss=dpo"]
    headline, _ = verdict.answer(names, data, [{"loss.name": n[5:]} for n in names], {})
    assert headline.startswith("Fastest on the whole step: loss=dpo, beyond every other run's spread.")
    headline, _ = verdict.answer(names[:2], data[:2], [{"loss.name": "dapo"}, {"loss.name": "cispo"}], {})
    assert headline.startswith("Cost of the whole step: no difference measured")


def test_an_exact_option_must_match_the_loss_until_the_samples_part():
    base = run([0.01] * 6, loss=[0.5, 0.4, 0.3, 0.2, 0.1, 0.05], reward=[0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    rounding = run([0.01] * 6, loss=[0.5, 0.4, 0.3 + 1e-7, 0.7, 0.9, 0.2], reward=[0.1, 0.2, 0.3, 0.45, 0.5, 0.7])
    wrong = run([0.01] * 6, loss=[0.5, 0.45, 0.3, 0.2, 0.1, 0.05], reward=[0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    assert verdict.parted_at(rounding, base) == 3 and verdict.parted_at(wrong, base) is None
    ok, text = verdict.same_result(rounding, base, "fp_tolerance")
    assert ok and "the 3 steps before sampling parts" in text  # step 3 on differs: other samples, not judged
    ok, text = verdict.same_result(wrong, base, "fp_tolerance")
    assert ok is False and "all 6 steps" in text
    assert verdict.same_result(wrong, base, "approximate")[0] is None


def test_the_verdict_takes_the_loosest_exactness_of_what_changed_and_a_pipeline_is_timed_on_the_whole_step():
    sync, bf16 = {"train.precision": "fp32", "rollout.pipeline": "sync"}, {"train.precision": "bf16"}
    assert verdict.exactness_of({**sync, **bf16, "head.name": "tiled"}, {**sync, "head.name": "dense"}) == \
        "approximate"
    assert verdict.exactness_of({"head.name": "tiled"}, {"head.name": "dense"}) == "fp_tolerance"
    runs = [{"rollout.pipeline": "sync"}, {"rollout.pipeline": "async"}]
    assert verdict.varying(runs) == ["pipeline"]
    # a paired sweep: the replaying jobs have no rollout.decode / rollout.speculate key; only the head was swept
    paired = [{"head.name": "dense", "rollout.decode": "eager", "rollout.speculate": "off"}, {"head.name": "tiled"}]
    assert verdict.varying(paired) == ["head"]
    assert "step" in verdict.changed_phases(["pipeline"], runs)
    data = [run([0.1] * 8, generate=[1.0] * 8), run([0.1] * 8, generate=[0.5] * 8)]
    headline, _ = verdict.answer(["sync", "async"], data, runs, {})
    assert headline == ("Fastest on the whole step: async, beyond every other run's spread. Nothing these options "
                        "leave unchanged was timed to catch load between jobs: report.repeats=3 interleaves them.")


def test_a_paired_sweep_is_timed_without_generation_which_only_its_recording_job_ran():
    """precision changes generation too, but in a paired sweep only the first job generates: timing `generate` would
    charge it to that job alone. The same rollouts also make 'same result' hold over every step."""
    rec = {"train.precision": "fp32", "rollout.record": "/s/record", "head.name": "dense"}
    rep = {"train.precision": "bf16", "rollout.path": "/s/record", "rollout.name": "replay", "head.name": "dense"}
    data = [run([0.1] * 8, generate=[1.0] * 8), run([0.1] * 8)]
    headline, rows = verdict.answer(["fp32", "bf16"], data, [rec, rep], {1: 0})
    assert headline.startswith("Cost of old_logprobs + ref_logprobs + train against fp32 (precision): bf16: no "
                               "difference measured")
    assert "generate" in verdict.changed_phases(["precision"], [rec, rep])  # unpaired, it would be timed
    ok, text = verdict.same_result(run([0.1] * 4, loss=[1.0, 2.0, 3.0, 4.0]), run([0.1] * 4, loss=[1.0, 2.0, 3.0, 4.0]),
                                   "fp_tolerance", paired=True)
    assert ok and text.endswith("over all 4 steps, on the same recorded rollouts (tolerance 1e-04)")


def test_repeats_pool_each_options_runs_so_load_on_one_repeat_is_spread_not_a_ranking():
    """report.repeats=2: one repeat of tiled ran while the machine was busy (every step slower). Alone, that run's
    steps agree with each other and would rank tiled 3x slower; pooled with its other repeat, the options' ranges
    overlap: no difference measured."""
    calm = [0.010, 0.0102, 0.0099, 0.0101, 0.010, 0.0098, 0.0101, 0.010]
    names = ["report.repeat=0,head=dense", "report.repeat=0,head=tiled", "report.repeat=1,head=dense",
             "report.repeat=1,head=tiled"]
    data = [run(calm), run(calm[::-1]), run(calm), run([3 * t for t in calm])]
    ps = [params(head="dense"), params(head="tiled")] * 2
    headline, rows = verdict.answer(names, data, ps, {1: 0, 2: 0, 3: 0})
    assert set(rows) == {"head=dense", "head=tiled"} and rows["head=tiled"]["repeats"] == 2
    assert headline.startswith("Cost of old_logprobs + ref_logprobs + train against head=dense (head): head=tiled: no "
                               "difference measured.")
    assert rows["head=tiled"]["phase_low"] < 0.0102 < rows["head=tiled"]["phase_high"] == pytest.approx(0.030)
    single, _ = verdict.answer(names[2:], data[2:], ps[2:], {1: 0})  # the loaded repeat alone: a ranking
    assert "head=tiled: 3.00x" in single


def test_repeats_are_the_sweepers_outermost_key_so_jobs_interleave():
    from omegaconf import OmegaConf

    from rlrun import sweep_jobs

    config = OmegaConf.create({"report": {"repeats": 3},
                               "hydra": {"sweeper": {"_target_": "hydra._internal.core_plugins.basic_sweeper."
                                                                 "BasicSweeper", "params": {"head": "dense,tiled"}},
                                         "overrides": {"task": ["experiment=smoke"]}}})
    sweep_jobs.expand_repeats(config)
    order = [[o for o in job if o.split("=")[0] in ("report.repeat", "head")] for job in sweep_jobs.jobs(config)]
    assert order == [["report.repeat=0", "head=dense"], ["report.repeat=0", "head=tiled"],
                     ["report.repeat=1", "head=dense"], ["report.repeat=1", "head=tiled"],
                     ["report.repeat=2", "head=dense"], ["report.repeat=2", "head=tiled"]]
    assert sweep_jobs.swept_keys(config) == ["report.repeat", "head"]


def test_each_job_gets_its_answer_in_a_few_words():
    """The runs table's verdict column (tag rlrun.verdict): same or not, then the cost against the baseline."""
    base, fast = run([1.0, 1.1, 0.9, 1.0, 1.05, 0.95, 1.0]), run([0.5, 0.52, 0.48, 0.5, 0.51, 0.49, 0.5])
    as_slow = run([0.98, 1.12, 0.91, 1.01, 1.04, 0.96, 1.0])
    wrong = run([0.98, 1.12, 0.91, 1.01, 1.04, 0.96, 1.0], loss=[0.1, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3])
    names = ["head=dense", "head=tiled", "head=chunked"]
    _, rows = verdict.answer(names, [base, fast, as_slow], [params(head=n[5:]) for n in names], {1: 0, 2: 0})
    assert verdict.brief(rows["head=dense"]) == "baseline"
    assert verdict.brief(rows["head=tiled"]) == "same · 0.50x vs head=dense"
    assert verdict.brief(rows["head=chunked"]) == "same · no difference measured vs head=dense"
    _, rows = verdict.answer(names[:2], [base, wrong], [params(head=n[5:]) for n in names[:2]], {1: 0})
    assert verdict.brief(rows["head=tiled"]) == "DIFFERENT · no difference measured vs head=dense"
    _, alone = verdict.answer(names[:2], [base, fast], [{"loss.name": "dapo"}, {"loss.name": "cispo"}], {})
    assert {verdict.brief(r) for r in alone.values()} == {"no baseline in the sweep"}
    assert {r["same_text"] for r in alone.values()} == {"no baseline in the sweep"}  # not "the baseline" for each


def test_each_jobs_answer_as_bars_draws_a_difference_within_the_noise_with_its_interval():
    """system/answer/* (the chart view's bars): the baseline 1 and 1; every compared job its ratio with the interval
    (the quartiles' ratio) and whether it differs: one within the noise is drawn, marked 0, its interval holding 1;
    a wrong result same 0; no baseline: no ratio, no same."""
    base, fast = run([1.0, 1.1, 0.9, 1.0, 1.05, 0.95, 1.0]), run([0.5, 0.52, 0.48, 0.5, 0.51, 0.49, 0.5])
    as_slow = run([0.98, 1.12, 0.91, 1.01, 1.04, 0.96, 1.0])
    wrong = run([0.98, 1.12, 0.91, 1.01, 1.04, 0.96, 1.0], loss=[0.1, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3])
    names = ["head=dense", "head=tiled", "head=chunked"]
    _, rows = verdict.answer(names, [base, fast, as_slow], [params(head=n[5:]) for n in names], {1: 0, 2: 0})
    bars = {n: verdict.metrics(rows[n]) for n in names}
    for n in names:  # the median seconds per step on the changed phases, at 4 significant digits
        assert bars[n].pop("system/answer/phase_s") == float(f"{rows[n]['phase_s']:.4g}")
    assert bars["head=dense"] == {"system/answer/cost_x": 1.0, "system/answer/same": 1.0}
    tiled = rows["head=tiled"]
    assert bars["head=tiled"] == {"system/answer/cost_x": float(f"{tiled['ratio']:.4g}"), "system/answer/same": 1.0,
                                  "system/answer/cost_x_low": float(f"{tiled['ratio_low']:.4g}"),
                                  "system/answer/differs": -1.0,
                                  "system/answer/cost_x_high": float(f"{tiled['ratio_high']:.4g}")}
    got = bars["head=tiled"]
    assert 0.45 < got["system/answer/cost_x_low"] < got["system/answer/cost_x_high"] < 0.55
    assert bars["head=chunked"]["system/answer/differs"] == 0.0
    assert bars["head=chunked"]["system/answer/cost_x_low"] < 1 < bars["head=chunked"]["system/answer/cost_x_high"]
    _, rows = verdict.answer(names[:2], [base, wrong], [params(head=n[5:]) for n in names[:2]], {1: 0})
    assert verdict.metrics(rows["head=tiled"])["system/answer/same"] == 0.0
    _, alone = verdict.answer(names[:2], [base, fast], [{"loss.name": "dapo"}, {"loss.name": "cispo"}], {})
    assert [set(verdict.metrics(r)) for r in alone.values()] == [{"system/answer/phase_s"}] * 2


def paced(train, generate, tokens=100.0, **kw):
    """A made-up history whose generation logged its pace (tokens / s), as every generating step does."""
    h = run(train, generate=generate, **kw)
    h[verdict.REF_KEY] = (list(range(len(train))), [tokens / g for g in generate])
    return h


WOBBLE = [1.0, 1.02, 0.98, 1.01, 0.99, 1.0, 1.03, 0.97, 1.0, 1.01, 0.99, 1.02]


def loaded(cost, busy_steps, train_x=1.7, generate_x=3.0):
    """A job whose changed phases cost `cost` a step at full speed, with other work slowing the steps in
    `busy_steps`: its train pass `train_x`, its generation `generate_x` (load slows them unalike: measured on 2 cores,
    generation up to 13x)."""
    n = len(WOBBLE)
    return paced([cost * w * (train_x if i in busy_steps else 1) for i, w in enumerate(WOBBLE)],
                 [0.5 * w * (generate_x if i in busy_steps else 1) for i, w in enumerate(WOBBLE[::-1])][:n])


def test_steps_slowed_by_other_work_are_left_out_wherever_they_fell():
    """The issue's run 3: the sweep's first job (here chunked) ran while the machine was busy for half its steps.
    Timed on every step, chunked is dearer; its generation, which a head does not change, shows which steps were
    slowed, and on the others chunked costs what dense costs: no difference measured, the left-out steps said."""
    names, ps = ["head=dense", "head=chunked"], [params(head="dense"), params(head="chunked")]
    base, half = loaded(0.3, ()), loaded(0.3, range(2, 12, 2))
    headline, rows = verdict.answer(names, [base, half], ps, {1: 0})
    assert "head=chunked: no difference measured" in headline
    assert "left out as slowed (other work, the job's evaluations): head=chunked 5 of 10." in headline
    assert rows["head=chunked"]["timed"] == 5 and rows["head=dense"]["timed"] == 10
    unpaced = [run(base["time/train_s"][1]), run(half["time/train_s"][1])]  # without the pace: the busy steps count
    headline, rows = verdict.answer(names, unpaced, ps, {1: 0})
    assert rows["head=chunked"]["phase_high"] > 1.5 * rows["head=dense"]["phase_high"]
    assert "Nothing these options leave" in headline
    busy = loaded(0.3, range(12))  # busy throughout: no ratio, and what to do
    headline, rows = verdict.answer(names, [base, busy], ps, {1: 0})
    assert "head=chunked: too few steps at the machine's full pace (0 of 10)" in headline
    assert "The machine was busy through most of head=chunked: run again, or report.repeats=3" in headline
    assert verdict.cost_x(rows["head=chunked"]) is None
    headline, rows = verdict.answer(names, [busy, base], ps, {1: 0})  # the baseline was the busy one
    assert "head=chunked: too few timed steps in its baseline head=dense" in headline


def test_a_real_difference_survives_and_an_idle_machine_leaves_no_step_out():
    """tiled 0.6x on the changed phases, a third of its steps slowed: 0.60x on the rest. Idle, every step counts
    and the answer says nothing of the machine."""
    names, ps = ["head=dense", "head=tiled"], [params(head="dense"), params(head="tiled")]
    headline, rows = verdict.answer(names, [loaded(0.3, ()), loaded(0.18, (3, 6, 9, 11))], ps, {1: 0})
    assert rows["head=tiled"]["ratio"] == pytest.approx(0.6, rel=0.02) and "head=tiled: 0.59x [" in headline
    headline, rows = verdict.answer(names, [loaded(0.3, ()), loaded(0.18, ())], ps, {1: 0})
    assert "slowed" not in headline and "Nothing" not in headline and rows["head=tiled"]["timed"] == 10


def test_a_sweep_of_too_few_timed_steps_gives_no_ratio():
    """The 3-step sweep that printed "0.75x" from one timed step with the range [0.2478, 0.2478]."""
    names, ps = ["head=dense", "head=tiled"], [params(head="dense"), params(head="tiled")]
    headline, rows = verdict.answer(names, [run([0.4, 0.33, 0.33]), run([0.4, 0.3, 0.2478])], ps, {1: 0})
    assert "head=tiled: too few timed steps (1; 5 after the first 2: more train.steps)" in headline
    assert verdict.cost_x(rows["head=tiled"]) is None
    assert "system/answer/cost_x" not in verdict.metrics(rows["head=tiled"])
    enough = [run([0.4, 0.33] + [0.33] * 5), run([0.4, 0.3] + [0.2478] * 5)]
    assert "head=tiled: 0.75x" in verdict.answer(names, enough, ps, {1: 0})[0]


def test_the_sweeps_console_ends_with_the_answer_each_option_on_a_line_no_interval_split():
    wobble = [1.0, 1.02, 0.98, 1.01, 0.99, 1.0, 1.03, 0.97, 1.0, 1.01]
    names = ["head=dense", "head=tiled", "head=chunked"]
    data = [paced([0.3 * w for w in wobble], [0.5] * 10), paced([0.18 * w for w in wobble[::-1]], [0.5] * 10),
            paced([0.3 * w for w in wobble[::-1]], [0.5] * 10)]
    text = verdict.console(verdict.answer(names, data, [params(head=n[5:]) for n in names], {1: 0, 2: 0}))
    lines = text.splitlines()
    assert lines[0] == "rlrun: the sweep's answer" and all(len(line) <= 100 for line in lines)
    assert not any(re.search(r"\[[^\]]*$", line) for line in lines)  # an interval is never broken across lines
    rows = {line.split()[0]: line for line in lines if line.startswith("  head=")}
    assert rows["head=dense"].endswith("the baseline") and "300 ms [" in rows["head=dense"]
    assert re.search(r"0\.60x \[0\.5\d, 0\.6\d\] · same result: yes$", rows["head=tiled"])
    assert rows["head=chunked"].endswith("no difference measured · same result: yes")
