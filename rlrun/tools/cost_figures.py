"""The report's cost figures: memory.png, memory_plan.png, throughput.png and cost.png, drawn from the numbers of
tools/costs.py (what each figure shows is decided there and tested there; here it is only drawn)."""

from __future__ import annotations

import math
import textwrap

import numpy as np

from ..render import num, short
from . import costs
from .charts import DPI, FONT, WIDTH, figure, hbars, heatmap, job_bars, legend_above, panel_height, wrap


def _mib(v: float) -> str:
    return num(v, ".0f" if abs(v) >= 10 else ".2g")


def _note(lines: list[str]) -> tuple[str, float]:
    """(text, inches): a few sentences for under the panels, wrapped to the figure's width, and their height."""
    text = "\n".join(textwrap.fill(line, 100) for line in lines)
    return text, 0.2 + 0.19 * (text.count("\n") + 1)


def _put_note(fig, text: str, height: float) -> None:
    fig.tight_layout(rect=(0, height / fig.get_figheight(), 1, 1))
    fig.text(0.01, 0.01, text, fontsize=FONT - 1, va="bottom", ha="left", color="dimgray")


def memory_figure(names, data, device):
    """Peak growth per phase (the median step) as the measure, one row per job; beside each row, faint, the
    absolute peak as context only. The colours span the phases of a step (evaluation may saturate them)."""
    from ..render import pyplot

    m = costs.memory(data)
    med = [[g[0] for g in row] for row in m["growth"]]
    in_step = [v for row in med for p, v in zip(m["phases"], row) if p in costs.STEP_PHASES and math.isfinite(v)]
    what = "CUDA's peak allocated" if device == "cuda" else "the process's RSS: libraries and earlier jobs in it"
    note, extra = _note([f"Median step: the first steps of a sweep's first job carry the libraries' first-call "
                         f"buffers (memory_plan.png marks the largest step). Grey: the absolute peak, {what}; it "
                         "ranks jobs by the order they ran in, not by what they cost."])
    fig = pyplot().figure(figsize=(WIDTH, panel_height(names) + extra), dpi=DPI)
    grid = fig.add_gridspec(1, 3, width_ratios=[max(len(m["phases"]), 1), 1.6, 0.12])
    ax = fig.add_subplot(grid[0])
    side = fig.add_subplot(grid[1], sharey=ax)
    heatmap(fig, ax, names, m["phases"], med, "growth MiB", "Peak growth per phase, MiB (median step)",
            texts=[["<0.01" if 0 < v < 0.01 else _mib(v) for v in row] for row in med], cax=fig.add_subplot(grid[2]),
            vmax=max(in_step, default=None))
    side.barh(np.arange(len(names)), np.nan_to_num(np.array(m["peak"], dtype=float)), 0.6, color="gray", alpha=0.35)
    for i, v in enumerate(m["peak"]):
        side.text(0, i, f" {_mib(v)}", va="center", ha="left", fontsize=FONT - 1, color="dimgray")
    side.set_xlabel("context: absolute\npeak, MiB", fontsize=FONT - 1, color="dimgray")
    side.tick_params(labelleft=False, labelsize=FONT - 1, colors="dimgray")
    _put_note(fig, note, extra)
    return fig


def plan_figure(names, data, device="cpu", floor=None):
    """Predicted (the memory plan, logged at the start) vs measured peak growth, one panel per phase: measured is
    the median step, the largest step a mark; `floor` (costs.empty_phase_floor) a dotted line."""
    p = costs.plan(data)
    if not p["phases"]:
        return None
    note = ["Measured: the median step. |: the largest step (the first steps of a sweep's first job carry the "
            "libraries' first-call buffers)."]
    if floor is not None:
        note.append(f"Dotted: the growth of an empty phase (offload/onload with offload=off), {_mib(floor)} MiB: "
                    "what the meter reads for nothing.")
    if device != "cuda":
        note.append("CPU: measured is RSS. Tensors under 1 MiB come from malloc's heap, whose slack RSS counts and "
                    "the plan (tensor bytes) does not: a small run, made of such tensors, reads above its plan.")
    text, extra = _note(note)
    ran = {ph: [i for i, m in enumerate(p["measured"][ph]) if math.isfinite(m[0])] for ph in p["phases"]}
    fig, axes = figure([panel_height([names[i] for i in ran[ph]]) for ph in p["phases"]], extra=extra)
    for ax, phase in zip(axes, p["phases"]):  # the jobs that ran the phase (a skipped logprob pass has no row)
        jobs = ran[phase]
        predicted = [p["predicted"][phase][i] for i in jobs]
        measured = [p["measured"][phase][i] for i in jobs]
        hbars(ax, [names[i] for i in jobs], {"plan": predicted, "measured": [m[0] for m in measured]}, "MiB",
              f"{phase}: predicted vs measured peak growth, MiB", legend=False)
        _largest(ax, [m[1] for m in measured], np.arange(len(jobs)) + 0.2,
                 [*predicted, *(m[0] for m in measured), floor or 0.0])
        if floor is not None:
            ax.axvline(floor, ls=":", color="dimgray", lw=1.5, label="empty phase")
        legend_above(ax)
    _put_note(fig, text, extra)
    return fig


