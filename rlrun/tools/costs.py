"""What each job of a sweep costs, from its metric histories ({key: (steps, values)}, report.histories): the numbers
behind the report's table, memory.png, memory_plan.png, throughput.png and cost.png. Pure functions of the
histories: no MLflow, no matplotlib.

- Step time is the job's console "step time": the mean over steps of `time/step_s`, the metered phases of one
  training step. Evaluation is timed as its own phase and logged apart, and checkpoints are written outside the
  phases, so neither is in it. The median step is kept beside it: in a short sweep the first step of the first
  job carries the process's warm-up (measured: 1.9 s against 0.01 s for the next steps on CPU).
- Tokens/s is the step's: trained tokens over step time (the console's "per step" number), not one phase's rate.
- Memory is each phase's peak growth over what was in use when the phase began (`mem/<phase>_growth_mib`), the
  median over steps: a sweep's jobs share one process, so the first steps of the first job carry the libraries'
  first-call buffers (measured: ~12 MiB in generate on CPU), whichever job that is; the largest step is kept as
  context. The absolute peak is context only: on CPU it is the process's RSS, libraries and earlier jobs included.
"""

from __future__ import annotations

import math
from typing import TypedDict

import numpy as np

from ..meters import PHASES, growth_key, peak_key, plan_growth_key, time_key

STEP, TOKENS = "time/step_s", "train_tokens"  # logged by every training step (meters.py, the recipes)
STEP_PHASES = tuple(p for p in PHASES if p != "eval")  # evaluation runs between steps, not in them
# Phases that hold nothing of their own when the optimizer state is not offloaded (offload=off): what they grow is
# the growth of an empty phase, the floor of the measurement.
EMPTY_WHEN_NOT_OFFLOADED = ("offload", "onload")
NAN = float("nan")
PIPELINE = ("pipeline/gen_busy_s", "pipeline/gen_idle_s", "staleness_mean")  # rollout.pipeline=async
KEYS = (STEP, TOKENS, "throughput/gen_tokens_per_s", "throughput/train_tokens_per_s", *PIPELINE,
        *(k(p) for k in (peak_key, growth_key, time_key, plan_growth_key) for p in PHASES))


def values(h: dict, key: str) -> list[float]:
    return [float(v) for v in h[key][1]] if key in h else []


def step_seconds(h: dict) -> float:
    """Mean seconds of a training step, evaluation and checkpoints excluded (the console's "step time")."""
    v = values(h, STEP)
    return sum(v) / len(v) if v else NAN


def tokens_per_s(h: dict) -> float:
    """Trained tokens per second of step time, over the whole run (runner.Summary's `tokens_per_s`)."""
    tokens, seconds = values(h, TOKENS), values(h, STEP)
    return sum(tokens) / sum(seconds) if tokens and len(tokens) == len(seconds) and sum(seconds) > 0 else NAN


def phase_seconds(h: dict) -> dict[str, float]:
    """{phase: its seconds per training step} for the phases of a step: a phase that runs on some steps only (a
    skipped logprob pass) counts over all steps, so the parts add up to `step_seconds` (one rank)."""
    n = len(values(h, STEP))
    return {p: sum(values(h, time_key(p))) / n for p in STEP_PHASES if n and time_key(p) in h}


def mean(h: dict, key: str) -> float:
    v = values(h, key)
    return sum(v) / len(v) if v else NAN


def growth(h: dict, phase: str) -> tuple[float, float]:
    """(median, largest) over steps of the phase's peak growth, MiB; NaN where the phase never ran."""
    v = values(h, growth_key(phase))
    return (float(np.median(v)), max(v)) if v else (NAN, NAN)


def largest_growth(h: dict) -> tuple[float, str | None]:
    """(MiB, phase): the phase of a training step with the largest median peak growth: the memory a step of this
    job needs on top of what stays resident (evaluation, between steps, is in memory.png)."""
    found = [(growth(h, p)[0], p) for p in STEP_PHASES if growth_key(p) in h]
    return max(found) if found else (NAN, None)


def absolute_peak(h: dict) -> float:
    """The largest absolute peak of any phase and step, MiB (context: on CPU the process's RSS)."""
    return max((max(values(h, peak_key(p))) for p in PHASES if peak_key(p) in h), default=NAN)


class Job(TypedDict):
    step_s: float
    median_step_s: float
    tokens_per_s: float
    growth_mib: float
    growth_phase: str | None
    peak_mib: float
    gen_tokens_per_s: float
    train_tokens_per_s: float


