"""The contract of a `batching` option (rlrun/batching/layouts.py): built as `Option(cfg.batching, agree)`."""

from __future__ import annotations

from typing import Protocol


class Layout(Protocol):
    exactness: str  # rlrun.axes.EXACTNESS
    phases: tuple[str, ...]
    exchanges: bool  # data parallel: ranks exchange whole groups to even their token loads
    shares_prompt: bool  # a group's prompt laid out once (its loads count it once)
    packs: bool  # lays out forwards of max_tokens positions (else each micro-batch as it is: train.micro_batch)
    max_tokens: int

    def logprobs(self, model, micros, head, counts: dict | None = None) -> list:
        """Per-token logprobs [N] of each micro-batch's response under `model` (no grad), through `head`."""

    def forwards(self, backbone, micros, fields: tuple[str, ...], counts: dict):
        """Each forward of a training pass: (hidden states [n, H], {field: [n] tensor or None}, mask [n], boundary:
        True on the step's last backward, None when every step has grad_accum of them)."""

    def pair_hidden(self, backbone, batch, counts: dict | None = None):
        """DPO: [N, H] hidden states that predict a batch's targets, in their order."""

    def planned_forward(self, cfg, rows: int, seq_len: int, response: int) -> tuple[int, int, int] | None:
        """(positions of a forward, positions of its rows, response tokens of a forward) for the planner; None: one
        micro-batch as it is."""
