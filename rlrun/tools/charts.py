"""The charts of rlrun-report: one colour per run, run names wrapped for tick labels, horizontal bars and annotated
heatmaps with one row per run, on figures of one width (through rlrun.render)."""

from __future__ import annotations

import numpy as np

from .. import render

# Figures are drawn 8 inches wide at 100 dpi: 800 px, so the artifact viewer shows them at (about) their own size
# (shrunk at most ~15% beside MLflow's assistant panel) and 10-12 pt text stays >= 12 px; one panel per row.
DPI = 100
WIDTH = 8.0
FONT = 11


def colors(n: int) -> list:
    """One distinct colour per run, the same in every panel and figure."""
    get = render.pyplot().get_cmap
    xs: range | np.ndarray  # indices into a listed colormap, or positions along a continuous one
    if n <= 10:
        cmap, xs = get("tab10"), range(n)
    elif n <= 20:
        cmap, xs = get("tab20"), range(n)
    else:
        cmap, xs = get("turbo"), np.linspace(0.05, 0.95, n)
    return [cmap(x) for x in xs]


def figure(heights: list[float], extra: float = 0.0):
    """(figure, axes): WIDTH inches wide, one panel per row, `heights` in inches (+ `extra` for a legend)."""
    return render.figure(WIDTH, heights, DPI, extra)


def wrap(name: str, width: int = 34) -> str:
    """A long run name broken after commas into lines of about `width` characters (tick labels stay narrow)."""
    if "\n" in name:  # already broken
        return name
    lines, line = [], ""
    for part in name.split(","):
        if line and len(line) + 1 + len(part) > width:
            lines.append(line + ",")
            line = part
        else:
            line = f"{line},{part}" if line else part
    return "\n".join(lines + [line])


def panel_height(names) -> float:
    """Inches for a panel with one row per name (taller where wrapped names take several lines)."""
    lines = max((wrap(n).count("\n") + 1 for n in names), default=1)
    return 1.4 + (0.3 + 0.18 * (lines - 1)) * max(len(names), 2)


def hbars(ax, names, series: dict[str, list[float]], xlabel, title, stacked=False, log=False, legend=True):
    """Horizontal bars, one row per run (readable for many runs); grouped or stacked series. `legend=False`: the
    caller adds its own artists, then `legend_above`."""
    y = np.arange(len(names))
    height = 0.8 if stacked else 0.8 / max(len(series), 1)
    left = np.zeros(len(names))
    for i, (label, values) in enumerate(series.items()):
        values = np.nan_to_num(np.array(values, dtype=float))
        if stacked:
            ax.barh(y, values, height, left=left, label=label)
            left += values
        else:
            ax.barh(y - 0.4 + height * (i + 0.5), values, height, label=label)
    rows(ax, names)
    ax.set_xlabel(xlabel, fontsize=FONT)
    ax.tick_params(axis="x", labelsize=FONT - 1)
    if log:
        ax.set_xscale("log")
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(title, fontsize=FONT + 1)
    if legend:
        legend_above(ax)


def rows(ax, names, marked=()):
    """One tick per run, first run on top, in sweep order; runs in `marked` named as baselines."""
    ax.set_yticks(np.arange(len(names)), [wrap(n) + ("\n(baseline)" if i in marked else "")
                                          for i, n in enumerate(names)], fontsize=FONT - 1)
    if not ax.yaxis_inverted():
        ax.invert_yaxis()


def legend_above(ax, ncol: int = 4):
    """The panel's legend between its title and its data, so that it never covers a bar (the title moves up)."""
    from matplotlib.container import BarContainer

    handles, labels = ax.get_legend_handles_labels()
    order = sorted(range(len(handles)), key=lambda i: not isinstance(handles[i], BarContainer))  # bars, then marks
    handles, labels = [handles[i] for i in order], [labels[i] for i in order]
    if not handles:
        return
    ncol = min(ncol, len(handles))
    lines = -(-len(handles) // ncol)
    ax.legend(handles, labels, loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=ncol, fontsize=FONT - 1,
              frameon=False, borderaxespad=0.2, handlelength=1.5, columnspacing=1.2)
    ax.set_title(ax.get_title(), fontsize=FONT + 1, pad=6 + 1.45 * (FONT - 1) * lines)


def job_bars(ax, names, values, xlabel, title, texts, marked=(), color=None):
    """One bar per job in its colour (the colours of curves.png; `color`: one for all), `texts` written after the
    bars, and the jobs in `marked` (baselines) hatched and named so."""
    y = np.arange(len(names))
    v = np.nan_to_num(np.array(values, dtype=float))
    bars = ax.barh(y, v, 0.7, color=color or colors(len(names)), alpha=0.45 if color else 1.0)
    for i in marked:
        bars[i].set_hatch("//")
        bars[i].set_edgecolor("black")
    ax.bar_label(bars, labels=texts, padding=3, fontsize=FONT - 1)
    ax.set_xlim(0, max(float(v.max(initial=0.0)), 1e-12) * 1.7)  # room for the texts
    rows(ax, names, marked)
    ax.set_xlabel(xlabel, fontsize=FONT)
    ax.set_title(title, fontsize=FONT + 1)
    ax.tick_params(axis="x", labelsize=FONT - 1)
    ax.grid(axis="x", alpha=0.3)


def heatmap(fig, ax, names, columns, values, unit, title, texts=None, cax=None, vmax=None):
    """Runs x phases, each cell annotated (`texts`, else the value); NaN (phase absent) left blank. `cax`: the
    axes for the colour bar (default: taken from `ax`); `vmax`: the top of the colour scale (cells above it
    saturate)."""
    values = np.array(values, dtype=float)
    im = ax.imshow(np.ma.masked_invalid(values), aspect="auto", cmap="viridis", vmin=0 if vmax else None, vmax=vmax)
    ax.set_xticks(range(len(columns)), columns, rotation=30, ha="right", rotation_mode="anchor", fontsize=FONT - 1)
    ax.set_yticks(range(len(names)), [wrap(n) for n in names], fontsize=FONT - 1)
    ax.set_title(title, fontsize=FONT + 1)
    bar = fig.colorbar(im, cax=cax, label=unit) if cax is not None else fig.colorbar(im, ax=ax, label=unit, pad=0.01)
    bar.ax.tick_params(labelsize=FONT - 1)
    finite = values[np.isfinite(values)]
    mid = (finite.min() + (vmax or finite.max())) / 2 if finite.size else 0
    for (r, c), v in np.ndenumerate(values):
        if np.isfinite(v):
            text = texts[r][c] if texts else f"{v:.0f}" if abs(v) >= 10 else f"{v:.2g}"
            ax.text(c, r, text, ha="center", va="center", fontsize=FONT - 1, color="black" if v > mid else "white")
