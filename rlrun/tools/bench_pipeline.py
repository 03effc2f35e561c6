"""`python -m rlrun.bench pipeline`: rollout.pipeline=sync vs async (one, two steps off) on the embedded default run.

Each round runs every mode once, one after the other (the order rotates from round to round), each through the
real entry point (`python -m rlrun`) in a fresh process with its own store. Round r uses seed r: the rounds give
both the speed and the held-out accuracy over seeds. `sync` uses all of torch's threads (both cores here) in one
process; `async` splits them between the trainer and the generator process (rollout.worker_threads). A run's
speed is the median wall time between consecutive steps' ends (read from the steps' log timestamps, so scoring,
logging and the generator's hand-over are in it; the median leaves out the steps with a held-out evaluation), and
its learning is `eval/accuracy` at the end and over the run. Every mode trains with truncated importance sampling
(loss.tis.enabled=true; in sync its weight is ~1), as sweeps/pipeline.yaml does.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import tempfile

MODES = {"sync": ["rollout.pipeline=sync"],
         "async_k1": ["rollout.pipeline=async", "rollout.max_staleness=1"],
         "async_k2": ["rollout.pipeline=async", "rollout.max_staleness=2"]}


def rlrun_in(tmp: str, args: list[str]) -> str:
    """`python -m rlrun ARGS` through the real entry point in a fresh process working in `tmp`, with its own store
    there (its URI returned); a failure raises with the end of its stderr."""
    uri = f"sqlite:///{tmp}/mlflow.db"
    cmd = [sys.executable, "-m", "rlrun", *args, "progress=false", f"tracking.uri={uri}"]
    env = {**os.environ, "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "false"}
    r = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    return uri


@contextlib.contextmanager
def child_run(args: list[str]):
    """One run (`rlrun_in`) in a temporary folder: (client, its run), readable until the block ends."""
    from ..tracking import open_client

    with tempfile.TemporaryDirectory() as tmp:
        client = open_client(rlrun_in(tmp, [*args, f"hydra.run.dir={tmp}/out"]))
        [run] = client.search_runs([client.get_experiment_by_name("rlrun").experiment_id])
        yield client, run


def run_one(mode: str, seed: int, a) -> dict:
    """One run of the default scenario in `mode` with `seed`: its step end times, held-out accuracy curve and the
    pipeline's own account (seconds per step waiting / generating / idle)."""
    from ..tracking import metric_key

    with child_run([f"seed={seed}", f"train.steps={a.steps}", "loss.tis.enabled=true", "export.enabled=false",
                    *MODES[mode], *a.rlrun_args]) as (client, run):
        def history(name):
            return sorted(client.get_metric_history(run.info.run_id, metric_key(name)), key=lambda m: m.step)

        ends = [m.timestamp / 1000 for m in history("loss")]
        return {"step_s": [b - e for e, b in zip(ends, ends[1:])],
                "accuracy": [m.value for m in history("eval/accuracy")],
                **{k: statistics.mean(m.value for m in history(name)) if history(name) else 0.0
                   for k, name in (("wait_s", "time/wait_s"), ("gen_busy_s", "pipeline/gen_busy_s"),
                                   ("gen_idle_s", "pipeline/gen_idle_s"), ("staleness", "staleness_mean"))}}


def rounds(a, run=run_one) -> list[dict[str, dict]]:
    """`a.rounds` rounds; each runs every mode, in an order rotated by the round (no mode always goes first)."""
    modes = list(a.modes)
    out = []
    for r in range(a.rounds):
        order = modes[r % len(modes):] + modes[: r % len(modes)]
        result = {}
        for mode in order:
            print(f"round {r + 1}/{a.rounds}: {mode} (seed {r})", flush=True)
            result[mode] = run(mode, r, a)
        out.append(result)
    return out


def summarize(results: list[dict[str, dict]], modes) -> list[dict]:
    """One row per mode: steps/s (median step over each round, then median over rounds; and each round's), its
    ratio to sync's, held-out accuracy at the end per seed and its mean, and the pipeline's seconds per step."""
    rows = []
    for mode in modes:
        runs = [rnd[mode] for rnd in results]
        per_round = [1.0 / statistics.median(r["step_s"]) for r in runs]
        final = [r["accuracy"][-1] for r in runs]
        rows.append({"impl": mode, "steps_per_s": statistics.median(per_round), "rounds_steps_per_s": per_round,
                     "accuracy_end": statistics.mean(final), "seeds_accuracy_end": final,
                     **{k: statistics.median(r[k] for r in runs) for k in
                        ("wait_s", "gen_busy_s", "gen_idle_s", "staleness")}})
    sync = next((r for r in rows if r["impl"] == "sync"), None)
    for r in rows:
        r["speedup"] = r["steps_per_s"] / sync["steps_per_s"] if sync else float("nan")
        r["accuracy_vs_sync"] = r["accuracy_end"] - sync["accuracy_end"] if sync else float("nan")
    return rows


def table(rows: list[dict], a) -> str:
    from ..render import num
    from ..render import table as render_table

    head = (f"rollout.pipeline on the embedded default run ({a.steps} steps, loss.tis on), {a.rounds} round(s), "
            f"round r = seed r; steps/s: median over rounds of the median step wall time")
    cells = [[r["impl"], num(r["steps_per_s"], ".2f"), " ".join(num(x, ".2f") for x in r["rounds_steps_per_s"]),
              num(r["speedup"], ".2f") + "x", num(r["accuracy_end"], ".2f"),
              " ".join(num(x, ".2f") for x in r["seeds_accuracy_end"]), num(r["wait_s"], ".3f"),
              num(r["gen_busy_s"], ".3f"), num(r["gen_idle_s"], ".3f"), num(r["staleness"], ".2f")] for r in rows]
    return head + "\n" + render_table(
        ["mode", "steps/s", "per round", "vs sync", "eval acc (end)", "per seed", "trainer wait s",
         "generator busy s", "generator idle s", "staleness"], cells)


def bench(a, log_mlflow) -> list[dict]:
    """The benchmark; `log_mlflow` logs the result (rlrun.tools.bench's own)."""
    rows = summarize(rounds(a), a.modes)
    text = table(rows, a)
    print(text)
    log_mlflow(a, [{k: v for k, v in r.items() if not isinstance(v, list)} for r in rows], text, "pipeline")
    return rows


def modes(text: str) -> list[str]:
    import argparse

    out = text.split(",")
    if set(out) - set(MODES):
        raise argparse.ArgumentTypeError(f"{text}: each must be one of {', '.join(MODES)}")
    return out


def add_parser(sub, log_mlflow) -> None:
    import argparse

    p = sub.add_parser("pipeline", help="rollout.pipeline=sync vs async on the default run: steps/s, held-out accuracy",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", type=modes, default=["sync", "async_k1"],
                   help=f"of {', '.join(MODES)}")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds; round r uses seed r")
    p.add_argument("--steps", type=int, default=400, help="optimizer steps per run (200 is the default run's; "
                   "runs of 200 steps last ~8 s here, too short for a steady ratio)")
    p.add_argument("--rlrun-args", nargs="*", default=[], help="extra rlrun overrides for every run")
    p.add_argument("--tracking-uri", default="sqlite:///mlflow.db", help="'none' to skip MLflow")
    p.set_defaults(func=lambda a: bench(a, log_mlflow))
