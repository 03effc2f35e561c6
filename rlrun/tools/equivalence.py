"""Does the cheap way train the same? The baseline of each group of runs, chosen from the runs themselves.

Runs that differ only in efficiency axes (head, logprob_policy, offload, batching, activations) and rollout.decode
should train the same. Within each such group, the baseline is the run with the reference setting of every axis that
varies in the group (dense, always, off, padded, keep, eager), or the run the user names (`--baseline`,
`report.baseline=`). A group whose runs vary in these axes but hold no baseline is reported as such, with the job to
add: a silent "no result" is what this module exists to prevent.

Pure functions of run parameters (MLflow's flattened `params`) and curves: no torch, no MLflow.
"""

from __future__ import annotations

import numpy as np

from .. import registry

# The axes whose options train their baseline's numbers (the efficiency axes, and rollout.decode: to fp32 tolerance)
# -> their reference option, from the registry; precision and the pipeline are approximate, compared by what they
# learn. KEY: each axis's config key ("<axis>.name", or the key it is keyed by: rollout.decode).
REFERENCE = {axis: registry.baseline(axis) for axis in (*registry.EFFICIENCY, "decode")}
KEY = {axis: registry.key_of(axis) for axis in REFERENCE}
# Parameters that say nothing about what is trained: never a reason to put two runs in different groups.
IGNORED = ("run_name", "tracking.", "progress", "report.", "log.", "checkpoint.", "export.", "plan.")
COMPARED = ("loss", "reward_mean")  # the curves compared step by step


def record_of(params: dict[str, str]) -> str | None:
    """The record whose rollouts a run trained on: the one it wrote (rollout.record) or replayed (rollout.path)."""
    for key in ("rollout.record", "rollout.path"):
        if params.get(key) not in (None, "None", ""):
            return params[key]
    return None


def group_key(params: dict[str, str]) -> tuple:
    """What a run trains apart from its efficiency axes: runs with equal keys should train the same. Runs on one
    record (a paired sweep: the run that wrote it, the runs that replayed it) share their rollouts, whatever their
    rollout option says (hf and replay; the record checked their sampler's settings equal)."""
    skip = tuple(f"{axis}." for axis, key in KEY.items() if key == f"{axis}.name") + IGNORED  # a group's own keys
    keyed = {key for axis, key in KEY.items() if key != f"{axis}.name"}
    rec = record_of(params)
    if rec is not None:
        skip += ("rollout.",)
    own = [(k, v) for k, v in params.items() if not k.startswith(skip) and k not in keyed]
    return tuple(sorted(own + ([("rollouts of the record", rec)] if rec is not None else [])))


def axis_values(params: dict[str, str]) -> dict[str, str | None]:
    """{axis: its option}; a keyed axis a run has no key for (rollout.decode: rollout=vllm, a run before it) at its
    reference."""
    return {axis: params.get(KEY[axis], None if KEY[axis] == f"{axis}.name" else REFERENCE[axis])
            for axis in REFERENCE}


def baselines(params: list[dict[str, str]], names: list[str], prefer: str | None = None):
    """-> ({run index: its baseline's index}, [problems]) over runs grouped by `group_key`. `prefer`: the name of
    the run to use as the baseline of its group (a problem if no run has that name)."""
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault(group_key(p), []).append(i)
    pairs, problems = {}, []
    if prefer is not None and prefer not in names:
        problems.append(f"baseline {prefer!r} is not one of the runs ({', '.join(names)}).")
    for idx in groups.values():
        if len(idx) < 2:
            continue
        varying = [a for a in REFERENCE if len({axis_values(params[i])[a] for i in idx}) > 1]
        chosen = [i for i in idx if names[i] == prefer] or \
                 [i for i in idx if all(axis_values(params[i])[a] == REFERENCE[a] for a in varying)]
        if not chosen:
            want = ",".join(f"{KEY[a].removesuffix('.name')}={REFERENCE[a]}" for a in varying)
            problems.append(f"runs {', '.join(names[i] for i in idx)} differ only in {', '.join(varying)} but none "
                            f"has the reference setting ({want}): add a job with {want} to compare them with, or "
                            "name one as the baseline (report.baseline=NAME, rlrun-report --baseline NAME).")
            continue
        pairs.update({i: chosen[0] for i in idx if i != chosen[0]})
    return pairs, problems


def max_differences(curves: dict, base: dict) -> dict[str, float]:
    """Max |curve - baseline curve| over the steps both logged, per compared curve ({key: (steps, values)})."""
    out = {}
    for k in COMPARED:
        if k in curves and k in base:
            n = min(len(curves[k][1]), len(base[k][1]))
            out[k] = float(np.max(np.abs(curves[k][1][:n] - base[k][1][:n]))) if n else float("nan")
    return out


def rows(params: list[dict[str, str]], names: list[str], data: list[dict], prefer: str | None = None):
    """-> ([{run, baseline, loss, reward_mean}], [problems]): each run against its group's baseline."""
    pairs, problems = baselines(params, names, prefer)
    out = [{"run": names[i], "baseline": names[b], **max_differences(data[i], data[b])} for i, b in pairs.items()]
    return out, problems


def text(result: list[dict], problems: list[str], num) -> str:
    """equivalence.txt: one line per run vs its baseline, then the problems (`num` formats a number)."""
    width = max((len(r["run"]) for r in result), default=0)
    lines = [f"{r['run']:<{width}} vs {r['baseline']:<30} max|dloss|={num(r.get('loss'))} "
             f"max|dreward|={num(r.get('reward_mean'))}" for r in result]
    return "\n".join(lines + [f"no equivalence: {p}" for p in problems])
