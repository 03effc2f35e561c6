"""Golden runs: four seeded runs through the real entry point, compared bit for bit with fixtures recorded from
the code as it was before the loop.py -> recipes/ + runner.py refactor (commit in each fixture's `recorded_with`).

Every deterministic metric (`DETERMINISTIC`: no wall times, memory, throughputs or summaries) must equal the
fixture with `==` at every step; a failure names each differing metric with its first differing step and both
values. Metrics the code under test logs beyond the fixture's are allowed.

A fixture holds one or more recordings of the same runs, each from another machine: the same code gives other last
bits on another CPU even with the kernels pinned (below; MKL's and the compiler's choices differ by CPU model), so a
run passes when it equals one recording bit for bit at every step, and a failure lists its differences from the
recording nearest to it. A machine none of the recordings was made on (its run equals none of them, found out by
running, not assumed from its CPU name) passes within `RTOL`/`ATOL` of the nearest recording at every step, with a
warning that names the tolerance and how to add its own recording; a refactoring bug moves a curve by far more. Each
recording is of reference code (the pre-refactor commit, or a later commit that passed
against an earlier recording), never of the code a test is meant to check.

Re-record deliberately (a change that is meant to move the curves), from the repository root:

    python tests/e2e/test_golden.py --record                 # all four, each run twice: the two must agree
    python tests/e2e/test_golden.py --record dpo_chunked     # one of them
    RLRUN_CODE_ROOT=/work/golden python tests/e2e/test_golden.py --record   # record another checkout's code

or add this machine's recording of a reference checkout beside the others (a new CI machine):

    git worktree add /work/golden COMMIT && RLRUN_CODE_ROOT=/work/golden python tests/e2e/test_golden.py --record --add

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
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
# The checkout whose code runs (`import rlrun` resolves there through PYTHONPATH): this one unless overridden.
CODE_ROOT = Path(os.environ.get("RLRUN_CODE_ROOT", ROOT)).resolve()

# Defaults that changed after the fixtures were recorded (the embedded default became a warm-started
# post-training scenario with held-out evaluation and an exported model; the default logprob policy became window;
# zero-advantage rows leave the train pass, equal to fp32 tolerance: tests/unit/recipes/test_skipping.py):
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
        from helpers import free_port  # tests/: on sys.path by conftest, or by __main__ below when run as a script

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


# Another CPU's last bits: the two recordings of each case (an AVX2 machine, an AVX-512 Xeon) differ by ~1e-7
# relative at first, growing with the steps to 3.3e-5 (dpo_chunked's grad_norm at step 19), and no sampled token
# changed; a real change of the computation moves a curve by 1e-3 or more.
RTOL, ATOL = 1e-4, 1e-7


def same(a: float, b: float, rtol: float = 0.0, atol: float = 0.0) -> bool:
    # a NaN in the fixture must stay NaN
    return a == b or (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=rtol, abs_tol=atol)


def differences(expected: dict[str, list[list]], got: dict[str, list[list]], renames=None, rtol: float = 0.0,
                atol: float = 0.0) -> list[str]:
    """One line per fixture metric that is missing or differs (its first differing step, both values); bit for bit
    unless given a tolerance."""
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
            if w is None or h is None or w[0] != h[0] or not same(w[1], h[1], rtol, atol):
                step = (w or h)[0]
                problems.append(f"{name}: first difference at step {step}: expected "
                                f"{'nothing' if w is None else repr(w[1])} (step {w and w[0]}), got "
                                f"{'nothing' if h is None else repr(h[1])} (step {h and h[0]}); "
                                f"{len(want)} steps expected, {len(have)} logged")
                break
    return problems


def load(name: str) -> dict:
    return json.loads((FIXTURES / f"golden_{name}.json").read_text())


def compare(fixture: dict, got: dict[str, list[list]]) -> tuple[dict, list[str]]:
    """(the recording `got` equals, []) or (the recording with the fewest differing metrics, those differences)."""
    best: tuple[dict, list[str]] | None = None
    for recording in fixture["recordings"]:
        problems = differences(recording["metrics"], got, current_names(recording["metrics"]))
        if not problems:
            return recording, []
        if best is None or len(problems) < len(best[1]):
            best = (recording, problems)
    assert best is not None, "a fixture with no recording"
    return best


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
    nearest, problems = compare(fixture, got)
    if not problems:
        return  # bit for bit: this machine's kind has a recording
    made = nearest["recorded_with"]
    where = f"commit {made['commit'][:10]}, {made.get('cpu_model', 'CPU not recorded')}"
    loose = differences(nearest["metrics"], got, current_names(nearest["metrics"]), RTOL, ATOL)
    assert not loose, (f"golden_{name} ({fixture['launcher']} {' '.join(fixture['overrides'])}): equals none of its "
                       f"{len(fixture['recordings'])} recording(s), and {len(loose)} metric(s) differ beyond rtol "
                       f"{RTOL}, atol {ATOL} from the nearest ({where}):\n  " + "\n  ".join(loose))
    warnings.warn(f"golden_{name}: no recording of this machine's kind (equal to none bit for bit: "
                  f"{len(problems)} metric(s) differ in the last bits); checked within rtol {RTOL}, atol {ATOL} of "
                  f"the nearest ({where}). Add this machine's recording: tests/e2e/test_golden.py --record --add",
                  stacklevel=1)


def test_differences_names_the_first_differing_step():
    want = {"loss": [[0, 1.0], [1, 2.0]], "kl": [[0, 0.5]], "old": [[0, 3.0]]}
    got = {"loss": [[0, 1.0], [1, 2.0000000000000004]], "new": [[0, 3.0]]}
    problems = differences(want, got, renames={"old": "new"})
    assert len(problems) == 2
    assert problems[0].startswith("loss: first difference at step 1: expected 2.0") and "2.0000000000000004" in \
        problems[0]
    assert problems[1].startswith("kl: missing")
    assert differences({"x": [[0, math.nan]]}, {"x": [[0, math.nan]]}, {}) == []


def test_a_run_passes_by_equalling_one_recording_and_fails_against_the_nearest():
    a = {"recorded_with": {"commit": "a"}, "metrics": {"train/loss": [[0, 1.0], [1, 2.0]]}}
    b = {"recorded_with": {"commit": "b"}, "metrics": {"train/loss": [[0, 1.0], [1, 2.0000001]]}}
    fixture = {"recordings": [a, b]}
    assert compare(fixture, {"train/loss": [[0, 1.0], [1, 2.0000001]]}) == (b, [])
    nearest, problems = compare(fixture, {"train/loss": [[0, 1.5], [1, 2.0]]})
    assert len(problems) == 1 and "first difference at step 0" in problems[0]
    # two recordings may each match part of a run; the run must equal one of them whole
    c = {"recorded_with": {"commit": "c"}, "metrics": {"train/loss": [[0, 1.0]], "train/kl": [[0, 0.1]]}}
    d = {"recorded_with": {"commit": "d"}, "metrics": {"train/loss": [[0, 1.1]], "train/kl": [[0, 0.2]]}}
    assert compare({"recordings": [c, d]}, {"train/loss": [[0, 1.0]], "train/kl": [[0, 0.2]]})[1]


def test_the_tolerance_for_another_machine_takes_its_last_bits_but_not_a_change():
    want = {"train/grad_norm": [[0, 0.6438801289], [1, 0.5]], "train/kl": [[0, 0.0]]}
    assert differences(want, {"train/grad_norm": [[0, 0.6438800693], [1, 0.5]], "train/kl": [[0, 1e-9]]}, {},
                       RTOL, ATOL) == []
    assert differences(want, {"train/grad_norm": [[0, 0.6438800693], [1, 0.5]], "train/kl": [[0, 1e-9]]}, {})
    moved = differences(want, {"train/grad_norm": [[0, 0.6438801289], [1, 0.5001]], "train/kl": [[0, 0.0]]}, {},
                        RTOL, ATOL)
    assert len(moved) == 1 and "step 1" in moved[0]


def cpuinfo(field: str) -> str:
    """The first `field` line of /proc/cpuinfo ('' where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_model() -> str:
    """The CPU's model name (what a recording was made on: the last bits depend on it)."""
    return cpuinfo("model name") or platform.processor() or "unknown"


def cpu_flags() -> list[str]:
    """The vector-instruction flags of the CPU (avx*, fma, amx*): kernels dispatch on them."""
    return sorted(f for f in cpuinfo("flags").split() if f.startswith(("avx", "fma", "amx")))


def git_commit(root: Path) -> str:
    r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                           capture_output=True, text=True).stdout.strip()
    return r.stdout.strip() + (" (with uncommitted changes)" if dirty else "")


