"""A sweep's answer in words, that a busy machine cannot turn around: what the options cost where they act, with
the noise of the measurement, and whether they train the same.

- **Cost from the phases an option changes.** Each option says which phases of a step it changes (`phases` on its
  object: rlrun/axes.py). A job is timed on the phases its sweep's varying axes change (a head or a batching
  layout: the logprob passes and train; a logprob policy: the passes; offload: its phases and the passes between;
  activations: train; precision: every pass; the pipeline: the whole step), not on the whole step, most of which
  (generation) such an option does not touch, so that load on the machine does not decide the ranking. The whole
  step is shown beside it, labelled.
- **Noise.** Each job's per-step times, after its first `WARMUP` steps, give a median and a spread (the
  interquartile range). Two jobs differ only where their ranges do not overlap; otherwise the answer is "no
  difference measured", never a ranking. With repeats (`report.repeats=N`: every job N times, interleaved), an
  option's cost is the median of its repeats' medians and its spread their range, so load that came and went
  between repeats counts too.
- **Same result.** An option's exactness (rlrun/axes.py: EXACTNESS) sets what its equivalence with the baseline
  must show: an exact option (bitwise, fp_tolerance) the baseline's loss to `FP_TOL` (relative) over the steps
  before the runs part (the first step whose rewards differ: a sampled token flipped by rounding, after which the
  runs draw other samples and only their learning can be compared); an approximate option or another objective is
  shown, not judged.

Pure functions of run parameters (MLflow's flattened params) and metric histories ({key: (steps, values)}); the
options' facts come from the registry.
"""

from __future__ import annotations

import statistics

from .. import registry
from ..meters import time_key
from . import equivalence as eq

WARMUP = 2  # first steps left out of the timings: the process's and the job's warm-up
FP_TOL = 1e-4  # relative to the baseline's largest |loss|: an exact option's loss before the runs part
PARAM = {g: "train.precision" if g == "precision" else "rollout.pipeline" if g == "pipeline" else f"{g}.name"
         for g in registry.AXES}
EXACT = ("baseline", "bitwise", "fp_tolerance")
REPEAT = "report.repeat="  # a repeated job's name part (report.repeats; sweep.expand_repeats)


def options(params: dict[str, str]) -> dict[str, str]:
    """{axis group: its option} of one run."""
    return {g: params[k] for g, k in PARAM.items() if k in params}


def varying(all_params: list[dict[str, str]]) -> list[str]:
    """The axes whose option differs between the runs."""
    return [g for g in registry.AXES if len({options(p).get(g) for p in all_params}) > 1]


def fact(group: str, name: str, what: str):
    obj = registry.get(group, name)
    return getattr(obj, what, None) or getattr(obj, what.upper())


def changed_phases(groups: list[str], all_params: list[dict[str, str]]) -> tuple[str, ...]:
    """The phases any option of the varying axes changes ("step": the whole step)."""
    names = {(g, options(p)[g]) for p in all_params for g in groups if g in options(p)}
    return tuple(dict.fromkeys(ph for g, n in sorted(names) for ph in fact(g, n, "phases")))


def series(h: dict, phases: tuple[str, ...]) -> list[float]:
    """Per step from WARMUP on: the seconds of `phases` (the whole step's where "step" is one of them, or where the
    run logged none of them)."""
    keys = [k for k in ([] if "step" in phases else [time_key(p) for p in phases]) if k in h] or ["time/step_s"]
    by_key = {k: dict(zip(*h[k])) for k in keys if k in h}
    steps = sorted({s for v in by_key.values() for s in v})
    return [sum(v.get(s, 0.0) for v in by_key.values()) for s in steps if s >= WARMUP]


def spread(values: list[float]) -> tuple[float, float, float]:
    """(median, lower quartile, upper quartile); NaN for no values."""
    if not values:
        return (float("nan"),) * 3
    if len(values) < 4:
        return statistics.median(values), min(values), max(values)
    q = statistics.quantiles(values, n=4)
    return statistics.median(values), q[0], q[2]


