"""task=dataset: local files or folders read through the `datasets` library (see rlrun.tasks), mapped to rows
with the column keys of the task node."""

from __future__ import annotations

import decimal
import numbers

from .base import TaskError, short
from .loading import MAX_ROW_BYTES, Split, load_splits


def read(cfg, seed: int, fmt, pairs: bool) -> tuple[list[dict], list[dict] | None]:
    """(rows of task.split, rows of task.eval_split or None), prompts formatted by `fmt`."""
    names = [("task.split", cfg.split)] + ([("task.eval_split", cfg.eval_split)] if cfg.eval_split else [])
    splits = load_splits(cfg.path, names, cfg.max_rows)
    rows = _rows(splits[0], cfg, fmt, pairs)
    return rows, (_rows(splits[1], cfg, fmt, pairs) if len(splits) > 1 else None)


def _text(value, where: str, key: str, written: str | None = None) -> str:
    """An answer / chosen / rejected cell as text: a JSON number as written in the file (`written`: '1.50', '7');
    a parquet number as str() of its value ('7', '1.5', a float 7.0 as '7.0', a decimal with its scale: '1.50').
    CSV cells are text already (loading._text_columns)."""
    if isinstance(value, str) and value.strip():
        return value
    if written is not None:
        return written
    if isinstance(value, (numbers.Real, decimal.Decimal)) and not isinstance(value, bool) and value == value:
        return str(value)
    what = "missing (null)" if value is None else "empty" if isinstance(value, str) else \
        f"{short(value)} ({type(value).__name__})"
    raise TaskError(f"{where}: {key} is {what}; every row needs non-empty text there.")


def _columns(split: Split, keys: list[str], cfg) -> None:
    for k in keys:
        if getattr(cfg, k) not in split.columns:
            raise TaskError(f"{split.path} (split {split.name!r}): task.{k}={getattr(cfg, k)!r} is not a column; its "
                            f"columns are {split.columns}. Set task.{k}=<one of them>.")


def _rows(split: Split, cfg, fmt, pairs: bool) -> list[dict]:
    """Rows of a loaded split: GRPO {**columns, prompt: text, answer}; DPO {prompt, chosen, rejected}."""
    keys = ["prompt_key", "chosen_key", "rejected_key"] if pairs else ["prompt_key", "answer_key"]
    _columns(split, keys, cfg)
    if not split.rows:
        raise TaskError(f"{split.path}: split {split.name!r} has no rows.")
    out = []
    for i, rec in enumerate(split.rows):
        where, written = split.where(i), (split.literals[i] if split.literals else {})
        prompt = fmt(rec[cfg.prompt_key], where, f"task.prompt_key={cfg.prompt_key!r}")
        if pairs:
            row = {"prompt": prompt}
            for side in ("chosen", "rejected"):
                key = getattr(cfg, f"{side}_key")
                row[side] = _text(rec[key], where, f"task.{side}_key={key!r}", written.get(key))
        else:
            key = cfg.answer_key
            row = {**rec, "prompt": prompt,
                   "answer": _text(rec[key], where, f"task.answer_key={key!r}", written.get(key))}
        for name in ("prompt", "chosen", "rejected") if pairs else ("prompt", "answer"):  # any format (parquet,
            if len(row[name].encode()) > MAX_ROW_BYTES:  # csv: no lines); only the texts built here
                raise TaskError(f"{where}: the {name} is longer than {MAX_ROW_BYTES:,} bytes; longer texts are "
                                "refused (far longer than any model's context). Shorten or drop that row.")
        out.append(row)
    return out
