"""`rlrun check`'s resume probe (rlrun/check/lifecycle.py): two steps unbroken against one step, its checkpoint and
a fresh run resumed from it, through the run's own checkpoint code. It passes on right configurations and fails
where a state is not saved or not restored (the run trains some data again, or its optimizer starts over)."""

import pytest
import torch
from conftest import make_cfg

from rlrun import check
from rlrun.check import lifecycle
from rlrun.config import validate
from rlrun.engine import single
from rlrun.tasks import stream


def row(*overrides):
    cfg = validate(make_cfg("experiment=smoke", *overrides))
    with torch.random.fork_rng():
        return lifecycle.resume(check.Context(cfg, *[None] * 12))  # the probe reads only the configuration


@pytest.mark.slow  # three short runs each (~5 s)
@pytest.mark.parametrize("overrides", [[], ["train.dynamic_sampling=true", "loss=gspo", "train.overlong=penalty"],
                                       ["train.rollout_batch=16", "logprob_policy=window", "train.num_iterations=2"],
                                       ["logprob_policy=always", "loss.kl_coef=0.1"]],
                         ids=["smoke", "dynamic-sampling-gspo", "a-rollout-across-steps", "always-kl"])
def test_a_resumed_run_equals_the_unbroken_one(overrides):
    """(always: its passes' seconds differ between the runs, a clock's, not state: left out by `timing`)"""
    got = row(*overrides)
    assert got.ok, got.measured
    assert "model" in got.measured and "optimizer" in got.measured and "prompts" in got.measured


def prompts_trained_again(self, state):  # the stream's shuffle restored, its position not: data trained again
    self.rng.setstate(state["rng"])


def optimizer_starts_over(self, state):
    self.model.load_state_dict(state["model"])
    self.scheduler.load_state_dict(state["scheduler"])


def scheduler_starts_over(self, state):
    self.model.load_state_dict(state["model"])
    self.optimizer.load_state_dict(state["optimizer"])


FAULTS = [(stream.PromptStream, prompts_trained_again, "prompts"),
          (single.Engine, optimizer_starts_over, "optimizer"),
          (single.Engine, scheduler_starts_over, "scheduler")]


@pytest.mark.slow  # two short runs (~5 s)
@pytest.mark.parametrize("owner,fault,part", FAULTS, ids=[f.__name__ for _, f, _ in FAULTS])
def test_a_state_not_restored_fails_the_resume_probe_naming_it(monkeypatch, owner, fault, part):
    monkeypatch.setattr(owner, "load_state_dict", fault)
    got = row()
    assert got.ok is False and f"{part} (" in got.measured.split("differ: ")[1], got.measured


def test_a_sweep_job_s_check_leaves_out_the_probes_that_train_runs_of_their_own(monkeypatch):
    from rlrun.check.rows import Row

    ran = []
    probe = lambda name: (lambda ctx: ran.append(name) or Row(name, "-", "-", True, ""), (name,))  # noqa: E731
    monkeypatch.setattr(check, "PROBES", [probe("accumulation"), probe("resume")])
    job = {r.probe: r for r in check.run_probes(None, job=True)}
    assert ran == ["accumulation"] and job["accumulation"].ok and job["resume"].ok is None
    assert "rlrun check" in job["resume"].expects  # where to run it instead
    ran.clear()
    assert all(r.ok for r in check.run_probes(None)) and ran == ["accumulation", "resume"]
