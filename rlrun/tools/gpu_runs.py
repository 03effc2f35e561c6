"""Parts `plan`, `offload`, `runs` and `vllm` of `python -m rlrun.bench gpu`: short GRPO runs of Qwen2-shaped models.

Each run is rlrun's own loop (`rlrun.cli.run`, as `rlrun <overrides>`) in a fresh process with its own MLflow store;
what a row says is read back from the metrics the run logged (time/*, mem/*, plan/*, grad_norm, throughput/*,
mismatch/*). The models are random-init Qwen2 architectures built from a transformers config (model=tiny with
Qwen2-0.5B's or Qwen2-1.5B's sizes, vocabulary 151936, tied embeddings; the character tokenizer, so nothing is
downloaded). Random init means every response runs to rollout.max_new_tokens, so the token counts are the plan's
upper bounds, and packing has no padding to remove (its speed-up is measured by `python -m rlrun.bench batching`).

- plan: each phase's predicted (plan/*) vs measured (mem/*) CUDA peak and growth, median over the run's steps, for
  head x activations x LoRA points; target as `python -m rlrun.bench plan`: 15% or 32 MiB.
- offload: offload=on vs off on the 1.5B shape: prep seconds per step (offload + old + ref + onload), the
  old-pass peak, the bytes that come back to the device per step (the onload phase's growth) against AdamW's
  state (2 x 4 bytes per trainable parameter), and the grad norms of the two runs (the round trip is exact).
- runs: logprob policies, batching and rollout.pipeline against the baseline (always, padded, sync): steps/s,
  peak, and the step-0 grad norm (same rollout, same weights: the options are exact there).
- vllm: rollout=vllm with weight sync vs rollout=hf: generated tokens/s, syncs, generation-vs-trainer mismatch.
"""

from __future__ import annotations

import os
import statistics
import time
import traceback
from typing import Any

from .. import registry, render
from ..meters import PHASES, growth_key, peak_key, plan_growth_key, plan_peak_key, time_key

SHAPES = {  # Qwen2-0.5B (494.0M parameters) and Qwen2-1.5B (1543.7M) as model=tiny sizes
    "0.5b": dict(hidden_size=896, intermediate_size=4864, layers=24, heads=14, kv_heads=2),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, layers=28, heads=12, kv_heads=2)}
VOCAB = 151936
HEADS, ACTIVATIONS = tuple(registry.REGISTRY["head"]), tuple(registry.REGISTRY["activations"])
PLAN_PHASES = ("generate", "old_logprobs", "ref_logprobs", "train")
PREP = ("offload", "old_logprobs", "ref_logprobs", "onload")  # offload docs: the step's preparation
BASE = ["logprob_policy=always", "batching=padded", "rollout.pipeline=sync", "loss.kl_coef=0"]
VARIANTS = {"always": [], "window": ["logprob_policy=window"], "skip": ["logprob_policy=skip"],
            "packed": ["batching=packed"], "shared_prompt": ["batching=shared_prompt"],
            "async": ["rollout.pipeline=async", "rollout.max_staleness=1"]}
KEYS = ["loss", "grad_norm", "throughput/gen_tokens_per_s", "mismatch/gen_vs_train_abs", "staleness_mean",
        *(f(p) for p in PHASES for f in (time_key, peak_key, growth_key, plan_peak_key, plan_growth_key))]
EXACT = 1e-5  # relative difference of a grad norm that counts as the same computation in fp32
OFFLOAD_EXACT = 1e-4  # across steps, where CUDA's nondeterministic kernels (atomics) may part two runs slightly
MOVED = 0.05  # bytes back on the device within 5% of AdamW's state
MISMATCH = 1e-3  # max generation-vs-trainer logprob gap (mean |diff| per step) for an "ok" in float32


def model_overrides(shape: str) -> list[str]:
    return ["model=tiny", "model.arch=qwen2", *(f"model.{k}={v}" for k, v in SHAPES[shape].items()),
            f"model.vocab_size={VOCAB}", "model.tie_embeddings=true", "model.max_positions=4096"]


