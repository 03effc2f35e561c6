"""Figures that compare runs, drawn from MLflow alone.

    rlrun-report PARENT_RUN_ID                       # the jobs of a sweep
    rlrun-report --experiment rlrun --filter "params.\\`loss.name\\` = 'dapo'"   # any runs, by MLflow filter

Draws cost.png (per job: step time, peak growth and tokens/s, against its group's equivalence baseline),
memory.png (peak growth per phase; the absolute peak as context), memory_plan.png (predicted vs measured growth per
phase), throughput.png (tokens/s of the whole step, step time by phase, each phase's rate), curves.png (loss and
reward per step, one line per run), pipeline.png where a job ran rollout.pipeline=async (steps/s, the trainer's
and the generator's working and idle time per step) and, where runs differ only in efficiency axes, equivalence.png and
equivalence.txt (max difference of each curve from its group's baseline, tools/equivalence.py; a group with no
baseline is named there, with the job to add), and for a paired sweep (report.replay) paired.png (each job's
per-step difference from the recording job, the exact options' noise floor beside the others, tools/noise_floor.py).
Step time and tokens/s leave evaluation and checkpoints out: the numbers each job's console prints at its end
(tools/costs.py says how each number is taken).
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import sys
from typing import Literal

import numpy as np

from .. import nofollow, render
from ..errors import LinkError
from ..render import num
from ..tracking import log_figures, metric_key, open_client, spill
from . import costs, noise_floor
from . import equivalence as eq
from .charts import DPI, FONT, colors, figure, hbars, panel_height, wrap
from .cost_figures import (  # noqa: F401 (report.*)
    cost_figure,
    memory_figure,
    pipeline_figure,
    plan_figure,
    throughput_figure,
)

STYLES = ["-", "--", ":", "-."]


def child_runs(client, parent_run_id: str):
    parent = client.get_run(parent_run_id)
    runs = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent_run_id}'",
                              order_by=["attributes.start_time ASC"], max_results=5000)
    return parent, runs


def labels(runs) -> list[str]:
    """Run names (the overrides) without the overrides every run shares."""
    parts = [(r.data.tags.get("mlflow.runName") or r.info.run_id[:8]).split(",") for r in runs]
    common = set.intersection(*(set(p) for p in parts)) if len(parts) > 1 else set()
    return [",".join(x for x in p if x not in common) or ",".join(p) for p in parts]


def histories(client, run, keys):
    """{key: (steps, values)} for each of `keys` (the code's names) the run logged: under its MLflow name
    (`metric_key`), or under the key itself for runs logged before the names were namespaced."""
    out = {}
    for key in keys:
        hist: list = []
        for name in dict.fromkeys((metric_key(key), key)):  # one read when both names are the same (eval/*)
            hist = hist or client.get_metric_history(run.info.run_id, name)
        hist = sorted(hist, key=lambda m: m.step)
        if hist:
            out[key] = (np.array([m.step for m in hist]), np.array([m.value for m in hist]))
    return out


CURVES = (("loss", "loss"), ("reward_mean", "mean reward (GRPO)"), ("rewards/accuracy", "reward accuracy (DPO)"),
          ("rewards/margin", "reward margin (DPO)"), ("entropy", "token entropy (policy)"),
          ("eval/accuracy", "held-out accuracy"))



def collect(client, runs):
    return [histories(client, r, [k for k, _ in CURVES] + reward_curves(runs) + list(costs.KEYS) + ["grad_norm"])
            for r in runs]


def reward_curves(runs) -> list[str]:
    """Each named reward's held-out mean that any run logged (eval/rewards/NAME/mean): a task with several rewards
    (word_problems: the answer in \\boxed{} and in any form) shows each beside eval/accuracy."""
    return sorted({k for r in runs for k in r.data.metrics if k.startswith("eval/rewards/") and k.endswith("/mean")})


def curves_figure(names, data):
    """One panel per curve that any run logged (loss, GRPO reward, DPO accuracy and margin, token entropy,
    held-out accuracy, each named reward's held-out mean), one colour per run shared by all panels, and one legend
    for the figure listing every run."""
    named = sorted({k for h in data for k in h if k.startswith("eval/rewards/")})
    curves = [*CURVES, *((k, f"held-out reward {k.split('/')[2]!r}") for k in named)]
    present = [(k, label) for k, label in curves if any(k in h for h in data)] or [CURVES[0]]
    ncol = 1 if max((len(n) for n in names), default=0) > 45 else 2
    legend_h = 0.3 + 0.24 * -(-len(names) // ncol)
    fig, axes = figure([3.0] * len(present), extra=legend_h)
    from matplotlib.ticker import MaxNLocator

    palette = colors(len(names))
    handles: dict = {}
    for ax, (key, ylabel) in zip(axes, present):
        for i, h in enumerate(data):
            if key in h:  # line styles vary so that runs with identical curves stay visible on top of each other
                line, = ax.plot(*h[key], lw=1.5, alpha=0.85, ls=STYLES[i % len(STYLES)], color=palette[i],
                                marker="o" if len(h[key][0]) == 1 else None)
                handles.setdefault(i, line)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
        ax.set_xlabel("optimizer step", fontsize=FONT)
        ax.set_ylabel(ylabel, fontsize=FONT)
        ax.set_title(f"{ylabel} per step", fontsize=FONT + 1)
        ax.tick_params(labelsize=FONT - 1)
        ax.grid(alpha=0.3)
    order = sorted(handles)
    fig.tight_layout(rect=(0, legend_h / fig.get_figheight(), 1, 1))
    fig.legend([handles[i] for i in order], [names[i] for i in order], loc="lower center", ncol=ncol,
               fontsize=FONT - 1, frameon=False, bbox_to_anchor=(0.5, 0.0))
    return fig


def equivalence(runs, names, data, baseline: str | None = None):
    """Each run vs the baseline of its group (tools/equivalence.py): (rows, problems)."""
    return eq.rows([r.data.params for r in runs], names, data, baseline)


def equivalence_figure(rows):
    names = [f"{wrap(r['run'])}\nvs {wrap(r['baseline'])}" for r in rows]
    fig, (ax,) = figure([panel_height(names)])
    floor = 1e-12
    hbars(ax, names, {"loss": [max(r.get("loss", 0), floor) for r in rows],
                       "reward": [max(r.get("reward_mean", 0), floor) for r in rows]},
           f"max |difference| over steps (log scale; {floor:g} = identical)",
           "Curves vs each group's baseline (reference setting: dense / always / off)", log=True)
    fig.tight_layout()
    return fig


# The table: step time and tokens/s are the console's (no evaluation, no checkpoints); growth is the largest phase's
# peak growth (median step); peak is the absolute peak, context only (CPU: the process's RSS).
COLUMNS = ("run", "reward / acc", "step s (no eval)", "tokens/s (step)", "growth MiB", "peak MiB")
KEYS: dict[str, Literal["step_s", "tokens_per_s", "growth_mib", "peak_mib"]] = {  # column -> costs.Job key
    "step s (no eval)": "step_s", "tokens/s (step)": "tokens_per_s", "growth MiB": "growth_mib", "peak MiB": "peak_mib"}


def rows_of(names, data) -> list[dict]:
    """One row per run: the last value of its reward (GRPO) or accuracy (DPO) curve and its costs (tools/costs.py;
    floats, NaN where the run has none)."""
    out = []
    for name, h in zip(names, data):
        curve = next((k for k in ("reward_mean", "rewards/accuracy") if k in h), None)
        job = costs.job(h)
        out.append({"run": name, "reward / acc": float(h[curve][1][-1]) if curve else float("nan"),
                    **{c: job[k] for c, k in KEYS.items()}})
    return out


SPECS = {"reward / acc": ".3f", "step s (no eval)": ".4f", "tokens/s (step)": ".0f", "growth MiB": None,
         "peak MiB": ".0f"}  # None: render.short (1.23 MiB at tiny scale, 1234 MiB at large)


def _cells(names, data) -> list[list[str]]:
    return [[r["run"]] + [num(r[c], spec) if (spec := SPECS[c]) else render.short(r[c]) for c in COLUMNS[1:]]
            for r in rows_of(names, data)]


def table(names, data) -> str:
    """The comparison as aligned text: full run names, '–' where a run has no value."""
    return render.table(list(COLUMNS), _cells(names, data))


def markdown(names, data) -> str:
    """The comparison as a markdown table (the sweep parent's description)."""
    return render.markdown(list(COLUMNS), _cells(names, data))


@dataclasses.dataclass
class Gathered:
    """What a comparison of runs is drawn from, read from the store once: the figures and the sweep's description
    both use it (tools/verdict.answer: the one-line answer and a row per option)."""

    names: list[str]
    data: list[dict]
    params: list[dict]
    base_of: dict
    answer: tuple[str, dict]


def gather(client, runs, baseline: str | None = None) -> Gathered:
    from . import verdict

    names, data, params = labels(runs), collect(client, runs), [r.data.params for r in runs]
    base_of, _ = eq.baselines(params, names, baseline)
    return Gathered(names, data, params, base_of, verdict.answer(names, data, params, base_of))


def figures(client, runs, device="cpu", baseline: str | None = None, got: Gathered | None = None):
    """{filename: figure} comparing `runs`, plus the equivalence rows and problems (`baseline`: a run's name);
    `got`: what `gather` read, where the caller has it already."""
    got = got or gather(client, runs, baseline)
    names, data, params, base_of = got.names, got.data, got.params, got.base_of
    answer = got.answer if len(runs) > 1 else None
    figs = {"cost.png": cost_figure(costs.costs(names, data, base_of), answer),
            "memory.png": memory_figure(names, data, device), "throughput.png": throughput_figure(names, data),
            "curves.png": curves_figure(names, data)}
    plan = plan_figure(names, data, device, costs.empty_phase_floor(params, data))
    if plan is not None:
        figs["memory_plan.png"] = plan
    pipe = pipeline_figure(names, data)
    if pipe is not None:
        figs["pipeline.png"] = pipe
    print(table(names, data))
    rows, problems = equivalence(runs, names, data, baseline)
    if rows:
        figs["equivalence.png"] = equivalence_figure(rows)
    paired = noise_floor.figure_of(names, data, params)  # a paired sweep: each option against the exact floor
    if paired is not None:
        figs["paired.png"] = paired
    return figs, (rows, problems)


def write(figs, equivalence_result, out_dir):
    """The figures as PNGs and, where any group could be checked or should have been, equivalence.txt."""
    os.makedirs(out_dir, exist_ok=True)
    for name, fig in figs.items():  # each file replaced by a rename, never written through a link (nofollow)
        buf = io.BytesIO()
        fig.savefig(buf, dpi=DPI, format="png")
        nofollow.write_replacing(os.path.join(out_dir, name), buf.getvalue())
    rows, problems = equivalence_result
    if rows or problems:
        text = eq.text(rows, problems, num)
        nofollow.write_replacing(os.path.join(out_dir, "equivalence.txt"), (text + "\n").encode())
        print(text)


class ReportError(Exception):
    """What to compare cannot be found: one line for the user, exit 2."""


def find_runs(client, a) -> list:
    """The runs that `a` names: a sweep's children, or an experiment's runs matching the filter."""
    from mlflow.exceptions import MlflowException

    try:
        if a.parent_run_id:
            _, runs = child_runs(client, a.parent_run_id)
        else:
            exp = client.get_experiment_by_name(a.experiment)
            if exp is None:
                raise ReportError(f"no experiment {a.experiment!r} in {a.uri}")
            runs = client.search_runs([exp.experiment_id], a.filter, order_by=["attributes.start_time ASC"],
                                      max_results=5000)
            runs = [r for r in runs if r.data.tags.get("rlrun.kind") != "sweep"]
    except MlflowException as e:
        if a.parent_run_id and e.error_code == "RESOURCE_DOES_NOT_EXIST":
            raise ReportError(f"no run {a.parent_run_id!r} in {a.uri}") from e
        raise ReportError(f"{a.uri}: {e.message.splitlines()[0][:300]}") from e
    if not runs and a.parent_run_id:
        raise ReportError(f"run {a.parent_run_id!r} has no child runs: give a sweep's parent run id "
                          "(the run tagged rlrun.kind=sweep) or --experiment NAME")
    if not runs:
        which = f"matched the filter {a.filter!r}" if a.filter else "exist"
        raise ReportError(f"no runs of experiment {a.experiment!r} {which}")
    return runs


def open_store(uri: str):
    """A client for `uri`; a sqlite file that does not exist is an error here (reading it would create it)."""
    if uri.startswith("sqlite:///") and not os.path.exists(uri[len("sqlite:///") :]):
        raise ReportError(f"no MLflow database at {uri[len('sqlite:///'):]!r} (--uri {uri}); run from the folder "
                          "that holds mlflow.db or pass --uri")
    return open_client(uri)


def sync(path: str) -> int:
    """`rlrun-report --sync FILE`: send a run's kept records to the store the run was logged to; exit code."""
    if not os.path.exists(path):
        print(f"rlrun-report --sync: {path} does not exist (nothing kept, or already sent).")
        return 2
    try:
        with open(path) as f:
            uri = json.loads(f.readline())["uri"]
    except (ValueError, KeyError, TypeError):
        print(f"rlrun-report --sync: {path} is not a file rlrun kept for a tracking store (mlflow_spill.jsonl).")
        return 2
    rejected = path.replace(".jsonl", "") + ".rejected.jsonl"
    before = spill.count(rejected)
    sent, left = spill.replay(open_client(uri), path)
    lost = spill.count(rejected) - before
    if left:
        print(f"sent {sent} records to {uri}; {left} left in {path}: the store is unreachable or refused one "
              "(try again when it is back).")
        return 1
    if lost:  # said above, one line each (what was lost); the records are kept, not retried
        print(f"sent {sent - lost} records to {uri}; {lost} could not be (set aside in {rejected}, see above); "
              f"{path} removed.")
        return 1
    print(f"sent {sent} records to {uri}; {path} removed.")
    return 0


def main(argv=None):
    from ..tracking import secrets

    secrets.guard_output()  # a --uri with a password prints scrubbed (tracking/secrets.py)
    p = argparse.ArgumentParser(prog="rlrun-report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("parent_run_id", nargs="?", help="a sweep's parent run: compare its child runs")
    p.add_argument("--experiment", help="compare runs of this experiment (with --filter)")
    p.add_argument("--filter", default="", help="MLflow search filter, e.g. \"params.`loss.name` = 'dapo'\"")
    p.add_argument("--uri", default="sqlite:///mlflow.db", help="tracking URI (default: %(default)s)")
    p.add_argument("--out", help="folder for the PNGs (default: report-<id or experiment>)")
    p.add_argument("--log", action="store_true", help="also log the figures on the parent run")
    p.add_argument("--baseline", metavar="NAME", help="the run the others are compared with (default: in each "
                                                      "group, the run with dense/always/off/padded/keep)")
    p.add_argument("--sync", metavar="FILE", help="send what a run kept while its tracking store was unreachable "
                                                  "(the mlflow_spill.jsonl in its output folder) to that store")
    a = p.parse_args(argv)
    if a.sync:
        sys.exit(sync(a.sync))
    if not a.parent_run_id and not a.experiment:
        p.error("give a PARENT_RUN_ID or --experiment NAME")
    try:
        client = open_store(a.uri)
        runs = find_runs(client, a)
    except ReportError as e:
        print(f"rlrun-report: {e}", file=sys.stderr)
        sys.exit(2)
    figs, result = figures(client, runs, runs[0].data.tags.get("rlrun.device", "cpu"), a.baseline)
    out = a.out or f"report-{a.parent_run_id or a.experiment}"
    try:
        write(figs, result, out)
    except LinkError as e:
        print(f"rlrun-report: {e}", file=sys.stderr)
        sys.exit(2)
    if a.log and a.parent_run_id:
        log_figures(client, a.parent_run_id, figs)
    render.close(figs)
    print(f"{len(runs)} runs -> {', '.join(os.path.join(out, n) for n in figs)}")


if __name__ == "__main__":
    main()
