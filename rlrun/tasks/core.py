"""`load` / `load_pairs`: the typed `task` config node -> rows (train / eval) and bound rewards.

The node is validated (rlrun/config: schema.py and rules.py are the one place of defaults and checks); the rows
come from the reader of `task.name` in the registry (arith.py, jsonl.py, dataset.py: `TaskReader` in protocol.py).
"""

from __future__ import annotations

import contextlib
import logging
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .. import registry
from . import scoring
from .base import TaskError, plain
from .chat import Formatter
from .lengths import cut_prompts

if TYPE_CHECKING:
    from .worker import RewardWorker

log = logging.getLogger("rlrun")


@dataclass
class Task:
    """Rows to train and evaluate on, and the rewards that score completions (see rlrun.tasks)."""

    name: str
    train: list[dict]
    eval: list[dict]
    rewards: list[scoring.Reward] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # from loading; check_lengths returns them too
    worker: RewardWorker | None = None  # while `isolated` (a run); None: rewards are called in this process

    def score(self, completions: list[str], rows: list[dict]) -> tuple[list[float], dict[str, list[float]]]:
        if self.worker is None:
            return scoring.score(self.rewards, completions, rows)
        if len(completions) != len(rows):
            raise ValueError(f"score: {len(completions)} completions for {len(rows)} rows")
        per = self.worker.score(completions, rows)
        return scoring.weigh(self.rewards, per, completions, rows), per

    @property
    def reward_names(self) -> list[str]:
        return [r.name for r in self.rewards]


@contextlib.contextmanager
def isolated(task: Task, timeout_s: float, seed: int = 0):
    """Within the block, `task.score` calls the rewards in a worker process, each call bounded by `timeout_s`
    (rlrun/tasks/worker.py); the worker ends with the block."""
    from .worker import RewardWorker

    task.worker = RewardWorker(task.rewards, timeout_s, seed)
    try:
        yield task
    finally:
        task.worker.close()
        task.worker = None


def _held_out(rows: list[dict], eval_rows: list[dict] | None, eval_size, seed: int, what: str):
    """(train, eval, warnings). With eval_size, distinct prompts are drawn with the seed (a count or fraction of
    them); every row of a drawn prompt leaves train, and eval keeps one row per prompt. With an eval split,
    train rows whose prompt is also in eval are dropped (counted in a warning). Train keeps its order."""
    if eval_rows is None and not eval_size:
        return rows, [], []
    warnings, from_split = [], eval_rows is not None
    if eval_rows is None:  # not from_split
        first: dict[str, dict] = {}
        for r in rows:
            first.setdefault(r["prompt"], r)
        prompts, n = list(first.values()), len(first)
        k = eval_size if isinstance(eval_size, int) else max(1, round(eval_size * n))
        if k >= n:
            raise TaskError(f"task.eval_size={eval_size} holds out {k} of the {n} distinct {what} prompts, leaving "
                            "none to train on; lower it.")
        picked = sorted(random.Random(f"rlrun-eval-{seed}").sample(range(n), k))
        eval_rows = [prompts[i] for i in picked]
    held = {r["prompt"] for r in eval_rows}
    train = [r for r in rows if r["prompt"] not in held]
    if not train:
        raise TaskError(f"every training prompt is also in the eval split ({len(held)} prompts); nothing is left "
                        "to train on.")
    if from_split and len(train) < len(rows):
        warnings.append(f"{len(rows) - len(train)} of {len(rows)} training rows have a prompt that is also in the "
                        "eval split; they were left out of training.")
    return train, eval_rows, warnings


def _read(cfg, seed: int, tokenizer, pairs: bool):
    """(train rows, eval-split rows or None), prompts formatted, before holding out."""
    fmt = Formatter(tokenizer, cfg.chat_template, cfg.add_generation_prompt, cfg.system_prompt)
    return registry.get("task", cfg.name)(cfg, seed, fmt, pairs)


def given_on_command_line(key: str) -> bool:
    """Whether this Hydra run's overrides set `key` (True outside a Hydra run: a library caller's config is all
    given)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return True
    return any(o.split("=", 1)[0].lstrip("+~") == key for o in HydraConfig.get().overrides.task)


def chosen_reward(cfg):
    """`task.reward`, unless `task.rewards` is set and the reward is only the task's default (its YAML file's):
    then the list replaces it. Both given on the command line is still refused (scoring.parse_rewards)."""
    reward = plain(cfg.reward)
    if reward not in (None, "") and cfg.rewards not in (None, []) and not given_on_command_line("task.reward"):
        log.info("task.rewards replaces the task's default task.reward=%s", reward)
        return None
    return reward


def load(cfg, seed: int, tokenizer=None) -> Task:
    """The GRPO task of the `task` config node (see rlrun.tasks for the contract)."""
    rows, eval_rows = _read(cfg, seed, tokenizer, pairs=False)
    train, held, warnings = _held_out(rows, eval_rows, cfg.eval_size, seed, "training")
    fields = set().union(*(r.keys() for r in (train[:1] + held[:1])))
    rewards = scoring.load_rewards(chosen_reward(cfg), plain(cfg.rewards), fields)
    task = Task(cfg.name, train, held, rewards, warnings)
    if cfg.max_prompt_tokens is not None and tokenizer is not None:
        cut_prompts(task, tokenizer, cfg.max_prompt_tokens)
    return task


def load_pairs(cfg, seed: int, tokenizer=None) -> tuple[list[dict], list[dict]]:
    """(train pairs, eval pairs) for loss=dpo: rows {prompt, chosen, rejected} (the caller adds "id")."""
    rows, eval_rows = _read(cfg, seed, tokenizer, pairs=True)
    train, held, _ = _held_out(rows, eval_rows, cfg.eval_size, seed, "pair")
    return train, held
