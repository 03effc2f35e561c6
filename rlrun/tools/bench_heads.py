"""`python -m rlrun.bench heads`: one DAPO (or GSPO) forward+backward of the lm head and the loss per
implementation, each in its own process, on identical seeded inputs (the module docstring of rlrun/tools/bench.py);
its inputs, metering and error measures are also the GPU bench's (gpu_heads.py)."""

from __future__ import annotations

import math
from typing import TypedDict

import torch

from .. import registry
from ..heads.common import chunked_logprobs_nograd
from ..losses import objective
from ..losses.dapo import token_loss as dapo_token_loss
from ..meters import MIB, Meter
from ..render import in_child, num, table

PEERS = ("deepspeed", "liger")


class Clip(TypedDict):  # typed keys, so `**CLIP` is checked against the loss's parameters
    clip_low: float
    clip_high: float


CLIP: Clip = {"clip_low": 0.2, "clip_high": 0.28}
GSPO_CLIP: Clip = {"clip_low": 3e-4, "clip_high": 4e-4}
CALL = "call"  # the one phase a benchmark meters: the whole measured call, not the loop's PHASES


def metered(meter, prepare, call, runs: int):
    """`call()` `runs` times, each metered by `meter` as the loop meters a phase (`prepare()` before each, not
    metered); its last result and, per run, (seconds, peak growth in bytes)."""
    readings = []
    for _ in range(runs):
        prepare()
        meter.new_step()
        with meter.phase(CALL):
            out = call()
        readings.append((meter.seconds[CALL], meter.growth[CALL]))
    return out, readings


def make_inputs(a, device):
    g = torch.Generator().manual_seed(a.seed)
    dtype = getattr(torch, a.dtype)
    n = a.tokens
    hidden = torch.randn(n, a.hidden, generator=g).to(device, dtype)
    weight = (torch.randn(a.vocab, a.hidden, generator=g) / math.sqrt(a.hidden)).to(device, dtype)
    targets = torch.randint(0, a.vocab, (n,), generator=g).to(device)
    seq_adv = torch.randn(a.seqs, generator=g)
    adv = seq_adv.repeat_interleave(n // a.seqs).to(device)
    mask = torch.ones(n, dtype=torch.bool, device=device)
    # old logprobs near the current ones, so that some ratios clip
    old = chunked_logprobs_nograd(hidden, weight, targets, 1.0, a.tile_size)
    old = old + 0.3 * torch.randn(n, generator=g).to(device)
    return hidden, weight, targets, mask, adv, seq_adv.to(device), old


def run_impl(name, a, hidden, weight, targets, mask, adv, seq_adv, old):
    n = targets.shape[0]
    if name in registry.REGISTRY["head"]:  # --loss gspo: a.seqs sequences of equal length, GSPO's clip range
        seq = torch.arange(n, device=hidden.device) // (n // a.seqs)
        f = objective(a.objective, adv, old, seq=seq, mask=mask, **(CLIP if a.objective == "dapo" else GSPO_CLIP))
        loss, _ = registry.get("head", name).loss(hidden, weight, targets, mask, f, n, 1.0, a.tile_size)
        return loss
    if name == "deepspeed":
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

        def shard_loss(_self, x, y, m):  # dense DAPO on one (flattened) shard, normalised by the global count
            lp = torch.log_softmax((x @ weight.T).float(), -1).gather(-1, y[:, 0].long()[:, None]).squeeze(-1)
            tok, _ = dapo_token_loss(lp, y[:, 1], y[:, 2], **CLIP)
            return torch.where(m, tok, 0.0).sum() / n

        y = torch.stack([targets.float(), old, adv], -1)[None]
        shards = math.ceil(n / a.tile_size)
        return TiledFusedLogitsLoss.apply(shard_loss, None, hidden[None], y, mask[None], shards, [weight], "sum")
    if name == "liger":
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        rows = a.seqs
        fn = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, compiled=False, loss_type="dapo",
                                      chunk_size=max(1, a.tile_size // (n // rows)), epsilon_low=0.2, epsilon_high=0.28)
        out = fn(hidden.view(rows, n // rows, -1), weight, targets.view(rows, -1), mask.view(rows, -1).long(), seq_adv,
                 old_per_token_logps=old.view(rows, -1))
        return out[0] if isinstance(out, tuple) else out
    raise ValueError(name)


def child(name, a, out_path):
    torch.set_num_threads(a.threads or torch.get_num_threads())
    device = torch.device(a.device)
    hidden, weight, targets, mask, adv, seq_adv, old = make_inputs(a, device)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)

    def zero_grads():
        hidden.grad = weight.grad = None

    def step():
        loss = run_impl(name, a, hidden, weight, targets, mask, adv, seq_adv, old)
        loss.backward()
        return loss

    # the first call warms up (allocator, lazy imports) and is not counted
    loss, readings = metered(Meter(device, phases=(CALL,)), zero_grads, step, a.repeat + 1)
    times, peaks = zip(*readings[1:])
    torch.save({"loss": loss.detach().double().cpu(), "grad_h": hidden.grad.double().cpu(),
                "grad_w": weight.grad.double().cpu(), "time": min(times), "peak": max(peaks)}, out_path)


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def available(name):
    if name in registry.REGISTRY["head"]:
        return True
    try:
        __import__({"deepspeed": "deepspeed", "liger": "liger_kernel"}[name])
        return True
    except ImportError:
        return False


def heads_rows(names, results) -> list[dict]:
    """One table row per implementation; errors relative to dense where dense ran."""
    ref = results.get("dense")
    rows = []
    for name in names:
        r = results[name]
        if "error" in r:
            rows.append({"impl": name, "error": r["error"]})
            continue
        row = {"impl": name, "time_s": r["time"], "peak_extra_mib": r["peak"] / MIB, "loss": r["loss"].item()}
        if ref is not None and "error" not in ref:
            row.update(err_loss=rel_err(r["loss"], ref["loss"]), err_grad_h=rel_err(r["grad_h"], ref["grad_h"]),
                       err_grad_w=rel_err(r["grad_w"], ref["grad_w"]))
        rows.append(row)
    return rows


def heads_bench(a, log_mlflow):
    from tqdm import tqdm

    names = [n for n in a.impls.split(",") if n]
    missing = [n for n in names if not available(n)]
    names = [n for n in names if n not in missing]
    results = {name: in_child(child, name, a) for name in tqdm(names, desc="heads", unit="impl")}
    rows = heads_rows(names, results)
    table = format_table(rows, a)
    print(table)
    for name in missing:
        print(f"(skipped {name}: not installed)")
    log_mlflow(a, rows, table, "heads")
    return rows


def format_table(rows, a):
    head = (f"{a.objective.upper()} fwd+bwd, {a.dtype}, {a.tokens} tokens x hidden {a.hidden} x vocab {a.vocab}, "
            f"tile {a.tile_size} tokens, device {a.device}")
    body = [[r["impl"], f"failed: {r['error']}"] if "error" in r else
            [r["impl"], num(r["time_s"], ".2f"), num(r["peak_extra_mib"], ".0f"), num(r["loss"], ".6f"),
             *(num(r.get(k), ".1e") for k in ("err_loss", "err_grad_h", "err_grad_w"))] for r in rows]
    return head + "\n" + table(["impl", "time s", "peak extra MiB", "loss", "err loss", "err dh", "err dW"], body)
