"""The equivalence check of a sweep: each group of runs that differ only in efficiency axes gets its baseline from
its own runs (tools/equivalence.py), and every shipped sweep over efficiency axes has one for every group."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from rlrun.config import ConfigError, validate
from rlrun.tools import equivalence as eq
from rlrun.tracking import flatten

SWEEPS = Path(__file__).resolve().parents[3] / "sweeps"


def params(**axes) -> dict[str, str]:
    base = {"loss.name": "dapo", "seed": "0", "head.name": "dense", "logprob_policy.name": "window",
            "offload.name": "off", "tracking.uri": "sqlite:///x.db", "run_name": "r"}
    return base | {eq.KEY.get(k, k): v for k, v in axes.items()}


def test_a_head_sweep_under_the_default_policy_compares_with_dense():
    """`rlrun -m head=dense,tiled,chunked`: every job runs logprob_policy=window, none is `always`; the axis that
    varies is the head, so dense is the baseline (the report used to demand dense/always/off and found none)."""
    runs = [params(head=h) for h in ("tiled", "dense", "chunked")]
    pairs, problems = eq.baselines(runs, ["tiled", "dense", "chunked"])
    assert pairs == {0: 1, 2: 1} and problems == []


def test_product_sweeps_take_the_reference_of_every_varying_axis_within_each_group():
    combos = list(itertools.product(["dapo", "cispo"], ["dense", "tiled"], ["always", "window", "skip"]))
    runs = [params(**{"loss.name": loss}, head=h, logprob_policy=p) for loss, h, p in combos]
    names = ["/".join(c) for c in combos]
    pairs, problems = eq.baselines(runs, names)
    assert problems == [] and len(pairs) == 10  # 2 losses x (6 jobs - their baseline)
    assert {names[b] for b in pairs.values()} == {"dapo/dense/always", "cispo/dense/always"}
    assert all(names[i].split("/")[0] == names[b].split("/")[0] for i, b in pairs.items())  # never across losses


def test_rollout_decode_is_compared_with_eager_and_a_run_without_the_key_decodes_eagerly():
    """rollout.decode=compiled trains eager's numbers to fp32 tolerance: its runs are grouped with eager's and
    compared; a run that logged no rollout.decode (rollout=vllm, or a run before the key) counts as eager."""
    runs = [params(decode="compiled"), params(decode="eager"), params(decode="compiled", head="tiled"), params()]
    pairs, problems = eq.baselines(runs, ["compiled", "eager", "compiled/tiled", "keyless"])
    assert problems == [] and pairs[0] in (1, 3) and pairs[2] in (1, 3)
    _, problems = eq.baselines([params(decode="compiled", head="tiled"), params(decode="compiled", head="chunked")],
                               ["a", "b"])
    assert "add a job with head=dense" in problems[0]  # decode does not vary there: only the head is asked for
    _, problems = eq.baselines([params(decode="compiled", head="tiled"), params(head="chunked")], ["a", "b"])
    assert "head=dense,rollout.decode=eager" in problems[0]


def test_runs_that_train_different_things_are_never_compared():
    runs = [params(seed="0"), params(seed="1"), params(**{"train.lr": "0.1"}, head="tiled")]
    assert eq.baselines(runs, ["a", "b", "c"]) == ({}, [])


def test_a_group_without_its_baseline_says_so_and_names_the_job_to_add():
    pairs, problems = eq.baselines([params(head="tiled"), params(head="chunked")], ["tiled", "chunked"])
    assert pairs == {} and len(problems) == 1
    assert "tiled, chunked" in problems[0] and "add a job with head=dense" in problems[0]
    assert "report.baseline=NAME" in problems[0]


def test_a_named_baseline_wins_and_an_unknown_one_is_a_problem():
    runs = [params(head="tiled"), params(head="chunked")]
    assert eq.baselines(runs, ["tiled", "chunked"], prefer="chunked") == ({0: 1}, [])
    _, problems = eq.baselines(runs, ["tiled", "chunked"], prefer="dense")
    assert any("'dense' is not one of the runs" in p for p in problems)


def test_differences_are_taken_over_the_common_steps():
    import numpy as np

    a = {"loss": (np.arange(3), np.array([1.0, 2.0, 3.0])), "reward_mean": (np.arange(2), np.array([0.5, 0.5]))}
    b = {"loss": (np.arange(4), np.array([1.0, 2.5, 3.0, 9.0])), "reward_mean": (np.arange(2), np.array([0.5, 0.5]))}
    assert eq.max_differences(a, b) == {"loss": 0.5, "reward_mean": 0.0}
    rows, problems = eq.rows([params(head="tiled"), params()], ["tiled", "dense"], [a, b])
    assert rows == [{"run": "tiled", "baseline": "dense", "loss": 0.5, "reward_mean": 0.0}] and problems == []
    text = eq.text(rows, ["x"], lambda v: f"{v:.3g}")
    assert "tiled" in text and "max|dloss|=0.5" in text and text.endswith("no equivalence: x")


def sweep_jobs(name: str) -> list[dict[str, str]]:
    """The flattened params of every job of a shipped sweep that the validator accepts (refused jobs never run); a
    paired sweep's (report.replay) as its jobs log them: the first recording, the others replaying."""
    from rlrun.rollout import paired

    with initialize_config_dir(config_dir=str(SWEEPS), version_base="1.3"):
        grid = compose(name, return_hydra_config=True).hydra.sweeper.params or {}
        axes = [[f"{k}={v}" for v in str(values).split(",")] for k, values in grid.items()]
        jobs = []
        for overrides in itertools.product(*axes):
            cfg = compose(name, overrides=list(overrides))
            if cfg.report.replay:
                cfg = paired.job_config(cfg, len(jobs), "/sweep")
            try:
                validate(cfg)
            except ConfigError:
                continue
            jobs.append(flatten(OmegaConf.to_container(cfg, resolve=True)))
    return jobs


SHIPPED = sorted(p.stem for p in SWEEPS.glob("*.yaml"))


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_sweep_over_efficiency_axes_has_its_equivalence_check(name):
    jobs = sweep_jobs(name)
    assert jobs, f"sweeps/{name}.yaml has no valid job"
    varies = any(len({j.get(f"{a}.name") for j in jobs}) > 1 for a in eq.REFERENCE)
    pairs, problems = eq.baselines(jobs, [str(i) for i in range(len(jobs))])
    assert problems == [], f"sweeps/{name}.yaml: {problems}"
    if varies:  # a sweep over an efficiency axis must compare its jobs with a baseline
        assert pairs, f"sweeps/{name}.yaml varies an efficiency axis but compares nothing"


def test_the_shipped_sweeps_include_the_ones_that_prove_equivalence():
    assert {"heads_equivalence", "logprob_policies", "smoke"} <= set(SHIPPED)
    assert len(eq.baselines(sweep_jobs("heads_equivalence"), [str(i) for i in range(6)])[0]) == 4  # tiled, chunked
    paired = sweep_jobs("heads_paired")  # dense records, tiled and chunked replay it: still one group, dense its base
    assert [j["rollout.name"] for j in paired] == ["hf", "replay", "replay"]
    assert eq.baselines(paired, ["dense", "tiled", "chunked"]) == ({1: 0, 2: 0}, [])
