"""Reward functions for tests, plugged in through `task.reward=helpers:NAME`."""

import math

calls = {"n": 0}


def nan_reward(completion: str, answer: str) -> float:
    return math.nan


def interrupt_after_two_rollouts(completion: str, answer: str) -> float:
    calls["n"] += 1
    if calls["n"] > 16:  # smoke rollouts have 8 completions: the third rollout is interrupted
        raise KeyboardInterrupt
    return 0.5
