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

from .. import axes, registry
from ..meters import time_key
from . import equivalence as eq

WARMUP = 2  # first steps left out of the timings: the process's and the job's warm-up
FP_TOL = 1e-4  # relative to the baseline's largest |loss|: an exact option's loss before the runs part
PARAM = {g: registry.key_of(g) for g in registry.AXES}  # each axis's MLflow param
EXACT = ("baseline", *axes.SAME)
REPEAT = "report.repeat="  # a repeated job's name part (report.repeats; sweep.expand_repeats)
MIN_TIMED = 5  # timed steps an option needs (after WARMUP, over its repeats) before its cost is compared at all
PACE_SLACK = 1.5  # a step is timed where generation ran within this of its full pace (idle: ~80% of steps are)
REF_KEY = "throughput/gen_tokens_per_s"  # the reference pace: generation, where the options leave it unchanged


def options(params: dict[str, str]) -> dict[str, str]:
    """{axis group: its option} of one run."""
    return {g: params[k] for g, k in PARAM.items() if k in params}


def varying(all_params: list[dict[str, str]]) -> list[str]:
    """The axes whose option differs between the runs that have the axis's key: a run without it (a paired sweep's
    replaying job, rollout=replay, has no rollout.decode or rollout.speculate) varies nothing (its heading named
    "(head, decode)" where only the head was swept)."""
    return [g for g in registry.AXES if len({options(p).get(g) for p in all_params} - {None}) > 1]


def fact(group: str, name: str, what: str):
    obj = registry.get(group, name)
    return getattr(obj, what, None) or getattr(obj, what.upper())


def changed_phases(groups: list[str], all_params: list[dict[str, str]]) -> tuple[str, ...]:
    """The phases any option of the varying axes changes ("step": the whole step)."""
    names = {(g, options(p)[g]) for p in all_params for g in groups if g in options(p)}
    return tuple(dict.fromkeys(ph for g, n in sorted(names) for ph in fact(g, n, "phases")))


def timed(h: dict, phases: tuple[str, ...]) -> dict[int, float]:
    """{step: the seconds of `phases`} from WARMUP on (the whole step's where "step" is one of them, or where the
    run logged none of them)."""
    keys = [k for k in ([] if "step" in phases else [time_key(p) for p in phases]) if k in h] or ["time/step_s"]
    by_key = {k: dict(zip(*h[k])) for k in keys if k in h}
    steps = sorted({s for v in by_key.values() for s in v})
    return {s: sum(v.get(s, 0.0) for v in by_key.values()) for s in steps if s >= WARMUP}


def series(h: dict, phases: tuple[str, ...]) -> list[float]:
    """Per step from WARMUP on: the seconds of `phases` (timed's values, in step order)."""
    return list(timed(h, phases).values())


def per_token(h: dict) -> dict[int, float]:
    """{step: seconds per generated token} from WARMUP on: the generation phase's own pace, the reference for the
    machine's speed where the swept options do not change generation (the same work per token in every job)."""
    return {int(s): 1.0 / v for s, v in zip(*h.get(REF_KEY, ((), ()))) if s >= WARMUP and v > 0}


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


