"""Benchmarks: commands that print a table and log it to MLflow (never timed tests).

    python -m rlrun.bench heads --tokens 2048 --hidden 512 --vocab 151936 --tile-size 256
    python -m rlrun.bench heads --loss gspo --impls dense,tiled,chunked   # a sequence-level loss (tiled: 2 sweeps)
    python -m rlrun.bench dpo --vocab 151936 --lengths 256,512,1024,2048,4096 --budget-mib 4096
    python -m rlrun.bench trl                     # needs TRL: pip install -e '.[bench]'; --model smollm2: real
    python -m rlrun.bench check --model smollm2   # rlrun check over the exact axes' covering array (bench_check.py)
    python -m rlrun.bench plan                    # the memory plan's accuracy (bench_plan.py); --model smollm2
    python -m rlrun.bench batching                # padded vs packed vs shared_prompt (rlrun/tools/bench_batching.py)
    python -m rlrun.bench pipeline                # rollout.pipeline=sync vs async (rlrun/tools/bench_pipeline.py)
    python -m rlrun.bench skip                    # train.skip_zero_advantage on vs off (rlrun/tools/bench_skip.py)
    python -m rlrun.bench generate                # rollout=hf decode: ended rows leave (rlrun/tools/bench_generate.py)
    python -m rlrun.bench replay                  # a sweep, generating vs paired (rlrun/tools/bench_replay.py)
    python -m rlrun.bench gpu                     # rlrun on a CUDA device, every part (rlrun/tools/bench_gpu.py)

`heads`: one DAPO forward+backward of the lm head + loss per implementation, each in its own process (so peaks do
not mix), on identical seeded inputs: rlrun's dense / tiled / chunked heads and the peers a user would pick
instead, DeepSpeed's TiledFusedLogitsLoss and (if liger-kernel is installed) Liger's LigerFusedLinearGRPOLoss.
Reports time, peak extra memory (peak minus memory in use before the call: CPU RSS or CUDA allocated), and the
max relative error of loss and gradients against dense.

`dpo`: one DPO step (reference logprob pass + policy forward and backward) of the embedded tiny model with a
large vocabulary, per head and response length, each in its own process; reports time and peak extra memory and
the longest length each head fits within `--budget-mib`. Points whose dense logits alone would not fit in this
machine's available memory are skipped rather than run into the OOM killer.

`trl`: rlrun's default GRPO run and TRL's GRPOTrainer on the same work, interleaved (rlrun/tools/bench_trl.py).

`plan`: the memory plan's prediction vs the measured peak growth per phase of short runs (rlrun/tools/bench_plan.py).

`batching`: the training and old-logprob passes of each batching option on a long-tailed workload
(rlrun/tools/bench_batching.py).

`pipeline`: the default run synchronous and asynchronous (one / two steps off), interleaved rounds over seeds:
steps/s and held-out accuracy (rlrun/tools/bench_pipeline.py).
"""

from __future__ import annotations

import argparse
import functools

import torch

from ..meters import MIB, Meter, proc_bytes
from ..render import in_child, num, table
from ..tracking import MLflow, TrackingError, check_uri, log_metrics
from . import (
    bench_batching,
    bench_check,
    bench_generate,
    bench_gpu,
    bench_heads,
    bench_pipeline,
    bench_plan,
    bench_replay,
    bench_skip,
    bench_trl,
)

BENCH_EXPERIMENT = "rlrun-bench"


def log_mlflow(a, rows, table, kind, curves=None, files=()):
    """One run in experiment rlrun-bench: arguments as params, the table as `{kind}.txt` (first: nothing logged after
    can lose it), each float of each row as `{column}/{impl}` (no train/ or system/: a benchmark's columns), `curves`
    ({name: values}) over steps, `files` as artifacts. A run whose logging fails is FAILED."""
    if a.tracking_uri == "none":
        return
    cfg = argparse.Namespace(uri=a.tracking_uri, experiment=BENCH_EXPERIMENT, parent_run_id=None)
    tracker = MLflow(cfg, {k: v for k, v in vars(a).items() if k != "func"}, f"bench-{kind}")
    run_id = tracker.run_id
    assert run_id is not None  # MLflow() opened the run or raised
    try:
        tracker.text(table, f"{kind}.txt")
        log_metrics(tracker.client, run_id,
                    {f"{k}/{r['impl']}": v for r in rows for k, v in r.items() if isinstance(v, float)})
        for name, step, v in ((n, i, v) for n, values in (curves or {}).items() for i, v in enumerate(values)):
            log_metrics(tracker.client, run_id, {name: v}, step=step)
        for path in files:
            tracker.client.log_artifact(run_id, path)
    except BaseException:
        tracker.finish("FAILED")
        raise
    tracker.finish("FINISHED")
    print(f"logged to MLflow run {tracker.run_id} ({a.tracking_uri}, experiment {BENCH_EXPERIMENT})")


