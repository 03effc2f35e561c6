"""Checkpoint and resume: kill -9 or Ctrl-C at any moment, resume, and get the same curve in the same run."""

import hashlib
import io
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time

import pytest
import torch
from helpers import finished, runs

from rlrun import checkpoint

ENV = {**os.environ, "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "false"}
# The kill tests draw their kill point from this seed (fixed: a failure reruns at the same point). To explore
# other points: RLRUN_TEST_KILL_SEED=N pytest tests/e2e/test_checkpoint.py tests/distributed/test_distributed.py -m slow
KILL_SEED = int(os.environ.get("RLRUN_TEST_KILL_SEED", "0"))


def kill_point(name: str, low: int, high: int) -> int:
    """The step after which test `name` kills its run: seeded by KILL_SEED and the test's own name."""
    return random.Random(f"{KILL_SEED}:{name}").randint(low, high)


def test_save_read_keep_and_fall_back_past_a_corrupted_checkpoint(tmp_path, caplog):
    for step in range(1, 6):
        checkpoint.save(str(tmp_path), step, {"step": step, "w": torch.full((3,), float(step))}, keep=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000003.pt", "step_00000004.pt", "step_00000005.pt"]
    state, path = checkpoint.load_latest(str(tmp_path))
    assert state["step"] == 5 and torch.equal(state["w"], torch.full((3,), 5.0))
    newest = tmp_path / "step_00000005.pt"
    newest.write_bytes(newest.read_bytes()[:-20])  # truncated
    data = bytearray((tmp_path / "step_00000004.pt").read_bytes())
    data[100] ^= 0xFF  # one flipped byte
    (tmp_path / "step_00000004.pt").write_bytes(bytes(data))
    state, path = checkpoint.load_latest(str(tmp_path))
    assert state["step"] == 3 and path.endswith("step_00000003.pt")
    assert "checksum mismatch" in caplog.text
    with pytest.raises(checkpoint.CheckpointError, match="no checkpoint"):
        checkpoint.load_latest(str(tmp_path / "empty"))


def test_changed_keys():
    saved = {"train.lr": "0.1", "train.steps": "5", "head.name": "dense", "tracking.uri": "a", "seed": "0"}
    now = {"train.lr": "0.2", "train.steps": "9", "head.name": "tiled", "tracking.uri": "b", "seed": "0",
           "rollout.top_k": "0"}  # a checkpoint from before rollout.top_k was drawn with it off
    assert checkpoint.changed_keys(saved, now) == ["train.lr"]
    # the memory plan and the head's tile may change, and a checkpoint from before plan.* existed still resumes
    assert checkpoint.changed_keys({"head.size": "128"}, {"plan.device_gib": "80", "head.size": "auto",
                                                          "head.memory_budget_mib": "None", "rollout.top_k": "0"}) == []


def rlrun(tmp, *args):
    return subprocess.Popen([sys.executable, "-m", "rlrun", *args, "progress=false",
                             f"tracking.uri=sqlite:///{tmp}/mlflow.db"], cwd=tmp, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def logged_steps(db):
    """Steps logged so far, read through a read-only connection: an MLflow client here could race the run's own
    creation of the store's tables."""
    if not os.path.exists(db):
        return 0
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1) as con:
            return con.execute("SELECT COUNT(DISTINCT step) FROM metrics WHERE key = 'train/loss'").fetchone()[0]
    except sqlite3.Error:  # tables not created yet
        return 0


def kill_after(tmp, args, at_step, sig):
    """Start rlrun, send `sig` once `at_step` steps are logged; -> (the ended process, steps logged by then)."""
    p = rlrun(tmp, *args)
    deadline = time.time() + 240
    while p.poll() is None and logged_steps(tmp / "mlflow.db") < at_step and time.time() < deadline:
        time.sleep(0.02)
    assert p.poll() is None, f"the run ended before it could be interrupted after step {at_step}: " + \
        p.stderr.read()[-2000:]
    assert logged_steps(tmp / "mlflow.db") >= at_step, f"no step {at_step} within 240 s"
    p.send_signal(sig)
    p.wait(timeout=120)
    return p, logged_steps(tmp / "mlflow.db")


def curve(db, key="train/loss"):
    client, (r,) = runs(db)
    hist = sorted(client.get_metric_history(r.info.run_id, key), key=lambda m: m.step)
    return r, [m.step for m in hist], [m.value for m in hist]


STEPS = 12  # three periodic checkpoints before the last kill point: enough to resume from one that is not the first


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["dapo", "dpo", "dapo-packed", "dapo-async"])
def test_sigkill_at_a_seeded_step_then_resume_gives_the_same_curve(tmp_path, loss):
    # the packed layout resumes bit for bit too; so does async generation (the rollouts generated ahead are in the
    # checkpoint, and the generator restarts on the checkpoint's weights)
    extra = {"packed": ["batching=packed"], "async": ["rollout.pipeline=async"]}.get(loss.partition("-")[2], [])
    # evaluations between the checkpoints (of 8 held-out rows, kept cheap): one logged before a kill is not logged
    # again by the resume
    args = ["experiment=smoke", f"loss={loss.partition('-')[0]}", *extra, f"train.steps={STEPS}", "eval.every=4",
            "eval.size=8", f"checkpoint.dir={tmp_path}/run/ckpt", "checkpoint.every=3"]
    (tmp_path / "base").mkdir()
    (tmp_path / "run").mkdir()
    code, err = finished(rlrun(tmp_path / "base", *args[:-2]), 600)
    assert code == 0, err[-2000:]
    at = kill_point(f"sigkill-{loss}", 4, STEPS - 2)  # >= 4: the first checkpoint (after step 3) exists; steps left
    p, logged = kill_after(tmp_path / "run", args, at, signal.SIGKILL)
    where = f"SIGKILL once {at} steps were logged (RLRUN_TEST_KILL_SEED={KILL_SEED}), {logged} logged by then"
    # the newest checkpoint is a periodic one (every 3 steps), at or before the last logged step
    saved = checkpoint.load_latest(str(tmp_path / "run" / "ckpt"))[0]["step"]
    assert saved % 3 == 0 and 3 <= saved <= logged, f"{where}: newest checkpoint after step {saved}"
    code, err = finished(rlrun(tmp_path / "run", *args, "resume=true"), 600)
    assert code == 0, f"{where}: " + err[-2000:]
    run_, steps, values = curve(tmp_path / "run" / "mlflow.db")
    _, base_steps, base_values = curve(tmp_path / "base" / "mlflow.db")
    assert run_.info.status == "FINISHED", where
    assert steps == base_steps == list(range(STEPS)), where  # no missing, no duplicated step
    assert values == base_values, f"{where}, resumed from the checkpoint after step {saved}"  # bit for bit
    evals = [curve(tmp_path / d / "mlflow.db", "eval/accuracy")[1:] for d in ("run", "base")]
    assert evals[0] == evals[1] and evals[1][0] == [0, 4, 8, 12], f"{where}: eval/accuracy"  # each once


@pytest.mark.slow
def test_ctrl_c_writes_a_checkpoint_marks_killed_and_resume_finishes(tmp_path):
    args = ["experiment=smoke", "train.steps=24", f"checkpoint.dir={tmp_path}/ckpt"]  # no periodic checkpoints
    p, _ = kill_after(tmp_path, args, 5, signal.SIGINT)  # fixed: Ctrl-C once 5 steps are logged
    assert p.returncode == 130, p.stderr.read()[-2000:]
    run_, steps, _ = curve(tmp_path / "mlflow.db")
    assert run_.info.status == "KILLED"
    state, _ = checkpoint.load_latest(str(tmp_path / "ckpt"))
    # the step in flight finished, was logged and checkpointed; the run stopped there, not at the end
    assert state["step"] == len(steps) and 5 <= len(steps) < 24, (state["step"], steps)
    refused = subprocess.run([sys.executable, "-m", "rlrun", *args, "resume=true", "train.lr=0.5"], cwd=tmp_path,
                             env=ENV, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "train.lr was '0.001', now '0.5'" in refused.stderr
    code, err = finished(rlrun(tmp_path, *args, "resume=true", "train.steps=26"), 600)  # more steps may be asked for
    assert code == 0, err[-2000:]
    run2, steps, _ = curve(tmp_path / "mlflow.db")
    assert run2.info.run_id == run_.info.run_id and run2.info.status == "FINISHED"
    assert steps == list(range(26))


def test_sharded_checkpoints_are_sealed_and_a_changed_file_falls_back(tmp_path, caplog, monkeypatch):
    """engine=deepspeed layout: step_N/ (DeepSpeed's files + rlrun_rank{R}.pt per rank) sealed by step_N.manifest."""
    monkeypatch.setenv("RANK", "1")
    for step in (2, 4, 6):
        folder = tmp_path / f"step_{step:08d}"
        folder.mkdir()
        (folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"optimizer bytes %d" % step)
        for rank in (0, 1):
            checkpoint.write(str(folder / f"rlrun_rank{rank}.pt"), {"step": step, "rank": rank})
        checkpoint.write_manifest(str(tmp_path), step, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step_00000004", "step_00000004.manifest", "step_00000006", "step_00000006.manifest"]  # keep=2
    (tmp_path / "step_00000008").mkdir()  # a checkpoint whose writing was killed: never sealed, never loaded
    state, path = checkpoint.load_latest(str(tmp_path))
    assert (state["step"], state["rank"]) == (6, 1) and path.endswith("step_00000006.manifest")
    assert state["deepspeed_checkpoint"] == (str(tmp_path), "step_00000006")
    (tmp_path / "step_00000006" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"truncat")
    with caplog.at_level("WARNING"):
        state, path = checkpoint.load_latest(str(tmp_path))
    assert state["step"] == 4 and "changed since the checkpoint was sealed" in caplog.text


@pytest.mark.slow  # three short runs through the entry point (~30 s)
def test_resume_by_run_id_restores_the_runs_config_and_applies_only_the_new_overrides(tmp_path):
    """`rlrun resume=<run id> train.steps=4 eval.every=2` continues the run without repeating its overrides
    (experiment, model size, checkpoint.dir): they come from the run's config.yaml; one that changes what is
    trained is still refused."""
    first = rlrun(tmp_path, "experiment=smoke", "train.steps=2", "eval.every=1", "model.hidden_size=64",
                  f"checkpoint.dir={tmp_path}/ckpt", "export.enabled=false")
    code, err = finished(first, 300)
    assert code == 0, err[-2000:]
    _, (r,) = runs(tmp_path / "mlflow.db")
    code, err = finished(rlrun(tmp_path, f"resume={r.info.run_id}", "train.steps=4", "eval.every=2"), 300)
    assert code == 0, err[-2000:]
    client, (r2,) = runs(tmp_path / "mlflow.db")
    assert r2.info.run_id == r.info.run_id and r2.info.status == "FINISHED", err[-3000:]
    assert [m.step for m in client.get_metric_history(r.info.run_id, "train/loss")] == [0, 1, 2, 3]
    code, err = finished(rlrun(tmp_path, f"resume={r.info.run_id}", "train.steps=6", "loss=cispo"), 300)
    assert code == 2
    assert "loss.name was 'dapo', now 'cispo'; a resumed run must train the same thing" in err


def test_rotation_removes_only_this_runs_own_checkpoints(tmp_path, caplog):
    """Two runs' checkpoints in one folder (the lock is the first guard; this is the second), an older rlrun's
    checkpoint without an owner line, and a user's file that matches step_*.pt: rotation removes none of them."""
    for step in (1, 2, 3):
        checkpoint.save(str(tmp_path), step, {"step": step, "owner": "run-a"}, keep=5)
    (tmp_path / "step_best.pt").write_bytes(b"the user's own")
    older = tmp_path / "step_00000004.pt"
    payload = io.BytesIO()
    torch.save({"step": 4}, payload)
    older.write_bytes(hashlib.sha256(payload.getvalue()).hexdigest().encode() + payload.getvalue())  # no owner line
    for step in (5, 6, 7):
        checkpoint.save(str(tmp_path), step, {"step": step, "owner": "run-b"}, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step_00000001.pt", "step_00000002.pt", "step_00000003.pt", "step_00000004.pt", "step_00000007.pt",
        "step_best.pt"]  # run-b kept its newest only; nothing else was touched
    assert [checkpoint.owner_of(str(tmp_path / f"step_0000000{i}.pt")) for i in (1, 4, 7)] == ["run-a", None, "run-b"]
    assert "holds 5 checkpoint(s) this run did not write" in caplog.text
    assert checkpoint.read(str(older))["step"] == 4  # an older rlrun's checkpoint still loads
    state, path = checkpoint.load_latest(str(tmp_path))  # step_best.pt is not a checkpoint name: never loaded
    assert state["step"] == 7


def test_sharded_rotation_removes_only_this_runs_own_checkpoints(tmp_path):
    for step, owner in ((2, "run-a"), (4, "run-b"), (6, "run-b"), (8, "run-b")):
        (tmp_path / f"step_{step:08d}").mkdir()
        checkpoint.write(str(tmp_path / f"step_{step:08d}" / "rlrun_rank0.pt"), {"step": step, "owner": owner})
        checkpoint.write_manifest(str(tmp_path), step, keep=2, owner=owner)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step_00000002", "step_00000002.manifest", "step_00000006", "step_00000006.manifest", "step_00000008",
        "step_00000008.manifest"]


@pytest.mark.slow  # two short in-process runs
def test_a_resumed_run_rotates_the_checkpoints_it_wrote_before(tmp_path):
    from conftest import make_cfg, new_store

    from rlrun.cli import run

    new_store(tmp_path)
    args = ["experiment=smoke", "eval.every=0", f"checkpoint.dir={tmp_path}/ckpt", "checkpoint.every=1",
            "checkpoint.keep=2", "export.enabled=false"]
    run(make_cfg(*args, "train.steps=3", tmp_path=tmp_path), "first")
    owners = {checkpoint.owner_of(str(p)) for p in (tmp_path / "ckpt").glob("step_*.pt")}
    assert len(owners) == 1 and None not in owners
    run(make_cfg(*args, "train.steps=5", "resume=true", tmp_path=tmp_path), "first")
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step_*.pt")) == ["step_00000004.pt", "step_00000005.pt"]
    assert {checkpoint.owner_of(str(p)) for p in (tmp_path / "ckpt").glob("step_*.pt")} == owners  # one lineage


@pytest.mark.slow  # one short run through the entry point (~15 s)
def test_sigusr1_prints_every_threads_stack_and_the_run_goes_on(tmp_path):
    """`kill -USR1 <pid>` on a run that looks stuck shows where it waits; the run keeps training."""
    p = rlrun(tmp_path, "experiment=smoke", "train.steps=40")
    deadline = time.time() + 240
    while p.poll() is None and logged_steps(tmp_path / "mlflow.db") < 2 and time.time() < deadline:
        time.sleep(0.02)
    p.send_signal(signal.SIGUSR1)
    at = logged_steps(tmp_path / "mlflow.db")
    while p.poll() is None and logged_steps(tmp_path / "mlflow.db") < at + 2 and time.time() < deadline:
        time.sleep(0.02)
    assert p.poll() is None and logged_steps(tmp_path / "mlflow.db") >= at + 2  # still training after the dump
    p.send_signal(signal.SIGINT)
    code, err = finished(p, 120)
    assert code == 130, err[-2000:]
    assert "Current thread" in err and 'File "' in err and "rlrun" in err, err[-2000:]


def test_a_checkpoint_from_before_rollout_top_k_resumes_with_it_off():
    """rollout.top_k was added after checkpoints were written: one without it trained with top_k off (0), so it
    resumes with top_k=0 and is refused with another."""
    saved = {"train.lr": "0.001"}
    assert checkpoint.changed_keys(saved, {"train.lr": "0.001", "rollout.top_k": "0"}) == []
    assert checkpoint.changed_keys(saved, {"train.lr": "0.001", "rollout.top_k": "5"}) == ["rollout.top_k"]
