"""Logprob policies: which extra forward passes a rollout needs (seeds 000 and 001).

Schedule (as in TRL): a rollout is consumed over a window of `window` micro-steps (rollout batch / micro batch x
num_iterations); an optimizer step happens every `grad_accum` micro-steps (train batch / micro batch). A rollout
whose window starts at micro-step a needs its old-policy logprobs only if an optimizer step happens inside its
window, i.e. a // grad_accum != (a + window - 1) // grad_accum; otherwise the weights that sampled it are the
weights that train on it, and the ratio can be taken against the detached current logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("always", "window", "skip")


@dataclass(frozen=True)
class Need:
    old: bool
    ref: bool


def crosses_step(start: int, window: int, grad_accum: int) -> bool:
    """True if an optimizer step falls inside micro-steps [start, start + window - 1]."""
    return start // grad_accum != (start + window - 1) // grad_accum


def plan(policy: str, *, start: int, window: int, grad_accum: int, ref_coef: float) -> Need:
    """Which passes the rollout whose window starts at micro-step `start` needs under `policy`."""
    if policy == "always":
        return Need(old=True, ref=True)
    if policy == "window":
        return Need(old=crosses_step(start, window, grad_accum), ref=ref_coef != 0)
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
