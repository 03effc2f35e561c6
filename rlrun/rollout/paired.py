"""A paired sweep (`report.replay=true`): the sweep generates once. Its first job records the rollouts it trains on
(rollout.record=<sweep dir>/record) and every other job replays them (rollout=replay rollout.path=that folder), so
every job trains on the same samples: exact options agree over the whole run instead of until a rounding flips a
sampled token, and an inexact option's effect is not hidden in sampling noise (docs/replay.md).

A replay of the recording job's own config reproduces its training bit for bit (tests/unit/rollout/test_replay.py), so
the first job, which generated, is paired with the others as if it had replayed too.

`job_config` turns one job's composed config into its paired form (the sweep's callback validates those before any
job runs; the job itself applies it); `problems` says why a sweep's jobs cannot share one record.
"""

from __future__ import annotations

import os

from omegaconf import DictConfig, OmegaConf, open_dict

from .. import algorithms, registry
from ..config import ConfigError, validate
from . import record, replay

FOLDER = "record"  # under hydra.sweep.dir
GENERATING = ("hf", "vllm")  # the rollout options that can record


def folder(sweep_dir: str) -> str:
    return os.path.abspath(os.path.join(str(sweep_dir), FOLDER))


def job_config(cfg: DictConfig, job_num: int, sweep_dir: str) -> DictConfig:
    """Job 0 records to the sweep's record folder; the others replay it, with the sampler's settings (which the
    record checks) from their own config. A copy: `cfg` is left as it is."""
    out = cfg.copy()
    path = folder(sweep_dir)
    with open_dict(out):
        if job_num == 0:
            out.rollout.record = path
        else:
            r = cfg.rollout
            out.rollout = OmegaConf.create({"name": "replay", "path": path, "temperature": r.temperature,
                                            "top_p": r.top_p, "top_k": r.top_k,
                                            "max_new_tokens": r.max_new_tokens, "pipeline": "sync"})
    return out


def problems(configs: list[DictConfig], names: list[str], sweep_dir: str) -> list[str]:
    """Why these jobs (composed, before job_config) cannot share one record, then what refuses the configs they
    will run (job_config's): each problem names the job, the key and the fix. [] when they can."""
    out = []
    first, first_name = configs[0], names[0]
    if os.path.exists(folder(sweep_dir)):
        out.append(f"report.replay: {folder(sweep_dir)} exists already (an earlier sweep's record); set "
                   "hydra.sweep.dir to a new folder, or remove it")
    for cfg, name in zip(configs, names):
        r = cfg.rollout
        if not algorithms.of(cfg).samples:
            out.append(f"job {name}: loss={cfg.loss.name} trains on preference pairs from its data and draws no "
                       "rollouts to record; drop report.replay, or sweep GRPO objectives (loss=dapo, cispo, gspo)")
        elif r.name not in GENERATING:
            out.append(f"job {name}: report.replay records with the job's sampler, and rollout={r.name} has none "
                       f"(use rollout={' or rollout='.join(GENERATING)}; a replay sweep of an existing record: "
                       "rollout=replay rollout.path=DIR without report.replay)")
        elif r.get("record"):
            out.append(f"job {name}: rollout.record={r.record} and report.replay both choose where the rollouts are "
                       "recorded; drop rollout.record (the sweep records to hydra.sweep.dir/record)")
        elif registry.get("pipeline", r.pipeline).exactness != "baseline":  # only sync replays in step
            out.append(f"job {name}: rollout.pipeline={r.pipeline}: a paired sweep replays in step (sync), so an "
                       "async job would be compared with sync ones; set rollout.pipeline=sync or drop report.replay")
    if out:
        return out
    recorded = record.fixed(first)
    first_rollout = _plain(first.rollout)
    have = replay.rollouts_needed(first)
    for cfg, name in zip(configs[1:], names[1:]):
        changed = record.differences(recorded, record.fixed(cfg))
        ours = _plain(cfg.rollout)
        changed += [f"rollout.{k} was {first_rollout.get(k)!r} in job {first_name}, now {ours.get(k)!r}"
                    for k in sorted(set(first_rollout) | set(ours))
                    if first_rollout.get(k) != ours.get(k) and f"rollout.{k}" not in record.FIXED]
        if changed:
            out.append(f"job {name}: its rollouts would differ from job {first_name}'s, which records them (a paired "
                       "sweep varies training-side options only; drop report.replay to sweep these):\n      "
                       + "\n      ".join(c.replace(" in the record,", f" in job {first_name},") for c in changed))
        elif replay.rollouts_needed(cfg) > have:
            out.append(f"job {name}: needs {replay.rollouts_needed(cfg)} rollouts and job {first_name} records "
                       f"{have}: give every job the same train.steps, batch_size and num_iterations")
    for num, (cfg, name) in enumerate(zip(configs, names)):  # what each job will run: record (0) or replay
        if out:
            break
        try:
            validate(job_config(cfg, num, sweep_dir))
        except ConfigError as e:
            out += [f"job {name}: {p}" for p in e.problems]
    return out


def _plain(node) -> dict:
    out = OmegaConf.to_container(node, resolve=True)
    assert isinstance(out, dict)
    return out