def common(a, steps: int) -> list[str]:
    """What every run of the check shares: the device, the sizes of a step, nothing but training."""
    return [f"engine.device={a.device}", f"train.steps={steps}", f"seed={a.seed}", "train.lr=1e-6",
            f"train.rollout_batch={a.rollout_batch}", f"train.batch_size={a.rollout_batch}",
            f"train.group_size={a.group}", f"train.micro_batch={a.micro_batch}",
            f"rollout.max_new_tokens={a.new_tokens}", "warm_start.enabled=false", "eval.every=0",
            "export.enabled=false", "progress=false"]


STOP: dict[str, Any] = {"why": None, "waiting": False}  # set by bench_gpu's SIGTERM handler


class Stopped(Exception):
    """Raised by bench_gpu's SIGTERM handler while a child runs: that child is cut short, the finished ones stay."""


def child(a, target, *args) -> dict:
    """`render.in_child(target, *args)`, unless the command's time is up: after `--budget` seconds, or once it got a
    SIGTERM (a scheduler's, or `timeout`'s), no child starts, and one cut short by the SIGTERM is an error. Either
    way the part goes on to its rows, so a command stopped half-way still prints and writes what it measured."""
    if STOP["why"]:
        return {"skipped": f"not started: {STOP['why']}"}
    deadline = getattr(a, "deadline", None)
    if deadline is not None and time.monotonic() >= deadline:
        return {"skipped": f"not started: over --budget {a.budget:g} s"}
    STOP["waiting"] = True
    try:
        return render.in_child(target, *args)
    except Stopped:
        return {"error": f"cut short: {STOP['why']}"}
    finally:
        STOP["waiting"] = False


def missing(r: dict) -> bool:
    """A run that did not finish (failed, cut short, or not started): it has no metrics to read."""
    return "error" in r or "skipped" in r


def saved(measure, log_path: str, out_path: str) -> None:
    """In a child process: its output to `log_path`; saves what `measure()` returns, or {"error": why}."""
    import torch

    render.quiet(log_path)
    try:
        out = measure()
    except BaseException as e:  # noqa: BLE001 - the row says why, the log has the traceback
        traceback.print_exc()
        out = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    torch.save(out, out_path)


def run_child(overrides: list[str], name: str, log_path: str, out_path: str) -> None:
    """`rlrun <overrides>` in this fresh process; saves {metric: [(step, value, seconds)]} of KEYS, or {"error"}."""
    from .bench_trl import rlrun_run

    def histories() -> dict:
        with rlrun_run(lambda uri: [*overrides, f"tracking.uri={uri}"], name) as history:
            return {k: [(m.step, m.value, m.timestamp / 1000) for m in history(k)] for k in KEYS}

    saved(histories, log_path, out_path)


def merged(*groups: list[str]) -> list[str]:
    """Overrides, a later `key=value` replacing an earlier one of the same key (Hydra refuses a key twice)."""
    out: dict[str, str] = {}
    for item in (x for g in groups for x in g):
        out[item.split("=", 1)[0]] = item
    return list(out.values())


def launch(a, name: str, overrides: list[str]) -> dict:
    """One run in a child process; its histories, or {"error": why (and where the log is)}."""
    return logged_child(a, name, f"rlrun {' '.join(overrides)}", run_child, overrides, name)


def logged_child(a, name: str, what: str, target, *args) -> dict:
    """`target(*args, log, out)` in a child (gpu_runs.child) with its output in `<log-dir>/<name>.log`, named in
    its error."""
    os.makedirs(a.log_dir, exist_ok=True)
    log = os.path.join(a.log_dir, f"{name}.log")
    print(f"{name}: {what}", flush=True)
    r = child(a, target, *args, log)
    return {**r, "error": f"{r['error']} (log: {log})"} if "error" in r else r


def values(h: dict, key: str, skip: int = 0) -> list[float]:
    return [v for step, v, _ in h.get(key, []) if step >= skip]


def median(h: dict, key: str, skip: int = 0) -> float | None:
    v = values(h, key, skip)
    return statistics.median(v) if v else None


def steps_per_s(h: dict, skip: int) -> float | None:
    """1 / the median wall time between consecutive steps' ends (their logged `loss`), steps from `skip` on."""
    ends = [t for step, _, t in h.get("loss", []) if step >= skip]
    gaps = [b - e for e, b in zip(ends, ends[1:])]
    return 1.0 / statistics.median(gaps) if gaps and statistics.median(gaps) > 0 else None