def dpo_child(head_name, length, a, out_path):
    import random

    from omegaconf import OmegaConf

    from .. import models
    from ..losses.dpo import dpo_loss
    from ..recipes.dpo import encode_pairs, pair_logprobs

    torch.set_num_threads(a.threads or torch.get_num_threads())
    device = torch.device(a.device)
    mcfg = OmegaConf.create(dict(name="tiny", arch="llama", hidden_size=a.hidden, intermediate_size=4 * a.hidden,
                                 layers=2, heads=4, kv_heads=2, max_positions=length + 64, vocab_size=a.vocab,
                                 tie_embeddings=False, dtype="float32"))
    policy, tok = models.build(mcfg, seed=0)
    reference, _ = models.build(mcfg, seed=1)
    policy.to(device), reference.to(device).requires_grad_(False)
    rng = random.Random(0)
    text = lambda: "".join(rng.choice(models.CHARS[:36]) for _ in range(length - 1))  # noqa: E731
    pairs = [{"id": i, "prompt": "1+2=", "chosen": text(), "rejected": text()} for i in range(a.pairs)]
    batch = encode_pairs(tok, pairs, device)
    from .. import axes

    ax = axes.of(head_name, a.tile_size)  # the head bound to its tile, the pairs padded (the DPO bench's layout)

    def step():
        with torch.no_grad():
            rc, rr = pair_logprobs(reference, batch, ax.head, ax.layout, False)
        pc, pr = pair_logprobs(policy, batch, ax.head, ax.layout, False)
        loss, _ = dpo_loss(pc, pr, rc, rr, beta=0.1)
        loss.backward()
        return loss

    # two calls: a warm-up, then the one measured
    meter = Meter(device, phases=(bench_heads.CALL,))
    loss, readings = bench_heads.metered(meter, lambda: policy.zero_grad(set_to_none=True), step, 2)
    torch.save({"time": readings[-1][0], "peak": readings[-1][1], "loss": loss.item()}, out_path)


def available_bytes() -> int:
    return proc_bytes("/proc/meminfo", "MemAvailable")


def dpo_bench(a):
    from tqdm import tqdm

    lengths = [int(x) for x in a.lengths.split(",")]
    heads = [h for h in a.impls.split(",") if h]
    bad = [h for h in heads if h not in ("dense", "chunked")]
    if bad:
        raise SystemExit(f"--impls {bad}: DPO runs on dense and chunked (tiled is refused for DPO)")
    rows = []
    for head in heads:
        for length in tqdm(lengths, desc=f"dpo {head}", unit="len"):
            tokens = 2 * a.pairs * length
            # dense holds ~4 [tokens, vocab] fp32 tensors at its peak (logits, log-softmax, their gradients)
            need = 4 * tokens * a.vocab * 4 if head == "dense" else 0
            if a.device == "cpu" and need > 0.8 * available_bytes():
                rows.append({"impl": head, "length": length, "error": f"skipped: needs ~{need / 2**30:.0f} GiB"})
                continue
            r = in_child(dpo_child, head, length, a)
            rows.append({"impl": head, "length": length, **r} if "error" in r else
                        {"impl": head, "length": length, "time_s": r["time"], "peak_extra_mib": r["peak"] / MIB,
                         "loss": r["loss"]})
    table = dpo_table(rows, heads, a)
    print(table)
    log_mlflow(a, [dict(r, impl=f"{r['impl']}-{r['length']}") for r in rows], table, "dpo")
    return rows