def _largest(ax, largest, y, shown) -> None:
    """The largest steps as marks; one far beyond the bars (a first step's one-time buffers) as an arrow at the
    right edge with its value, so that it does not squeeze the bars into a corner."""
    right = 1.35 * max([v for v in shown if math.isfinite(v)], default=1.0) or 1.0
    inside = [(v, t) for v, t in zip(largest, y) if math.isfinite(v) and v <= right * 1.6]
    beyond = [(v, t) for v, t in zip(largest, y) if math.isfinite(v) and v > right * 1.6]
    ax.plot([v for v, _ in inside], [t for _, t in inside], "|", color="black", markersize=14, mew=2,
            label="largest step")
    edge = max([v for v, _ in inside] + [right]) * 1.15
    for v, t in beyond:
        ax.annotate(f"{_mib(v)} →", (edge, t), ha="right", va="center", fontsize=FONT - 1)
    ax.set_xlim(0, edge)


def throughput_figure(names, data):
    """Tokens/s of the whole step and the step time split by phase (evaluation and checkpoints excluded: the
    console's numbers), then each phase's own rate as context."""
    t = costs.throughput(data)
    fig, axes = figure([panel_height(names)] * 3)
    job_bars(axes[0], names, t["tokens_per_s"], "trained tokens / s of step time",
             "Tokens / s, whole step (trained tokens / step time)", [num(v, ".0f") for v in t["tokens_per_s"]])
    hbars(axes[1], names, t["phases"], "seconds per step (mean)",
          "Step time by phase, s (evaluation and checkpoints excluded)", stacked=True)
    top = max([v for v in t["step_s"] if math.isfinite(v)], default=0.0)
    axes[1].set_xlim(0, max(top, 1e-12) * 1.25)
    for i, v in enumerate(t["step_s"]):
        axes[1].text(v if math.isfinite(v) else 0, i, f"  {num(v, '.3g')} s", va="center", fontsize=FONT - 1)
    hbars(axes[2], names, {"generate phase": t["generated"], "train phase": t["trained"]}, "tokens / s (mean)",
          "Context: each phase's own rate (tokens / its time)")
    fig.tight_layout()
    return fig


def _cost_text(v: float, ratio: float, baseline: bool, spec: str | None, unit: str) -> str:
    text = f"{num(v, spec) if spec else short(v)}{unit}"
    if baseline:
        return text
    return text + (f"  {ratio:.2f}× baseline" if math.isfinite(ratio) else "")


def answer_panel(ax, answer) -> None:
    """The sweep's answer (tools/verdict.answer): each option's cost on the phases the options change against its
    baseline's, with its interval (the quartiles' ratio) as a whisker: green cheaper, red dearer, grey "no difference
    measured" (its interval holds 1), drawn and labelled; too few timed steps: no bar, said."""
    from .verdict import cost_text

    line, rows = answer
    opts = list(rows)
    y = np.arange(len(opts))
    for i, o in enumerate(opts):
        r = rows[o]
        if r.get("is_baseline"):
            ax.barh(i, 1.0, 0.6, color="white", edgecolor="black", hatch="//")
            ax.text(1.0, i, "  baseline", va="center", fontsize=FONT - 1)
        elif "baseline" in r and not r.get("few") and math.isfinite(r["ratio"]):
            color = {-1: "tab:green", 1: "tab:red", 0: "lightgray"}[r["differs"]]
            ax.barh(i, r["ratio"], 0.6, color=color, edgecolor="dimgray")
            ax.errorbar(r["ratio"], i, xerr=[[r["ratio"] - r["ratio_low"]], [r["ratio_high"] - r["ratio"]]],
                        fmt="none", ecolor="black", capsize=4)
            said = cost_text(r, interval=True) if r["differs"] else \
                f"no difference\n({r['ratio']:.2f}x [{r['ratio_low']:.2f}, {r['ratio_high']:.2f}])"
            ax.text(r["ratio_high"], i, f"  {said}", va="center", fontsize=FONT - 1)
        else:
            ax.text(0.02, i, cost_text(r) if "baseline" in r else r["same_text"], va="center", fontsize=FONT - 1)
    ax.axvline(1.0, color="black", lw=1)
    ax.set_yticks(y, [wrap(o) for o in opts], fontsize=FONT - 1)
    ax.invert_yaxis()
    highs = [r.get("ratio_high", 1.0) for r in rows.values() if math.isfinite(r.get("ratio_high", 1.0))]
    ax.set_xlim(0, max(highs + [1.0]) * 2.4)
    phases = line.split(" against ")[0].removeprefix("Cost of ") if line.startswith("Cost of ") else "the step"
    ax.set_xlabel("× the baseline's cost (median; whisker: the interval)", fontsize=FONT - 1)
    ax.set_title(f"The answer: the cost of {textwrap.shorten(phases, 50)}\n(lower is cheaper; grey: no difference "
                 "measured)", fontsize=FONT + 1)


