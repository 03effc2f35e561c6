"""The numbers behind the report's cost figures and table (tools/costs.py), checked on jobs whose metrics are known:
step time and tokens/s are the console's (no evaluation), memory is growth per phase (the absolute peak only as
context), the cost chart marks each group's baseline, the plan figure draws the measured floor, and no legend
covers the data."""

from __future__ import annotations

import numpy as np
import pytest

from rlrun import runner
from rlrun.runner.summary import Summary
from rlrun.tools import costs, report
from rlrun.tools import equivalence as eq

EVAL_S = 0.5  # each evaluation's time: known, so that a step time that includes it shows


def job(gen_s=0.02, train_s=0.03, tokens=32, steps=4, growth=(("generate", 1.0), ("train", 4.0)), peak=600.0,
        first=0.0):
    """What a GRPO job logs, in the frame's order: an evaluation before step 0, `steps` steps, one after the last
    -> [(step, metrics)]. `first`: extra growth on step 0 (the process's first-call buffers)."""
    out = [(0, {"eval/accuracy": 0.1, "time/eval_s": EVAL_S, "mem/eval_growth_mib": 2.0, "mem/eval_peak_mib": peak})]
    for s in range(steps):
        m = {"loss": 1.0 / (s + 1), "reward_mean": 0.1 * s, "train_tokens": float(tokens),
             "time/generate_s": gen_s * (1 + s % 2), "time/train_s": train_s, "time/offload_s": 1e-5,
             "time/onload_s": 1e-5, "throughput/gen_tokens_per_s": 1000.0, "throughput/train_tokens_per_s": 2000.0,
             "mem/offload_growth_mib": 0.004, "mem/onload_growth_mib": 0.0}
        m["time/step_s"] = sum(v for k, v in m.items() if k.startswith("time/"))
        for phase, g in growth:
            m[f"mem/{phase}_growth_mib"] = g + (first if s == 0 else 0.0)
            m[f"mem/{phase}_peak_mib"] = peak + g
            m[f"plan/{phase}_growth_mib"] = g * 0.8
        out.append((s, m))
    out.append((steps, {"eval/accuracy": 0.2, "time/eval_s": EVAL_S, "mem/eval_growth_mib": 2.0,
                        "mem/eval_peak_mib": peak}))
    return out


def history(logged) -> dict:
    """{key: (steps, values)} as report.histories reads a run back from MLflow."""
    out: dict[str, tuple[list, list]] = {}
    for step, m in logged:
        for k, v in m.items():
            out.setdefault(k, ([], []))
            out[k][0].append(step)
            out[k][1].append(v)
    return {k: (np.array(s), np.array(v)) for k, (s, v) in out.items()}


def console(logged) -> dict:
    summary = Summary("reward_mean")
    for _, m in logged:
        summary.add(m)
    return summary.result()


def test_step_time_and_tokens_per_s_are_the_consoles_without_evaluation():
    logged = job()
    h, said = history(logged), console(logged)
    steps = [m for _, m in logged if "time/step_s" in m]
    assert costs.step_seconds(h) == pytest.approx(said["step_s"])
    assert costs.step_seconds(h) == pytest.approx(np.mean([m["time/step_s"] for m in steps]))
    assert costs.step_seconds(h) < EVAL_S / 4  # the evaluations (0.5 s each) are not in it
    assert costs.tokens_per_s(h) == pytest.approx(said["tokens_per_s"]) == pytest.approx(
        32 * 4 / sum(m["time/step_s"] for m in steps))
    row = report.rows_of(["a"], [h])[0]
    assert row["step s (no eval)"] == pytest.approx(said["step_s"])
    assert row["tokens/s (step)"] == pytest.approx(said["tokens_per_s"])
    table = report.table(["a"], [h])
    assert "step s (no eval)" in table.splitlines()[0] and f"{said['step_s']:.4f}" in table
    assert f"{said['tokens_per_s']:.0f} trained" in runner.end_table(said)  # the console prints the same number
    assert said["peak_mib"] == costs.absolute_peak(h)  # the runs table's memory column: the report's peak MiB


def test_step_phases_add_up_to_the_step_and_leave_evaluation_out():
    h = history(job())
    t = costs.throughput([h])
    assert "eval" not in t["phases"] and set(t["phases"]) == {"generate", "offload", "onload", "train"}
    assert sum(v[0] for v in t["phases"].values()) == pytest.approx(t["step_s"][0])
    fig = report.throughput_figure(["a"], [h])
    tokens_ax, step_ax = fig.axes[:2]
    assert [p.get_width() for p in tokens_ax.patches] == pytest.approx(t["tokens_per_s"])  # the step's, not a phase's
    assert sum(p.get_width() for p in step_ax.patches) == pytest.approx(t["step_s"][0])


