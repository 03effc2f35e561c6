"""`python -m rlrun.bench skip`: train.skip_zero_advantage on vs off, whole runs through the real entry point.

Each round runs both modes with the same seed (round r = seed r), the order alternating from round to round, each
in a fresh process with its own store (`bench_pipeline.rounds`). Both draw the same samples until float rounding
flips a token (the skip is exact to fp32 tolerance), so the loss curves agree over the first steps and the rewards
stay comparable. Per mode: steps/s (the median wall time between consecutive steps' ends, median over rounds), the
positions the train pass computes per step (deterministic: the work left out), the train phase's and the
old-policy pass's seconds per step, the share of rows dropped, the mean reward, and the
relative difference of the gradient norm from `off`'s (median and max) over the steps where both still drew the
same rewards and lengths. (Not the loss: on-policy its value is -sum(A) / T whatever the weights. A token flipped
in one row can keep both means, so the max may include a step whose samples already differ: the median is the
arithmetic's.)
`--rlrun-args experiment=varied_lengths` runs the variable-length work.
"""

from __future__ import annotations

import os
import statistics

from .bench_pipeline import child_run, rounds

MODES = {"off": ["train.skip_zero_advantage=false"], "on": ["train.skip_zero_advantage=true"]}


def run_one(mode: str, seed: int, a) -> dict:
    """One run in `mode` with `seed`: step end times and the per-step metrics the table reads."""
    from ..tracking import metric_key

    with child_run([f"seed={seed}", f"train.steps={a.steps}", "export.enabled=false", "eval.every=0", *MODES[mode],
                    *a.rlrun_args]) as (client, run):
        def history(name):
            return [m.value for m in sorted(client.get_metric_history(run.info.run_id, metric_key(name)),
                                            key=lambda m: m.step)]

        ends = [m.timestamp / 1000 for m in sorted(client.get_metric_history(run.info.run_id, metric_key("loss")),
                                                   key=lambda m: m.step)]
        return {"step_s": [b - e for e, b in zip(ends, ends[1:])], "grad_norm": history("grad_norm"),
                "reward": history("reward_mean"), "lengths": history("response_len_mean"),
                "train_s": history("time/train_s"), "old_s": history("time/old_logprobs_s"),
                "positions": history("batching/train_positions"), "skipped": history("passes/skipped_rows_frac")}


def same_prefix(a: dict, b: dict) -> int:
    """How many first steps two runs drew the same rewards and response lengths (the samples have not parted yet;
    one of the two alone can coincide for a step after they part)."""
    n = 0
    while n < min(len(a["reward"]), len(b["reward"])) and all(a[k][n] == b[k][n] for k in ("reward", "lengths")):
        n += 1
    return n


def summarize(results: list[dict[str, dict]]) -> list[dict]:
    rows = []
    for mode in MODES:
        runs = [rnd[mode] for rnd in results if mode in rnd]
        if not runs:
            continue
        diffs, parted = [], []
        for rnd in results:
            if "off" in rnd and mode in rnd:
                n = same_prefix(rnd[mode], rnd["off"])
                parted.append(n)
                diffs += [abs(x - y) / max(abs(y), 1e-12)
                          for x, y in zip(rnd[mode]["grad_norm"][:n], rnd["off"]["grad_norm"][:n])]

        def med(key, runs=runs):
            return statistics.median(statistics.median(r[key]) for r in runs) if all(r[key] for r in runs) else 0.0

        rows.append({"impl": mode, "steps_per_s": statistics.median(1.0 / statistics.median(r["step_s"]) for r in runs),
                     "rounds_steps_per_s": [1.0 / statistics.median(r["step_s"]) for r in runs],
                     "train_s": med("train_s"), "old_s": med("old_s"), "positions": med("positions"),
                     "skipped_frac": statistics.mean(statistics.mean(r["skipped"]) for r in runs) if all(
                         r["skipped"] for r in runs) else 0.0,
                     "reward_mean": statistics.mean(statistics.mean(r["reward"]) for r in runs),
                     "same_steps": min(parted) if parted else 0,
                     "grad_norm_diff": statistics.median(diffs) if diffs else 0.0,
                     "grad_norm_diff_max": max(diffs) if diffs else 0.0})
    off = next((r for r in rows if r["impl"] == "off"), None)
    for r in rows:
        r["speedup"] = r["steps_per_s"] / off["steps_per_s"] if off else float("nan")
    return rows


def table(rows: list[dict], a) -> str:
    from ..render import num
    from ..render import table as render_table

    load = os.getloadavg()[0]
    head = (f"train.skip_zero_advantage, {a.steps} steps, {a.rounds} round(s) (round r = seed r), "
            f"args: {' '.join(a.rlrun_args) or '(default run)'}; load average {load:.1f} at the end on "
            f"{os.cpu_count()} cores; steps/s: median over rounds of the median step wall time")
    cells = [[r["impl"], num(r["steps_per_s"], ".2f"), " ".join(num(x, ".2f") for x in r["rounds_steps_per_s"]),
              num(r["speedup"], ".2f") + "x", num(r["positions"], ".0f"), num(r["train_s"] * 1000, ".1f"),
              num(r["old_s"] * 1000, ".1f"),
              num(r["skipped_frac"], ".2f"), num(r["reward_mean"], ".3f"), str(r["same_steps"]),
              f"{num(r['grad_norm_diff'], '.0e')} / {num(r['grad_norm_diff_max'], '.0e')}"] for r in rows]
    return head + "\n" + render_table(
        ["skip", "steps/s", "per round", "vs off", "train positions", "train ms", "old pass ms", "rows skipped",
         "reward mean", "same samples (steps)", "grad_norm rel. diff there (median / max)"], cells)


def bench(a, log_mlflow) -> list[dict]:
    a.modes = list(MODES)
    rows = summarize(rounds(a, run_one))
    text = table(rows, a)
    print(text)
    log_mlflow(a, [{k: v for k, v in r.items() if not isinstance(v, list)} for r in rows], text, "skip")
    return rows


def add_parser(sub, log_mlflow) -> None:
    import argparse

    p = sub.add_parser("skip", help="train.skip_zero_advantage on vs off: steps/s, train-phase time, rows skipped",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; round r uses seed r")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps per run (the default run's 200)")
    p.add_argument("--rlrun-args", nargs="*", default=[], help="extra rlrun overrides for every run, e.g. "
                   "experiment=varied_lengths")
    p.add_argument("--tracking-uri", default="sqlite:///mlflow.db", help="'none' to skip MLflow")
    p.set_defaults(func=lambda a: bench(a, log_mlflow))
