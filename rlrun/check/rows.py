"""A probe's verdict (`Row`) and the distances the probes compare with (rlrun/check/probes.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Row:
    probe: str
    expects: str
    measured: str
    ok: bool | None  # None: does not apply to this configuration
    source: str  # the public report of the failure class
    # a failure stops a sweep's job before it trains: what it trains would be wrong. The memory plan's forecast is
    # not (a miss is reported and logged; the job trains)
    blocks: bool = True


def within(tol: float, *distances: float) -> bool:
    """Every distance at most `tol`; a NaN is not (Python's max() passes over a NaN after a number: max(0.0, nan) is
    0.0, so a NaN gradient beside an exact loss would pass)."""
    return all(d <= tol for d in distances)


def guarded(probe, *args, names: tuple[str, ...], source: str = "") -> list[Row]:
    """`probe(*args)`'s rows; where it raises, one FAIL row per probe it stands for, with the exception's message:
    a head or layout that crashes on the probe (a dropped partial tile's IndexError) is that probe's failure, shown
    in the table with the others, never a traceback that hides which probe met it."""
    try:
        out = probe(*args)
    except Exception as e:  # noqa: BLE001 - any exception of a probe is its verdict, reported in its row
        message = " ".join(f"{type(e).__name__}: {e}".split())
        return [Row(name, "runs to its verdict", f"raised {message[:160]}", False, source) for name in names]
    return out if isinstance(out, list) else [out]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30)).item()


def rel_scalar(got: float, want: float) -> float:
    """|got - want| relative to |want| (a loss)."""
    return abs(got - want) / max(abs(want), 1e-12)


def grads_of(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def grad_diff(got: dict, want: dict) -> float:
    """The largest relative difference of any parameter's gradient (inf where the two differ in which exist)."""
    if got.keys() != want.keys() or not want:
        return float("inf")
    return max(rel(got[n], want[n]) for n in want)


def approximate(ctx) -> bool:
    """Whether the configuration's policy computes in a lower precision (train.precision=bf16)."""
    return ctx.axes.precision.exactness == "approximate"


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()
