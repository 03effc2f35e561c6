"""A library of common rewards, for `task.rewards: [{fn: rlrun.tasks.rewards:NAME, ...}]`.

Each takes the completion first and what it needs by keyword (see rlrun.tasks: how rewards are called); options
such as `pattern` come from the reward's `kwargs`. `partial_credit` and `exact_match` are also the historic
`rlrun.tasks:partial_credit` / `rlrun.tasks:exact_match` (two positional arguments, same values as always).
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation


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
    """1.0 when the completion, stripped, is the answer."""
    return float(completion.strip() == answer)


# A number with optional sign, thousands commas and decimals: "-1,234.5", "42" (also the "42" of "42.").
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _last_number(text: str) -> Decimal | None:
    for match in reversed(_NUMBER.findall(text)):
        try:
            return Decimal(match.replace(",", ""))
        except InvalidOperation:
            continue
    return None


def answer_number(answer: str) -> Decimal:
    """The reference number of an answer: what follows '####' (GSM8K) when present, else its last number."""
    _, sep, tail = answer.rpartition("####")
    value = _last_number(tail if sep else answer)
    if value is None:
        raise ValueError(f"the answer {answer[-80:]!r} has no number to compare with")
    return value


def numeric_match(completion: str, answer: str, **_) -> float:
    """1.0 when the last number in the completion equals the answer's number (GSM8K style, see `answer_number`),
    compared as decimals with commas stripped: "1,000" == "1000", "3.50" == "3.5"."""
    got = _last_number(completion)
    return float(got is not None and got == answer_number(answer))


def format(completion: str, pattern: str, fullmatch: bool = False, **_) -> float:
    """1.0 when the regex `pattern` (a reward kwarg) is found in the completion (the whole completion, stripped,
    with `fullmatch: true`). Dot matches newlines, so a pattern can span reasoning lines."""
    text = completion.strip() if fullmatch else completion
    found = (re.fullmatch if fullmatch else re.search)(pattern, text, re.DOTALL)
    return float(found is not None)


def length_penalty(completion: str, max_chars: int = 1000, **_) -> float:
    """-len(completion) / max_chars, at most -1: 0 for an empty completion, -1 at `max_chars` characters and
    beyond. Characters, not tokens: a reward sees text only. Give it a small weight beside a correctness reward."""
    if max_chars <= 0:
        raise ValueError(f"length_penalty needs max_chars > 0, got {max_chars}")
    return -min(len(completion) / max_chars, 1.0)