def peak(h: dict) -> float | None:
    """The largest measured peak of any phase at any step (MiB)."""
    v = [x for p in PHASES for x in values(h, peak_key(p))]
    return max(v) if v else None


def rel_diff(x: float | None, ref: float | None) -> float:
    if x is None or ref is None:
        return float("inf")
    return abs(x - ref) / max(abs(ref), 1e-30)


def error_row(part: str, case: str, r: dict) -> dict:
    """The row of a run that did not finish: failed (error) or not started (skipped), saying why."""
    return {"part": part, "case": case, **{k: r[k] for k in ("error", "skipped") if k in r}}


def plan_points(text: str) -> list[tuple[str, str, bool]]:
    """'dense-keep,tiled-keep-lora' -> [(head, activations, lora)]; ValueError naming a malformed point."""
    out = []
    for item in filter(None, text.split(",")):
        parts = item.split("-")
        if (len(parts) not in (2, 3) or parts[0] not in HEADS or parts[1] not in ACTIVATIONS
                or parts[2:] not in ([], ["lora"])):
            raise ValueError(f"plan point {item!r}: write HEAD-ACTIVATIONS or HEAD-ACTIVATIONS-lora with HEAD of "
                             f"{'/'.join(HEADS)} and ACTIVATIONS of {'/'.join(ACTIVATIONS)}, e.g. tiled-keep-lora")
        out.append((parts[0], parts[1], len(parts) == 3))
    if not out:
        raise ValueError(f"no plan point in {text!r}")
    return out


def plan_rows(point: str, h: dict) -> list[dict]:
    """Per phase: predicted vs measured peak and growth (medians over the steps); the verdict as bench plan's."""
    from .bench_plan import CHECKED, within

    rows = []
    for p in PLAN_PHASES:
        pp, mp, pg, mg = (median(h, k(p)) for k in (plan_peak_key, peak_key, plan_growth_key, growth_key))
        if pp is None or mp is None or pg is None or mg is None:
            continue  # a phase this run does not have
        rows.append({"part": "plan", "case": f"{point} / {p}", "mem_mib": mp, "mem_what": "peak",
                     "plan_peak_mib": pp, "peak_mib": mp, "plan_growth_mib": pg, "growth_mib": mg,
                     "check": f"plan peak {pp:.0f} ({100 * (pp - mp) / mp:+.1f}%), growth {pg:.0f} vs {mg:.0f} MiB "
                              f"({100 * (pg - mg) / max(mg, 1e-9):+.1f}%)",
                     "ok": (within(pp, mp) and within(pg, mg)) if p in CHECKED else None})
    return rows


def plan_overrides(a, model: list[str], head: str, act: str, lora: bool) -> list[str]:
    """Both logprob passes run (always, a KL term), so every phase the plan predicts is measured."""
    return merged(model, common(a, a.plan_steps), [f"head={head}", f"activations={act}", "logprob_policy=always",
                                                   "loss.kl_coef=0.01", *(["model.lora.enabled=true"] if lora else [])])


def plan_part(a, model: list[str]) -> list[dict]:
    rows = []
    for head, act, lora in a.plan_points:
        point = f"{head}-{act}" + ("-lora" if lora else "")
        r = launch(a, f"plan-{point}", plan_overrides(a, model, head, act, lora))
        rows += [error_row("plan", point, r)] if missing(r) else plan_rows(point, r)
    return rows


def state_bytes(model: list[str]) -> int:
    """AdamW's state of `model`: exp_avg and exp_avg_sq, fp32, per trainable parameter (meta device: no weights)."""
    from .. import plan
    from .bench_trl import compose

    cfg = compose([*model, "tracking=none"])
    meta, _ = plan.meta_model(cfg.model, 0)
    return 2 * 4 * sum(p.numel() for p in meta.parameters() if p.requires_grad)