def cost_figure(rows: list[dict], answer=None):
    """Per job: the sweep's answer (the cost of the changed phases, with its interval: `answer_panel`) where one is
    given; then step time, peak growth and tokens/s, each against its group's baseline (hatched), as context (the
    whole step: in a paired sweep only the recording job generates)."""
    names = [r["run"] for r in rows]
    marked = [i for i, r in enumerate(rows) if r["is_baseline"]]
    shown = answer is not None and any("baseline" in r for r in answer[1].values())
    fig, every = figure([panel_height(list(answer[1]) if shown else names)] * shown + [panel_height(names)] * 3)
    if shown:
        answer_panel(every[0], answer)
    axes = every[1:] if shown else every
    panels = (("step_s", ".3g", " s", "seconds per step (mean, as the job's console; no evaluation)",
               "Context: the whole step as timed, load included"),
              ("growth_mib", None, " MiB", "MiB, a step's largest phase (median step)",
               "Peak growth: lower is cheaper"),
              ("tokens_per_s", ".0f", "", "trained tokens / s of step time", "Tokens / s: higher is faster"))
    for ax, (key, spec, unit, xlabel, title) in zip(axes, panels):
        job_bars(ax, names, [r[key] for r in rows], xlabel, title,
                 [_cost_text(r[key], r[f"{key}_ratio"], r["is_baseline"], spec, unit) for r in rows], marked)
    if not marked:
        axes[0].set_title(axes[0].get_title() + "\n(no baseline among these jobs)", fontsize=FONT + 1)
    # the median step: a mean far above it is one slow step (the first job's first step carries the warm-up)
    axes[0].plot([r["median_step_s"] for r in rows], np.arange(len(rows)), "|", color="black", markersize=14, mew=2,
                 label="median step")
    legend_above(axes[0])
    fig.tight_layout()
    return fig


def pipeline_figure(names, data):
    """rollout.pipeline: steps/s per job, then where each side's time goes per step: the trainer working and
    waiting for rollouts, the generator generating and idle (async jobs). None without an async job."""
    p = costs.pipeline(data)
    if p is None:
        return None
    fig, axes = figure([panel_height(names)] * 3)
    job_bars(axes[0], names, p["steps_per_s"], "optimizer steps / s (no evaluation)", "Steps / s: higher is faster",
             [num(v, ".3g") for v in p["steps_per_s"]])
    hbars(axes[1], names, {"working": p["trainer_busy_s"], "waiting for a rollout": p["trainer_wait_s"]},
          "seconds per step (mean)", "Trainer: working vs waiting for the generator", stacked=True, legend=False)
    legend_above(axes[1])
    hbars(axes[2], names, {"generating": p["generator_busy_s"], "idle (waiting for weights or a request)":
                           p["generator_idle_s"]}, "seconds per step (mean)",
          "Generator process (async jobs; sync generates inside its step)", stacked=True, legend=False)
    legend_above(axes[2], ncol=2)
    for i, (s, stale) in enumerate(zip(p["trainer_busy_s"], p["staleness"])):
        if math.isfinite(stale):
            axes[1].text(s + p["trainer_wait_s"][i], i, f"  staleness {stale:.2g}", va="center", fontsize=FONT - 1)
    fig.tight_layout()
    return fig
