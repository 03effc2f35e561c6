"""Part `heads` of `python -m rlrun.bench gpu`: the loss heads at a real size, each against an fp64 reference.

Per dtype (fp32, bf16) one DAPO forward+backward of the lm head and loss per implementation, each in its own
process with `python -m rlrun.bench heads`'s machinery (rlrun/tools/bench_heads.py): its seeded inputs (the old logprobs
kept off the clip bounds: keep_off_the_clip), its implementations and its metering (the fastest call after a
warm-up, `torch.cuda.max_memory_allocated` growth over what was allocated when the call began). The reference is
computed in float64 from the same inputs as the dtype's run (the bf16 inputs upcast, so that it measures the error
of the computation, not of rounding the inputs): per-token logprobs by plain autograd a block of rows at a time,
rlrun's DAPO objective on them, and the chain rule back through each block. It shares no code with the heads it
checks, only the objective (the loss's definition).
"""

from __future__ import annotations

import argparse
import math

import torch

from ..heads.common import chunked_logprobs_nograd
from ..losses import masked_total, objective
from ..meters import MIB, Meter
from . import bench_heads, gpu_runs

IMPLS = ("dense", "tiled", "chunked", "deepspeed", "liger")
DTYPES = ("float32", "bfloat16")
SHORT = {"float32": "fp32", "bfloat16": "bf16"}
# Max relative error (max |x - ref| / max |ref|) of loss, dL/dh and dL/dW vs the fp64 reference for an "ok".
# fp32: the project's equivalence tolerance. bf16: inputs and lm-head matmul in bf16 (8-bit mantissa, eps 3.9e-3),
# softmax in fp32. Calibrated on CPU at 4096 x 32768 x 896: every head (DeepSpeed's too) within 1.5e-6 in fp32,
# and 1.5e-4 (loss) / 7.2e-3 (gradients) in bf16 (docs/gpu.md).
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}
REFERENCE = "fp64 reference"
MARGIN = 0.05  # no log-ratio within this of a clip bound: see keep_off_the_clip


def keep_off_the_clip(current: torch.Tensor, old: torch.Tensor, margin: float = MARGIN) -> torch.Tensor:
    """`old` logprobs moved so that no token's log-ratio (current - old) lies within `margin` of a clip bound. The
    clipped objective's gradient jumps at the bounds (a clipped token contributes none), so a token that bf16's
    rounding (a few 1e-3 in a logprob) carries across a bound changes its whole row of dL/dh: measured 0.95 relative
    error at 256 tokens with every head agreeing, which says nothing about the heads. Both branches stay exercised."""
    r = current - old
    for bound in (math.log(1 - bench_heads.CLIP["clip_low"]), math.log(1 + bench_heads.CLIP["clip_high"])):
        pushed = torch.where(r >= bound, r.new_full((), bound + margin), r.new_full((), bound - margin))
        r = torch.where((r - bound).abs() < margin, pushed, r)
    return current - r


def inputs(a, device):
    """`python -m rlrun.bench heads`'s seeded inputs (bench_heads.make_inputs), the old logprobs kept off the clip."""
    hidden, weight, targets, mask, adv, seq_adv, old = bench_heads.make_inputs(a, device)
    current = chunked_logprobs_nograd(hidden, weight, targets, 1.0, a.tile_size)
    return hidden, weight, targets, mask, adv, seq_adv, keep_off_the_clip(current, old)


def bench_args(a, dtype: str) -> argparse.Namespace:
    """The arguments `child`, `bench_heads.make_inputs` and `bench_heads.run_impl` read, from the gpu command's."""
    return argparse.Namespace(tokens=a.tokens, seqs=a.seqs, hidden=a.hidden, vocab=a.vocab, tile_size=a.tile_size,
                              dtype=dtype, repeat=a.repeat, device=a.device, threads=0, seed=a.seed, objective="dapo")


def reference(hidden, weight, targets, mask, adv, old, rows: int = 1024):
    """(loss, dL/dhidden, dL/dweight) of DAPO over the dense head in float64, `rows` tokens at a time."""
    h, w = hidden.detach().double(), weight.detach().double()
    n = targets.shape[0]
    blocks = [slice(i, min(i + rows, n)) for i in range(0, n, rows)]

    def block_logprobs(hb, wb, sl):
        return torch.log_softmax(hb @ wb.T, dim=-1).gather(-1, targets[sl, None]).squeeze(-1)

    with torch.no_grad():
        lp = torch.cat([block_logprobs(h[sl], w, sl) for sl in blocks])
    lp.requires_grad_(True)
    f = objective("dapo", adv.double(), old.double(), **bench_heads.CLIP)
    loss = masked_total(f(lp)[0], mask, n)
    (g,) = torch.autograd.grad(loss, lp)
    grad_h, grad_w = torch.empty_like(h), torch.zeros_like(w)
    for sl in blocks:  # L = sum_t l(lp_t): dL/dtheta = sum_t l'(lp_t) dlp_t/dtheta, block by block
        hb, wb = h[sl].clone().requires_grad_(True), w.detach().requires_grad_(True)
        gh, gw = torch.autograd.grad(block_logprobs(hb, wb, sl), (hb, wb), grad_outputs=g[sl])
        grad_h[sl] = gh
        grad_w += gw
    return loss.detach(), grad_h, grad_w


