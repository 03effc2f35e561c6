"""The synthetic task: "3+4=" -> "7", reproducible from the seed, and preference pairs made from it."""

from __future__ import annotations

import random

from .chat import format_rows


def read(cfg, seed: int, fmt, pairs: bool) -> tuple[list[dict], None]:
    """task=arith: (the problems of the seed, or pairs made from them; no eval split)."""
    rows = arith_examples(cfg.size, cfg.max_operand, list(cfg.ops), seed)
    return format_rows(arith_pairs(rows, seed) if pairs else rows, fmt, "task=arith"), None


def arith_examples(n: int, max_operand: int, ops: list[str], seed: int) -> list[dict]:
    """`n` problems like "3+4=" -> "7" (results stay non-negative), reproducible from `seed`."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b, op = rng.randint(0, max_operand), rng.randint(0, max_operand), rng.choice(ops)
        if op == "-":
            a, b = max(a, b), min(a, b)
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        out.append({"prompt": f"{a}{op}{b}=", "answer": str(value)})
    return out


def arith_pairs(examples: list[dict], seed: int) -> list[dict]:
    """Preference pairs from verifiable problems: chosen = the answer, rejected = a wrong number."""
    rng = random.Random(seed + 1)
    pairs = []
    for ex in examples:
        value = int(ex["answer"])
        wrong = value
        while wrong == value:
            wrong = max(0, value + rng.choice([-3, -2, -1, 1, 2, 3]))
        pairs.append({"prompt": ex["prompt"], "chosen": ex["answer"], "rejected": str(wrong)})
    return pairs
