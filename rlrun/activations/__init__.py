"""activations=keep|checkpoint|offload: what the train pass keeps of the forward for the backward.

- `keep` (the baseline): everything autograd saves stays where it was made.
- `checkpoint`: every `activations.every`-th decoder layer keeps only its input; its forward runs again in the
  backward (non-reentrant `torch.utils.checkpoint`), so its internals are never held for the whole pass. The same
  operations run on the same inputs, so the result is `keep`'s.
- `offload`: the tensors autograd saves go to host memory as the forward makes them and come back for the
  backward (`torch.autograd.graph.save_on_cpu`, pinned). On a CPU run they are already in host memory: nothing
  moves, and the run says so.

Only passes with a gradient are affected: the logprob passes run under no_grad, where a checkpointed layer is a
plain call. A layer is wrapped by replacing its instance `forward`, so parameter names, state dicts, exports and
checkpoints are unchanged (and `copy.deepcopy` of the model copies the wrapper with it).
"""

from __future__ import annotations

import contextlib
import types

import torch
from torch.utils.checkpoint import checkpoint

LAYER_LISTS = ("layers", "h", "blocks")  # where transformers decoders keep their layers


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder layers of a transformers causal LM (or of the backbone inside it, PEFT-wrapped or not)."""
    for module in model.modules():
        for name in LAYER_LISTS:
            found = getattr(module, name, None)
            if isinstance(found, torch.nn.ModuleList) and len(found):
                return found
    raise ValueError(f"{type(model).__name__}: no decoder layer list ({', '.join(LAYER_LISTS)}) to checkpoint")


def _checkpointed(self, *args, **kwargs):
    """A decoder layer's forward that keeps only its inputs when a gradient is wanted."""
    inner = type(self).forward
    if torch.is_grad_enabled():
        return checkpoint(inner, self, *args, use_reentrant=False, **kwargs)
    return inner(self, *args, **kwargs)


class Keep:
    """activations=keep (the baseline): what autograd saves stays where it was made."""

    exactness = "baseline"
    phases = ("train",)  # only passes with a gradient: the logprob passes run under no_grad
    cost = "nothing recomputed, nothing moved"  # what it costs for what it saves (rlrun plan's activations lines)

    def __init__(self, cfg, device: torch.device | str = "cpu"):
        self.every, self.device = cfg.every, torch.device(device)
        self.context = self.build_context()  # built once: the train passes enter it step after step

    def build_context(self):
        return contextlib.nullcontext()

    def apply(self, model) -> None:
        """Set the model up for this option (the trainer's copy: rlrun.policy)."""

    def saving(self):
        """The context a pass with a gradient runs in."""
        return self.context

    def effective(self) -> bool:
        """False where the option changes nothing on this device."""
        return True

    def memory(self, s, layer_tokens: int, layer_bytes: int, outside: int, stream_bytes: int,
               device_type: str) -> dict[str, int]:
        """What the train pass keeps for its backward on a `device_type` device: every layer's internals
        (`layer_bytes` per token each) and what the backbone saves outside its layers (`outside`), for
        `layer_tokens` positions (rlrun/plan/terms.py counts the bytes)."""
        return {"activations saved for backward": s.layers * layer_tokens * layer_bytes,
                "saved outside the layers (embedding output, final norm)": outside}

    def checkpointed_layers(self, layers: int) -> int:
        return 0


class Checkpoint(Keep):
    """activations=checkpoint: every `every`-th decoder layer keeps only its input; its forward runs again in the
    backward. The same operations on the same inputs: keep's numbers."""

    exactness = "bitwise"
    cost = ("recompute: one more forward of {n} of {layers} layers in backward (about +1/3 of their train FLOPs; "
            "measured as system/time/train_s)")

    def apply(self, model) -> None:
        for layer in list(decoder_layers(model))[:: self.every]:
            layer.forward = types.MethodType(_checkpointed, layer)

    def checkpointed_layers(self, layers: int) -> int:
        return len(range(0, layers, self.every))

    def memory(self, s, layer_tokens, layer_bytes, outside, stream_bytes, device_type):
        """A checkpointed layer's input only (the residual stream, `stream_bytes` per element), the layers not
        checkpointed whole, and one layer's internals while it is recomputed."""
        n = self.checkpointed_layers(s.layers)
        per_layer = layer_tokens * layer_bytes
        return {f"layer inputs kept ({n} checkpointed layers)": n * layer_tokens * s.hidden * stream_bytes,
                f"activations saved for backward ({s.layers - n} layers kept whole)": (s.layers - n) * per_layer,
                RECOMPUTED: per_layer,
                "saved outside the layers (embedding output, final norm)": outside}


class Offload(Keep):
    """activations=offload: saved tensors go to (pinned) host memory as the forward makes them and come back for
    the backward; on a CPU run they are already there and nothing moves."""

    exactness = "bitwise"
    combined = False  # rlrun plan lists it alone: where checkpoint costs compute, this copies over PCIe
    cost = ("{mib:.0f} MiB copied to pinned host memory in forward and back in backward per micro-batch (on a CPU "
            "run nothing moves)")

    def build_context(self):
        if self.device.type != "cpu":
            return torch.autograd.graph.save_on_cpu(pin_memory=True)
        return contextlib.nullcontext()

    def effective(self) -> bool:
        return self.device.type != "cpu"

    def memory(self, s, layer_tokens, layer_bytes, outside, stream_bytes, device_type):
        if device_type == "cpu":  # already in host memory: keep's
            return super().memory(s, layer_tokens, layer_bytes, outside, stream_bytes, device_type)
        return {"activations saved for backward (in host memory: activations=offload)": 0,
                "one layer's saved tensors back on the device in backward": layer_tokens * layer_bytes}


RECOMPUTED = "one layer recomputed in backward"  # the plan's part that is the recompute's moment, not a sum


def option(cfg, device: torch.device | str = "cpu") -> Keep:
    """The object of `activations=cfg.name` (through the registry) for a run on `device`."""
    from .. import registry

    return registry.get("activations", cfg.name)(cfg, device)


def apply(model, cfg) -> None:
    """Set `model` up for `cfg` (the activations group): wrap the layers `checkpoint` recomputes."""
    option(cfg).apply(model)


def keep_all(model) -> None:
    """Undo `checkpoint` on `model` (a copy of it): its layers keep what they save again. The same numbers; for the
    check's float64 arbiter, whose float64 mode does not reach a recompute that autograd's engine runs."""
    for i in checkpointed(model):
        del decoder_layers(model)[i].forward


def checkpointed(model) -> list[int]:
    """Indices of the decoder layers that run checkpointed."""
    return [i for i, layer in enumerate(decoder_layers(model)) if "forward" in vars(layer)]
