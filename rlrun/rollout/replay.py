"""rollout=replay rollout.path=DIR: GRPO trains on the rollouts a run recorded (rollout.record=DIR), in their order,
and generates nothing. The rollouts come from SOURCE (recipes/sources.Replay) instead of rollout.pipeline's;
`check` refuses, before anything is built, a record that is not one or a config whose rollouts would differ from
the record's (rollout/record.FIXED)."""

from __future__ import annotations

import math
import os
from typing import NoReturn

from ..errors import RecordError
from . import record

# `rlrun check` draws its probe rollout with this sampler: a replay has none, and the probes test the training side
PROBE_SAMPLER = "hf"
# where GRPO takes this option's rollouts from (axes.source_of), instead of rollout.pipeline's source; by import path,
# as the registry names options (recipes sit above rollout in the layers)
SOURCE = "rlrun.recipes.sources:Replay"


def reserved(cfg, device_gib: float) -> dict[str, int]:
    """Nothing: a replay samples nothing."""
    return {}


def build(cfg, model, tokenizer, device) -> NoReturn:
    """Never called: a replay samples nothing (Replay.generates_here is False, so setup builds no sampler)."""
    raise RecordError("rollout=replay reads its rollouts from rollout.path and has no sampler to build")


def rollouts_needed(cfg) -> int:
    """The rollouts a GRPO run of cfg.train.steps consumes: each step takes batch_size rows, each rollout gives
    rollout_batch rows num_iterations times."""
    t = cfg.train
    return math.ceil(t.steps * t.batch_size / (t.rollout_batch * t.num_iterations))


def check(cfg) -> None:
    """RecordError naming every key that differs from the record's, or that it holds too few rollouts."""
    rec = record.Record(os.path.expanduser(cfg.rollout.path))
    problems = record.differences(rec.header["fixed"], record.fixed(cfg))
    need = rollouts_needed(cfg)
    if need > len(rec):
        problems.append(f"train.steps={cfg.train.steps} needs {need} rollouts and the record holds {len(rec)}: lower "
                        "train.steps, or record a longer run")
    if problems:
        raise RecordError(f"rollout=replay rollout.path={cfg.rollout.path!r}: this config cannot replay the record "
                          "(what a record's rollouts depend on must be as recorded; the training side is free):\n  - "
                          + "\n  - ".join(problems))
