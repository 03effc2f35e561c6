"""The float64 arbiter of `rlrun check`: a comparison that rounding leaves undecided (fp32 past its tolerance, bf16
past its own) is made again on a float64 copy of the model, computed in float64 throughout (rlrun/check/probes.py:
generator = trainer, accumulation, ranks, sequence alone, vs baseline)."""

from __future__ import annotations

import copy

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from ..activations import keep_all
from .rows import Row, approximate

# A computation may be up to this many times further from float64 than the reference computation's own rounding
# is (an exact option against the baseline in fp32; under bf16, each side of a comparison; SmolLM2 measured
# 1.0-1.4x), which a lost term, a stale weight or a wrong normaliser never is.
ROUNDING_SLACK = 4.0

F64_ALONE_TOL = 1e-9  # float64 rounds ~1e-16 a step: a 30-layer model stays far below this; any real difference
# (a position, a mask) is of the order of the logprobs themselves


def in_float64(model, fn):
    """fn(a float64 copy of `model`), computed in float64 throughout (`KeepFloat64`): the float64 arbiter."""
    exact = copy.deepcopy(model).double()
    keep_all(exact)  # a checkpointed layer's recompute runs outside KeepFloat64 (in float32): keep its activations
    with KeepFloat64():
        return fn(exact)


class KeepFloat64(TorchFunctionMode):
    """Float64 throughout: every float32 a model or rlrun asks for here is float64 (a dtype argument, .float(), the
    default dtype of a new tensor). A model's own casts would round otherwise: transformers' RMSNorm normalises in
    float32, its eager attention takes softmax in float32, its rotary embedding calls .float(). A "float64" Llama
    that still rounds each norm's input to float32 parts by float32's ulp wherever a GPU's kernels sum two batch
    shapes in another order: SmolLM2 on an H200 measured sequence alone 8.4e-7 apart "in float64". Keeping only
    float64 tensors from being cast down is not enough: an op then meets a float64 tensor and a float32 one made
    from integers, and raised on the H200 (transformers 5.17). Converting integers or float32 data to float64 is
    exact, so nothing is lost."""

    def __enter__(self):
        self.default = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        return super().__enter__()

    def __exit__(self, *exc):
        torch.set_default_dtype(self.default)
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.float:
            func = torch.Tensor.double
        wide = lambda x: torch.float64 if x is torch.float32 else x  # noqa: E731
        return func(*tree_map(wide, args), **tree_map(wide, kwargs or {}))


def arbitrated(ctx, probe: str, sides, dist, tol: float, what: str, label: str, source: str) -> Row:
    """A comparison of two computations of the same numbers: `sides(model)` gives (the configuration's way, the
    reference way), `dist` their distance. Within `tol` it passes. Past it (a real model's rounding: 30 layers, a
    49152-way softmax), both are computed again in float64 (`in_float64`), where rounding vanishes and a real
    difference (a position, a mask, a normaliser) does not: they must agree to `F64_ALONE_TOL`. Under bf16 compute
    the bf16 path is judged too: the configuration's way may be no further from the float64 reference than
    `ROUNDING_SLACK` times the reference way's own bf16 rounding (SmolLM2 in bf16: gradients 0.24 apart on two
    ranks, logprobs 0.22 apart in a batch and alone, each side that far from float64 alone)."""
    mine, ref = sides(ctx.trainer)
    d = dist(mine, ref)
    expects = f"{what} within {tol:.0e}"
    if d <= tol:
        return Row(probe, expects, f"{label} {d:.1e}", True, source)
    mine64, ref64 = in_float64(ctx.trainer, sides)
    d64 = dist(mine64, ref64)
    ok, measured = d64 <= F64_ALONE_TOL, f"{label} {d:.1e}"
    expects += f", else {F64_ALONE_TOL:.0e} in float64"
    if approximate(ctx):
        off, own = dist(mine, ref64), dist(ref, ref64)
        expects += f" and bf16 at most {ROUNDING_SLACK:g}x the reference way's rounding"
        measured += f"; bf16 vs float64 {off:.1e}, reference way {own:.1e}"
        ok = ok and off <= max(tol, ROUNDING_SLACK * own)
    return Row(probe, expects, f"{measured}; float64 {d64:.1e}", ok, source)
