"""A paired sweep's comparison (report.replay; rollout/paired.py): every job trained on the rollouts the first job
recorded, so every difference from that job over the whole run is the option's own arithmetic. Exact options
(bitwise, fp_tolerance, and nothing else changed) give the noise floor: rounding in a different summation order,
carried into the weights by training. An inexact option (bf16, another objective, an approximate one) is shown
beside it, per metric, as a multiple of that floor: above it the option changes training; at it, no effect beyond
rounding is measured.

Pure functions of run parameters (MLflow's flattened params) and metric histories ({key: (steps, values)}), plus the
figure.
"""

from __future__ import annotations

import numpy as np

from ..render import num
from . import equivalence as eq
from . import verdict
from .charts import FONT, colors, figure

KEYS = ("loss", "grad_norm")  # loss: what is minimised; grad_norm: where rounding shows first (Adam's scaling)


def recording(params: list[dict[str, str]]) -> int | None:
    """The index of the run that wrote the record the others replayed (None: no run replayed another's)."""
    for i, p in enumerate(params):
        rec = p.get("rollout.record")
        if rec not in (None, "None", "") and any(q.get("rollout.path") == rec for q in params):
            return i
    return None


def differences(h: dict, base: dict) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{key: (steps, |h - base|)} over the steps both logged."""
    out = {}
    for k in KEYS:
        if k in h and k in base:
            a, b = dict(zip(*h[k])), dict(zip(*base[k]))
            steps = np.array(sorted(set(a) & set(b)))
            out[k] = (steps, np.array([abs(a[s] - b[s]) for s in steps]))
    return out


def rows(names: list[str], data: list[dict], params: list[dict[str, str]]) -> tuple[str, list[dict]] | None:
    """(the recording run's name, one row per run that replayed its record: {run, exact, <key>: max |difference|})
    or None when the runs are not paired."""
    rec = recording(params)
    if rec is None:
        return None
    out = []
    for i, p in enumerate(params):
        if i == rec or p.get("rollout.path") != params[rec]["rollout.record"]:
            continue
        exact = (eq.group_key(p) == eq.group_key(params[rec])
                 and verdict.exactness_of(p, params[rec]) in verdict.EXACT)
        diffs = differences(data[i], data[rec])
        out.append({"run": names[i], "exact": exact, "steps": max((len(s) for s, _ in diffs.values()), default=0),
                    **{k: float(d.max()) if len(d) else float("nan") for k, (_, d) in diffs.items()}})
    return names[rec], out


def floor(found: list[dict]) -> dict[str, float]:
    """{key: the largest difference of any exact run}: the arithmetic noise floor ({} without an exact run)."""
    exact = [r for r in found if r["exact"]]
    return {k: max(r[k] for r in exact if k in r) for k in KEYS if any(k in r for r in exact)}


def text(paired: tuple[str, list[dict]]) -> str:
    """The comparison in words (the parent run's description)."""
    base, found = paired
    low = floor(found)
    steps = max((r["steps"] for r in found), default=0)
    head = f"Paired against {base} (the same rollouts, {steps} steps): "
    head += ("exact options' noise floor " + ", ".join(f"max |Δ{k}| {num(v, '.1e')}" for k, v in low.items())
             if low else "no exact option to set a noise floor")
    parts = []
    for r in found:
        if r["exact"]:
            continue
        cells = [f"max |Δ{k}| {num(r[k], '.1e')}" + (f" ({r[k] / low[k]:.3g}x the floor)" if low.get(k) else "")
                 for k in KEYS if k in r]
        parts.append(f"{r['run']}: " + ", ".join(cells))
    return head + (". Inexact: " + "; ".join(parts) if parts else "") + "."


def brief(paired: tuple[str, list[dict]]) -> str:
    """One line for the top of the parent's description (MLflow folds it after a few lines): each inexact option as a
    multiple of the exact floor on the metric where it is largest, or the floor itself when all are exact."""
    low = floor(paired[1])
    parts = []
    for r in paired[1]:
        if not r["exact"]:
            ratios = {k: r[k] / low[k] for k in KEYS if low.get(k) and k in r}
            k = max(ratios, key=ratios.__getitem__, default=None)
            parts.append(f"{r['run']} {ratios[k]:.3g}x ({k})" if k else f"{r['run']}: no exact option to compare")
    if parts:
        return "Paired on one record, each inexact option against the exact options' noise floor: " + \
            "; ".join(parts) + "."
    return "Paired on one record: the exact options' noise floor is " + \
        ", ".join(f"max |Δ{k}| {num(v, '.1e')}" for k, v in low.items()) + "."


def figure_of(names: list[str], data: list[dict], params: list[dict[str, str]]):
    """paired.png: per step, each replaying run's |difference| from the recording run, one panel per KEYS (log
    scale): exact runs grey (their largest: the floor, a dashed line), inexact runs in colour. None: not paired."""
    rec = recording(params)
    found = rows(names, data, params)
    if rec is None or found is None or not found[1]:
        return None
    exact = {r["run"]: r["exact"] for r in found[1]}
    low = floor(found[1])
    fig, axes = figure([3.0] * len(KEYS))
    palette = colors(max(1, sum(not e for e in exact.values())))
    tiny = 1e-12  # identical steps: drawn at the bottom of the log axis
    for ax, key in zip(axes, KEYS):
        shade = iter(palette)
        for i, name in enumerate(names):
            if name not in exact:
                continue
            d = differences(data[i], data[rec]).get(key)
            if d is None:
                continue
            style = {"color": "0.55", "lw": 1.0, "ls": "--"} if exact[name] else {"color": next(shade), "lw": 1.5}
            ax.plot(d[0], np.maximum(d[1], tiny), label=f"{name}{' (exact)' if exact[name] else ''}", **style)
        if key in low:
            ax.axhline(max(low[key], tiny), color="0.3", lw=0.8, ls=":", label="noise floor (exact options' max)")
        ax.set_yscale("log")
        ax.set_xlabel("optimizer step", fontsize=FONT)
        ax.set_ylabel(f"|Δ {key}|", fontsize=FONT)
        ax.set_title(f"|{key} - {names[rec]}'s| per step, on the same rollouts", fontsize=FONT + 1)
        ax.tick_params(labelsize=FONT - 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=FONT - 2, frameon=False)
    fig.tight_layout()
    return fig
