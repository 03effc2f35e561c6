"""The contract of an `activations` option (rlrun/activations/__init__.py): built as `Option(cfg.activations,
device)`."""

from __future__ import annotations

from typing import Protocol


class Activations(Protocol):
    exactness: str  # rlrun.axes.EXACTNESS
    phases: tuple[str, ...]
    cost: str  # what it costs for what it saves, in words ({n}, {layers}, {mib} filled by rlrun plan)

    def apply(self, model) -> None:
        """Set the trainer's copy of the policy up for the option (rlrun.policy)."""

    def saving(self):
        """The context every pass with a gradient runs in (built once)."""

    def effective(self) -> bool:
        """False where the option changes nothing on the run's device."""

    def memory(self, s, layer_tokens: int, layer_bytes: int, outside: int, stream_bytes: int,
               device_type: str) -> dict[str, int]:
        """What the train pass keeps for its backward (rlrun/plan/terms.py: saved_activations)."""

    def checkpointed_layers(self, layers: int) -> int: ...
