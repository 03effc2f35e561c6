"""The float64 arbiter of `rlrun check`: a comparison that fp32's rounding leaves undecided is made again on a float64
copy of the model, computed in float64 throughout (rlrun/check/probes.py: accumulation, ranks, sequence alone,
vs baseline)."""

from __future__ import annotations

import copy

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from ..activations import keep_all


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
