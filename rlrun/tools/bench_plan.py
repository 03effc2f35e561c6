"""`python -m rlrun.bench plan`: how close the memory plan (rlrun/plan/) comes to what runs measure.

Each point is a short GRPO run of the embedded model (random init, so responses run to rollout.max_new_tokens and
the plan's upper bound on tokens is the real count) with a large vocabulary, `logprob_policy=always` and a small
KL coefficient so that the old and reference passes both run, in its own process. The run logs its plan (plan/*)
and its measured peak growth (mem/*); the bench reads both back from the run's MLflow store and prints, per phase,
predicted vs measured, the error, and whether it is within the target: 15% or 32 MiB, whichever is larger.
Predicted is the plan of each step's micro-batches as they came (plan/<phase>_trained_growth_mib: their lengths, and
the rows train.skip_zero_advantage left in); the table also shows the plan made before the run (`rlrun plan`'s, every
completion at rollout.max_new_tokens), the bound a run must fit, which a real model's shorter completions stay under.
Measured is the median over the run's steps: on CPU it is RSS, which is process-wide, and one step's phase can
catch an allocation that is not its own (a BLAS library's first-call buffers, a thread's); the plan is a step's.

Tokens per micro-batch are micro_batch x max_new_tokens: 512 = 64 x 8 (two micro-batches per step, so gradients
accumulate) and 2048 = 128 x 16 (one). The LoRA point adds model.lora.enabled=true (lm head frozen, reference by
disabling the adapters).

Shape points (--widths x --layers, vocab 32000, 32 rows x 16 new tokens per micro-batch, 4 micro-batches per step):
models wider and deeper than the default's, where the backbone's activations and gradients matter, with each head
and with chunked under train.precision=bf16. The auto points: head.size=auto within --auto-budget MiB, the first
head call (forward and backward) of a fresh process measured against the budget, lm head trained and frozen.

Combination points (--pairs): the planner holds for each option alone, so these check options together: an
all-pairs covering array (rlrun/pairs.py) of the options that change its terms (PAIR_AXES: head, batching,
activations, precision, LoRA, and one micro-batch or four that accumulate), each a shape point of hidden 256, 4
layers, vocab 32000; the table's last line counts them apart.
"""

from __future__ import annotations

import os
import statistics

import torch

from .. import registry, render
from ..plan.phases import FLOOR_MIB, TOLERANCE, within  # noqa: F401 (the plan's target, said once there)

PHASES = ("generate", "old_logprobs", "ref_logprobs", "train")
CHECKED = ("old_logprobs", "ref_logprobs", "train")  # the phases the target is about
TOKENS = {512: (64, 8), 2048: (128, 16)}  # tokens per micro-batch -> (micro_batch, max_new_tokens)


SHAPE_VARIANTS = (("dense", "fp32"), ("tiled", "fp32"), ("chunked", "fp32"), ("chunked", "bf16"))
# --model: a real model's points: its experiment's run (sizes, task, sampling) with each head, full weights trained in
# fp32, then LoRA and bf16 (head, precision, lora)
MODELS = {"smollm2": ["experiment=smollm2"]}
MODEL_VARIANTS = (("dense", "fp32", False), ("tiled", "fp32", False), ("chunked", "fp32", False),
                  ("chunked", "fp32", True), ("tiled", "bf16", False))


def pair_axes() -> dict[str, list]:
    """The options that change the planner's terms, from the registry; `micro`: rows per micro-batch (32: four
    micro-batches accumulate into the step's 128 rows; 128: one); GRPO's losses (gspo adds sequence ids and, on
    tiled, a sweep's logprobs); offload; `skip`: train.skip_zero_advantage acting (no KL term, so that rows of
    advantage 0 leave the train and old passes); the rollout pipeline (async: the generator's weight slots)."""
    losses = [name for name in registry.REGISTRY["loss"] if name != "dpo"]  # the points run GRPO's loop
    return {"head": list(registry.REGISTRY["head"]), "batching": list(registry.REGISTRY["batching"]),
            "activations": list(registry.REGISTRY["activations"]), "precision": list(registry.REGISTRY["precision"]),
            "lora": [False, True], "micro": [32, 128], "loss": losses, "offload": list(registry.REGISTRY["offload"]),
            "skip": [False, True], "pipeline": list(registry.REGISTRY["pipeline"])}


def pair_points() -> list[dict]:
    from ..pairs import all_pairs

    return [dict(row, vocab=32000, hidden=256, layers=4, pair=True,
                 extra=(f"batching={row['batching']}", f"activations={row['activations']}", f"loss={row['loss']}",
                        f"offload={row['offload']}", f"train.skip_zero_advantage={str(row['skip']).lower()}",
                        f"rollout.pipeline={row['pipeline']}"))
            for row in all_pairs(pair_axes())]