def offload_rows(on: dict, off: dict, expected: int, skip: int) -> list[dict]:
    """The two runs' rows: prep s/step, old-pass peak; for `on`, the bytes back on the device per step and the grad
    norms against `off`'s."""
    rows = []
    for case, h in (("offload=off", off), ("offload=on", on)):
        if missing(h):
            rows.append(error_row("offload", case, h))
            continue
        prep = sum(median(h, time_key(p), skip) or 0.0 for p in PREP)
        row = {"part": "offload", "case": case, "speed": prep, "speed_unit": "s prep/step",
               "mem_mib": median(h, peak_key("old_logprobs"), skip), "mem_what": "old-pass peak", "ok": None,
               "check": "moves nothing"}
        if case == "offload=on":
            moved = median(h, growth_key("onload"), skip) or 0.0
            norms = [rel_diff(x, y) for x, y in zip(values(h, "grad_norm"), values(off, "grad_norm"))]
            same = bool(norms) and not missing(off) and max(norms) <= OFFLOAD_EXACT
            row.update(moved_mib=moved, state_mib=expected / 2**20, grad_norm_rel_diff=max(norms, default=None),
                       check=f"back on device {moved:.0f} MiB/step (AdamW state {expected / 2**20:.0f}); "
                             f"grad norms vs off {max(norms, default=float('nan')):.1e} (tol {OFFLOAD_EXACT:.0e})",
                       ok=abs(moved - expected / 2**20) <= MOVED * expected / 2**20 and same)
        rows.append(row)
    return rows


def offload_overrides(a, model: list[str], mode: str) -> list[str]:
    """Both logprob passes run, between which the state is off the device with offload=on."""
    return merged(model, common(a, a.offload_steps), [f"offload={mode}", "head=chunked", "logprob_policy=always",
                                                      "loss.kl_coef=0.01"])


def offload_part(a, model: list[str]) -> list[dict]:
    runs = {mode: launch(a, f"offload-{mode}", offload_overrides(a, model, mode)) for mode in ("off", "on")}
    # from the second step on: the first has no optimizer state yet (AdamW creates it in its first step)
    return offload_rows(runs["on"], runs["off"], state_bytes(model), skip=1)


def runs_rows(results: dict[str, dict], skip: int) -> list[dict]:
    """Steps/s, peak and the step-0 grad norm of each variant against `always` (the baseline)."""
    base = results.get("always", {"error": "not run"})
    base_sps = None if missing(base) else steps_per_s(base, skip)
    base_g0 = None if missing(base) else next(iter(values(base, "grad_norm")), None)
    rows = []
    for name, h in results.items():
        if missing(h):
            rows.append(error_row("runs", name, h))
            continue
        sps, g0 = steps_per_s(h, skip), next(iter(values(h, "grad_norm")), None)
        row = {"part": "runs", "case": name, "speed": sps, "speed_unit": "steps/s", "mem_mib": peak(h),
               "mem_what": "peak"}
        if name == "always":
            row.update(check="baseline (always, padded, sync)", ok=None)
        else:
            d = rel_diff(g0, base_g0)
            ratio = sps / base_sps if sps and base_sps else None
            row.update(grad_norm0_rel_diff=d, speedup=ratio, ok=d <= EXACT,
                       check=f"x{render.num(ratio, '.2f')} steps/s; step-0 grad norm vs always {d:.1e} "
                             f"(tol {EXACT:.0e})")
        rows.append(row)
    return rows


def runs_overrides(a, model: list[str], variant: str) -> list[str]:
    return merged(model, common(a, a.run_steps), BASE, VARIANTS[variant])


def runs_part(a, model: list[str]) -> list[dict]:
    results = {v: launch(a, f"runs-{v}", runs_overrides(a, model, v))
               for v in ["always", *[v for v in a.variants if v != "always"]]}
    return runs_rows(results, a.warmup)


def vllm_rows(hf: dict, vllm: dict, steps: int, skip: int) -> list[dict]:
    rows, base = [], None
    for case, h in (("rollout=hf", hf), ("rollout=vllm", vllm)):
        if missing(h):
            rows.append(error_row("vllm", case, h))
            continue
        tps = median(h, "throughput/gen_tokens_per_s", skip)
        mism = max(values(h, "mismatch/gen_vs_train_abs"), default=None)
        syncs = len([v for v in values(h, time_key("sync")) if v > 0])
        row = {"part": "vllm", "case": case, "speed": tps, "speed_unit": "gen tok/s",
               "mem_mib": median(h, peak_key("generate"), skip), "mem_what": "generate peak", "mismatch_max": mism,
               "syncs": float(syncs), "ok": mism is not None and mism <= MISMATCH}
        note = f"mismatch max {render.num(mism, '.1e')} (tol {MISMATCH:.0e})"
        if case == "rollout=hf":
            base = tps
        else:
            ratio = tps / base if tps and base else None
            row["ok"] = row["ok"] and syncs >= steps - 1
            note = (f"x{render.num(ratio, '.2f')} hf's tok/s; {syncs} syncs of {steps - 1} steps, "
                    f"{render.num(median(h, time_key('sync')), '.3f')} s each; " + note)
        rows.append({**row, "check": note})
    return rows


