"""What the tools print and draw, written once: numbers, aligned text tables, figure set-up, and the harness that
runs a measurement in a fresh process (so that peaks do not mix).

Imports no torch and no matplotlib at import time: matplotlib comes in with the first figure (with the Agg
backend: files, no display), torch only in `in_child`, to read what a child saved with torch.save.
"""

from __future__ import annotations

import math
import os
import tempfile

NONE = "–"  # where a table or a sentence has no number


# --- numbers ---


def num(v, spec: str = ".3g") -> str:
    """`v` formatted with `spec`; NONE for None, NaN or infinity. `+ 0.0` keeps "-0" out."""
    if v is None or not math.isfinite(v):
        return NONE
    return format(float(v) + 0.0, spec)


def short(v) -> str:
    """A number for a sentence: whole from 100 up, three significant digits below."""
    return num(v, ".0f" if v is not None and math.isfinite(v) and abs(v) >= 100 else ".3g")


# --- aligned text tables ---


def table(head: list[str], rows: list[list[str]], left: int = 1, gap: str = "  ") -> str:
    """`head` and `rows` as aligned text, each column as wide as its widest cell: the first `left` columns
    left-aligned, the others right-aligned. A row shorter than `head` ends in a note (an error, say) written as
    it is, spanning the columns it lacks."""
    full = [head] + [r for r in rows if len(r) == len(head)]
    widths = [max(len(r[i]) for r in full) for i in range(len(head))]

    def line(row):
        n = len(row) if len(row) == len(head) else len(row) - 1
        cells = [c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(row[:n], widths))]
        return gap.join(cells + row[n:]).rstrip()

    return "\n".join(line(r) for r in [head] + rows)


def cells(row: dict, columns: list[str], specs: dict[str, str]) -> list[str]:
    """One table row from a dict: `num(row[c], specs[c])` for columns with a spec, `str(row[c])` for the others."""
    return [num(row.get(c), specs[c]) if c in specs else str(row[c]) for c in columns]


def markdown(head: list[str], rows: list[list[str]]) -> str:
    """`head` and `rows` as a markdown table, the first column left-aligned and the others right-aligned."""
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join([":---"] + ["---:"] * (len(head) - 1)) + "|"]
    return "\n".join(lines + ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows])


# --- figures ---


def pyplot():
    """matplotlib.pyplot on the Agg backend (figures are written to files, never shown)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def figure(width: float, heights: list[float], dpi: int = 100, extra: float = 0.0):
    """(figure, axes): a figure `width` inches wide with one panel per row, `heights` in inches, plus `extra`
    inches below (for a legend)."""
    fig = pyplot().figure(figsize=(width, sum(heights) + extra), dpi=dpi)
    grid = fig.add_gridspec(len(heights), 1, height_ratios=heights)
    return fig, [fig.add_subplot(grid[i]) for i in range(len(heights))]


def save(fig, path: str, dpi: int | None = None) -> str:
    """Lay out, write and close `fig` (closed figures free their memory); returns `path`."""
    fig.tight_layout()
    fig.savefig(path, **({"dpi": dpi} if dpi else {}))
    pyplot().close(fig)
    return path


def close(figs: dict) -> None:
    """Close figures once written and logged: pyplot keeps every open figure alive (and warns past 20)."""
    for fig in figs.values():
        pyplot().close(fig)


# --- child processes ---


def in_child(target, *args) -> dict:
    """`target(*args, out_path)` in a fresh process, and what it saved at `out_path` with torch.save;
    {"error": ...} if it failed."""
    import multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.pt")
        p = mp.get_context("spawn").Process(target=target, args=(*args, path))
        p.start()
        try:
            p.join()
        except BaseException:  # Ctrl-C or a SIGTERM handler's exception in the waiting parent: no child left behind
            p.kill()
            p.join()
            raise
        if p.exitcode != 0:
            return {"error": f"exit code {p.exitcode}"}
        import torch

        return torch.load(path)


def quiet(log_path: str) -> None:
    """This (child) process's output goes to `log_path`, shown if it fails: the table is what the parent prints."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)


def tail(log_path: str, chars: int = 3000) -> str:
    """The end of a child's log, for the message that says it failed."""
    with open(log_path) as f:
        return f.read()[-chars:]


def duration(seconds: float) -> str:
    """A time left or taken, as people say it: "40 s", "3.5 min", "2.1 h"."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"