def full_pace(paces: list[dict[int, float]]) -> float:
    """The machine's full pace over a sweep: the 10th percentile of every timed step's seconds per generated token
    (the fastest steps, less the odd outlier)."""
    every = sorted(v for p in paces for v in p.values())
    return every[len(every) // 10]


def at_full_pace(data: list[dict], phases: tuple[str, ...], members: dict[str, list[int]]):
    """(each job's timed steps, those kept, {option: its cost's spread}, whether a pace was found): `answer`'s
    timing, on the steps at the machine's full pace where generation gives the pace."""
    steps = [timed(h, phases) for h in data]
    paces = [{} if "generate" in phases or "step" in phases else per_token(h) for h in data]
    has_pace = all(p and set(s) <= set(p) for s, p in zip(steps, paces))
    if not has_pace:
        return steps, steps, {o: pooled([list(steps[i].values()) for i in m]) for o, m in members.items()}, False
    limit = PACE_SLACK * full_pace(paces)
    kept = [{s: v for s, v in st.items() if paces[i][s] <= limit} for i, st in enumerate(steps)]
    return steps, kept, {o: spread([v for i in m for v in kept[i].values()]) for o, m in members.items()}, True


def answer(names: list[str], data: list[dict], all_params: list[dict[str, str]], base_of: dict[int, int]):
    """(the sweep's answer in one line, {option: {phase cost, spread, whole step, verdict, repeats}}); the repeats
    of one option (report.repeats) are pooled under its name without `report.repeat=K`.

    Load: where the options leave generation unchanged, its seconds per generated token at each step are the
    machine's pace then. Only the steps at the machine's full pace are timed (within PACE_SLACK of `full_pace`):
    a step slowed by other work, or by the process's first job, is left out, in whichever job it fell, and the
    answer says how many. Load does not slow a step's phases alike (measured: 2 busy loops on 2 cores slowed
    generation of the tiny model up to 13x, its train pass less), so scaling a slowed step back would rank the job
    that ran loaded; leaving it out compares like with like. An option with fewer than MIN_TIMED such steps (over
    its repeats) gets no ratio. Without a pace (the options change generation; a paired sweep's replaying jobs):
    every step after WARMUP, and a repeated option's cost is the median of its repeats' medians."""
    groups = varying(all_params)
    phases = changed_phases(groups, all_params)
    if any(eq.record_of(p) for p in all_params):  # a replaying run generates nothing: time the phases all ran
        phases = tuple(p for p in phases if p != "generate")
    opts = list(dict.fromkeys(option_of(n) for n in names))
    members = {o: [i for i, n in enumerate(names) if option_of(n) == o] for o in opts}
    steps, kept, cost, has_pace = at_full_pace(data, phases, members)
    whole = {o: pooled([series(data[i], ("step",)) for i in members[o]]) for o in opts}
    counted = {o: sum(len(kept[i]) for i in members[o]) for o in opts}
    total = {o: sum(len(steps[i]) for i in members[o]) for o in opts}
    rows = {o: {"phase_s": cost[o][0], "phase_low": cost[o][1], "phase_high": cost[o][2], "step_s": whole[o][0],
                "timed": counted[o], "steps": total[o], "paced": has_pace, "same": None,
                "same_text": "the baseline", "repeats": len(members[o])} for o in opts}
    judged = {}  # option -> (its baseline option, a job of each), each option judged once (on its first repeat)
    for i, b in base_of.items():
        o, ob = option_of(names[i]), option_of(names[b])
        if o != ob and o not in judged:
            judged[o] = (ob, i, b)
    for o, (ob, i, b) in judged.items():
        paired = eq.record_of(all_params[i]) is not None and eq.record_of(all_params[i]) == eq.record_of(all_params[b])
        ok, text = same_result(data[i], data[b], exactness_of(all_params[i], all_params[b]), paired)
        mine, theirs = cost[o], cost[ob]
        few = min(counted[o], counted[ob]) < MIN_TIMED
        rows[o].update(same=ok, same_text=text, baseline=ob, differs=0 if few else differ(mine, theirs), few=few,
                       ratio=float("nan") if few or not theirs[0] else mine[0] / theirs[0],
                       ratio_low=mine[1] / theirs[2] if theirs[2] else float("nan"),
                       ratio_high=mine[2] / theirs[1] if theirs[1] else float("nan"))
        if few and counted[ob] < MIN_TIMED <= counted[o]:  # the baseline is the one short of steps
            rows[o]["short_of"] = ob
        rows[ob]["is_baseline"] = True
    for row in rows.values():
        if "baseline" not in row and not row.get("is_baseline"):
            row["same_text"] = "no baseline in the sweep"
    base_idx = {opts.index(o): opts.index(ob) for o, (ob, _, _) in judged.items()}
    line = headline(opts, groups, phases, cost, base_idx, rows)
    short = [o for o in opts if counted[o] < MIN_TIMED]
    if short and not judged and len(opts) > 1:
        line = (f"Cost of {label_of(phases)}: too few timed steps to compare ({', '.join(short)}: "
                f"{min(counted[o] for o in short)}; {MIN_TIMED} are needed after the first {WARMUP}: more "
                "train.steps).")
    return line + machine(has_pace, rows, max(len(m) for m in members.values()), len(opts)), rows


def machine(has_pace: bool, rows: dict, repeats: int, n_opts: int) -> str:
    """What the answer says of the machine: the steps it left out as slowed by other work, or that nothing could
    have caught load (then what to run)."""
    if has_pace:
        out = [f"{o} {r['steps'] - r['timed']} of {r['steps']}" for o, r in rows.items() if r["timed"] < r["steps"]]
        if not out:
            return ""
        busy = [o for o, r in rows.items() if r["timed"] < MIN_TIMED]
        return (f" Timed: the steps at the machine's full pace (generation, which these options do not change, within "
                f"{PACE_SLACK}x its fastest); left out as slowed (other work, the job's evaluations): {', '.join(out)}."
                + (f" The machine was busy through most of {', '.join(busy)}: run again, or report.repeats=3 "
                   "(interleaved)." if busy else ""))
    if repeats == 1 and n_opts > 1:
        return (" Nothing these options leave unchanged was timed to catch load between jobs: report.repeats=3 "
                "interleaves them.")
    return ""


def cost_x(row: dict) -> float | None:
    """A row's cost against its baseline: its ratio, or None where no difference was measured (within both
    spreads, or too few timed steps), which is never a ranking."""
    return None if row["differs"] == 0 else row["ratio"]


def cost_text(row: dict, interval: bool = False) -> str:
    """"0.51x" (with `interval`: "0.51x [0.48, 0.55]", the ratio of the quartiles, low against high), "no difference
    measured", or too few timed steps."""
    if row.get("few"):
        if row.get("short_of"):
            return f"too few timed steps in its baseline {row['short_of']}"
        if row.get("paced") and row["timed"] < row["steps"]:
            return f"too few steps at the machine's full pace ({row['timed']} of {row['steps']})"
        return f"too few timed steps ({row['timed']}; {MIN_TIMED} after the first {WARMUP}: more train.steps)"
    c = cost_x(row)
    if c is None:
        return "no difference measured"
    return f"{c:.2f}x [{row['ratio_low']:.2f}, {row['ratio_high']:.2f}]" if interval else f"{c:.2f}x"


def brief(row: dict) -> str:
    """One job's answer in a few words, for a narrow column of MLflow's runs table: whether it trains the same as
    its baseline, then its cost on the changed phases against the baseline's (answer's row of its option)."""
    if "baseline" not in row:
        return "baseline" if row.get("is_baseline") else row["same_text"]
    same = {True: "same", False: "DIFFERENT", None: "not judged"}[row["same"]]
    return f"{same} · {cost_text(row)} vs {row['baseline']}"


def metrics(row: dict) -> dict[str, float]:
    """One job's answer as numbers, for the bars of MLflow's chart view (tracking/ui.py), under system/answer/ (the
    System metrics tab: a child's Model metrics tab opens on its learning curves): phase_s, its median seconds per
    step on the changed phases; cost_x, that against its baseline's, drawn whether or not it is beyond the noise,
    with cost_x_low and _high (the quartiles' ratio: an interval that holds 1 is "no difference measured") and
    differs (-1 cheaper, 1 dearer, 0 no difference measured); same, 1 where it trains the same as its baseline, 0
    where not, absent where not judged (the baseline: 1 and 1). 4 significant digits. Too few timed steps: no
    cost."""
    out = {}
    if row["phase_s"] == row["phase_s"]:
        out["system/answer/phase_s"] = row["phase_s"]
    if row.get("is_baseline"):
        out["system/answer/cost_x"] = out["system/answer/same"] = 1.0
    elif "baseline" in row and not row.get("few") and row["ratio"] == row["ratio"]:
        out.update({"system/answer/cost_x": row["ratio"], "system/answer/cost_x_low": row["ratio_low"],
                    "system/answer/cost_x_high": row["ratio_high"], "system/answer/differs": float(row["differs"])})
    if row.get("same") is not None:
        out["system/answer/same"] = float(row["same"])
    return {k: float(f"{v:.4g}") for k, v in out.items() if v == v}


def label_of(phases: tuple[str, ...]) -> str:
    return "the whole step" if "step" in phases or not phases else " + ".join(phases)


def headline(names, groups, phases, cost, base_of, rows) -> str:
    """One sentence: each run's cost on the changed phases against its baseline's (or 'no difference measured'),
    and whether the exact ones train the same; without a baseline, the fastest run where it is beyond the others'
    spread."""
    label = label_of(phases)
    if not base_of:
        ranked = sorted((n for n in names if cost[n][0] == cost[n][0]), key=lambda n: cost[n][0])
        if len(ranked) < 2:
            return f"Cost of {label}: one timed run."
        if all(differ(cost[ranked[0]], cost[n]) < 0 for n in ranked[1:]):
            return f"Fastest on {label}: {ranked[0]}, beyond every other run's spread."
        return f"Cost of {label}: no difference measured between the fastest runs ({ranked[0]}, {ranked[1]})."
    parts = []
    for i in sorted(base_of):  # answer() put each one's difference from its baseline in its row
        row = rows[names[i]]
        parts.append(f"{names[i]}: {cost_text(row, interval=True)}")
    judged = [rows[names[i]]["same"] for i in base_of if rows[names[i]]["same"] is not None]
    same = ("yes" if all(judged) else "NO") if judged else "not judged (approximate options)"
    base = names[next(iter(base_of.values()))]
    return f"Cost of {label} against {base} ({', '.join(groups)}): {'; '.join(parts)}. Same result: {same}."


def console(answer: tuple[str, dict]) -> str:
    """The answer as a sweep's console ends with it: the headline wrapped to 100 columns (an interval never split),
    then one line per option: its cost on the changed phases with the spread, against its baseline, and whether it
    trains the same."""
    import re
    import textwrap

    line, rows = answer
    kept = re.sub(r"\[([^\]]*)\]", lambda m: m.group(0).replace(" ", "\u00a0"), line)
    wrapped = textwrap.wrap(kept, 98, initial_indent="  ", subsequent_indent="  ", break_on_hyphens=False)
    out = ["rlrun: the sweep's answer", *(w.replace("\u00a0", " ") for w in wrapped)]
    width = max((len(o) for o in rows), default=0)

    def sec(v: float) -> str:
        return f"{v * 1000:.3g} ms" if v < 1 else f"{v:.3g} s"

    costs = {o: f"{sec(r['phase_s'])} [{sec(r['phase_low'])}, {sec(r['phase_high'])}]"
             if r["phase_s"] == r["phase_s"] else "not timed" for o, r in rows.items()}
    wide = max((len(c) for c in costs.values()), default=0)
    for o, row in rows.items():
        if row.get("is_baseline"):
            said = "the baseline"
        elif "baseline" in row:
            same = {True: "yes", False: "NO", None: "not judged"}[row["same"]]
            said = f"{cost_text(row, interval=True)} · same result: {same}"
        else:
            said = row["same_text"]
        out.append(f"  {o:<{width}}  {costs[o]:<{wide}}  {said}")
    return "\n".join(out)
