"""Tasks: prompts with verifiable answers and the rewards that score completions.

A task is a list of examples ({"prompt", "answer"}) plus a reward function `reward(completion, answer) -> float`.
`arith` is synthetic (generated from the seed); `jsonl` reads a file. Rewards are plain functions, chosen by an
import path (`module:function`) so users can plug their own.
"""

from __future__ import annotations

import importlib
import json
import random


class TaskError(ValueError):
    """A data file or task option that cannot be used."""


def partial_credit(completion: str, answer: str) -> float:
    """1.0 for the exact answer; otherwise up to 0.75 for form and per-position correct characters.

    Form (0.25 x the share of characters of the answer's kind, digit or not; 0.25 for the right length) gives even
    a random model rewards that differ within a group, so advantages are never all zero; matching characters
    (0.25 x share) then lead to the exact answer.
    """
    completion = completion.strip()
    if completion == answer:
        return 1.0
    if not completion:
        return 0.0
    same_kind = sum(c.isdigit() == answer.isdigit() for c in completion) / len(completion)
    matches = sum(a == b for a, b in zip(completion, answer))
    return 0.25 * same_kind + 0.25 * (len(completion) == len(answer)) + 0.25 * matches / max(len(answer), 1)


def exact_match(completion: str, answer: str) -> float:
    return float(completion.strip() == answer)


def load_reward(path: str):
    """`module:function` -> the function, with an error naming the key on failure."""
    module, _, name = path.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise TaskError(f"task.reward={path!r} cannot be imported ({e}); use 'module:function'.") from e
    if not callable(fn):
        raise TaskError(f"task.reward={path!r} is not callable.")
    return fn


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


def read_jsonl(path: str, fields: tuple[str, ...]) -> list[dict]:
    """Records of a JSONL file, each checked for `fields`; errors name the file and line."""
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise TaskError(f"task.path={path!r} cannot be read ({e.strerror}); point it at a JSONL file.") from e
    out = []
    with f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise TaskError(f"{path}:{lineno}: not valid JSON ({e.msg}); one JSON object per line.") from e
            if not isinstance(rec, dict):
                raise TaskError(f"{path}:{lineno}: expected a JSON object with keys {list(fields)}.")
            missing = [k for k in fields if not isinstance(rec.get(k), str)]
            if missing:
                raise TaskError(f"{path}:{lineno}: missing or non-string field(s) {missing}; need {list(fields)}.")
            out.append({k: rec[k] for k in fields})
    if not out:
        raise TaskError(f"task.path={path!r} has no records.")
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


def build_pairs(cfg, seed: int) -> list[dict]:
    """Preference pairs for `loss=dpo` from the same `task` options: synthetic from `arith`, or a JSONL file with
    `prompt`, `chosen`, `rejected`."""
    if cfg.name == "arith":
        return arith_pairs(arith_examples(cfg.size, cfg.max_operand, list(cfg.ops), seed), seed)
    if cfg.name == "jsonl":
        return read_jsonl(cfg.path, ("prompt", "chosen", "rejected"))
    raise TaskError(f"task={cfg.name!r} has no preference pairs; use task=arith or task=jsonl.")


def build(cfg, seed: int):
    """(examples, reward_fn) for the `task` config group."""
    if cfg.name == "arith":
        ops = list(cfg.ops)
        bad = [op for op in ops if op not in "+-*"]
        if bad or not ops:
            raise TaskError(f"task.ops={ops} must be a non-empty list of '+', '-', '*'.")
        examples = arith_examples(cfg.size, cfg.max_operand, ops, seed)
    elif cfg.name == "jsonl":
        examples = read_jsonl(cfg.path, ("prompt", "answer"))
    else:
        raise TaskError(f"task={cfg.name!r} has no GRPO examples.")
    return examples, load_reward(cfg.reward)


class PromptStream:
    """Endless epochs over `examples`, reshuffled each epoch from `seed`; its position can be saved (resume)."""

    def __init__(self, examples: list[dict], seed: int):
        self.examples, self.rng, self.order, self.pos = examples, random.Random(seed), [], 0

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self.pos >= len(self.order):
            self.order = list(range(len(self.examples)))
            self.rng.shuffle(self.order)
            self.pos = 0
        self.pos += 1
        return self.examples[self.order[self.pos - 1]]

    def state_dict(self) -> dict:
        return {"rng": self.rng.getstate(), "order": list(self.order), "pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.rng.setstate(state["rng"])
        self.order, self.pos = list(state["order"]), state["pos"]


prompt_stream = PromptStream
