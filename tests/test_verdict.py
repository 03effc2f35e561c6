"""A sweep's answer (rlrun/tools/verdict.py): timed on the phases the varying options change, with their noise, and
a same-result verdict set by the options' exactness. Made-up histories: what a busy machine does to them is the
point (a slow generation phase must not rank a head)."""

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
    data = [run([1.0, 1.1, 0.9, 1.0, 1.05, 0.95]), run([0.5, 0.52, 0.48, 0.5, 0.51, 0.49])]
    headline, _ = verdict.answer(["padded", "packed"], data, [params(batching="padded"), params(batching="packed")],
                                 {1: 0})
    assert "packed: 0.51x" in headline  # medians after the warm-up steps: 0.495 / 0.975


def test_without_a_baseline_the_fastest_is_named_only_beyond_the_others_spread():
    data = [run([1.0, 1.1, 0.9, 1.0]), run([0.99, 1.12, 0.92, 1.01]), run([0.4, 0.41, 0.4, 0.42])]
    names = ["loss=dapo", "loss=cispo", "loss=dpo"]
    headline, _ = verdict.answer(names, data, [{"loss.name": n[5:]} for n in names], {})
    assert headline == "Fastest on the whole step: loss=dpo, beyond every other run's spread."
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
    assert "step" in verdict.changed_phases(["pipeline"], runs)
    data = [run([0.1] * 5, generate=[1.0] * 5), run([0.1] * 5, generate=[0.5] * 5)]
    headline, _ = verdict.answer(["sync", "async"], data, runs, {})
    assert headline == "Fastest on the whole step: async, beyond every other run's spread."


def test_a_paired_sweep_is_timed_without_generation_which_only_its_recording_job_ran():
    """precision changes generation too, but in a paired sweep only the first job generates: timing `generate` would
    charge it to that job alone. The same rollouts also make 'same result' hold over every step."""
    rec = {"train.precision": "fp32", "rollout.record": "/s/record", "head.name": "dense"}
    rep = {"train.precision": "bf16", "rollout.path": "/s/record", "rollout.name": "replay", "head.name": "dense"}
    data = [run([0.1] * 6, generate=[1.0] * 6), run([0.1] * 6)]
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
    base, fast = run([1.0, 1.1, 0.9, 1.0, 1.05, 0.95]), run([0.5, 0.52, 0.48, 0.5, 0.51, 0.49])
    as_slow = run([0.98, 1.12, 0.91, 1.01, 1.04, 0.96])
    wrong = run([0.98, 1.12, 0.91, 1.01, 1.04, 0.96], loss=[0.1, 0.3, 0.3, 0.3, 0.3, 0.3])
    names = ["head=dense", "head=tiled", "head=chunked"]
    _, rows = verdict.answer(names, [base, fast, as_slow], [params(head=n[5:]) for n in names], {1: 0, 2: 0})
    assert verdict.brief(rows["head=dense"]) == "baseline"
    assert verdict.brief(rows["head=tiled"]) == "same · 0.51x vs head=dense"
    assert verdict.brief(rows["head=chunked"]) == "same · no difference measured vs head=dense"
    _, rows = verdict.answer(names[:2], [base, wrong], [params(head=n[5:]) for n in names[:2]], {1: 0})
    assert verdict.brief(rows["head=tiled"]) == "DIFFERENT · no difference measured vs head=dense"
    _, alone = verdict.answer(names[:2], [base, fast], [{"loss.name": "dapo"}, {"loss.name": "cispo"}], {})
    assert {verdict.brief(r) for r in alone.values()} == {"no baseline in the sweep"}
    assert {r["same_text"] for r in alone.values()} == {"no baseline in the sweep"}  # not "the baseline" for each


def test_each_jobs_answer_as_bars_has_no_cost_bar_within_the_noise():
    """answer/* (the chart view's bars): the baseline 1 and 1; a measured difference its ratio; a difference within
    the spreads no cost bar (never a ranking); a wrong result same 0; no baseline: no ratio, no same."""
    base, fast = run([1.0, 1.1, 0.9, 1.0, 1.05, 0.95]), run([0.5, 0.52, 0.48, 0.5, 0.51, 0.49])
    as_slow = run([0.98, 1.12, 0.91, 1.01, 1.04, 0.96])
    wrong = run([0.98, 1.12, 0.91, 1.01, 1.04, 0.96], loss=[0.1, 0.3, 0.3, 0.3, 0.3, 0.3])
    names = ["head=dense", "head=tiled", "head=chunked"]
    _, rows = verdict.answer(names, [base, fast, as_slow], [params(head=n[5:]) for n in names], {1: 0, 2: 0})
    bars = {n: verdict.metrics(rows[n]) for n in names}
    for n in names:  # the median seconds per step on the changed phases, at 4 significant digits
        assert bars[n].pop("answer/phase_s") == float(f"{rows[n]['phase_s']:.4g}")
    assert bars["head=dense"] == {"answer/cost_x": 1.0, "answer/same": 1.0}
    assert bars["head=tiled"] == {"answer/cost_x": float(f"{rows['head=tiled']['ratio']:.4g}"), "answer/same": 1.0}
    assert 0.45 < bars["head=tiled"]["answer/cost_x"] < 0.55
    assert bars["head=chunked"] == {"answer/same": 1.0}
    _, rows = verdict.answer(names[:2], [base, wrong], [params(head=n[5:]) for n in names[:2]], {1: 0})
    assert verdict.metrics(rows["head=tiled"])["answer/same"] == 0.0
    _, alone = verdict.answer(names[:2], [base, fast], [{"loss.name": "dapo"}, {"loss.name": "cispo"}], {})
    assert [set(verdict.metrics(r)) for r in alone.values()] == [{"answer/phase_s"}] * 2
