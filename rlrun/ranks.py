"""This process's place among the launcher's ranks, read from the environment the launcher sets (torchrun,
deepspeed, SLURM via submitit): no torch import, so the CLI and the validators can use it."""

from __future__ import annotations

import os


def world_size() -> int:
    """How many processes the launcher started (1 without a launcher)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    """This process's global rank (0 without a launcher)."""
    return int(os.environ.get("RANK", "0"))


def is_main() -> bool:
    """Rank 0: the one process that talks to MLflow and draws progress."""
    return rank() == 0
