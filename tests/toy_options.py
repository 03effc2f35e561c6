"""The toy options' objects (tests/toys.py registers them by these import strings): a shipped option's arithmetic
under another name, each with its own facts."""

from __future__ import annotations

import types

from rlrun.activations import Checkpoint
from rlrun.batching.layouts import Packed
from rlrun.heads import dense
from rlrun.logprobs import Always
from rlrun.offload import On
from rlrun.precision import Fp32
from rlrun.recipes.sources import Sync
from rlrun.rollout.decoding import Eager


def _head() -> types.ModuleType:
    """dense's arithmetic as a head module of its own; its memory term is dense's, under its own labels."""
    toy = types.ModuleType("toy_head")
    toy.logprobs, toy.loss = dense.logprobs, dense.loss
    toy.EXACTNESS, toy.PHASES, toy.TILED, toy.SWEEPS_SEQUENCE_LEVEL = "fp_tolerance", dense.PHASES, False, False

    def memory(size, tokens, vocab, *, grad, trainable, entropy_grad=False, top_p=1.0, top_k=0):
        return {f"toy {part}": n for part, n in dense.memory(size, tokens, vocab, grad=grad, trainable=trainable,
                                                             entropy_grad=entropy_grad, top_p=top_p,
                                                             top_k=top_k).items()}

    toy.memory, toy.freed_before_weight_grad = memory, dense.freed_before_weight_grad
    return toy


HEAD = _head()


class ToyLayout(Packed):  # packed's passes under another name
    exactness = "fp_tolerance"


class ToyActivations(Checkpoint):  # checkpoint's recompute under another name
    exactness = "bitwise"


class ToyPolicy(Always):  # always's passes under another name
    exactness = "bitwise"


class ToyOffload(On):  # offload=on's copies under another name
    exactness = "bitwise"


# The axes keyed by a config key (train.precision, rollout.pipeline, rollout.decode): an object, no config node
class ToyPrecision(Fp32):  # fp32's arithmetic under another name
    exactness = "bitwise"


class ToyPipeline(Sync):  # sync's rollouts under another name
    exactness = "bitwise"


class ToyDecode(Eager):  # eager's decode loop under another name
    exactness = "bitwise"
