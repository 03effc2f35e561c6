"""Golden runs: four seeded runs through the real entry point, compared bit for bit with fixtures recorded from
the code as it was before the loop.py -> recipes/ + runner.py refactor (commit in each fixture's `recorded_with`).

Every deterministic metric (`DETERMINISTIC`: no wall times, memory, throughputs or summaries) must equal the
fixture with `==` at every step; a failure names each differing metric with its first differing step and both
values. Metrics the code under test logs beyond the fixture's are allowed.

Re-record deliberately (a change that is meant to move the curves), from the repository root:

    python tests/test_golden.py --record                 # all four, each run twice: the two must agree
    python tests/test_golden.py --record dpo_chunked     # one of them
    RLRUN_CODE_ROOT=/work/golden python tests/test_golden.py --record   # record another checkout's code

Runs pin OMP_NUM_THREADS=1 (every rank and the single process): CPU reductions may split differently with more
threads, which would change the last bits. They also pin ATEN_CPU_CAPABILITY=avx2: the fixtures were recorded
with AVX2 kernels, and an AVX-512 machine would otherwise change the last bits. The fixtures also depend on the
torch build (recorded in `recorded_with`): a mismatch after a torch upgrade is not a refactoring bug; re-record.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from helpers import free_port  # tests/ is on sys.path: conftest, or this script's folder

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"
# The checkout whose code runs (`import rlrun` resolves there through PYTHONPATH): this one unless overridden.
CODE_ROOT = Path(os.environ.get("RLRUN_CODE_ROOT", ROOT)).resolve()

# Defaults that changed after the fixtures were recorded (the embedded default became a warm-started
# post-training scenario with held-out evaluation and an exported model; the default logprob policy became window;
# zero-advantage rows leave the train pass, equal to fp32 tolerance: tests/test_skipping.py):
# pinned to the values the fixtures were recorded with, so each fixture still checks the very same computation.
PINNED = ["logprob_policy=always", "model.hidden_size=64", "model.intermediate_size=256", "model.layers=2",
          "model.heads=2", "task.max_operand=4", "task.eval_size=0", "train.lr_schedule=constant",
          "warm_start.enabled=false", "eval.every=0", "export.enabled=false", "train.skip_zero_advantage=false"]

# name -> (launcher, overrides). The launcher adds tracking.uri (a fresh sqlite store), progress=false and
# hydra.run.dir (both in a temporary folder), which change no metric.
CASES: dict[str, tuple[str, list[str]]] = {
    "grpo_default": ("python", ["train.steps=40"]),
    "cispo_tiled_window_kl": ("python", ["loss=cispo", "head=tiled", "logprob_policy=window", "loss.kl_coef=0.05",
                                         "train.num_iterations=2", "train.steps=20"]),
    "dpo_chunked": ("python", ["loss=dpo", "head=chunked", "train.steps=20"]),
    "zero3_2rank": ("torchrun2", ["engine=deepspeed", "engine.zero_stage=3", "experiment=smoke", "train.steps=6"]),
}

# Metric renames made after the fixtures were recorded: old fixture key -> the key the code logs now. Add an entry
# when an issue renames a metric on purpose (the values must still match). Every name also moved into MLflow
# namespaces (`loss` -> `train/loss`, `passes/...` -> `system/passes/...`: tracking.metric_key), applied after these.
RENAMES: dict[str, str] = {}

NONDETERMINISTIC_PREFIXES = ("time/", "mem/", "throughput/", "summary/")


def deterministic(key: str) -> bool:
    """Wall times, memory, throughputs, run summaries (which include those) and saved-time estimates vary."""
    return not key.removeprefix("system/").startswith(NONDETERMINISTIC_PREFIXES) and "saved_s_est" not in key


def current_names(fixture_keys) -> dict[str, str]:
    """Fixture key -> the MLflow name the code logs it under now (RENAMES, then the namespaces)."""
    from rlrun.tracking import metric_key

    return {k: metric_key(RENAMES.get(k, k)) for k in fixture_keys}


def launch_env(code_root: Path) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(code_root), os.environ.get("PYTHONPATH", "")) if p)
    # ATEN_CPU_CAPABILITY: the fixtures were recorded with AVX2 kernels; an AVX-512 machine would otherwise pick other
    # kernels and change the last bits (the recording pins it too, so every fixture is an AVX2 one)
    return dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING="false",
                TOKENIZERS_PARALLELISM="false", GIT_PYTHON_REFRESH="quiet", ATEN_CPU_CAPABILITY="avx2")


def launch(launcher: str, overrides: list[str], workdir: Path, code_root: Path = CODE_ROOT,
           timeout: int = 3600) -> Path:
    """Run `python -m rlrun OVERRIDES` (or torchrun with 2 ranks) on `code_root`'s code; returns the MLflow db.

    The working directory is `workdir` (MLflow's sqlite store puts artifacts in ./mlruns, Hydra its outputs in
    ./outputs), so the code under test is found through PYTHONPATH, which comes before the editable install."""
    workdir.mkdir(parents=True, exist_ok=True)
    env = launch_env(code_root)
    found = subprocess.run([sys.executable, "-c", "import rlrun; print(rlrun.__file__)"], cwd=workdir, env=env,
                           capture_output=True, text=True, check=True).stdout.strip()
    assert Path(found).resolve().is_relative_to(code_root), f"rlrun resolves to {found}, not under {code_root}"
    db = workdir / "mlflow.db"
    args = ["-m", "rlrun", *PINNED, *overrides, f"tracking.uri=sqlite:///{db}", "progress=false",
            f"hydra.run.dir={workdir}/outputs"]
    if launcher == "python":
        cmd = [sys.executable, *args]
    elif launcher == "torchrun2":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
               *args]
    else:
        raise ValueError(f"unknown launcher {launcher!r}")
    out = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{' '.join(cmd)} exited {out.returncode}:\n{out.stderr[-4000:]}"
    return db


def read_metrics(db: Path) -> dict[str, list[list]]:
    """Every deterministic metric of the store's one run: {key: [[step, value], ...]} in step order."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{db}")
    exps = [e.experiment_id for e in client.search_experiments()]
    (run,) = client.search_runs(exps)
    assert run.info.status == "FINISHED", run.info.status
    out = {}
    for key in sorted(run.data.metrics):
        if deterministic(key):
            hist = sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: (m.step, m.timestamp))
            out[key] = [[int(m.step), float(m.value)] for m in hist]
    return out


