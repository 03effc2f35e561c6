"""A sweep parent's description: the answer in one plain line (the runs table shows its first line as it is), then
one short line per job, cheapest first (MLflow's run page folds a long description and draws tables without borders,
so lines read better than a table)."""

from __future__ import annotations

# The comparison's columns a job's line shows (the rest are in comparison.json and the figures), and how each reads
# in a sentence; a column not named here reads "column value".
STEP = "step s (no eval)"  # report.COLUMNS' step time: the console's (evaluation and checkpoints left out)
LINE = (STEP, "tokens/s (step)", "reward / acc", "growth MiB")
PHRASES = {STEP: "{} s/step", "tokens/s (step)": "{} tokens/s", "reward / acc": "reward / acc {}",
           "growth MiB": "growth {} MiB"}


def comparison_note(rows: list[dict], specs: dict[str, str], answer=None) -> str:
    """The sweep's comparison as markdown that MLflow's run page shows legibly: it folds a description after a few
    lines and draws tables without borders or padding, so the answer in one plain line, then one short line per
    job, cheapest first. `answer`: tools/verdict.answer's (headline, {run: its cost on the changed phases, its
    spread and its same-result verdict}); without it (a bare table), the runs by step time."""
    from ..render import num, short

    def esc(text):  # run names hold `_` and `*`, which markdown reads as emphasis
        return str(text).replace("\\", "\\\\").replace("_", "\\_").replace("*", "\\*")

    headline, verdicts = answer or (None, {})
    verdicts = dict(verdicts)  # {run name: its verdict}

    def cost(r):
        v = verdicts.get(r["run"], {}).get("phase_s", r.get(STEP, float("nan")))
        return v if v == v else float("inf")  # NaN: no time, last

    rows = sorted(rows, key=cost)
    lines = [f"{headline}\n"] if headline else []  # plain: the runs table shows the first line as it is
    shown = [c for c in LINE if c in specs] or list(specs)
    for r in rows:
        cells = [PHRASES.get(c, c + " {}").format(num(r.get(c), specs[c]) if specs[c] else short(r.get(c)))
                 for c in shown]
        v: dict = verdicts.get(r["run"], {})
        if "phase_s" in v:
            over = f" over {v['repeats']} repeats" if v.get("repeats", 1) > 1 else ""
            cells.insert(0, f"changed phases {num(v['phase_s'], '.4f')} s [{num(v['phase_low'], '.4f')}, "
                            f"{num(v['phase_high'], '.4f')}]{over}")
            same = {True: "yes", False: "NO", None: "–"}[v["same"]]
            cells.append(f"same result: {same} ({esc(v['same_text'])})")
        if "check" in v:
            cells.append(f"check: {esc(v['check'])}")
        lines.append(f"- **{esc(r['run'])}**: " + " · ".join(cells))
    return "\n".join(lines)
