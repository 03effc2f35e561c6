"""What a probe's step makes, watched op by op (torch dispatch modes): the lm head's products (`no full logits`) and
the live tensors of a step (the memory plan on CPU)."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

MATMULS = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm,
           torch.ops.aten.matmul, torch.ops.aten.linear, torch.ops.aten.einsum}


class HeadProducts(TorchDispatchMode):
    """The most rows of any logits the lm head computes: a matmul output with the head weight (itself, a view, a
    cast or a copy of it) as an operand and the vocabulary as a dim. Followed from the weight, not guessed from a
    shape: a [4, 56, 56] attention mask or score of a pack as wide as a tiny vocabulary is no product of the
    weight (issue #53: counting every tensor with a vocabulary-wide last dim failed a correct DPO check)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.shape, self.vocab, self.rows = tuple(weight.shape), weight.shape[0], 0
        # the live tensors holding the weight's values; weak, so that a freed copy's address, reused by another
        # tensor, is not taken for the weight's
        self.held: weakref.WeakSet = weakref.WeakSet([weight])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        held = {t.untyped_storage().data_ptr() for t in self.held}
        inputs = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        if not any(a.untyped_storage().data_ptr() in held for a in inputs):
            return out
        for t in torch.utils._pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            if tuple(t.shape) in (self.shape, self.shape[::-1]):  # a copy, cast or transpose: still the weight
                self.held.add(t)
            elif func.overloadpacket in MATMULS and self.vocab in t.shape:
                self.rows = max(self.rows, t.numel() // self.vocab)
        return out


class LiveTensors(TorchDispatchMode):
    """The peak bytes of the tensors an operation under it made and that are still alive (storages counted once;
    freed as their storage is): a step's growth in tensors, whatever the allocator keeps beside them. On CPU, RSS
    also holds glibc's freed heap blocks, which at a probe's sizes are most of what RSS adds (SmolLM2, tiled,
    packed, checkpoint: tensors 141 MiB against the plan's 135, RSS 264-315 from step to step)."""

    def __init__(self, ignore=()):
        super().__init__()
        self.sizes: dict[int, int] = {}
        self.ignore = {t.untyped_storage().data_ptr() for t in ignore}  # the weights: their views are not new
        self.live = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                ptr = storage.data_ptr()
                if ptr and ptr not in self.sizes and ptr not in self.ignore:
                    self.sizes[ptr] = storage.nbytes()
                    self.live += storage.nbytes()
                    weakref.finalize(storage, self.freed, ptr)
        self.peak = max(self.peak, self.live)
        return out

    def freed(self, ptr: int) -> None:
        self.live -= self.sizes.pop(ptr, 0)