def same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))  # a NaN in the fixture must stay NaN


def differences(expected: dict[str, list[list]], got: dict[str, list[list]], renames=None) -> list[str]:
    """One line per fixture metric that is missing or differs (its first differing step, both values)."""
    renames = RENAMES if renames is None else renames
    problems = []
    for old_key, want in expected.items():
        key = renames.get(old_key, old_key)
        name = key if key == old_key else f"{key} (fixture: {old_key})"
        if key not in got:
            problems.append(f"{name}: missing (logged: {sorted(got)})")
            continue
        have = got[key]
        for i in range(max(len(want), len(have))):
            w = want[i] if i < len(want) else None
            h = have[i] if i < len(have) else None
            if w is None or h is None or w[0] != h[0] or not same(w[1], h[1]):
                step = (w or h)[0]
                problems.append(f"{name}: first difference at step {step}: expected "
                                f"{'nothing' if w is None else repr(w[1])} (step {w and w[0]}), got "
                                f"{'nothing' if h is None else repr(h[1])} (step {h and h[0]}); "
                                f"{len(want)} steps expected, {len(have)} logged")
                break
    return problems


def load(name: str) -> dict:
    return json.loads((FIXTURES / f"golden_{name}.json").read_text())


def _marks(name):
    marks = [pytest.mark.slow]
    if CASES[name][0] == "torchrun2":
        marks += [pytest.mark.distributed,
                  pytest.mark.skipif(__import__("importlib").util.find_spec("deepspeed") is None,
                                     reason="DeepSpeed is not installed (pip install -e '.[deepspeed]')")]
    return marks


