"""`resume`: the run's lifecycle, probed with the run's own code. The configuration trains two steps unbroken, with a
checkpoint after each (the run's checkpoint code, in a temporary folder); then a fresh run resumes from the first
checkpoint and trains the second step. The two final checkpoints must hold the same state: the weights, the optimizer
and scheduler, the prompt stream and the rollout buffer (the same rows trained in the same order), the logprob-pass
counts, the sampler's and dynamic sampling's state, everything a run checkpoints, but its own timing. A resumed run
that trains some data again (huggingface/trl#7274) or restores a state half-way is off here; the tests' kill-and-resume
runs (tests/e2e/test_checkpoint.py) hold the same to the logged curves, on a process killed mid-step.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile

import numpy as np
import torch

from .. import checkpoint, registry, tracking
from .rows import Row

RESUME_TOL = 1e-5  # relative, a floating tensor of the two final states (CPU: they are equal bit for bit)
SKIPPED = ("config", "run_id", "owner", "spill", "summary")  # what identifies the run or times it, not its state


def timing(path: str) -> bool:
    """A leaf that holds seconds (rlrun names them `seconds` or `*_s`: the logprob passes' time, for their saved-time
    estimate): the clock's, not the run's state."""
    return any(part == "seconds" or part.endswith("_s") for part in path.replace("[", ".").split("."))
SOURCE = "a resumed run that trains some data again or restores a state half-way (huggingface/trl#7274)"


# A sweep job's check (report.check_jobs) leaves out the probes that train short runs of their own: `resume` trains
# three steps of the configuration, as long as a smoke job itself; `rlrun check` with the job's overrides runs it
IN_JOB_SKIPPED = ("resume",)


def in_job(name: str) -> Row:
    """The row of a probe a sweep job's check leaves out."""
    return Row(name, "n/a: a sweep job's check leaves it out (it trains runs of its own): `rlrun check` with the "
               "job's overrides runs it", "-", None, "")


def short(cfg, folder: str):
    """`cfg` as two steps, a checkpoint after each into `folder`, nothing evaluated, exported or recorded, no
    progress lines (the check's own progress is on stderr)."""
    return dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, steps=2), resume=False, progress=False,
        checkpoint=dataclasses.replace(cfg.checkpoint, dir=folder, every=1, keep=2, export=False),
        eval=dataclasses.replace(cfg.eval, every=0), export=dataclasses.replace(cfg.export, enabled=False),
        rollout=dataclasses.replace(cfg.rollout, record=None) if hasattr(cfg.rollout, "record") else cfg.rollout)


def leaves(x, path: str = ""):
    """(path, value) of every leaf of a checkpoint's state."""
    if isinstance(x, dict):
        for k, v in x.items():
            yield from leaves(v, f"{path}.{k}" if path else str(k))
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            yield from leaves(v, f"{path}[{i}]")
    else:
        yield path, x


def differs(a, b) -> float:
    """0 where two leaves are the same; else a floating tensor's relative difference, or inf."""
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
            return float("inf")
        if not a.is_floating_point():
            return 0.0 if torch.equal(a, b) else float("inf")
        scale = a.double().abs().max().item() or 1.0
        return (a.double() - b.double()).abs().max().item() / scale if a.numel() else 0.0
    if isinstance(a, np.ndarray):
        return 0.0 if isinstance(b, np.ndarray) and np.array_equal(a, b) else float("inf")
    return 0.0 if a == b else float("inf")


def resume(ctx) -> Row:
    """Two steps unbroken against one step, a checkpoint, and a fresh run resumed from it (module docstring)."""
    from omegaconf import OmegaConf

    train = registry.get("recipe", ctx.cfg.loss.name).train
    with tempfile.TemporaryDirectory(prefix="rlrun-check-") as folder, torch.random.fork_rng():
        ends = []
        for name, start in (("unbroken", None), ("resumed", "unbroken")):
            cfg = short(ctx.cfg, os.path.join(folder, name))
            raw = OmegaConf.create(dataclasses.asdict(cfg))
            state = None
            if start is not None:  # the unbroken run's checkpoint after its first step
                state = checkpoint.read(os.path.join(folder, start, checkpoint.tag(1) + ".pt"))
            train(cfg, raw, tracking.Null(), state)
            ends.append(checkpoint.load_latest(cfg.checkpoint.dir)[0])
    unbroken, resumed = ({k: v for k, v in leaves({k: v for k, v in s.items() if k not in SKIPPED}) if not timing(k)}
                         for s in ends)
    missing = sorted(set(unbroken) ^ set(resumed))
    worst = {k: differs(v, resumed[k]) for k, v in unbroken.items() if k in resumed}
    off = sorted(k for k, d in worst.items() if not d <= RESUME_TOL)
    part = lambda key: key.split(".")[0].split("[")[0]  # noqa: E731 - a leaf's owner: model, optimizer, prompts...
    parts = sorted({part(k) for k in unbroken})
    measured = (f"{len(unbroken)} leaves of {', '.join(parts)}: floats' max rel diff "
                f"{max([d for d in worst.values() if d != float('inf')], default=0.0):.1e}")
    if off or missing:
        counts = {p: sum(part(k) == p for k in off + missing) for p in sorted({part(k) for k in off + missing})}
        measured += "; differ: " + ", ".join(f"{p} ({n} leaves)" for p, n in counts.items())
    return Row("resume", f"2 steps unbroken = 1 step, its checkpoint, a fresh run resumed from it (every state a "
               f"run checkpoints, floats within {RESUME_TOL:.0e})", measured, not off and not missing, SOURCE)