def record(name: str, times: int = 2, code_root: Path = CODE_ROOT, add: bool = False) -> dict:
    """Run case `name` `times` times; keep the metrics every recording agrees on bit for bit (printing the others).

    The fixture's recordings become this one (`add`: this one beside the others, unless it equals one of them)."""
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
    recording = {
        "recorded_with": {"commit": git_commit(code_root), "torch": torch.__version__, "deepspeed": ds_version,
                          "cpu_capability": launch_env(code_root)["ATEN_CPU_CAPABILITY"], "machine": platform.machine(),
                          "cpu_model": cpu_model(), "cpu_flags": cpu_flags(),
                          "omp_num_threads": 1, "identical_recordings": times,
                          "dropped_nondeterministic": sorted(dropped), "seconds": [round(s, 1) for s in seconds]},
        "metrics": {k: v for k, v in first.items() if k not in dropped},
    }
    path = FIXTURES / f"golden_{name}.json"
    recordings = [recording]
    if add and path.exists():
        old = load(name)
        if [old["launcher"], old["overrides"]] != [launcher, overrides]:
            raise SystemExit(f"{path} records {old['launcher']} {old['overrides']}, not {launcher} {overrides}: "
                             "record it anew (without --add)")
        if not compare(old, recording["metrics"])[1]:
            print(f"{name}: equals a recording already in {path}; nothing added", flush=True)
            return old
        recordings = old["recordings"] + [recording]
    fixture = {"overrides": overrides, "launcher": launcher, "recordings": recordings}
    FIXTURES.mkdir(exist_ok=True)
    path.write_text(json.dumps(fixture, indent=1) + "\n")
    print(f"{name}: wrote {path} ({path.stat().st_size} bytes, {len(recordings)} recording(s), "
          f"{len(recording['metrics'])} metrics)", flush=True)
    return fixture


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--record", action="store_true", help="run the cases and write tests/fixtures/golden_*.json")
    parser.add_argument("--add", action="store_true",
                        help="add this machine's recording beside the fixture's others (a new CI machine)")
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
        record(name, args.times, add=args.add)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "tests"))  # helpers.py
    main()
