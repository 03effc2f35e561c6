"""task=jsonl: the historic reader, one JSON object per line with string fields (see rlrun.tasks)."""

from __future__ import annotations

from .chat import format_rows
from .loading import read_jsonl


def read(cfg, seed: int, fmt, pairs: bool) -> tuple[list[dict], None]:
    """(the rows of task.path, no eval split): {prompt, answer}, or {prompt, chosen, rejected} for pairs."""
    rows = read_jsonl(cfg.path, ("prompt", "chosen", "rejected") if pairs else ("prompt", "answer"))
    return format_rows(rows, fmt, cfg.path), None