def vllm_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def vllm_part(a, model: list[str]) -> list[dict]:
    if not vllm_available():
        return [{"part": "vllm", "case": "rollout=vllm", "skipped": "vLLM is not installed: pip install -e '.[vllm]'"}]
    hf = launch(a, "vllm-hf", vllm_overrides(a, model, "hf"))
    vllm = launch(a, "vllm-vllm", vllm_overrides(a, model, "vllm"))
    return vllm_rows(hf, vllm, a.vllm_steps, skip=1)


def vllm_overrides(a, model: list[str], rollout: str) -> list[str]:
    """logprob_policy=always: the old pass measures the generation-vs-trainer mismatch at every step."""
    own = [f"rollout.max_model_len={a.new_tokens + 128}"] if rollout == "vllm" else []
    return merged(model, common(a, a.vllm_steps), ["logprob_policy=always", f"rollout={rollout}", *own])


def decode_child(args: dict, log_path: str, out_path: str) -> None:
    """`python -m rlrun.bench generate --device cuda` in this fresh process; saves its rows, or {"error"}."""
    import argparse

    from . import bench_generate

    saved(lambda: {"rows": bench_generate.measure(argparse.Namespace(**args))}, log_path, out_path)


def decode_rows(r: dict) -> list[dict]:
    """bench generate's rows as the table's: tokens/s, x of the GEMM bound, the compiled step's tokens and logprobs
    against eager's (ok: the same tokens, logprobs within MISMATCH of eager's)."""
    if missing(r):
        return [error_row("decode", "rollout.decode", r)]
    rows = []
    for g in r["rows"]:
        check = f"x{render.num(g['of_bound'], '.2f')} of the GEMM bound; x{render.num(g['speedup'], '.2f')} every row"
        ok = None
        if g["logprob_diff"] is not None:  # rlrun's own decodes, compared with eager's tokens
            ok = bool(g["same_tokens"]) and g["logprob_diff"] <= MISMATCH
            check += f"; logprobs vs eager {render.num(g['logprob_diff'], '.1e')}"
        if g["compile_s"]:
            check += f"; compiles {render.num(g['compile_s'], '.1f')} s"
        if g.get("per_pass") is not None:  # a rollout.speculate row
            check += (f"; acceptance {render.num(g['acceptance'], '.2f')}, "
                      f"{render.num(g['per_pass'], '.2f')} tokens/verify pass")
        rows.append({"part": "decode", "case": g["impl"], "speed": g["tokens_per_s"], "speed_unit": "gen tok/s",
                     "of_bound": g["of_bound"], "check": check, "ok": ok})
    return rows


def decode_part(a, model: list[str]) -> list[dict]:
    """rollout=hf's eager and compiled decode (CUDA graphs), rollout=vllm where installed, and the GEMM bound, on
    the same rollouts of the 0.5B shape (random init: every row runs to --new-tokens)."""
    args = [*model, f"train.rollout_batch={a.rollout_batch}", f"train.batch_size={a.rollout_batch}",
            f"train.micro_batch={min(a.micro_batch, a.rollout_batch)}", f"train.group_size={a.group}",
            f"rollout.max_new_tokens={a.new_tokens}", "warm_start.enabled=false"]
    what = f"python -m rlrun.bench generate --device {a.device} --rlrun-args {' '.join(args)}"
    return decode_rows(logged_child(a, "decode", what, decode_child, {
        "rollouts": a.decode_rollouts, "seed": a.seed, "device": a.device, "threads": None, "vllm": vllm_available(),
        "vllm_args": ["rollout.enforce_eager=false"], "rlrun_args": args}))
