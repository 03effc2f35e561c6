"""`python -m rlrun.bench check`: `rlrun check` on every configuration of the exact axes' all-pairs covering array.

Every pair of options of two exact axes (head, logprob_policy, offload, batching, activations, train.precision:
rlrun/pairs.py, from the registry) appears in at least one configuration; each is checked in its own process as
`rlrun check <model's experiment> <its options>` would (rlrun/check/), and the table gives, per configuration,
the probes that passed, the ones that failed, and the time. `--model smollm2` checks SmolLM2-135M-Instruct on its
experiment (experiment=smollm2: word problems through its chat template, LoRA, 49152-token vocabulary); the default
checks the embedded tiny model on experiment=smoke. Exit status 1 when any probe failed.
"""

from __future__ import annotations

import os
import time

from .. import render

MODELS = {"tiny": ["experiment=smoke"], "smollm2": ["experiment=smollm2"]}


def configurations() -> list[dict]:
    from ..pairs import all_pairs, exact_axes

    return all_pairs(exact_axes())


def child(overrides: list[str], threads: int, out_path: str) -> None:
    """One configuration's check in this fresh process; saves {probe: (verdict, measured)} and its seconds, or the
    error that stopped it (a check that cannot run is that configuration's failure, not the bench's)."""
    import torch

    from .. import check
    from ..config import validate
    from .bench_trl import compose

    torch.set_num_threads(threads)
    render.quiet(os.devnull)  # the table is what the parent prints
    t0 = time.perf_counter()
    try:
        rows = check.rows_of(validate(compose(["tracking=none", *overrides])))
        result = {"probes": {r.probe: (r.ok, r.measured) for r in rows}, "seconds": time.perf_counter() - t0}
    except Exception as e:  # noqa: BLE001 - reported in the table, by configuration
        result = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    torch.save(result, out_path)


def table(configs: list[dict], results: list[dict]) -> str:
    body = []
    for row, res in zip(configs, results):
        name = " ".join(f"{k.split('.')[-1]}={v}" for k, v in row.items())
        if "error" in res:
            body.append([name, "-", f"error: {res['error']}", "-"])
            continue
        probes = res["probes"]
        failed = [p for p, (ok, _) in probes.items() if ok is False]
        passed = sum(ok is True for ok, _ in probes.values())
        body.append([name, f"{passed} of {passed + len(failed)}", ", ".join(failed) or "-", f"{res['seconds']:.0f}"])
    bad = sum(1 for r in results if "error" in r or any(ok is False for ok, _ in r["probes"].values()))
    return (render.table(["configuration", "probes pass", "failed", "s"], body, left=3)
            + f"\n{len(configs) - bad} of {len(configs)} configurations pass every probe")


def details(configs: list[dict], results: list[dict]) -> str:
    """What each probe of each configuration measured (the MLflow run's text; the console gets the table)."""
    out = []
    for row, res in zip(configs, results):
        out.append(" ".join(f"{k}={v}" for k, v in row.items()))
        out += [f"  {res['error']}"] if "error" in res else [
            f"  {'pass' if ok else 'FAIL' if ok is False else '-':4}  {p}: {measured}"
            for p, (ok, measured) in res["probes"].items()]
    return "\n".join(out)


def bench(a, log_mlflow) -> list[dict]:
    from tqdm import tqdm

    configs = configurations()
    results = []
    for row in tqdm(configs, desc="check", unit="configuration"):
        overrides = [*MODELS[a.model], *(f"{k}={v}" for k, v in row.items()), *a.rlrun_args]
        results.append(render.in_child(child, overrides, a.threads))
    text = f"rlrun check, {a.model} ({' '.join(MODELS[a.model] + a.rlrun_args)}), the exact axes' covering array\n"
    text += table(configs, results)
    print(text)
    rows = [{"impl": " ".join(f"{k}={v}" for k, v in row.items()), **(
        {"error": res["error"]} if "error" in res else
        {"failed": float(sum(ok is False for ok, _ in res["probes"].values())), "seconds": res["seconds"],
         **{f"pass/{p}": float(ok) for p, (ok, _) in res["probes"].items() if ok is not None}})}
        for row, res in zip(configs, results)]
    log_mlflow(a, rows, f"{text}\n\n{details(configs, results)}", f"check-{a.model}")
    if any("error" in r or r["failed"] for r in rows):
        raise SystemExit(1)
    return rows


def add_parser(sub, log_mlflow) -> None:
    import argparse
    import functools

    c = sub.add_parser("check", help="rlrun check on every configuration of the exact axes' covering array",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("--model", default="tiny", choices=list(MODELS),
                   help="smollm2: SmolLM2-135M-Instruct on experiment=smollm2; tiny: the embedded model, smoke")
    c.add_argument("--threads", type=int, default=2)
    c.add_argument("--rlrun-args", nargs="*", default=[], help="extra overrides for every configuration")
    c.add_argument("--tracking-uri", default="sqlite:///mlflow.db", help="'none' to skip MLflow")
    c.set_defaults(func=functools.partial(bench, log_mlflow=log_mlflow))