def test_memory_is_growth_per_phase_and_the_absolute_peak_only_context():
    """dense grows most but, started first in the process, has the lowest RSS: growth must rank it most expensive."""
    dense = history(job(growth=(("generate", 1.0), ("train", 40.0)), peak=590.0))  # its train peak: 630 MiB
    tiled = history(job(growth=(("generate", 1.0), ("train", 5.0)), peak=637.0))  # 642 MiB
    m = costs.memory([dense, tiled])
    train = m["phases"].index("train")
    assert [row[train][0] for row in m["growth"]] == [40.0, 5.0]
    fig = report.memory_figure(["dense", "tiled"], [dense, tiled], "cpu")
    coloured = np.asarray(fig.axes[0].images[0].get_array())
    assert list(coloured[:, train]) == [40.0, 5.0]  # the colours are growth, not RSS
    context = fig.axes[1]  # beside the rows, faint and labelled as context
    assert "context: absolute" in context.get_xlabel()
    assert [b.get_width() for b in context.patches] == [630.0, 642.0] and context.patches[0].get_alpha() < 0.5
    assert [r["growth MiB"] for r in report.rows_of(["dense", "tiled"], [dense, tiled])] == [40.0, 5.0]


def test_growth_is_the_median_step_so_first_call_buffers_do_not_make_a_job_look_expensive():
    h = history(job(growth=(("train", 4.0),), first=12.0))  # step 0 carries 12 MiB of the process's one-time buffers
    assert costs.growth(h, "train") == (4.0, 16.0)
    assert costs.largest_growth(h) == (4.0, "train")  # and not eval (2 MiB, between steps) or step 0's 16
    assert report.rows_of(["a"], [h])[0]["growth MiB"] == 4.0


def test_cost_chart_marks_each_groups_baseline_and_compares_with_it():
    names = ["head=dense", "head=tiled", "head=chunked"]
    params = [{"head.name": n.split("=")[1], "logprob_policy.name": "window", "offload.name": "off"} for n in names]
    data = [history(job(train_s=t, growth=(("train", g),))) for t, g in ((0.06, 40.0), (0.03, 5.0), (0.04, 4.0))]
    base_of, _ = eq.baselines(params, names)
    rows = costs.costs(names, data, base_of)
    assert [r["is_baseline"] for r in rows] == [True, False, False]
    assert [r["baseline"] for r in rows] == [None, "head=dense", "head=dense"]
    assert rows[1]["growth_mib_ratio"] == pytest.approx(5.0 / 40.0)
    assert rows[1]["step_s_ratio"] == pytest.approx(rows[1]["step_s"] / rows[0]["step_s"])
    assert rows[1]["step_s_ratio"] < 1 and rows[0]["step_s_ratio"] != rows[0]["step_s_ratio"]  # NaN: no baseline
    fig = report.cost_figure(rows)
    assert len(fig.axes) == 3
    for ax in fig.axes:
        assert [p.get_hatch() for p in ax.patches] == ["//", None, None]
        assert "(baseline)" in ax.get_yticklabels()[0].get_text()
    assert "0.12× baseline" in [t.get_text() for t in fig.axes[1].texts][1]
    (median,) = fig.axes[0].get_lines()  # beside the mean, the median step (a slow first step shows as the gap)
    assert list(median.get_xdata()) == pytest.approx([r["median_step_s"] for r in rows])
    assert rows[0]["median_step_s"] == pytest.approx(0.06 + 0.03 + 2e-5)  # steps 0, 2: generate 0.02 s; 1, 3: 0.04


def test_cost_chart_leads_with_the_answer_its_intervals_and_a_difference_within_the_noise_drawn():
    """cost.png's first panel is the sweep's answer: each option's ratio to its baseline with its interval as a
    whisker; one within the noise is drawn grey and labelled, not dropped."""
    from rlrun.tools import verdict

    wobble = [1.0, 1.02, 0.98, 1.01, 0.99, 1.0, 1.03, 0.97, 1.0, 1.01]
    names = ["head=dense", "head=tiled", "head=chunked"]
    data = [{"time/train_s": (list(range(10)), [t * w for w in wobble]), "loss": (list(range(10)), [0.1] * 10),
             "time/step_s": (list(range(10)), [t * w for w in wobble])} for t in (0.3, 0.15, 0.3)]
    params = [{"head.name": n.split("=")[1]} for n in names]
    answer = verdict.answer(names, data, params, {1: 0, 2: 0})
    fig = report.cost_figure(costs.costs(names, data, {1: 0, 2: 0}), answer)
    assert len(fig.axes) == 4 and fig.axes[0].get_title().startswith("The answer: the cost of old_logprobs")
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert texts[0].strip() == "baseline" and texts[1].strip().startswith("0.50x [")
    assert texts[2].strip().startswith("no difference\n(1.00x [")
    bars = fig.axes[0].patches
    assert bars[0].get_hatch() == "//" and [round(b.get_width(), 2) for b in bars[1:]] == [0.5, 1.0]
    assert len(fig.axes[0].collections) == 2  # a whisker on each compared option
    assert fig.axes[1].get_title().startswith("Context: the whole step")


