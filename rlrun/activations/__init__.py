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


def apply(model, cfg) -> None:
    """Set the model up for `cfg` (the activations group): wrap the layers `checkpoint` recomputes."""
    if cfg.name == "checkpoint":
        for layer in list(decoder_layers(model))[:: cfg.every]:
            layer.forward = types.MethodType(_checkpointed, layer)


def effective(cfg, device: torch.device) -> bool:
    """False where the option changes nothing: `offload` on a CPU run (saved tensors already in host memory)."""
    return not (cfg.name == "offload" and device.type == "cpu")


def checkpointed(model) -> list[int]:
    """Indices of the decoder layers that run checkpointed."""
    return [i for i, layer in enumerate(decoder_layers(model)) if "forward" in vars(layer)]


def saving(cfg, device: torch.device):
    """The context a pass with a gradient runs in: saved tensors to pinned host memory for `offload` on an
    accelerator; nothing to do otherwise."""
    if cfg.name == "offload" and device.type != "cpu":
        return torch.autograd.graph.save_on_cpu(pin_memory=True)
    return contextlib.nullcontext()