def differ(a: tuple[float, float, float], b: tuple[float, float, float]) -> int:
    """-1 where `a` is faster than `b` beyond both their spreads, 1 where slower, 0: no difference measured."""
    if a[2] < b[1]:
        return -1
    if a[1] > b[2]:
        return 1
    return 0


def parted_at(h: dict, base: dict) -> int | None:
    """The first step at which the run's reward differs from its baseline's (their samples part), None if never."""
    key = next((k for k in ("reward_mean", "rewards/accuracy") if k in h and k in base), None)
    if key is None:
        return None
    got, want = dict(zip(*h[key])), dict(zip(*base[key]))
    return next((s for s in sorted(want) if s in got and got[s] != want[s]), None)


def same_result(h: dict, base: dict, exactness: str, paired: bool = False) -> tuple[bool | None, str]:
    """(pass / fail / None: not judged, in words) of a run against its baseline under its options' exactness.
    `paired`: both trained on one record's rollouts (a paired sweep), so sampling cannot part them."""
    if exactness not in EXACT:
        return None, f"{exactness}: compared by what it learns, not judged"
    if "loss" not in h or "loss" not in base:
        return None, "no loss curve to compare"
    stop = parted_at(h, base)
    got, want = dict(zip(*h["loss"])), dict(zip(*base["loss"]))
    steps = [s for s in sorted(want) if s in got and (stop is None or s < stop)]
    if not steps:
        return None, "the runs part at their first step: compare what they learn"
    scale = max(abs(want[s]) for s in steps) or 1.0
    worst = max(abs(got[s] - want[s]) for s in steps) / scale
    window = (f"the {len(steps)} steps before sampling parts" if stop is not None else
              f"all {len(steps)} steps, on the same recorded rollouts" if paired else f"all {len(steps)} steps")
    return worst <= FP_TOL, f"loss off by {worst:.1e} of its scale at most, over {window} (tolerance {FP_TOL:.0e})"


def exactness_of(params: dict[str, str], base: dict[str, str]) -> str:
    """The loosest exactness of the options in which a run differs from its baseline."""
    order = ["baseline", "bitwise", "fp_tolerance", "approximate", "objective"]
    found = [fact(g, n, "exactness") for g, n in options(params).items() if options(base).get(g) != n]
    return max(found, key=order.index, default="baseline")


def option_of(name: str) -> str:
    """A run's name without its repeat (report.repeats: `head=tiled,report.repeat=1` -> `head=tiled`)."""
    return ",".join(p for p in name.split(",") if not p.startswith(REPEAT)) or name


def pooled(values: list[list[float]]) -> tuple[float, float, float]:
    """One option's cost over its runs: a single run's per-step spread; over repeats, the median of the repeats'
    medians and their range (load that came and went between repeats is in it, not only within one)."""
    if len(values) == 1:
        return spread(values[0])
    medians = [statistics.median(v) for v in values if v]
    return (statistics.median(medians), min(medians), max(medians)) if medians else (float("nan"),) * 3


def answer(names: list[str], data: list[dict], all_params: list[dict[str, str]], base_of: dict[int, int]):
    """(the sweep's answer in one line, {option: {phase cost, spread, whole step, verdict, repeats}}); the repeats
    of one option (report.repeats) are pooled under its name without `report.repeat=K`."""
    groups = varying(all_params)
    phases = changed_phases(groups, all_params)
    if any(eq.record_of(p) for p in all_params):  # a replaying run generates nothing: time the phases all ran
        phases = tuple(p for p in phases if p != "generate")
    opts = list(dict.fromkeys(option_of(n) for n in names))
    members = {o: [i for i, n in enumerate(names) if option_of(n) == o] for o in opts}
    cost = {o: pooled([series(data[i], phases) for i in members[o]]) for o in opts}
    whole = {o: pooled([series(data[i], ("step",)) for i in members[o]]) for o in opts}
    rows = {o: {"phase_s": cost[o][0], "phase_low": cost[o][1], "phase_high": cost[o][2], "step_s": whole[o][0],
                "same": None, "same_text": "the baseline", "repeats": len(members[o])} for o in opts}
    base_opt = {}
    for i, b in base_of.items():  # each option judged once, on its first repeat against its baseline's
        o, ob = opts.index(option_of(names[i])), opts.index(option_of(names[b]))
        if o == ob or o in base_opt:
            continue
        base_opt[o] = ob
        paired = eq.record_of(all_params[i]) is not None and eq.record_of(all_params[i]) == eq.record_of(all_params[b])
        ok, text = same_result(data[i], data[b], exactness_of(all_params[i], all_params[b]), paired)
        mine, theirs = cost[opts[o]], cost[opts[ob]]
        rows[opts[o]].update(same=ok, same_text=text, baseline=opts[ob], differs=differ(mine, theirs),
                             ratio=mine[0] / theirs[0] if theirs[0] else float("nan"))
        rows[opts[ob]]["is_baseline"] = True
    for row in rows.values():
        if "baseline" not in row and not row.get("is_baseline"):
            row["same_text"] = "no baseline in the sweep"
    return headline(opts, groups, phases, cost, base_opt, rows), rows


