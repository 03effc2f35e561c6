"""Logprob policies: which extra forward passes a rollout needs (seeds 000 and 001).

Schedule (as in TRL): a rollout is consumed over a window of `window` micro-steps (rollout batch / micro batch x
num_iterations); an optimizer step happens every `grad_accum` micro-steps (train batch / micro batch). A rollout
whose window starts at micro-step a needs its old-policy logprobs only if an optimizer step happens inside its
window, i.e. a // grad_accum != (a + window - 1) // grad_accum; otherwise the weights that sampled it are the
weights that train on it, and the ratio can be taken against the detached current logprobs.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

POLICIES = ("always", "window", "skip")


@dataclass(frozen=True)
class Need:
    old: bool
    ref: bool


def crosses_step(start: int, window: int, grad_accum: int) -> bool:
    """True if an optimizer step falls inside micro-steps [start, start + window - 1]."""
    return start // grad_accum != (start + window - 1) // grad_accum


def plan(policy: str, *, start: int, window: int, grad_accum: int, ref_coef: float,
         old_before_loss: bool = False) -> Need:
    """Which passes the rollout whose window starts at micro-step `start` needs under `policy`. `old_before_loss`:
    the objective reads the old-policy logprobs before the loss (sequence-level importance weights), so `window`
    runs the old pass for every rollout (`skip` refuses such objectives: config/rules.py)."""
    if policy == "always":
        return Need(old=True, ref=True)
    if policy == "window":
        return Need(old=old_before_loss or crosses_step(start, window, grad_accum), ref=ref_coef != 0)
    if policy == "skip":
        return Need(old=False, ref=False)
    raise ValueError(f"logprob_policy={policy!r}; supported: {list(POLICIES)}")


def ever_needs_old(policy: str, window: int, grad_accum: int) -> bool:
    """Whether any rollout of the run needs the old-policy pass (the schedule repeats every grad_accum rollouts)."""
    return any(plan(policy, start=k * window, window=window, grad_accum=grad_accum, ref_coef=0.0).old
               for k in range(grad_accum))


def needs_reference_model(policy: str, ref_coef: float) -> bool:
    """Whether any rollout of the run can need the reference pass (so whether to build the reference model)."""
    return policy == "always" or (policy == "window" and ref_coef != 0)


class PassCounter:
    """Logprob passes run and skipped per kind ("old", "ref"), and the seconds spent in those that ran (for the
    estimate of the time a skipped pass saved). Checkpointed with the run."""

    def __init__(self, kinds: tuple[str, ...] = ("old", "ref")):
        self.kinds = kinds
        self.totals: Counter = Counter()
        self.seconds: Counter = Counter()

    def metrics(self, counts: Counter, phase_seconds: dict[str, float] | None = None) -> dict[str, float]:
        """`passes/<kind>_run|skipped` this step and in total; with `phase_seconds` (the meter's seconds per
        phase) also `passes/<kind>_saved_s_est`."""
        self.totals.update(counts)
        m = {}
        for key in (f"{kind}_{what}" for kind in self.kinds for what in ("run", "skipped")):
            m[f"passes/{key}"] = counts[key]
            m[f"passes/{key}_total"] = self.totals[key]
        for kind in self.kinds if phase_seconds is not None else ():
            self.seconds[kind] += phase_seconds.get(f"{kind}_logprobs", 0.0)
            if counts[f"{kind}_skipped"] and self.totals[f"{kind}_run"]:
                # estimated from this run's own passes of that kind; a run that never ran one (skip) has no
                # estimate: compare it with an `always` run instead (sweeps/logprob_policies.yaml)
                per_pass = self.seconds[kind] / self.totals[f"{kind}_run"]
                m[f"passes/{kind}_saved_s_est"] = counts[f"{kind}_skipped"] * per_pass
        return m

    def state_dict(self) -> dict:
        return {"totals": dict(self.totals), "seconds": dict(self.seconds)}

    def load_state_dict(self, state: dict) -> None:
        self.totals, self.seconds = Counter(state["totals"]), Counter(state["seconds"])
