"""A paired sweep (report.replay=true; rlrun/rollout/paired.py, docs/replay.md): the first job records the rollouts
it trains on, every other job replays them, so the jobs train on the same samples over the whole run and the sweep
generates once; jobs that could not share one record are refused before any runs, each reason named."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TEST_PATH, make_cfg
from helpers import runs

from rlrun.rollout import paired
from rlrun.tools import equivalence

ROOT = Path(__file__).resolve().parents[2]
# this checkout's code first (not an editable install's of another worktree), then the tests' helpers
ENV = {**os.environ, "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "false",
       "PYTHONPATH": os.pathsep.join([str(ROOT), TEST_PATH])}
SMOKE = ["experiment=smoke", "train.steps=4", "report.replay=true", "report.check_jobs=false", "progress=false",
         "export.enabled=false"]


def sweep(tmp, *args):
    return subprocess.run([sys.executable, "-m", "rlrun", "-m", *SMOKE, *args, f"hydra.sweep.dir={tmp}/sweep",
                           f"tracking.uri=sqlite:///{tmp}/mlflow.db"], cwd=tmp, env=ENV, capture_output=True,
                          text=True, timeout=600)


def history(client, run, key):
    return [(m.step, m.value) for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)]


@pytest.mark.slow  # a sweep of four short jobs (~30 s)
def test_a_paired_sweep_records_once_and_every_job_trains_on_those_rollouts(tmp_path):
    """Two heads, twice each (report.repeats=2, interleaved): the first job records, the three others replay."""
    r = sweep(tmp_path, "head=dense,tiled", "report.repeats=2")
    assert r.returncode == 0, r.stderr[-3000:]
    record_dir = tmp_path / "sweep" / paired.FOLDER
    assert len((record_dir / "rollouts.jsonl").read_text().splitlines()) == 4  # one rollout per step, written once
    client, all_runs = runs(tmp_path / "mlflow.db")
    (parent,) = [x for x in all_runs if x.data.tags.get("rlrun.kind") == "sweep"]
    children = sorted((x for x in all_runs if x is not parent), key=lambda x: x.info.start_time)
    assert [x.data.tags["mlflow.runName"] for x in children] == [  # interleaved: every job, then every job again
        "report.repeat=0,head=dense", "report.repeat=0,head=tiled", "report.repeat=1,head=dense",
        "report.repeat=1,head=tiled"]
    dense, tiled, dense_again, _ = children
    assert parent.data.tags["rlrun.record"] == str(record_dir)
    assert dense.data.params["rollout.record"] == str(record_dir) and dense.data.params["rollout.name"] == "hf"
    for job in children[1:]:
        assert job.data.params["rollout.path"] == str(record_dir) and job.data.params["rollout.name"] == "replay"
        assert "system/time/generate_s" not in job.data.metrics
    assert "system/time/generate_s" in dense.data.metrics
    # the same samples at every step, so rewards are equal and the losses agree to fp tolerance over the whole run;
    # the recording job's replay is that job bit for bit
    assert history(client, tiled, "train/reward_mean") == history(client, dense, "train/reward_mean")
    losses = zip(history(client, tiled, "train/loss"), history(client, dense, "train/loss"), strict=True)
    assert all(a[0] == b[0] and abs(a[1] - b[1]) < 1e-6 for a, b in losses)
    assert history(client, dense_again, "train/loss") == history(client, dense, "train/loss")
    note = parent.data.tags["mlflow.note.content"]
    assert f"paired: the first job records the rollouts it trains on to {record_dir}" in note
    assert "same result: yes (loss off by" in note and "all 4 steps, on the same recorded rollouts" in note
    assert "- **head=tiled**: changed phases" in note and "over 2 repeats" in note  # one line per option
    assert "over 2 interleaved repeats: the median of the repeats' medians, with their range" in note
    # the exact option's largest difference over the run: the floor an inexact option would be measured against
    assert "Paired against report.repeat=0,head=dense (the same rollouts, 4 steps): exact options' noise floor" in note
    assert (tmp_path / "sweep" / "figures" / "paired.png").exists()
    said = r.stdout[r.stdout.index("rlrun: the sweep's answer"):]  # the console ends with the answer, then the links
    assert "paired: report.repeat=0,head=dense generated and recorded the rollouts" in said
    assert said.index("paired:") < said.index("rlrun: sweep results:")


def always_fails(completion, answer):
    raise ValueError("this reward always fails")


@pytest.mark.slow  # two jobs that fail at their first step or before it (~25 s)
def test_a_paired_sweep_whose_recording_job_fails_counts_and_records_every_job(tmp_path):
    """The recording job fails, so the replaying job has no record: it was refused before its MLflow run existed,
    and the sweep said "1 of 1 sweep jobs failed" for 2 jobs."""
    r = sweep(tmp_path, "head=dense,tiled", "task.reward=test_paired_sweep:always_fails")
    assert r.returncode == 1, r.stderr[-3000:]
    assert "2 of 2 sweep jobs failed" in r.stderr, r.stderr[-3000:]
    _, all_runs = runs(tmp_path / "mlflow.db")
    children = [x for x in all_runs if x.data.tags.get("rlrun.kind") != "sweep"]
    assert sorted(x.info.status for x in children) == ["FAILED", "FAILED"]
    errors = [x.data.tags.get("error", "") for x in children]
    assert any(e.startswith("TaskError") for e in errors), errors


@pytest.mark.slow  # composes every job of the sweep in a new process (~5 s)
def test_a_sweep_whose_jobs_cannot_share_one_record_is_refused_before_any_runs(tmp_path):
    r = sweep(tmp_path, "head=dense,tiled", "rollout.temperature=1.0,0.7")
    assert r.returncode == 2, r.stderr[-3000:]
    assert "its jobs cannot share one record (report.replay; no job was run)" in r.stderr
    assert "rollout.temperature was 1.0 in job head=dense,rollout.temperature=1.0, now 0.7" in r.stderr
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "sweep").exists()  # nothing written


@pytest.mark.parametrize("jobs, says", [
    ([["head=tiled", "seed=1"]], "job 1: its rollouts would differ from job 0's, which records them (a paired sweep "
                                 "varies training-side options only; drop report.replay to sweep these):\n      "
                                 "seed was 0 in job 0, now 1"),
    ([["rollout.max_new_tokens=8"]], "rollout.max_new_tokens was 4 in job 0, now 8"),
    ([["rollout.sync_weights=false"]], "rollout.sync_weights was True in job 0, now False"),
    ([["loss=dpo"]], "job 1: loss=dpo trains on preference pairs from its data and draws no rollouts"),
    ([["train.steps=5"]], "job 1: needs 5 rollouts and job 0 records 4: give every job the same train.steps"),
    ([["rollout.pipeline=async"]], "job 1: rollout.pipeline=async: a paired sweep replays in step (sync)"),
    ([["rollout.record=/elsewhere"]], "job 1: rollout.record=/elsewhere and report.replay both choose where"),
    ([["rollout=replay", "rollout.path=/r"]], "job 1: report.replay records with the job's sampler, and "
                                               "rollout=replay has none"),
    ([["head=tiled", "loss.kl_coef=0.1", "train.precision=bf16", "train.steps=3"]], None),  # training side: fine
], ids=["seed", "sampler", "rollout-key", "dpo", "length", "async", "own-record", "replay", "training-side"])
def test_what_keeps_jobs_from_sharing_one_record_is_named(tmp_path, jobs, says):
    configs = [make_cfg(*SMOKE[:2])] + [make_cfg(*SMOKE[:2], *job) for job in jobs]
    problems = paired.problems(configs, [str(i) for i in range(len(configs))], str(tmp_path))
    if says is None:
        assert problems == []
    else:
        assert len(problems) == 1 and says in problems[0], problems


def test_a_paired_sweep_never_writes_into_an_earlier_record(tmp_path):
    (tmp_path / "sweep" / paired.FOLDER).mkdir(parents=True)
    jobs = [make_cfg(*SMOKE[:2], "head=dense"), make_cfg(*SMOKE[:2], "head=tiled")]
    (problem,) = paired.problems(jobs, ["head=dense", "head=tiled"], str(tmp_path / "sweep"))
    assert "exists already (an earlier sweep's record); set hydra.sweep.dir to a new folder" in problem
    assert paired.problems(jobs, ["head=dense", "head=tiled"], str(tmp_path / "other")) == []


def test_job_zero_records_and_the_others_replay_with_their_own_sampler_settings(tmp_path):
    cfg = make_cfg("experiment=smoke", "rollout.temperature=0.7", "head=tiled")
    first, other = paired.job_config(cfg, 0, str(tmp_path)), paired.job_config(cfg, 3, str(tmp_path))
    assert first.rollout.name == "hf" and first.rollout.record == str(tmp_path / paired.FOLDER)
    assert other.rollout.name == "replay" and other.rollout.path == str(tmp_path / paired.FOLDER)
    assert other.rollout.temperature == 0.7 and other.head.name == "tiled" and cfg.rollout.get("record") is None


def test_the_report_compares_the_recording_run_with_the_runs_that_replayed_it():
    """hf + rollout.record and replay + rollout.path of one record: one group, the dense run its baseline; a run
    that generated its own rollouts stays apart."""
    common = {"loss.name": "dapo", "train.steps": "4", "rollout.temperature": "1.0"}
    rec = {**common, "rollout.name": "hf", "rollout.record": "/s/record", "rollout.pipeline": "sync",
           "rollout.sync_weights": "True", "head.name": "dense"}
    rep = {**common, "rollout.name": "replay", "rollout.path": "/s/record", "rollout.pipeline": "sync",
           "head.name": "tiled"}
    own = {**common, "rollout.name": "hf", "rollout.record": "None", "rollout.pipeline": "sync",
           "rollout.sync_weights": "True", "head.name": "chunked"}
    pairs, problems = equivalence.baselines([rec, rep, own], ["dense", "tiled", "chunked"])
    assert pairs == {1: 0} and problems == []
