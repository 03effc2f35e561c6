"""The synthetic task: "3+4=" -> "7", reproducible from the seed, and preference pairs made from it.

With task.max_terms > 2 a problem has 2 to max_terms operands (each further one with probability MORE: most
problems short, a few long, like reasoning lengths), all with the problem's operator, evaluated left to right:
"3+4+5=" -> "12". With task.worked the answer is the running value after each operand, "3+4+5=" -> "7,12", so the
completions' lengths vary with the prompts' (what batching=packed|shared_prompt saves: docs/batching.md).
"""

from __future__ import annotations

import random

from .chat import format_rows

MORE = 0.75  # probability of each further operand past the second (long-tailed lengths)


def read(cfg, seed: int, fmt, pairs: bool) -> tuple[list[dict], None]:
    """task=arith: (the problems of the seed, or pairs made from them; no eval split)."""
    rows = arith_examples(cfg.size, cfg.max_operand, list(cfg.ops), seed, cfg.max_terms, cfg.worked)
    return format_rows(arith_pairs(rows, seed) if pairs else rows, fmt, "task=arith"), None


def apply(value: int, op: str, b: int) -> tuple[int, int]:
    """(value op b, b), b lowered to `value` for "-" so that results stay non-negative."""
    b = min(b, value) if op == "-" else b
    return {"+": value + b, "-": value - b, "*": value * b}[op], b


def arith_examples(n: int, max_operand: int, ops: list[str], seed: int, max_terms: int = 2,
                   worked: bool = False) -> list[dict]:
    """`n` problems like "3+4=" -> "7" (results stay non-negative), reproducible from `seed`; with max_terms > 2
    and `worked`, see the module's docstring (max_terms=2 draws exactly what it always drew)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b, op = rng.randint(0, max_operand), rng.randint(0, max_operand), rng.choice(ops)
        if op == "-":
            a, b = max(a, b), min(a, b)
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        prompt, steps = f"{a}{op}{b}", [value]
        while len(steps) + 1 < max_terms and rng.random() < MORE:
            value, c = apply(value, op, rng.randint(0, max_operand))
            prompt, steps = f"{prompt}{op}{c}", steps + [value]
        out.append({"prompt": f"{prompt}=", "answer": ",".join(map(str, steps)) if worked else str(value)})
    return out


def arith_pairs(examples: list[dict], seed: int) -> list[dict]:
    """Preference pairs from verifiable problems: chosen = the answer, rejected = the answer with a wrong number
    in place of its last one (a worked answer keeps its earlier steps)."""
    rng = random.Random(seed + 1)
    pairs = []
    for ex in examples:
        *steps, last = ex["answer"].split(",")
        value = int(last)
        wrong = value
        while wrong == value:
            wrong = max(0, value + rng.choice([-3, -2, -1, 1, 2, 3]))
        pairs.append({"prompt": ex["prompt"], "chosen": ex["answer"], "rejected": ",".join([*steps, str(wrong)])})
    return pairs
