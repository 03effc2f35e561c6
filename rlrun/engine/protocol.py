"""The engine contract: what the recipes and the run frame use of `engine=single` and `engine=deepspeed`."""

from __future__ import annotations

from typing import Protocol


class Engine(Protocol):
    """Built as `Engine(cfg, policy, reference, grad_accum)` by the run frame; owns the optimizer and the ranks."""

    rank: int
    world: int
    main: bool  # rank 0: the one that logs and writes
    device: object  # torch.device of this rank
    model: object  # the policy, as the engine wraps it (models.unwrap reaches the causal LM)
    reference: object  # a frozen reference model, or None (no reference, or LoRA's adapters-off reference)

    def __init__(self, cfg, policy, reference, grad_accum: int): ...

    def backward(self, loss, boundary: bool | None = None) -> None:
        """`loss` is this micro-batch's share of the step's loss (already divided by the step's token count).
        `boundary`: whether it is the step's last backward, when the number of backwards per step varies (batching
        packed / shared_prompt); None: every step has `grad_accum` of them."""

    def step(self) -> float:
        """Clip, optimizer step, LR step, zero grads; the gradient norm before clipping."""

    def lr(self) -> float: ...

    def offload(self) -> None:
        """Optimizer state off the device around the logprob passes (offload=on), else nothing."""

    def onload(self) -> None: ...

    def offload_effective(self) -> bool: ...

    def generation(self):
        """A context manager inside which the policy's full weights are ready for generate."""

    def gather(self, obj) -> list:
        """`obj` from every rank, in rank order."""

    def save(self, folder: str, step: int, state: dict, keep: int) -> str:
        """A checkpoint of the loop's `state` and the engine's own; its path."""

    def load_state_dict(self, state: dict) -> None: ...


class EngineModule(Protocol):
    """What `registry.get("engine", name)` is: a module whose `Engine` class satisfies `Engine`, and what is true of
    the engine, asked by the planner, rlrun.precision and the check instead of its name."""

    Engine: type[Engine]
    BF16_PATH: str  # rlrun.precision's tag of train.precision=bf16 on this engine
    OWN_MASTER: bool  # its optimizer keeps the master weights (the check's master-weights probe does not apply)
    GRADIENTS_AS_BACKWARD: bool  # a layer's gradient is made as its saved tensors are freed (the planner's peak)
    ZERO_STAGES: tuple[int, ...]  # the ZeRO stages it shards with, suggested by `rlrun plan`

    def world_size(self) -> int: ...

    def zero_stage(self, e) -> int: ...

    def dtype(self, e, precision: str) -> str: ...

    def offloads_optimizer(self, e) -> bool: ...

    def offloads_params(self, e) -> bool: ...

    def check_device(self, e): ...