def cost_x(row: dict) -> float | None:
    """A row's cost against its baseline: its ratio, or None where no difference was measured (within both
    spreads), which is never a ranking."""
    return None if row["differs"] == 0 else row["ratio"]


def cost_text(row: dict) -> str:
    c = cost_x(row)
    return "no difference measured" if c is None else f"{c:.2f}x"


def brief(row: dict) -> str:
    """One job's answer in a few words, for a narrow column of MLflow's runs table: whether it trains the same as
    its baseline, then its cost on the changed phases against the baseline's (answer's row of its option)."""
    if "baseline" not in row:
        return "baseline" if row.get("is_baseline") else row["same_text"]
    same = {True: "same", False: "DIFFERENT", None: "not judged"}[row["same"]]
    return f"{same} · {cost_text(row)} vs {row['baseline']}"


def metrics(row: dict) -> dict[str, float]:
    """One job's answer as numbers, for the bars of MLflow's chart view (tracking/ui.py): answer/phase_s, its median
    seconds per step on the changed phases; answer/cost_x, that against its baseline's, only where the difference is
    beyond both spreads: a job within the noise has no bar, never a ranking; answer/same, 1 where it trains the same
    as its baseline, 0 where not, absent where not judged (the baseline: 1 and 1). 4 significant digits."""
    out = {}
    if row["phase_s"] == row["phase_s"]:
        out["answer/phase_s"] = row["phase_s"]
    if row.get("is_baseline"):
        out["answer/cost_x"] = out["answer/same"] = 1.0
    elif "baseline" in row and (c := cost_x(row)) is not None and c == c:
        out["answer/cost_x"] = c
    if row.get("same") is not None:
        out["answer/same"] = float(row["same"])
    return {k: float(f"{v:.4g}") for k, v in out.items()}


def label_of(phases: tuple[str, ...]) -> str:
    return "the whole step" if "step" in phases or not phases else " + ".join(phases)


def headline(names, groups, phases, cost, base_of, rows) -> str:
    """One sentence: each run's cost on the changed phases against its baseline's (or 'no difference measured'),
    and whether the exact ones train the same; without a baseline, the fastest run where it is beyond the others'
    spread."""
    label = label_of(phases)
    if not base_of:
        timed = sorted((n for n in names if cost[n][0] == cost[n][0]), key=lambda n: cost[n][0])
        if len(timed) < 2:
            return f"Cost of {label}: one timed run."
        if all(differ(cost[timed[0]], cost[n]) < 0 for n in timed[1:]):
            return f"Fastest on {label}: {timed[0]}, beyond every other run's spread."
        return f"Cost of {label}: no difference measured between the fastest runs ({timed[0]}, {timed[1]})."
    parts = []
    for i in sorted(base_of):  # answer() put each one's difference from its baseline in its row
        row = rows[names[i]]
        parts.append(f"{names[i]}: {cost_text(row)}")
    judged = [rows[names[i]]["same"] for i in base_of if rows[names[i]]["same"] is not None]
    same = ("yes" if all(judged) else "NO") if judged else "not judged (approximate options)"
    base = names[next(iter(base_of.values()))]
    return f"Cost of {label} against {base} ({', '.join(groups)}): {'; '.join(parts)}. Same result: {same}."
