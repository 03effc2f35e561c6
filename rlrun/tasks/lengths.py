"""Length checks before training, in tokens: what would silently waste a run is said up front, with numbers."""

from __future__ import annotations

from .base import TaskError, short


def _lengths(tokenizer, texts: list[str]) -> list[int]:
    """Token counts as the rollout encodes them (no special tokens added); each distinct text encoded once."""
    distinct = list(dict.fromkeys(texts))
    ids = tokenizer(distinct, add_special_tokens=False)["input_ids"]
    n = {t: len(i) for t, i in zip(distinct, ids)}
    return [n[t] for t in texts]


def check_lengths(task_or_rows, tokenizer, max_new_tokens: int | None, max_positions: int | None) -> list[str]:
    """Warnings (sentences with counts and the key to change) about rows that cannot work: GRPO prompts that
    with rollout.max_new_tokens overflow the model's context, answers longer than rollout.max_new_tokens; DPO
    pairs longer than the context. Raises TaskError when there are no rows or when every row is too long.
    `task_or_rows`: a Task (train and eval rows; its loading warnings come first) or a list of rows.
    None for max_new_tokens / max_positions skips that check."""
    rows = list(getattr(task_or_rows, "train", task_or_rows)) + list(getattr(task_or_rows, "eval", []))
    out = list(getattr(task_or_rows, "warnings", []))
    if not rows:
        raise TaskError("the task has no rows (after max_rows and the held-out split); nothing to train on.")
    m = len(rows)
    prompts = _lengths(tokenizer, [r["prompt"] for r in rows])
    if "chosen" in rows[0]:
        sides = [_lengths(tokenizer, [r[k] for r in rows]) for k in ("chosen", "rejected")]
        total = [p + max(c, r) + 1 for p, c, r in zip(prompts, *sides)]  # + the EOS the pair encoder appends
        if max_positions is not None:
            over = [t for t in total if t > max_positions]
            if len(over) == m:
                raise TaskError(f"all {m} pairs are longer than the model's context of {max_positions} positions "
                                f"(prompt + longer response + EOS; the shortest is {min(total)} tokens): shorten "
                                "them or use a model with a longer context.")
            if over:
                out.append(f"{len(over)} of {m} pairs are longer than the model's context of {max_positions} "
                           f"positions (prompt + longer response + EOS; the longest is {max(over)} tokens): "
                           "shorten or drop them, or use a model with a longer context.")
        return out
    budget = max_new_tokens or 0
    if max_positions is not None:
        over = [p for p in prompts if p + budget > max_positions]
        plus = f" + rollout.max_new_tokens={max_new_tokens}" if max_new_tokens else ""
        if len(over) == m:
            raise TaskError(f"all {m} prompts are too long: the shortest is {min(prompts)} tokens{plus} > the "
                            f"model's context of {max_positions} positions. Shorten the prompts, lower "
                            "rollout.max_new_tokens, or use a model with a longer context.")
        if over:
            out.append(f"{len(over)} of {m} prompts do not fit the model's context: prompt{plus} > "
                       f"{max_positions} positions (the longest prompt is {max(over)} tokens). Shorten or drop "
                       "them, lower rollout.max_new_tokens, or use a model with a longer context.")
    if max_new_tokens is not None:
        answers = _lengths(tokenizer, [r["answer"] for r in rows])
        long = [i for i, a in enumerate(answers) if a > max_new_tokens]
        if long:
            worst = max(long, key=answers.__getitem__)
            out.append(f"{len(long)} of {m} answers are longer than rollout.max_new_tokens={max_new_tokens} tokens "
                       f"(the longest is {answers[worst]} tokens: {short(rows[worst]['answer'], 40)}). Completions "
                       "stop at that length, so a reward that needs the whole answer in the completion can never "
                       f"be earned on those rows: raise rollout.max_new_tokens to at least {answers[worst]} (not "
                       "needed when the reward extracts part of the answer, as numeric_match does with '####').")
    return out
