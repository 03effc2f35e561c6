"""task=word_problems: arithmetic word problems in plain English, for a pretrained chat model.

"Mia has 17 coins. She finds 19 more. How many coins does Mia have now? Put the final answer in \\boxed{}." ->
"36". Each problem starts with a count (or, with "*" in task.ops, boxes of a count each) and applies 1 to
task.max_steps operations (each further one with probability MORE, so most problems are short), with operands up
to task.max_operand; counts never go below zero. Reproducible from the seed; answers are integers as text, scored
by math-verify (rlrun.tasks.rewards.math_verify), as TRL's accuracy reward does, with a format reward beside it
(conf/task/word_problems.yaml). The instruction (task.instruction) ends the user's message; the prompt goes through
the tokenizer's chat template (task.chat_template).
"""

from __future__ import annotations

import random

from .chat import format_rows

MORE = 0.5  # probability of each further operation past the first
NAMES = [("Tom", "He"), ("Anna", "She"), ("Sam", "He"), ("Lily", "She"), ("Ben", "He"), ("Mia", "She"),
         ("Leo", "He"), ("Zoe", "She"), ("Max", "He"), ("Ella", "She")]
THINGS = ["apples", "books", "coins", "pencils", "stickers", "marbles", "cards", "shells", "stamps", "cookies"]
GAIN = ["{he} gets {b} more.", "{he} buys {b} more.", "{he} finds {b} more.", "a friend gives {him} {b} more."]
LOSS = ["{he} gives {b} to a friend.", "{he} loses {b}.", "{he} gives away {b}.", "{he} uses {b}."]


def problem(rng: random.Random, max_operand: int, ops: list[str], max_steps: int) -> tuple[str, int]:
    """One problem's text (without the instruction) and its answer."""
    name, he = rng.choice(NAMES)
    things = rng.choice(THINGS)
    him = "him" if he == "He" else "her"
    if "*" in ops and rng.random() < 1 / len(ops):
        boxes, each = rng.randint(2, max(2, max_operand // 2)), rng.randint(2, max(2, max_operand // 2))
        text, value = f"{name} has {boxes} boxes with {each} {things} in each box.", boxes * each
    else:
        value = rng.randint(1, max_operand)
        text = f"{name} has {value} {things}."
    steps = [op for op in ops if op != "*"] or ["+"]
    for n in range(max_steps):
        if n and rng.random() >= MORE:
            break
        op = rng.choice(steps)
        if op == "-" and value == 0:
            op = "+"
        b = rng.randint(1, max_operand if op == "+" else min(max_operand, value))
        sentence = rng.choice(GAIN if op == "+" else LOSS).format(he=he.lower(), him=him, b=b)
        text += " " + ("Then " if n else "") + (sentence[0].upper() + sentence[1:] if not n else sentence)
        value = value + b if op == "+" else value - b
    return f"{text} How many {things} does {name} have now?", value


def word_problems(n: int, max_operand: int, ops: list[str], max_steps: int, instruction: str | None,
                  seed: int) -> list[dict]:
    """`n` rows {prompt, answer}, reproducible from `seed`."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        text, value = problem(rng, max_operand, ops, max_steps)
        rows.append({"prompt": f"{text} {instruction}" if instruction else text, "answer": str(value)})
    return rows


def read(cfg, seed: int, fmt, pairs: bool) -> tuple[list[dict], None]:
    """task=word_problems: (the problems of the seed, their prompts formatted; no eval split). Preference pairs
    (loss=dpo): chosen = the answer boxed, rejected = a wrong number boxed."""
    rows = word_problems(cfg.size, cfg.max_operand, list(cfg.ops), cfg.max_steps, cfg.instruction, seed)
    if pairs:
        rng = random.Random(seed + 1)
        rows = [{"prompt": r["prompt"], "chosen": f"\\boxed{{{r['answer']}}}",
                 "rejected": f"\\boxed{{{int(r['answer']) + rng.choice([-2, -1, 1, 2])}}}"} for r in rows]
    return format_rows(rows, fmt, "task=word_problems"), None