def child(name: str, a, out_path) -> None:
    """One implementation's forward+backward in this fresh process, metered as `bench_heads.child` meters it (the first
    call a warm-up; the fastest of the others, the largest growth), on `inputs`."""
    device = torch.device(a.device)
    hidden, weight, targets, mask, adv, seq_adv, old = inputs(a, device)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)

    def zero_grads():
        hidden.grad = weight.grad = None

    def step():
        loss = bench_heads.run_impl(name, a, hidden, weight, targets, mask, adv, seq_adv, old)
        loss.backward()
        return loss

    loss, readings = bench_heads.metered(Meter(device, phases=(bench_heads.CALL,)), zero_grads, step, a.repeat + 1)
    times, peaks = zip(*readings[1:])
    torch.save({"loss": loss.detach().double().cpu(), "grad_h": hidden.grad.double().cpu(),
                "grad_w": weight.grad.double().cpu(), "time": min(times), "peak": max(peaks)}, out_path)


def reference_child(a, out_path) -> None:
    """The fp64 reference of `a.dtype`'s inputs in this fresh process, metered like a head."""
    device = torch.device(a.device)
    hidden, weight, targets, mask, adv, _, old = inputs(a, device)
    meter = Meter(device, phases=(bench_heads.CALL,))
    (loss, grad_h, grad_w), readings = bench_heads.metered(
        meter, lambda: None, lambda: reference(hidden, weight, targets, mask, adv, old), 1)
    torch.save({"loss": loss.cpu(), "grad_h": grad_h.cpu(), "grad_w": grad_w.cpu(),
                "time": readings[0][0], "peak": readings[0][1]}, out_path)


def errors(impl: str, a) -> dict[str, float]:
    """Max relative errors of `impl`'s loss, dL/dh and dL/dW against the fp64 reference, in this process and without
    metering: the check a row makes, small enough for a test (tests/e2e/test_gpu.py on CUDA, test_bench_gpu on CPU).
    `a`: `bench_args`'s namespace, so that a field the heads read is never missing here alone."""
    device = torch.device(a.device)
    hidden, weight, targets, mask, adv, seq_adv, old = inputs(a, device)
    ref = dict(zip(("loss", "grad_h", "grad_w"), reference(hidden, weight, targets, mask, adv, old)))
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    loss = bench_heads.run_impl(impl, a, hidden, weight, targets, mask, adv, seq_adv, old)
    loss.backward()
    got = {"loss": loss.detach(), "grad_h": hidden.grad, "grad_w": weight.grad}
    return {k: bench_heads.rel_err(got[k].double(), ref[k]) for k in ref}


def row_of(impl: str, dtype: str, r: dict, ref: dict | None) -> dict:
    """One table row: the run's time and growth, its errors vs the reference and the verdict."""
    row = {"part": "heads", "case": f"{impl} {SHORT[dtype]}"}
    if gpu_runs.missing(r):
        return gpu_runs.error_row("heads", row["case"], r)
    row.update(time_s=r["time"], growth_mib=r["peak"] / MIB)
    if impl == REFERENCE:
        return {**row, "check": "float64, block by block", "ok": None}
    if ref is None or gpu_runs.missing(ref):
        return {**row, "check": "no reference", "ok": False}
    errs = {k: bench_heads.rel_err(r[k], ref[k]) for k in ("loss", "grad_h", "grad_w")}
    tol = TOLERANCE[dtype]
    row.update(err_loss=errs["loss"], err_grad_h=errs["grad_h"], err_grad_w=errs["grad_w"],
               check=f"vs fp64: loss {errs['loss']:.1e}, dh {errs['grad_h']:.1e}, dW {errs['grad_w']:.1e} "
                     f"(tol {tol:.0e})", ok=max(errs.values()) <= tol)
    return row


def run(a) -> tuple[list[dict], list[str]]:
    """Rows of every available implementation in each dtype of `a.dtypes`, and notes on those left out."""
    impls = [i for i in a.impls if bench_heads.available(i)]
    notes = [f"heads: {i} not installed, left out" + (" (pip install liger-kernel)" if i == "liger" else "")
             for i in a.impls if i not in impls]
    rows = []
    for dtype in a.dtypes:
        args = bench_args(a, dtype)
        print(f"heads: {SHORT[dtype]} reference", flush=True)
        ref = gpu_runs.child(a, reference_child, args)
        rows.append(row_of(REFERENCE, dtype, ref, None))
        for impl in impls:
            print(f"heads: {impl} {SHORT[dtype]}", flush=True)
            rows.append(row_of(impl, dtype, gpu_runs.child(a, child, impl, args), ref))  # one result in memory
    return rows, notes
