"""`vs baseline`'s float64 arbiter, one quantity at a time: the loss, each parameter's gradient and the logprobs of
the old pass are each held to the baseline's own rounding of that quantity, so that no quantity's error hides behind
another's (issue #70: logits rounded to bf16 inside the tiled head moved SmolLM2's loss 8.4e-2 from float64 against
the baseline's 2.3e-2 and passed, judged with the gradients' 0.25 as one maximum).

Each quantity is a distance from the float64 step: the loss relative to its value, a gradient relative to its
parameter's largest float64 entry, the logprobs as their largest absolute difference. The configuration's may be at
most `slack` times the baseline's (the baseline's options, in the configuration's precision) and always `floor`.
"""

from __future__ import annotations

import torch


def distances(got: dict, exact: dict) -> dict[str, float]:
    """Per quantity ("loss", "logprobs", "grad:<parameter>"), the distance of `got` from the float64 `exact`; inf
    where `got` lacks one `exact` has."""
    out = {}
    for key, want in exact.items():
        if key not in got:
            out[key] = float("inf")
        elif key == "loss":
            out[key] = abs(got[key] - want) / max(abs(want), 1e-12)
        elif key == "logprobs":
            out[key] = (got[key].double() - want.double()).abs().max().item() if want.numel() else 0.0
        else:
            scale = want.double().abs().max().item() or 1.0
            out[key] = (got[key].double() - want.double()).abs().max().item() / scale
    return out


def quantities(loss: float, grads: dict, logprobs: torch.Tensor | None = None) -> dict:
    """The quantities of one step, keyed as `distances` reads them."""
    out: dict = {"loss": loss, **{f"grad:{n}": g for n, g in grads.items()}}
    if logprobs is not None:
        out["logprobs"] = logprobs
    return out


def judge(got: dict, own: dict, exact: dict, *, floor: float, slack: float) -> tuple[bool, str]:
    """(whether every quantity of `got` is within max(floor, slack x `own`'s distance) of `exact`, what to print:
    the quantity nearest its bound, and any over it)."""
    mine, theirs = distances(got, exact), distances(own, exact)
    bound = {k: max(floor, slack * theirs.get(k, 0.0)) for k in mine}
    over = [k for k in mine if not mine[k] <= bound[k]]
    near = {k: mine[k] / bound[k] if bound[k] > 0 else (float("inf") if mine[k] > 0 else 0.0) for k in mine}
    worst = max(near, key=lambda k: near[k]) if near else None
    if worst is None:
        return True, "no quantity"
    said = (f"{len(mine)} quantities; nearest its bound: {label(worst)} {mine[worst]:.1e} against the baseline's "
            f"{theirs.get(worst, 0.0):.1e}")
    if over:
        said += f"; over: {', '.join(label(k) for k in over[:3])}" + (f" and {len(over) - 3} more" if len(over) > 3
                                                                       else "")
    return not over, said


def label(key: str) -> str:
    return key.removeprefix("grad:") + " gradient" if key.startswith("grad:") else key