@pytest.mark.parametrize("name", [pytest.param(n, marks=_marks(n)) for n in CASES])
def test_golden_run_is_bit_identical(tmp_path, name):
    fixture = load(name)
    got = read_metrics(launch(fixture["launcher"], fixture["overrides"], tmp_path))
    problems = differences(fixture["metrics"], got, current_names(fixture["metrics"]))
    assert not problems, (f"golden_{name} ({fixture['launcher']} {' '.join(fixture['overrides'])}): "
                          f"{len(problems)} metric(s) differ from the fixture:\n  " + "\n  ".join(problems))


def test_differences_names_the_first_differing_step():
    want = {"loss": [[0, 1.0], [1, 2.0]], "kl": [[0, 0.5]], "old": [[0, 3.0]]}
    got = {"loss": [[0, 1.0], [1, 2.0000000000000004]], "new": [[0, 3.0]]}
    problems = differences(want, got, renames={"old": "new"})
    assert len(problems) == 2
    assert problems[0].startswith("loss: first difference at step 1: expected 2.0") and "2.0000000000000004" in \
        problems[0]
    assert problems[1].startswith("kl: missing")
    assert differences({"x": [[0, math.nan]]}, {"x": [[0, math.nan]]}, {}) == []


def git_commit(root: Path) -> str:
    r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                           capture_output=True, text=True).stdout.strip()
    return r.stdout.strip() + (" (with uncommitted changes)" if dirty else "")


def record(name: str, times: int = 2, code_root: Path = CODE_ROOT) -> dict:
    """Run case `name` `times` times; keep the metrics every recording agrees on bit for bit (printing the others)."""
    import torch

    launcher, overrides = CASES[name]
    runs, seconds = [], []
    for i in range(times):
        with tempfile.TemporaryDirectory(prefix=f"golden_{name}_") as tmp:
            t0 = time.monotonic()
            runs.append(read_metrics(launch(launcher, overrides, Path(tmp), code_root)))
            seconds.append(time.monotonic() - t0)
        print(f"{name}: recording {i + 1}/{times} took {seconds[-1]:.1f}s, {len(runs[-1])} metrics", flush=True)
    first, dropped = runs[0], {}
    for other in runs[1:]:
        for problem in differences(first, other, renames={}):
            dropped[problem.split(":", 1)[0]] = problem
        for key in set(other) - set(first):
            dropped[key] = f"{key}: logged by a later recording only"
    for why in sorted(dropped.values()):
        print(f"{name}: NOT deterministic across identical runs, dropped: {why}", flush=True)
    try:
        import deepspeed
        ds_version = deepspeed.__version__
    except ImportError:
        ds_version = None
    fixture = {
        "overrides": overrides,
        "launcher": launcher,
        "recorded_with": {"commit": git_commit(code_root), "torch": torch.__version__, "deepspeed": ds_version,
                          "cpu_capability": launch_env(code_root)["ATEN_CPU_CAPABILITY"], "machine": platform.machine(),
                          "omp_num_threads": 1, "identical_recordings": times,
                          "dropped_nondeterministic": sorted(dropped), "seconds": [round(s, 1) for s in seconds]},
        "metrics": {k: v for k, v in first.items() if k not in dropped},
    }
    FIXTURES.mkdir(exist_ok=True)
    path = FIXTURES / f"golden_{name}.json"
    path.write_text(json.dumps(fixture, indent=1) + "\n")
    print(f"{name}: wrote {path} ({path.stat().st_size} bytes, {len(fixture['metrics'])} metrics)", flush=True)
    return fixture


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--record", action="store_true", help="run the cases and write tests/fixtures/golden_*.json")
    parser.add_argument("--times", type=int, default=2, help="recordings per case that must agree (default 2)")
    parser.add_argument("names", nargs="*", help=f"cases (default: all): {', '.join(CASES)}")
    args = parser.parse_args(argv)
    if not args.record:
        parser.error("nothing to do: pass --record (the comparison itself runs under pytest)")
    unknown = sorted(set(args.names) - set(CASES))
    if unknown:
        parser.error(f"unknown case(s) {unknown}; known: {list(CASES)}")
    print(f"recording the code at {CODE_ROOT} ({git_commit(CODE_ROOT)})", flush=True)
    for name in args.names or CASES:
        record(name, args.times)


if __name__ == "__main__":
    main()
