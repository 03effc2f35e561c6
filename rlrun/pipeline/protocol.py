"""The contract of a `pipeline` option (rlrun/recipes/sources.py: where GRPO's rollouts come from, keyed by
`rollout.pipeline`; a rollout option may bring its own, as rollout=replay does): a class GRPO's loop builds."""

from __future__ import annotations

from typing import Protocol


class Source(Protocol):
    exactness: str  # rlrun.axes.EXACTNESS
    phases: tuple[str, ...]
    generates_here: bool  # setup builds a rollout engine in this process (on the trainer's own copy)
    generator_process: bool  # a process of its own generates (rollout.worker_device; `rlrun check` probes it)

    def __init__(self, cfg, s, prompts, *, window: int, grad_accum: int, drawn=None) -> None:
        """Built by GRPO's loop: the run config, its setup, the prompt stream, the micro-steps a rollout lasts,
        the step's accumulation, dynamic sampling's totals (None: off)."""

    def stateful(self) -> dict: ...

    def open(self, cleanup, tracker, step: int) -> None: ...

    def ahead(self, step: int) -> None: ...

    def next(self, step: int, rollouts: int, got) -> tuple:
        """(the next rollout, drawn and scored: sampling.Drawn; the optimizer steps of the weights that drew it)."""

    def memory(self, cfg, s, gen, device_type: str) -> tuple:
        """(the generate phase as this option runs it, what the trainer's phases carry besides: {part: bytes})."""