def test_the_plan_figure_draws_the_measured_median_and_the_empty_phase_floor():
    on, off = history(job(first=30.0)), history(job())
    on["mem/onload_growth_mib"] = (np.arange(4), np.array([50.0] * 4))  # offload=on: its onload is not empty
    params = [{"offload.name": "on"}, {"offload.name": "off"}]
    floor = costs.empty_phase_floor(params, [on, off])
    assert floor == 0.004  # the largest growth of offload/onload in the offload=off job only
    p = costs.plan([on, off])
    assert p["measured"]["train"] == [(4.0, 34.0), (4.0, 4.0)] and p["predicted"]["train"] == [3.2, 3.2]
    fig = report.plan_figure(["on", "off"], [on, off], "cpu", floor)
    train_ax = fig.axes[p["phases"].index("train")]
    assert [round(b.get_width(), 6) for b in train_ax.patches] == [3.2, 3.2, 4.0, 4.0]  # predicted, then measured
    assert any(list(line.get_xdata()) == [floor, floor] for line in train_ax.get_lines())
    assert "empty phase" in fig.texts[0].get_text() and "34 →" in [t.get_text() for t in train_ax.texts]


def test_no_legend_covers_the_data():
    names = ["loss=dapo,head=dense", "loss=dapo,head=tiled"]
    data = [history(job()), history(job(train_s=0.01))]
    figs = {"throughput": report.throughput_figure(names, data),
            "plan": report.plan_figure(names, data, "cpu", 0.004),
            "equivalence": report.equivalence_figure([{"run": names[1], "baseline": names[0], "loss": 1e-9,
                                                       "reward_mean": 0.0}]),
            "pipeline": report.pipeline_figure(names, [history(job()), history(async_job())])}
    for name, fig in figs.items():
        fig.canvas.draw()
        for ax in fig.axes:
            if ax.get_legend() is not None:
                legend, data_area = ax.get_legend().get_window_extent(), ax.get_window_extent()
                assert legend.y0 >= data_area.y1 - 1 or not legend.overlaps(data_area), (name, ax.get_title())


def async_job(wait_s=0.01, busy_s=0.02, idle_s=0.005, steps=4):
    """A job with rollout.pipeline=async: no generate phase in its step; the trainer waits, the generator reports."""
    out = []
    for s, m in job(steps=steps):
        if "time/step_s" in m:
            m = {k: v for k, v in m.items() if k != "time/generate_s"}
            m.update({"time/wait_s": wait_s, "pipeline/gen_busy_s": busy_s, "pipeline/gen_idle_s": idle_s,
                      "staleness_mean": 1.0 if s else 0.0})
            m["time/step_s"] = sum(v for k, v in m.items() if k.startswith("time/") and k != "time/step_s")
        out.append((s, m))
    return out


def test_pipeline_numbers_are_steps_per_s_and_each_sides_time():
    sync, asyn = history(job()), history(async_job())
    assert costs.pipeline([sync, sync]) is None  # no async job: no pipeline figure
    p = costs.pipeline([sync, asyn])
    assert p["steps_per_s"] == pytest.approx([1 / costs.step_seconds(sync), 1 / costs.step_seconds(asyn)])
    assert p["trainer_wait_s"] == pytest.approx([0.0, 0.01])
    assert p["trainer_busy_s"][1] == pytest.approx(costs.step_seconds(asyn) - 0.01)  # working = step - waiting
    assert p["generator_busy_s"][1] == pytest.approx(0.02) and p["generator_idle_s"][1] == pytest.approx(0.005)
    assert np.isnan(p["generator_busy_s"][0])  # sync generates inside its step: no generator process
    assert p["staleness"][1] == pytest.approx(0.75)
    fig = report.pipeline_figure(["sync", "async"], [sync, asyn])
    assert [ax.get_title() for ax in fig.axes][0].startswith("Steps / s")
