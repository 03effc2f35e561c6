"""Logprob policies: which extra forward passes a rollout needs (seeds 000 and 001).

Schedule (as in TRL): a rollout is consumed over a window of `window` micro-steps (rollout batch / micro batch x
num_iterations); an optimizer step happens every `grad_accum` micro-steps (train batch / micro batch). A rollout
whose window starts at micro-step a needs its old-policy logprobs only if an optimizer step happens inside its
window, i.e. a // grad_accum != (a + window - 1) // grad_accum; otherwise the weights that sampled it are the
weights that train on it, and the ratio can be taken against the detached current logprobs.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Protocol

PHASES = ("old_logprobs", "ref_logprobs")  # what a logprob policy changes: which of these passes run


@dataclass(frozen=True)
class Need:
    old: bool
    ref: bool


def crosses_step(start: int, window: int, grad_accum: int) -> bool:
    """True if an optimizer step falls inside micro-steps [start, start + window - 1]."""
    return start // grad_accum != (start + window - 1) // grad_accum


class LogprobPolicy(Protocol):
    """The contract of a `logprob_policy` option: built as `Option(cfg.logprob_policy)`."""

    exactness: str  # rlrun.axes.EXACTNESS
    phases: tuple[str, ...]
    caches_reference: bool  # DPO: a pair's reference logprobs computed once and reused

    def need(self, *, start: int, window: int, grad_accum: int, ref_coef: float,
             old_before_loss: bool = False) -> Need: ...

    def builds_reference(self, ref_coef: float) -> bool: ...

    def ever_needs_old(self, window: int, grad_accum: int, old_before_loss: bool = False) -> bool: ...


class Always:
    """logprob_policy=always (the baseline): the old-policy and reference passes for every rollout (DPO: the
    reference pass for every batch)."""

    exactness = "baseline"
    phases = PHASES
    caches_reference = False  # DPO: the reference logprobs of a pair are computed again in every epoch

    def __init__(self, cfg=None):
        self.cfg = cfg

    def need(self, *, start: int, window: int, grad_accum: int, ref_coef: float,
             old_before_loss: bool = False) -> Need:
        """Which passes the rollout whose window starts at micro-step `start` needs. `old_before_loss`: the
        objective reads the old-policy logprobs before the loss (sequence-level importance weights)."""
        return Need(old=True, ref=True)

    def builds_reference(self, ref_coef: float) -> bool:
        """Whether any rollout can need the reference pass (so whether to build the reference model)."""
        return True

    def ever_needs_old(self, window: int, grad_accum: int, old_before_loss: bool = False) -> bool:
        """Whether any rollout of the run needs the old-policy pass (the schedule repeats every grad_accum
        rollouts)."""
        return any(self.need(start=k * window, window=window, grad_accum=grad_accum, ref_coef=0.0,
                             old_before_loss=old_before_loss).old for k in range(grad_accum))


class Window(Always):
    """logprob_policy=window: the old pass only for a rollout whose window crosses an optimizer step (or whose
    objective reads it before the loss); the reference pass only with a non-zero coefficient; DPO computes each
    pair's reference logprobs once. Exact where it runs: a skipped pass is one whose result equals the current
    logprobs (ratio against their detached value)."""

    exactness = "fp_tolerance"
    caches_reference = True

    def need(self, *, start, window, grad_accum, ref_coef, old_before_loss=False) -> Need:
        return Need(old=old_before_loss or crosses_step(start, window, grad_accum), ref=ref_coef != 0)

    def builds_reference(self, ref_coef: float) -> bool:
        return ref_coef != 0


class Skip(Always):
    """logprob_policy=skip: no old-policy pass (the ratio against the detached current logprobs), no reference
    pass; the validator admits it only where that is exact (config/rules.py)."""

    exactness = "fp_tolerance"

    def need(self, *, start, window, grad_accum, ref_coef, old_before_loss=False) -> Need:
        return Need(old=False, ref=False)

    def builds_reference(self, ref_coef: float) -> bool:
        return False


def option(name: str) -> Always:
    """The policy object of `logprob_policy=name` (through the registry)."""
    from . import registry

    return registry.get("logprob_policy", name)()


def plan(policy: str, *, start: int, window: int, grad_accum: int, ref_coef: float,
         old_before_loss: bool = False) -> Need:
    """Which passes the rollout whose window starts at micro-step `start` needs under `logprob_policy=policy`."""
    return option(policy).need(start=start, window=window, grad_accum=grad_accum, ref_coef=ref_coef,
                               old_before_loss=old_before_loss)


class PassCounter:
    """Logprob passes run and skipped per kind ("old", "ref"), and the seconds spent in those that ran (for the
    estimate of the time a skipped pass saved). Checkpointed with the run."""

    def __init__(self, kinds: tuple[str, ...] = ("old", "ref")):
        self.kinds = kinds
        self.totals: Counter[str] = Counter()
        self.seconds: defaultdict[str, float] = defaultdict(float)

    def metrics(self, counts: Counter[str], phase_seconds: dict[str, float] | None = None) -> dict[str, float]:
        """`passes/<kind>_run|skipped` this step and in total; with `phase_seconds` (the meter's seconds per
        phase) also `passes/<kind>_saved_s_est`."""
        self.totals.update(counts)
        m: dict[str, float] = {}
        for key in (f"{kind}_{what}" for kind in self.kinds for what in ("run", "skipped")):
            m[f"passes/{key}"] = counts[key]
            m[f"passes/{key}_total"] = self.totals[key]
        if phase_seconds is None:
            return m
        for kind in self.kinds:
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
        self.totals, self.seconds = Counter(state["totals"]), defaultdict(float, state["seconds"])
