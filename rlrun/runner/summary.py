"""What a run keeps of its steps: the run-level `Summary` (a few numbers, checkpointed) and the dead-gradient watch."""

from __future__ import annotations

import math
from collections import deque

import numpy as np


class Summary:
    """Run-level numbers accumulated step by step, so a checkpoint carries a few numbers, not every step's metrics:
    mean throughput and step time, trained tokens per second of step time (`tokens_per_s`), max peak memory per
    phase and of the run (`peak_mib`), pass totals, the first and last 3 values of `curve` (their means are
    `<curve>_first` / `<curve>_last`), and the last loss."""

    MEANS = {"gen_tokens_per_s": "throughput/gen_tokens_per_s",
             "train_tokens_per_s": "throughput/train_tokens_per_s", "step_s": "time/step_s",
             "load_1m": "host/load_1m"}

    def __init__(self, curve: str):
        self.curve = curve
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.peaks: dict[str, float] = {}
        self.first: list[float] = []
        self.last: deque[float] = deque(maxlen=3)
        self.latest: dict[str, float] = {}  # pass totals and the loss of the last step
        self.evals: dict[str, list[float]] = {}  # eval/* metric -> [first, last]
        self.trained = [0.0, 0.0]  # trained tokens and step seconds, summed over the steps that logged both

    def add(self, m: dict[str, float]) -> None:
        for name, key in self.MEANS.items():
            if key in m and math.isfinite(m[key]):
                self.sums[name] = self.sums.get(name, 0.0) + m[key]
                self.counts[name] = self.counts.get(name, 0) + 1
        if "train_tokens" in m and "time/step_s" in m:
            self.trained = [self.trained[0] + m["train_tokens"], self.trained[1] + m["time/step_s"]]
        for key, v in m.items():
            if key.startswith("mem/"):
                self.peaks[key] = max(self.peaks.get(key, v), v)
        if self.curve in m:
            if len(self.first) < 3:
                self.first.append(m[self.curve])
            self.last.append(m[self.curve])
        if any(k.startswith("eval/") for k in m):  # an evaluation, logged on its own
            for k, v in m.items():
                if k.startswith("eval/"):
                    self.evals[k] = [self.evals.get(k, [v])[0], v]
            return
        self.latest = {k: v for k, v in m.items() if k == "loss" or (k.startswith("passes/") and k.endswith("_total"))}

    def result(self) -> dict[str, float]:
        out = {name: self.sums[name] / self.counts[name] for name in self.sums}
        if self.trained[1] > 0:  # the step's rate, not one phase's: what the report's tokens/s column shows
            out["tokens_per_s"] = self.trained[0] / self.trained[1]
        out.update({k.replace("mem/", "max_"): v for k, v in self.peaks.items()})
        phase_peaks = [v for k, v in self.peaks.items() if k.endswith("_peak_mib")]
        if phase_peaks:  # the run's highest phase peak: the runs table's memory column (tracking/ui.py)
            out["peak_mib"] = max(phase_peaks)
        for key, v in self.latest.items():
            if key.startswith("passes/"):
                out["passes_" + key.removeprefix("passes/").removesuffix("_total")] = v
        if self.first:
            name = self.curve.split("/")[-1].replace("_mean", "")
            out[f"{name}_first"] = float(np.mean(self.first))
            out[f"{name}_last"] = float(np.mean(self.last))
        if "loss" in self.latest:
            out["loss_last"] = self.latest["loss"]
        for k, (first, last) in self.evals.items():
            name = k.replace("/", "_").replace("@", "_at_")
            out[f"{name}_first"], out[f"{name}_last"] = first, last
        return out

    def state_dict(self) -> dict:
        return {"sums": dict(self.sums), "counts": dict(self.counts), "peaks": dict(self.peaks),
                "first": list(self.first), "last": list(self.last), "latest": dict(self.latest),
                "evals": {k: list(v) for k, v in self.evals.items()}, "trained": list(self.trained)}

    def load_state_dict(self, state: dict) -> None:
        self.sums, self.counts, self.peaks = dict(state["sums"]), dict(state["counts"]), dict(state["peaks"])
        self.first, self.latest = list(state["first"]), dict(state["latest"])
        self.last = deque(state["last"], maxlen=3)
        self.evals = {k: list(v) for k, v in state["evals"].items()}
        self.trained = list(state.get("trained", [0.0, 0.0]))  # checkpoints written before it count from here


DEAD_GRADIENT_STEPS = 5  # consecutive steps of a zero or non-finite gradient norm before the warning
DEAD_GRADIENTS_TAG = "rlrun.warning.dead_gradients"


def watch_gradients(history_state: dict, grad_norm: float, equal_rewards: bool = False) -> str | None:
    """Training that died quietly: the warning text the first time the gradient norm has been exactly 0 or
    non-finite for DEAD_GRADIENT_STEPS consecutive steps, else None. `history_state` is a dict the caller keeps for
    the run (start with {}); the warning is given once per run. Call once per optimizer step with that step's grad
    norm and whether every prompt group of the step had equal rewards (GRPO); on a text, warn in the console and
    set the run tag DEAD_GRADIENTS_TAG to it.

    Two causes read differently: every group had equal rewards on every dead step (all advantages are 0, so there is
    nothing to learn: the reward or the task, not the optimizer), or the weights broke (e.g. train.lr=1e6)."""
    dead = not math.isfinite(grad_norm) or grad_norm == 0.0
    history_state["dead"] = history_state.get("dead", 0) + 1 if dead else 0
    history_state["equal"] = history_state.get("equal", 0) + 1 if dead and equal_rewards else 0
    history_state["steps"] = history_state.get("steps", 0) + 1
    if history_state["dead"] < DEAD_GRADIENT_STEPS or history_state.get("warned"):
        return None
    history_state["warned"] = True
    n, step = history_state["dead"], history_state["steps"] - 1
    if history_state["equal"] == n:
        return (f"the gradient norm has been exactly 0 for {n} consecutive steps (step {step} of this process) "
                "because every prompt group had equal rewards: all completions of a prompt scored the same, so "
                "every advantage is 0 and there is nothing to learn from. The learning rate is not the cause: the "
                "task is too hard or too easy for this policy, or the reward does not tell completions apart; check "
                "the reward and the samples (log.samples_every=N), or raise train.group_size or "
                "rollout.temperature.")
    what = "exactly 0" if grad_norm == 0.0 else f"non-finite ({grad_norm})"
    return (f"the gradient norm has been zero or non-finite for {n} consecutive steps "
            f"(now {what}, step {step} of this process): training has stopped learning, "
            "usually from a learning rate far too high (train.lr) that broke the weights; lower train.lr or check "
            "the loss and reward.")
