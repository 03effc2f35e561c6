"""`python -m rlrun.bench replay`: a sweep over a training-side option, every job generating vs paired (the first
job records its rollouts, the others replay them: `report.replay=true`, docs/replay.md), wall time of the whole
sweep command.

Each round runs both sweeps with the same seed (round r = seed r), the order alternating from round to round, each
through the real entry point (`python -m rlrun -m ...`) in a fresh process with its own store and sweep folder.
Per mode: the sweep's wall time (the whole command: composing and validating every job, each job's process, model,
`rlrun check`, evaluations, the parent's figures), its ratio to the generating sweep's in the same round, how many
jobs generated (read from the store: a job that logged a generate phase), and the first job's and the others'
wall time (their MLflow runs' start and end), which show where the saving is and what it cannot touch.

A paired sweep saves the generation of every job but the first, and nothing else: the column "at best" is the
ratio the round's generating sweep would have with exactly that taken out (its wall time less the generate phase
of its jobs after the first, each job's `time/generate_s` summed). The measured ratio is to be read against it: the
rest of a job (the train pass, evaluations, `rlrun check`, setup) and of the sweep are the same work either way.

The default workload is one where generation is most of a step, as in LLM RL: the embedded model untrained
(`warm_start.enabled=false`: its answers run long, so a decode runs to about 512 steps) drawing 512 new tokens for
32 sequences per step, 120 steps.
`--rlrun-args` replaces it, e.g. `--rlrun-args train.steps=200` for the default run.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

from .bench_pipeline import rlrun_in, rounds

MODES = {"generating": [], "paired": ["report.replay=true"]}
WORKLOAD = ["warm_start.enabled=false", "rollout.max_new_tokens=512", "model.max_positions=576",
            "train.rollout_batch=32", "train.batch_size=32", "train.micro_batch=32", "train.steps=120"]


def arguments(mode: str, seed: int, a, tmp: str) -> list[str]:
    """rlrun's arguments for the sweep of one mode: the swept option, the workload, the mode's switch, a folder of
    its own (bench_pipeline.rlrun_in adds the store)."""
    return ["-m", a.option, *a.rlrun_args, *MODES[mode], f"seed={seed}", "export.enabled=false",
            f"hydra.sweep.dir={tmp}/sweep"]


def jobs_of(uri: str) -> list[dict]:
    """The sweep's jobs from its store, in the order they ran: wall seconds, whether each generated, and the
    seconds of its generate phase over the run (0 where it logged none)."""
    from ..tracking import metric_key, open_client

    client = open_client(uri)
    exp = client.get_experiment_by_name("rlrun")
    runs = client.search_runs([exp.experiment_id], order_by=["start_time ASC"])
    key = metric_key("time/generate_s")
    return [{"seconds": (r.info.end_time - r.info.start_time) / 1000, "generated": key in r.data.metrics,
             "generate_s": sum(m.value for m in client.get_metric_history(r.info.run_id, key))
             if key in r.data.metrics else 0.0}
            for r in runs if r.data.tags.get("rlrun.kind") != "sweep"]


def run_one(mode: str, seed: int, a) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        start = time.monotonic()
        uri = rlrun_in(tmp, arguments(mode, seed, a, tmp))
        return {"wall_s": time.monotonic() - start, "jobs": jobs_of(uri)}


def at_best(generating: dict) -> float:
    """The ratio a paired sweep would have to this generating sweep if it saved exactly the generation of the jobs
    after the first (which replay) and nothing else."""
    saved = sum(j["generate_s"] for j in generating["jobs"][1:])
    return (generating["wall_s"] - saved) / generating["wall_s"]


def summarize(results: list[dict[str, dict]]) -> list[dict]:
    """One row per mode: the median sweep wall time and each round's, the median and range of its per-round ratio
    to the generating sweep of the same round (paired: and the round's `at_best`), the jobs that generated, the first
    and the other jobs' seconds, the generate phase of a job that generated."""
    rows = []
    for mode in MODES:
        runs = [rnd[mode] for rnd in results]
        ratios = [rnd[mode]["wall_s"] / rnd["generating"]["wall_s"] for rnd in results]
        best = [at_best(rnd["generating"]) if mode == "paired" else 1.0 for rnd in results]
        generated = [j["generate_s"] for r in runs for j in r["jobs"] if j["generated"]]
        rows.append({"impl": mode, "wall_s": statistics.median(r["wall_s"] for r in runs),
                     "at_best": statistics.median(best), "at_best_min": min(best), "at_best_max": max(best),
                     "generate_s": statistics.median(generated) if generated else float("nan"),
                     "rounds_wall_s": [r["wall_s"] for r in runs], "ratio": statistics.median(ratios),
                     "ratio_min": min(ratios), "ratio_max": max(ratios),
                     "jobs": float(statistics.median(len(r["jobs"]) for r in runs)),
                     "generated": float(max(sum(j["generated"] for j in r["jobs"]) for r in runs)),
                     "first_job_s": statistics.median(r["jobs"][0]["seconds"] for r in runs),
                     "other_jobs_s": statistics.median(j["seconds"] for r in runs for j in r["jobs"][1:])})
    return rows


def table(rows: list[dict], a, load: tuple[float, float]) -> str:
    from ..render import num
    from ..render import table as render_table

    head = (f"rlrun -m {a.option} {' '.join(a.rlrun_args)}: every job generating vs paired (report.replay=true), "
            f"{a.rounds} round(s) (round r = seed r), wall time of the whole sweep command; load average "
            f"{load[0]:.1f} at the start, {load[1]:.1f} at the end, on {os.cpu_count()} cores"
            # the start's: by the end the load average holds the bench's own sweeps
            + (" (LOADED: the times include other work's)" if load[0] > (os.cpu_count() or 1) / 2 else ""))
    cells = [[r["impl"], num(r["wall_s"], ".1f"), " ".join(num(x, ".1f") for x in r["rounds_wall_s"]),
              f"{num(r['ratio'], '.2f')}x [{num(r['ratio_min'], '.2f')}, {num(r['ratio_max'], '.2f')}]",
              f"{num(r['at_best'], '.2f')}x [{num(r['at_best_min'], '.2f')}, {num(r['at_best_max'], '.2f')}]",
              f"{r['generated']:.0f} of {r['jobs']:.0f}", num(r["first_job_s"], ".1f"), num(r["other_jobs_s"], ".1f"),
              num(r["generate_s"], ".1f")]
             for r in rows]
    return head + "\n" + render_table(
        ["sweep", "wall s", "per round", "vs generating [range]", "at best: its generation saved [range]",
         "jobs generating", "first job s", "other jobs s", "generate s a job"], cells)


def bench(a, log_mlflow, run=run_one) -> list[dict]:
    a.modes = list(MODES)
    before = os.getloadavg()[0]
    rows = summarize(rounds(a, run))
    text = table(rows, a, (before, os.getloadavg()[0]))
    print(text)
    log_mlflow(a, [{k: v for k, v in r.items() if not isinstance(v, list)} for r in rows], text, "replay")
    return rows


def add_parser(sub, log_mlflow) -> None:
    import argparse

    p = sub.add_parser("replay", help="a sweep every job generating vs paired (report.replay=true): wall time",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--option", default="head=dense,tiled,chunked",
                   help="the swept training-side option, as -m takes it")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds; round r uses seed r")
    p.add_argument("--rlrun-args", nargs="*", default=WORKLOAD, help="the workload's rlrun overrides (default: "
                   f"{' '.join(WORKLOAD)})")
    p.add_argument("--tracking-uri", default="sqlite:///mlflow.db", help="'none' to skip MLflow")
    p.set_defaults(func=lambda a: bench(a, log_mlflow))
