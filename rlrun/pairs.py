"""All-pairs covering arrays: a few configurations in which every pair of options of two axes appears at least once,
where the full product would be hundreds (the exact axes' 3x3x3x3x2x2 options: 324). Used to check combinations,
not just each option alone: `rlrun check` over the exact axes (tests/unit/check/test_check.py) and the memory planner
over the options that change its terms (`python -m rlrun.bench plan`, the `pairs` points)."""

from __future__ import annotations

import functools

from . import registry


def exact_axes() -> dict[str, list[str]]:
    """{config key: its options}, for the axes that must not change a run's numbers (registry.EFFICIENCY) and
    train.precision, from the registry (a new option is covered without a list to edit)."""
    groups = (*registry.EFFICIENCY, "precision")
    return {registry.KEYED_BY.get(g, g): list(registry.REGISTRY[g]) for g in groups}


def all_pairs(axes: dict[str, list]) -> list[dict]:
    """Configurations ({key: option}) covering every pair of options of two keys. Greedy: each new configuration
    takes, key by key, the option that completes the most pairs still missing; deterministic (dict order)."""
    keys = list(axes)
    missing = {(a, x, b, y) for i, a in enumerate(keys) for b in keys[i + 1:] for x in axes[a] for y in axes[b]}
    out = []
    while missing:
        row: dict = {}

        def gain(k, v, row=row, missing=missing):
            return sum(1 for a, x, b, y in missing if (a, x) == (k, v) and row.get(b, y) == y
                       or (b, y) == (k, v) and row.get(a, x) == x)

        for k in keys:
            row[k] = max(axes[k], key=functools.partial(gain, k))
        missing -= {(a, row[a], b, row[b]) for i, a in enumerate(keys) for b in keys[i + 1:]}
        out.append(row)
    return out