def job(h: dict) -> Job:
    """The numbers of one job in the table and the cost chart."""
    grown, phase = largest_growth(h)
    steps = values(h, STEP)
    return {"step_s": step_seconds(h), "median_step_s": float(np.median(steps)) if steps else NAN,
            "tokens_per_s": tokens_per_s(h), "growth_mib": grown, "growth_phase": phase,
            "peak_mib": absolute_peak(h), "gen_tokens_per_s": mean(h, "throughput/gen_tokens_per_s"),
            "train_tokens_per_s": mean(h, "throughput/train_tokens_per_s")}


def costs(names: list[str], data: list[dict], base_of: dict[int, int]) -> list[dict]:
    """One row per job for cost.png: its numbers, whether it is a baseline (`base_of`: {job: its baseline job},
    tools/equivalence.py) and, for a job with a baseline, each number divided by the baseline's."""
    jobs = [job(h) for h in data]
    bases = set(base_of.values())
    out = []
    for i, (name, j) in enumerate(zip(names, jobs)):
        row = {"run": name, **j, "is_baseline": i in bases, "baseline": names[base_of[i]] if i in base_of else None}
        for k in ("step_s", "growth_mib", "tokens_per_s"):
            b = jobs[base_of[i]][k] if i in base_of else NAN
            row[f"{k}_ratio"] = j[k] / b if b and math.isfinite(b) else NAN
        out.append(row)
    return out


def memory(data: list[dict]) -> dict:
    """memory.png's numbers: the phases any job ran, per job and phase the (median, largest) peak growth, and per
    job its absolute peak (context)."""
    phases = [p for p in PHASES if any(growth_key(p) in h for h in data)]
    return {"phases": phases, "growth": [[growth(h, p) for p in phases] for h in data],
            "peak": [absolute_peak(h) for h in data]}


def empty_phase_floor(params: list[dict[str, str]], data: list[dict]) -> float | None:
    """The largest growth, MiB, that a phase with nothing of its own showed in these jobs: offload and onload in
    jobs with offload=off. What the meter reads for no allocation at all; None where no job had such a phase."""
    found = [max(values(h, growth_key(p))) for prm, h in zip(params, data) if prm.get("offload.name") == "off"
             for p in EMPTY_WHEN_NOT_OFFLOADED if growth_key(p) in h]
    return max(found) if found else None


def plan(data: list[dict]) -> dict:
    """memory_plan.png's numbers: the phases with a plan and a measurement, and per phase and job the predicted
    growth and the measured (median, largest) growth."""
    phases = [p for p in PHASES if any(plan_growth_key(p) in h and growth_key(p) in h for h in data)]
    return {"phases": phases, "predicted": {p: [max(values(h, plan_growth_key(p)), default=NAN) for h in data]
                                            for p in phases},
            "measured": {p: [growth(h, p) for h in data] for p in phases}}


def throughput(data: list[dict]) -> dict:
    """throughput.png's numbers per job: tokens/s of the step, the step's seconds by phase (no evaluation), and the
    phases' own rates (context)."""
    per_phase = [phase_seconds(h) for h in data]
    phases = [p for p in STEP_PHASES if any(p in s for s in per_phase)]
    return {"tokens_per_s": [tokens_per_s(h) for h in data], "step_s": [step_seconds(h) for h in data],
            "phases": {p: [s.get(p, 0.0) for s in per_phase] for p in phases},
            "generated": [mean(h, "throughput/gen_tokens_per_s") for h in data],
            "trained": [mean(h, "throughput/train_tokens_per_s") for h in data]}


def pipeline(data: list[dict]) -> dict | None:
    """pipeline.png's numbers per job: steps/s, the trainer's seconds per step working and waiting for rollouts,
    the generator's seconds per step generating and idle (async jobs; a sync job generates inside its step), and the
    mean staleness; None where no job ran the async pipeline."""
    if not any(PIPELINE[0] in h for h in data):
        return None
    step = [step_seconds(h) for h in data]
    wait = [mean(h, time_key("wait")) if time_key("wait") in h else 0.0 for h in data]
    return {"steps_per_s": [1.0 / s if s else NAN for s in step],
            "trainer_busy_s": [s - w for s, w in zip(step, wait)], "trainer_wait_s": wait,
            "generator_busy_s": [mean(h, PIPELINE[0]) if PIPELINE[0] in h else NAN for h in data],
            "generator_idle_s": [mean(h, PIPELINE[1]) if PIPELINE[1] in h else NAN for h in data],
            "staleness": [mean(h, PIPELINE[2]) for h in data]}