def dpo_table(rows, heads, a) -> str:
    head = (f"DPO step (reference pass + policy fwd/bwd), {a.pairs} pair(s), tiny model hidden {a.hidden}, "
            f"vocab {a.vocab}, chunk {a.tile_size}, device {a.device}")
    body = []
    for r in rows:
        cells = [r["impl"], str(r["length"]), str(2 * a.pairs * r["length"])]
        body.append(cells + ([r["error"]] if "error" in r else
                             [num(r["time_s"], ".2f"), num(r["peak_extra_mib"], ".0f")]))
    lines = [head, table(["impl", "length", "tokens", "time s", "peak extra MiB"], body)]
    for h in heads:
        fits = [r["length"] for r in rows
                if r["impl"] == h and "error" not in r and r["peak_extra_mib"] <= a.budget_mib]
        lines.append(f"longest response length within {a.budget_mib} MiB, {h}: {max(fits) if fits else 'none'}")
    return "\n".join(lines)




def plan_bench(a):
    return bench_plan.bench(a, log_mlflow)


def batching_bench(a):
    return bench_batching.bench(a, log_mlflow)


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rlrun.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(required=True)
    h = sub.add_parser("heads", help="lm head + DAPO loss: time, peak memory, agreement")
    h.add_argument("--tokens", type=int, default=2048)
    h.add_argument("--seqs", type=int, default=8, help="sequences the tokens form (Liger takes [seqs, len, hidden])")
    h.add_argument("--hidden", type=int, default=512)
    h.add_argument("--vocab", type=int, default=151936)
    h.add_argument("--tile-size", type=int, default=256, help="tokens per tile / chunk / shard")
    h.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    h.add_argument("--impls", default="dense,tiled,chunked,deepspeed,liger")
    h.add_argument("--loss", dest="objective", default="dapo", choices=["dapo", "gspo"], help="gspo: rlrun's only")
    h.add_argument("--repeat", type=int, default=1, help="timed calls after one warm-up; min time, max peak")
    h.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    h.add_argument("--threads", type=int, default=0)
    h.add_argument("--seed", type=int, default=0)
    h.add_argument("--tracking-uri", default="sqlite:///mlflow.db", help="'none' to skip MLflow")
    h.set_defaults(func=functools.partial(bench_heads.heads_bench, log_mlflow=log_mlflow), heads=True)
    d = sub.add_parser("dpo", help="DPO step memory, dense vs chunked, as the response length grows")
    d.add_argument("--lengths", default="256,512,1024,2048,4096", help="response tokens per sequence")
    d.add_argument("--pairs", type=int, default=1)
    d.add_argument("--hidden", type=int, default=64)
    d.add_argument("--vocab", type=int, default=151936)
    d.add_argument("--tile-size", type=int, default=256, help="tokens per chunk")
    d.add_argument("--impls", default="dense,chunked")
    d.add_argument("--budget-mib", type=float, default=4096)
    d.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    d.add_argument("--threads", type=int, default=0)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--tracking-uri", default="sqlite:///mlflow.db", help="'none' to skip MLflow")
    d.set_defaults(func=dpo_bench, tokens=None, seqs=None)
    bench_trl.add_parser(sub, log_mlflow)
    bench_check.add_parser(sub, log_mlflow)
    bench_plan.add_parser(sub, plan_bench, ints)
    bench_batching.add_parser(sub, batching_bench)
    bench_pipeline.add_parser(sub, log_mlflow)
    bench_skip.add_parser(sub, log_mlflow)
    bench_replay.add_parser(sub, log_mlflow)
    bench_generate.add_parser(sub, log_mlflow)
    bench_gpu.add_parser(sub, log_mlflow)
    return p


def main(argv=None):
    p = parser()
    a = p.parse_args(argv)
    if getattr(a, "heads", False) and a.tokens % a.seqs:
        p.error(f"--tokens {a.tokens} must be divisible by --seqs {a.seqs}")
    if getattr(a, "heads", False) and a.objective != "dapo" and set(a.impls.split(",")) & set(bench_heads.PEERS):
        p.error(f"--loss {a.objective} runs on rlrun's heads only: --impls dense,tiled,chunked (the peers are DAPO's)")
    if a.func is plan_bench and set(a.tokens) - set(bench_plan.TOKENS):
        p.error(f"--tokens {a.tokens}: each must be one of {sorted(bench_plan.TOKENS)}")
    if a.tracking_uri != "none":  # a store that cannot be used fails now, not after the benchmark
        try:
            check_uri(a.tracking_uri, "--tracking-uri", "--tracking-uri none")
        except TrackingError as e:
            p.error(str(e))
    return a.func(a)


if __name__ == "__main__":
    main()
