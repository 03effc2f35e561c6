"""Length checks before training, in tokens: what would silently waste a run is said up front, with numbers."""

from __future__ import annotations

from .base import TaskError, short


def token_lengths(tokenizer, texts: list[str]) -> list[int]:
    """Token counts as the rollout encodes them (no special tokens added); each distinct text encoded once."""
    distinct = list(dict.fromkeys(texts))
    ids = tokenizer(distinct, add_special_tokens=False)["input_ids"]
    n = {t: len(i) for t, i in zip(distinct, ids)}
    return [n[t] for t in texts]


def _last_tokens(tokenizer, ids: list[int], n: int) -> str:
    """Text of at most `n` tokens from the end of `ids`, as the rollout will encode it again: a cut inside a
    multi-byte character (byte-level BPE) decodes to U+FFFD and re-encodes longer, so cut further until it fits."""
    for k in range(n, 0, -1):
        text = tokenizer.decode(ids[-k:]).lstrip("\ufffd")
        if len(tokenizer(text, add_special_tokens=False)["input_ids"]) <= n:
            return text
    return ""


def cut_prompts(task, tokenizer, n: int) -> None:
    """task.max_prompt_tokens=n: each prompt (train and eval) longer than n tokens keeps its last n (the end holds
    the question and, with a chat template, the assistant header); a warning counts them."""
    rows = list(task.train) + list(task.eval)
    ids = tokenizer([r["prompt"] for r in rows], add_special_tokens=False)["input_ids"]
    cut = [(r, i) for r, i in zip(rows, ids) if len(i) > n]
    for row, i in cut:
        row["prompt"] = _last_tokens(tokenizer, i, n)
    if cut:
        longest = max(len(i) for _, i in cut)
        task.warnings.append(f"{len(cut)} of {len(rows)} prompts were longer than task.max_prompt_tokens={n} tokens "
                             f"(the longest {longest}) and keep only their last {n} tokens.")


def check_lengths(task_or_rows, tokenizer, max_new_tokens: int | None, max_positions: int | None) -> list[str]:
    """Warnings (sentences with counts and the key to change) about rows that may not work: answers longer than
    rollout.max_new_tokens; DPO pairs longer than the context. Raises TaskError when there are no rows, when every
    DPO pair is too long, or when any GRPO prompt with rollout.max_new_tokens overflows the model's context (the fix
    named: task.max_prompt_tokens cuts them).
    `task_or_rows`: a Task (train and eval rows; its loading warnings come first) or a list of rows.
    None for max_new_tokens / max_positions skips that check."""
    rows = list(getattr(task_or_rows, "train", task_or_rows)) + list(getattr(task_or_rows, "eval", []))
    out = list(getattr(task_or_rows, "warnings", []))
    if not rows:
        raise TaskError("the task has no rows (after max_rows and the held-out split); nothing to train on.")
    m = len(rows)
    prompts = token_lengths(tokenizer, [r["prompt"] for r in rows])
    if "chosen" in rows[0]:
        sides = [token_lengths(tokenizer, [r[k] for r in rows]) for k in ("chosen", "rejected")]
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
        fit = max_positions - budget
        fixes = [f"set task.max_prompt_tokens={fit} (keeps the last {fit} tokens of each)"] if fit >= 1 else []
        fixes += ["shorten or drop them", "lower rollout.max_new_tokens", "use a model with a longer context"]
        fix = ", ".join(fixes[:-1]) + ", or " + fixes[-1] + "."
        fix = fix[0].upper() + fix[1:]
        if len(over) == m:
            raise TaskError(f"all {m} prompts are too long: the shortest is {min(prompts)} tokens{plus} > the "
                            f"model's context of {max_positions} positions. {fix}")
        if over:  # refused: generating past the context uses positions the model never learned
            raise TaskError(f"{len(over)} of {m} prompts do not fit the model's context: prompt{plus} > "
                            f"{max_positions} positions (the longest prompt is {max(over)} tokens). {fix}")
    if max_new_tokens is not None:
        answers = token_lengths(tokenizer, [r["answer"] for r in rows])
        long = [i for i, a in enumerate(answers) if a > max_new_tokens]
        if long:
            worst = max(long, key=answers.__getitem__)
            out.append(f"{len(long)} of {m} answers are longer than rollout.max_new_tokens={max_new_tokens} tokens "
                       f"(the longest is {answers[worst]} tokens: {short(rows[worst]['answer'], 40)}). Completions "
                       "stop at that length, so a reward that needs the whole answer in the completion can never "
                       f"be earned on those rows: raise rollout.max_new_tokens to at least {answers[worst]} (not "
                       "needed when the reward extracts part of the answer, as numeric_match does with '####').")
    return out
