"""The task contracts: `TaskReader`, what each task kind in the registry is, and `Task`, what the recipes get."""

from __future__ import annotations

from typing import Protocol, runtime_checkable


class TaskReader(Protocol):
    """`registry.get("task", name)`: the validated `task` node -> (rows, rows of an eval split or None), prompts
    formatted by `fmt` (a chat.Formatter); `pairs`: {prompt, chosen, rejected} rows for DPO, else {prompt, answer}
    (plus the row's other columns). Holding out and rewards are the loader's (core.py), the same for every kind."""

    def __call__(self, cfg, seed: int, fmt, pairs: bool) -> tuple[list[dict], list[dict] | None]: ...


@runtime_checkable
class Task(Protocol):
    """What `tasks.load` returns (core.Task): rows to train and evaluate on, and the rewards scoring completions."""

    name: str
    train: list[dict]  # "prompt" (the exact text fed to the tokenizer), "answer", the row's other columns
    eval: list[dict]  # held out: prompts never in train

    def score(self, completions: list[str], rows: list[dict]) -> tuple[list[float], dict[str, list[float]]]:
        """(weighted totals, {reward name: values}), one float per completion."""

    @property
    def reward_names(self) -> list[str]: ...
