"""`python -m rlrun.bench gpu`: rlrun on a CUDA device, checked and measured in one command (docs/gpu.md).

Six parts, each runnable alone (`--only heads,plan`) and sized to finish within about 10 minutes on one GPU:

  heads    dense / tiled / chunked (and DeepSpeed's TiledFusedLogitsLoss, Liger's fused GRPO loss where installed),
           fp32 and bf16, 8192 tokens x vocab 151936 x hidden 896: time, CUDA memory growth, error of loss and both
           gradients vs a float64 reference (rlrun/tools/gpu_heads.py)
  plan     the memory plan vs the measured CUDA peak per phase, head x activations x LoRA (Qwen2-0.5B shape)
  offload  offload=on vs off on the Qwen2-1.5B shape: prep seconds per step, optimizer-state bytes moved
  runs     logprob policies, batching and rollout.pipeline on a short GRPO run: steps/s, peak, exactness at step 0
  vllm     rollout=vllm with weight sync vs rollout=hf: generated tokens/s, syncs, mismatch (needs vLLM's GPU build)
  decode   rollout.decode=eager vs compiled (a CUDA graph a step) vs rollout=vllm on the same rollouts, against the
           GEMM bound (`python -m rlrun.bench generate --device cuda` on the 0.5B shape)

The runs are rlrun's own loop on random-init Qwen2-shaped models built from transformers configs (nothing is
downloaded; rlrun/tools/gpu_runs.py). It prints one table (part, case, speed, memory, check, verdict), logs it to
MLflow (experiment rlrun-bench) and writes it to docs/benchmarks-gpu.md with the device, torch and CUDA versions and
the date; a run of some parts replaces only theirs there (the results live in docs/benchmarks-gpu.json). Exit
code: 2 without a CUDA device, 1 if a check failed or a part could not run, else 0.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from .. import render

PARTS = ("heads", "plan", "offload", "runs", "vllm", "decode")
REPO_DOCS = Path(__file__).resolve().parents[2] / "docs"  # a checkout (editable install); else the working folder
DOCS = REPO_DOCS / "benchmarks-gpu.md" if (REPO_DOCS / "gpu.md").is_file() else Path("benchmarks-gpu.md")
HEAD = ["part", "case", "speed", "memory", "check", "verdict"]


def csv_of(choices):
    """An argparse type: comma-separated names, each one of `choices`, in the order given; one clear error."""

    def parse(text: str) -> list[str]:
        items = [x for x in text.split(",") if x]
        bad = [x for x in items if x not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{text!r}: each must be one of {', '.join(choices)}")
        return list(dict.fromkeys(items))

    return parse


def argument(parse):
    """An argparse type from a parser that raises ValueError with its message."""

    def wrapped(text: str):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return wrapped


def require_cuda() -> None:
    """Exit 2 with one line when there is no CUDA device: every part measures one."""
    import torch

    if not torch.cuda.is_available():
        print(f"python -m rlrun.bench gpu: error: no CUDA device (torch.cuda.is_available() is False; torch "
              f"{torch.__version__}, CUDA build {torch.version.cuda or 'none'}). Run it on a machine with an NVIDIA "
              "GPU and a CUDA build of torch.", file=sys.stderr)
        raise SystemExit(2)


def environment() -> dict:
    """What the numbers were measured on."""
    import torch

    props = torch.cuda.get_device_properties(0)
    return {"device": f"{props.name} ({props.total_memory / 2**30:.0f} GiB)", "torch": torch.__version__,
            "cuda": torch.version.cuda or "none", "date": datetime.date.today().isoformat()}


def speed_cell(r: dict) -> str:
    if r.get("speed") is not None:
        return f"{render.num(r['speed'], '.3g' if r['speed'] < 100 else '.0f')} {r['speed_unit']}"
    return render.NONE if "time_s" not in r else f"{render.num(r['time_s'], '.3f')} s"


def mem_cell(r: dict) -> str:
    if r.get("mem_mib") is not None:
        return f"{r['mem_mib']:.0f} MiB {r['mem_what']}"
    return f"{r['growth_mib']:.0f} MiB growth" if r.get("growth_mib") is not None else render.NONE


def verdict(r: dict) -> str:
    if "error" in r:
        return "failed"
    if "skipped" in r:
        return "skipped"
    return {True: "ok", False: "FAIL", None: render.NONE}[r.get("ok")]


def cells(r: dict) -> list[str]:
    """One table row: a failed or skipped row says why in its check column."""
    note = f"failed: {r['error']}" if "error" in r else f"skipped: {r['skipped']}" if "skipped" in r else r["check"]
    return [r["part"], r["case"], speed_cell(r), mem_cell(r), note, verdict(r)]


def summary(rows: list[dict]) -> str:
    checked = [r for r in rows if r.get("ok") is not None]
    failed = [f"{r['part']} {r['case']}" for r in rows if r.get("ok") is False or "error" in r]
    skipped = [f"{r['part']} {r['case']}" for r in rows if "skipped" in r]
    line = f"{sum(r['ok'] for r in checked)} of {len(checked)} checks ok"
    return line + (f"; failed: {', '.join(failed)}" if failed else "") + (
        f"; not run: {', '.join(skipped)}" if skipped else "")


def table(rows: list[dict], env: dict, notes: Sequence[str] = ()) -> str:
    """The one table the command prints, under the device it ran on, with the summary and notes below."""
    head = f"rlrun on {env['device']}, torch {env['torch']}, CUDA {env['cuda']}, {env['date']}"
    return "\n".join([head, render.table(HEAD, [cells(r) for r in rows], left=2), summary(rows), *notes])


def mlflow_rows(rows: list[dict]) -> list[dict]:
    """Rows as bench.log_mlflow logs them (`{column}/{impl}`): impl is part/case, ok as 1.0 / 0.0."""
    out = []
    for r in rows:
        impl = f"{r['part']}/{r['case']}".replace(" / ", "/").replace(" ", "_").replace("=", "-")
        out.append({**{k: v for k, v in r.items() if k != "ok"}, "impl": impl,
                    **({} if r.get("ok") is None else {"ok": float(r["ok"])})})
    return out


def load_results(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {"parts": {}}


def write_docs(md: Path, run: dict[str, dict]) -> dict:
    """Replace the parts in `run` ({part: {"env", "command", "rows", "notes"}}) in the results beside `md` (a .json
    of the same name), keep the others, and rewrite `md` from all of them. Returns the results."""
    store = md.with_suffix(".json")
    results = load_results(store)
    results["parts"].update(run)
    store.write_text(json.dumps(results, indent=1, default=float) + "\n")
    md.write_text(markdown(results))
    return results


def markdown(results: dict) -> str:
    parts = results["parts"]
    lines = ["# rlrun on a GPU: `python -m rlrun.bench gpu`", "",
             "Written by `python -m rlrun.bench gpu` ([gpu.md](gpu.md): how to run it, what each part measures); "
             "do not edit by hand: the results are in `benchmarks-gpu.json` beside this file.", ""]
    if not parts:
        return "\n".join(lines + ["**Not run yet**: no CUDA device has run this command, so there are no "
                                  "numbers here ([not-run.md](not-run.md)).", ""])
    for name in [p for p in PARTS if p in parts]:
        e = parts[name]["env"]
        lines.append(f"- `{name}`: {e['device']}, torch {e['torch']}, CUDA {e['cuda']}, {e['date']}: "
                     f"`{parts[name]['command']}`")
    rows = [r for p in PARTS for r in parts.get(p, {}).get("rows", [])]
    notes = [n for p in PARTS for n in parts.get(p, {}).get("notes", [])]
    body = render.markdown(HEAD, [cells(r) for r in rows])
    return "\n".join(lines + ["", body, "", summary(rows) + ".", *(f"\n{n}" for n in notes), ""])


def run_part(part: str, a) -> tuple[list[dict], list[str]]:
    """(rows, notes) of one part; a part that raises is one failed row, and the others still run."""
    from . import gpu_heads, gpu_runs

    try:
        if part == "heads":
            return gpu_heads.run(a)
        model = gpu_runs.model_overrides("1.5b" if part == "offload" else "0.5b")
        return getattr(gpu_runs, f"{part}_part")(a, model), []
    except Exception as e:  # noqa: BLE001 - one part's failure is a row; the table still comes out
        return [{"part": part, "case": "(all)", "error": f"{type(e).__name__}: {e}"}], []


@contextlib.contextmanager
def stopped_by_sigterm():
    """A SIGTERM (`timeout`, a scheduler) stops the parts instead of the process: the child in flight is cut short
    (gpu_runs.child), none starts after it, and the table of what finished is still printed and written."""
    from . import gpu_runs

    def stop(signum, frame):
        gpu_runs.STOP["why"] = "the command got SIGTERM"
        if gpu_runs.STOP["waiting"]:
            raise gpu_runs.Stopped()

    before = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)
        gpu_runs.STOP.update(why=None, waiting=False)


def bench(a, log_mlflow) -> list[dict]:
    require_cuda()
    a.deadline = time.monotonic() + a.budget if a.budget else None
    env = environment()
    vars(a).update({f"env_{k}": v for k, v in env.items()})  # logged as the MLflow run's params
    command = " ".join(["python -m rlrun.bench", *sys.argv[1:]]) if sys.argv[1:2] == ["gpu"] else "rlrun.bench gpu"
    with stopped_by_sigterm():
        results = {part: run_part(part, a) for part in a.only}
    rows = [r for rs, _ in results.values() for r in rs]
    notes = [n for _, ns in results.values() for n in ns]
    text = table(rows, env, notes)
    print(text, flush=True)
    if a.docs:  # before MLflow: the page is what a stopped command must not lose
        write_docs(Path(a.docs), {p: {"env": env, "command": command, "rows": rs, "notes": ns}
                                  for p, (rs, ns) in results.items()})
        print(f"written to {a.docs}", flush=True)
    log_mlflow(a, mlflow_rows(rows), text, "gpu")
    if any(r.get("ok") is False or "error" in r for r in rows):
        raise SystemExit(1)
    return rows


def add_parser(sub, log_mlflow) -> None:
    from . import gpu_heads, gpu_runs

    p = sub.add_parser("gpu", help="rlrun on a CUDA device: heads, plan, offload, runs, vLLM, decode (one table)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", type=csv_of(PARTS), default=list(PARTS), help=f"parts to run, of {','.join(PARTS)}")
    g = p.add_argument_group("heads")
    g.add_argument("--tokens", type=int, default=8192)
    g.add_argument("--seqs", type=int, default=8, help="sequences the tokens form (Liger takes [seqs, len, hidden])")
    g.add_argument("--hidden", type=int, default=896, help="Qwen2-0.5B's")
    g.add_argument("--vocab", type=int, default=gpu_runs.VOCAB)
    g.add_argument("--tile-size", type=int, default=1024, help="tokens per tile / chunk / shard")
    g.add_argument("--dtypes", type=csv_of(gpu_heads.DTYPES), default=list(gpu_heads.DTYPES))
    g.add_argument("--impls", type=csv_of(gpu_heads.IMPLS), default=list(gpu_heads.IMPLS))
    g.add_argument("--repeat", type=int, default=2, help="timed calls after one warm-up; min time, max peak")
    r = p.add_argument_group("runs (plan, offload, runs, vllm)")
    r.add_argument("--rollout-batch", type=int, default=64, help="sequences per rollout and per optimizer step")
    r.add_argument("--group", type=int, default=8)
    r.add_argument("--micro-batch", type=int, default=32)
    r.add_argument("--new-tokens", type=int, default=64, help="rollout.max_new_tokens")
    r.add_argument("--plan-points", type=argument(gpu_runs.plan_points),
                   default="dense-keep,tiled-keep,chunked-keep,tiled-checkpoint,tiled-keep-lora",
                   help="HEAD-ACTIVATIONS[-lora], comma-separated")
    r.add_argument("--plan-steps", type=int, default=3)
    r.add_argument("--offload-steps", type=int, default=4)
    r.add_argument("--run-steps", type=int, default=8, help="an H200 took 18 s + 4.8 s a step per run (docs/gpu.md)")
    r.add_argument("--variants", type=csv_of(list(gpu_runs.VARIANTS)), default=list(gpu_runs.VARIANTS))
    r.add_argument("--warmup", type=int, default=2, help="first steps left out of steps/s")
    r.add_argument("--vllm-steps", type=int, default=8)
    r.add_argument("--decode-rollouts", type=int, default=5, help="timed rollouts of the decode part (after one "
                   "untimed, which compiles)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                   help="start no run or head after this many seconds; their rows say 'not run' (a lease's minutes)")
    p.add_argument("--docs", default=str(DOCS), help="the markdown page to write, default the checkout's "
                   "docs/benchmarks-gpu.md ('' for none)")
    p.add_argument("--log-dir", default="bench-gpu-logs", help="each run's output, named in a failed row")
    p.add_argument("--tracking-uri", default="sqlite:///mlflow.db", help="'none' to skip MLflow")
    p.set_defaults(func=lambda a: bench(a, log_mlflow), device="cuda")  # every part measures CUDA
