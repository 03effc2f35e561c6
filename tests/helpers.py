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


def nan_after_two_rollouts(completion: str, answer: str) -> float:
    calls["nan"] = calls.get("nan", 0) + 1
    return math.nan if calls["nan"] > 16 else 0.5


def runs(db: str):
    """All MLflow runs of the store at `db` (a path), newest first."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{db}")
    exps = [e.experiment_id for e in client.search_experiments()]
    return client, client.search_runs(exps, order_by=["attributes.start_time DESC"])


def history(client, run_id: str, key: str) -> list[float]:
    return [m.value for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]


def fail_on_rank1_second_rollout(completion: str, answer: str) -> float:
    """Rank 1 raises while scoring its second rollout (engine=deepspeed tests)."""
    import os

    calls["rank1"] = calls.get("rank1", 0) + 1
    if os.environ.get("RANK") == "1" and calls["rank1"] > 4:  # 4 completions per rank per smoke rollout
        raise RuntimeError("reward server unreachable (test)")
    return 0.5