def model_points(model: str) -> list[dict]:
    return [dict(model=model, head=h, precision=p, lora=lora) for h, p, lora in MODEL_VARIANTS]


def overrides(point: dict, steps: int, uri: str) -> list[str]:
    if "model" in point:  # a real model's run, as its experiment sizes it; every logprob pass runs
        return [*MODELS[point["model"]], f"head={point['head']}", f"train.precision={point['precision']}",
                f"model.lora.enabled={str(point['lora']).lower()}", f"train.steps={steps}", "logprob_policy=always",
                "loss.kl_coef=0.01", "eval.every=0", "export.enabled=false", "progress=false", f"tracking.uri={uri}"]
    if "hidden" in point:  # a shape point: 32 rows x 16 new tokens per micro-batch, 4 micro-batches per step
        h, heads = point["hidden"], max(1, point["hidden"] // 64)
        size = [f"model.hidden_size={h}", f"model.intermediate_size={4 * h}", f"model.layers={point['layers']}",
                f"model.heads={heads}", f"model.kv_heads={heads}", f"train.micro_batch={point.get('micro', 32)}",
                "rollout.max_new_tokens=16", f"train.precision={point['precision']}"]
    else:
        micro, new = TOKENS[point["tokens"]]
        size = [f"train.micro_batch={micro}", f"rollout.max_new_tokens={new}"]
    kl = 0 if point.get("skip") else 0.01  # a KL term keeps every row in (skipping would not act)
    return [f"head={point['head']}", f"model.vocab_size={point['vocab']}", *size, "train.rollout_batch=128",
            "train.batch_size=128", "train.group_size=16", f"train.steps={steps}", "logprob_policy=always",
            f"loss.kl_coef={kl}", "warm_start.enabled=false", "eval.every=0", "export.enabled=false", "progress=false",
            f"tracking.uri={uri}", *(["model.lora.enabled=true"] if point.get("lora") else []), *point.get("extra", ())]


def child(point: dict, steps: int, out_path: str) -> None:
    """One run of `point` in this fresh process; saves {phase: (predicted, measured, smallest)} growth in MiB: the
    plan, the median of the steps' measured growth (what the table judges) and the smallest step's (what
    tests/unit/plan/test_plan.py judges: docs/plan.md, "Noise")."""
    from ..meters import growth_key, plan_growth_key
    from .bench_trl import rlrun_run

    render.quiet(os.devnull)  # the table is what the bench prints
    with rlrun_run(lambda uri: overrides(point, steps, uri), "bench-plan") as history:
        def median(values):
            return statistics.median(values) if values else None

        def values(name):  # one query of the store per metric
            return [m.value for m in history(name)]

        result = {}
        for p in PHASES:
            # the plan of each step's micro-batches as they came (their lengths; the rows that
            # train.skip_zero_advantage left in), and the run's plan made before it (every completion at
            # rollout.max_new_tokens, every row): the bound a run must fit
            bound = median(values(plan_growth_key(p)))
            planned = median(values(f"plan/{p}_trained_growth_mib"))
            measured = values(growth_key(p))
            result[p] = (planned if planned is not None else bound, median(measured), min(measured, default=None),
                         bound)
    torch.save({p: v for p, v in result.items() if None not in v}, out_path)


def auto_child(point: dict, out_path: str) -> None:
    """head.size=auto in this fresh process: the tile auto_size picks within point['budget'] MiB for 512 tokens of
    a micro-batch that accumulates, then the measured growth of the first head call (loss and backward)."""
    from .. import plan, registry
    from ..losses import objective
    from ..meters import MIB, Meter

    n, vocab, hidden, trainable = 512, point["vocab"], point["hidden"], point["trainable"]
    s = plan.Shapes(vocab=vocab, hidden=hidden, intermediate=4 * hidden, layers=1, kv_dim=hidden, params=0,
                    trainable=0, head_trainable=trainable, param_bytes=4)
    size = plan.auto_size(point["budget"] * MIB, n, s, registry.get("head", point["head"]), accumulate=True)
    head = registry.get("head", point["head"])
    warm = torch.randn(16, 8, requires_grad=True)  # as in a run, torch has computed before (thread pools set up)
    head.loss(warm, torch.randn(64, 8), torch.zeros(16, dtype=torch.long), torch.ones(16, dtype=torch.bool),
              objective("dapo", torch.zeros(16), None, None, None, clip_low=0.2, clip_high=0.28), 16, 1.0,
              16)[0].backward()
    g = torch.Generator().manual_seed(0)
    h = torch.randn(n, hidden, generator=g, requires_grad=True)
    w = torch.randn(vocab, hidden, generator=g, requires_grad=trainable)
    targets = torch.randint(0, vocab, (n,), generator=g)
    f = objective("dapo", torch.randn(n, generator=g), torch.randn(n, generator=g) - 5, None, None, clip_low=0.2,
                  clip_high=0.28)
    meter = Meter(torch.device("cpu"), phases=("call",))
    meter.new_step()
    with meter.phase("call"):
        loss, _ = head.loss(h, w, targets, torch.ones(n, dtype=torch.bool), f, n, 1.0, size)
        loss.backward()
    torch.save({"size": size, "measured": meter.growth["call"] / MIB}, out_path)


def points(a) -> list[dict]:
    if a.model:
        return model_points(a.model)
    grid = [dict(head=h, vocab=v, tokens=t, lora=False) for v in a.vocabs for t in a.tokens for h in a.heads]
    if a.lora:
        head, vocab, tokens = a.lora.split(",")
        grid.append(dict(head=head, vocab=int(vocab), tokens=int(tokens), lora=True))
    grid += [dict(head=head, vocab=32000, hidden=h, layers=n, precision=p) for h in a.widths for n in a.layers
             for head, p in SHAPE_VARIANTS]
    return grid + (pair_points() if a.pairs else [])


def label(p: dict) -> str:
    if "model" in p:
        return "-".join([p["model"], p["head"], p["precision"], *(["lora"] if p["lora"] else [])])
    if p.get("pair"):
        return "-".join([p["head"], p["batching"], p["activations"], p["precision"], *(["lora"] if p["lora"] else []),
                         f"mb{p['micro']}", p["loss"], *(["offload"] if p["offload"] == "on" else []),
                         *(["skip"] if p["skip"] else []), p["pipeline"]])  # an MLflow metric name's characters
    if "hidden" in p:
        return f"{p['head']}-h{p['hidden']}-L{p['layers']}" + ("-bf16" if p["precision"] == "bf16" else "")
    return f"{p['head']}-v{p['vocab']}-n{p['tokens']}" + ("-lora" if p["lora"] else "")


def rows_of(grid: list[dict], results: list[dict]) -> list[dict]:
    rows = []
    for p, r in zip(grid, results):
        if "error" in r:
            rows.append({"impl": label(p), "error": r["error"]})
            continue
        for phase, (pred, meas, *rest) in r.items():
            bound = rest[1] if len(rest) > 1 else pred
            rows.append({"impl": f"{label(p)}/{phase}", "point": label(p), "phase": phase, "predicted_mib": pred,
                         "bound_mib": bound, "measured_mib": meas, "error_pct": 100.0 * (pred - meas) / max(meas, 1e-9),
                         "ok": phase not in CHECKED or within(pred, meas), "pair": bool(p.get("pair"))})
    return rows


def table(rows: list[dict]) -> str:
    body = []
    for r in rows:
        if "error" in r:
            body.append([r["impl"], f"failed: {r['error']}"])
            continue
        target = ("ok" if r["ok"] else "MISSED") if r["phase"] in CHECKED else "(not a target)"
        body.append([r["point"], r["phase"], render.num(r["bound_mib"], ".0f"), render.num(r["predicted_mib"], ".0f"),
                     render.num(r["measured_mib"], ".0f"), render.num(r["error_pct"], "+.1f") + "%", target])
    # "before the run": rlrun plan's number, every completion at rollout.max_new_tokens (a random-weight model's
    # always are); "at the step's lengths": the plan of the micro-batches the steps trained on, which the target is for
    lines = [render.table(["run", "phase", "before the run MiB", "at the step's lengths MiB", "measured MiB", "error",
                           "target"], body, left=2)]
    checked = [r for r in rows if r.get("phase") in CHECKED]
    pairs = [r for r in checked if r.get("pair")]
    if pairs:
        lines.append(f"combinations (all-pairs covering array): {sum(r['ok'] for r in pairs)} of {len(pairs)} phases "
                     "within the target")
    lines.append(f"{sum(r['ok'] for r in checked)} of {len(checked)} train / logprob phases within "
                 f"{TOLERANCE:.0%} or {FLOOR_MIB:.0f} MiB")
    return "\n".join(lines)


def figure(rows: list[dict], path: str) -> str:
    """Predicted vs measured growth, log-log, one marker per head, with the target band."""
    import numpy as np

    done = [r for r in rows if "error" not in r]
    fig, (ax,) = render.figure(8, [6.5])
    lo = max(min(min(r["predicted_mib"], r["measured_mib"]) for r in done), 1.0) / 1.5
    hi = max(max(r["predicted_mib"], r["measured_mib"]) for r in done) * 1.5
    x = np.geomspace(lo, hi, 200)
    ax.plot(x, x, color="black", lw=1, label="predicted = measured")
    band = np.maximum(x * TOLERANCE, FLOOR_MIB)
    ax.fill_between(x, np.maximum(x - band, lo), x + band,
                    color="grey", alpha=0.2, label=f"target: {TOLERANCE:.0%} or {FLOOR_MIB:.0f} MiB")
    markers = {"train": "o", "old_logprobs": "s", "ref_logprobs": "D", "generate": "^"}
    colors = {"dense": "tab:red", "tiled": "tab:blue", "chunked": "tab:green"}
    for head, color in colors.items():
        for phase, marker in markers.items():
            pts = [r for r in done if r["phase"] == phase and head in r["point"].split("-")[:2]]
            if pts:
                ax.scatter([r["measured_mib"] for r in pts], [r["predicted_mib"] for r in pts], color=color,
                           marker=marker, s=40, alpha=0.8, label=f"{head} {phase}", edgecolors="black",
                           linewidths=[1.5 if "lora" in r["point"].split("-") else 0.0 for r in pts])
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="measured peak growth, MiB (CPU RSS)",
           ylabel="predicted at the steps' lengths, MiB", title="Memory plan vs measured, per phase (black edge: LoRA)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, ncol=2, loc="upper left")
    fig.tight_layout()
    return render.save(fig, path)


def auto_rows(a) -> list[dict]:
    """head.size=auto within a.auto_budget MiB, tiled and chunked, lm head trained and frozen: each first call's
    measured growth in a fresh process against the budget."""
    rows = []
    for head in ("tiled", "chunked") if a.auto_budget else ():
        for trainable in (True, False):
            p = dict(head=head, vocab=32000, hidden=64, trainable=trainable, budget=a.auto_budget)
            r = render.in_child(auto_child, p)
            name = f"auto-{head}-{'trained' if trainable else 'frozen'}-head"
            rows.append({"impl": name, "error": r["error"]} if "error" in r else
                        {"impl": name, "budget_mib": float(a.auto_budget), "size": r["size"],
                         "measured_mib": r["measured"], "ok": r["measured"] <= a.auto_budget})
    return rows


def auto_table(rows: list[dict]) -> str:
    body = [[r["impl"], f"failed: {r['error']}"] if "error" in r else
            [r["impl"], f"{r['budget_mib']:.0f}", str(r["size"]), f"{r['measured_mib']:.1f}",
             "ok" if r["ok"] else "OVER"] for r in rows]
    return render.table(["head.size=auto (vocab 32000, hidden 64)", "budget MiB", "tile", "first call MiB",
                         "within"], body, left=1)


def bench(a, log_mlflow) -> list[dict]:
    from tqdm import tqdm

    grid = points(a)
    results = [render.in_child(child, p, a.steps) for p in tqdm(grid, desc="plan", unit="run")]
    rows = rows_of(grid, results)
    autos = [] if a.model else auto_rows(a)
    text = table(rows) + ("\n\n" + auto_table(autos) if autos else "")
    print(text)
    files = [figure(rows, a.figure)] if a.figure and any("error" not in r for r in rows) else []
    rows += autos
    log_mlflow(a, [{k: v for k, v in r.items() if k != "ok"} for r in rows], text, "plan", files=files)
    return rows


def add_parser(sub, func, ints) -> None:
    """`python -m rlrun.bench plan`'s options (`ints`: bench.py's comma-separated integer type)."""
    import argparse

    m = sub.add_parser("plan", help="the memory plan (rlrun plan) vs the measured peak growth of short runs",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    m.add_argument("--heads", type=lambda t: t.split(","), default=list(registry.REGISTRY["head"]))
    m.add_argument("--vocabs", type=ints, default=[16384, 65536, 151936])
    m.add_argument("--tokens", type=ints, default=[512, 2048], help=f"per micro-batch: {sorted(TOKENS)}")
    m.add_argument("--lora", default="tiled,65536,2048", help="HEAD,VOCAB,TOKENS of a LoRA run ('' for none)")
    m.add_argument("--widths", type=ints, default=[128, 256, 512], help="hidden sizes of the shape points ('' none)")
    m.add_argument("--layers", type=ints, default=[2, 8], help="layer counts of the shape points")
    m.add_argument("--auto-budget", type=int, default=24, help="MiB for the head.size=auto points (0: none)")
    m.add_argument("--pairs", action=argparse.BooleanOptionalAction, default=True,
                   help="the combination points: an all-pairs covering array of the options that change the plan")
    m.add_argument("--model", choices=list(MODELS), default=None,
                   help="a real model's points instead: its experiment's run with each head, LoRA and bf16")
    m.add_argument("--steps", type=int, default=3)
    m.add_argument("--figure", default="plan_accuracy.png", help="predicted vs measured (PNG); '' for none")
    m.add_argument("--tracking-uri", default="sqlite:///mlflow.db", help="'none' to skip MLflow")
    m.set_defaults(func=func)
