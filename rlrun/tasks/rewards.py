"""A library of common rewards, for `task.rewards: [{fn: rlrun.tasks.rewards:NAME, ...}]`.

Each takes the completion first and what it needs by keyword (see rlrun.tasks: how rewards are called); options
such as `pattern` come from the reward's `kwargs`. `partial_credit` and `exact_match` are also the historic
`rlrun.tasks:partial_credit` / `rlrun.tasks:exact_match` (two positional arguments, same values as always).
"""

from __future__ import annotations

import random
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


def math_verify(completion: str, answer: str, lenient: bool = False, **_) -> float:
    """1.0 when HF's math-verify finds the completion's answer mathematically equal to `answer` (7/2 == 3.5 ==
    \\frac{7}{2}). By default only an answer written in LaTeX counts: a \\boxed{...}, or $...$ after "the answer
    is", as TRL's accuracy reward reads it; `lenient: true` also takes math-verify's plain-text extraction (the
    final number or expression), so it shows what a model knows apart from the form it is asked for."""
    mv = _math_verify()
    gold = mv.parse(answer if "$" in answer or "\\boxed" in answer else f"${answer}$", **_timeouts())
    if not gold:
        raise ValueError(f"math-verify cannot read the reference answer {answer[-80:]!r}")
    latex = mv.LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=False)
    configs = [latex, mv.ExprExtractionConfig()] if lenient else [latex]
    got = mv.parse(completion, extraction_config=configs, extraction_mode="first_match", **_timeouts())
    return float(bool(got) and mv.verify(gold, got, **_timeouts(verify=True)))


def _math_verify():
    import math_verify

    return math_verify


def _timeouts(verify: bool = False) -> dict:
    """math-verify bounds a call with SIGALRM, which only the main thread may set: elsewhere (a library caller's
    thread) no bound; a run's reward worker bounds every call itself (task.reward_timeout_s)."""
    import threading

    if threading.current_thread() is threading.main_thread():
        return {}
    return {"timeout_seconds": None} if verify else {"parsing_timeout": None}


def random_reward(completion: str, **_) -> float:
    """A control, not a reward: a uniform draw in [0, 1) that ignores the completion (from the reward worker's
    `random`, seeded with the run's seed). A run that learns with its real reward and not with this one learned
    from the reward, not from the updates themselves (docs/real-model.md)."""
    return random.random()
