"""Reliability: checkpoints that never run code, runs never left RUNNING, a checkpoint.dir checked before
training, quiet dead training noticed, and a new sqlite store created safely by processes started together."""

import hashlib
import io
import math
import os
import pickle
import random
import signal
import subprocess
import sys
import time
from collections import Counter, OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TEST_PATH, make_cfg, new_store
from helpers import history, runs

from rlrun import checkpoint, runner, signals

ROOT = str(Path(__file__).resolve().parents[2])
ENV = {**os.environ, "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "false", "OMP_NUM_THREADS": "1",
       "PYTHONPATH": f"{TEST_PATH}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


class Payload:
    """Unpickling this runs `touch MARKER`: what a malicious checkpoint would do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def crafted(path, payload_bytes: bytes) -> None:
    """A checkpoint file as rlrun lays it out (sha256 prefix, then the payload): the attacker writes the prefix."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(hashlib.sha256(payload_bytes).hexdigest().encode() + payload_bytes)


def torch_payload(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


@pytest.mark.parametrize("kind", ["torch.save", "bare pickle"])
def test_a_crafted_checkpoint_is_refused_and_runs_nothing(tmp_path, kind):
    marker = tmp_path / "MARKER"
    state = {"step": 7, "evil": Payload(marker)}
    payload = torch_payload(state) if kind == "torch.save" else pickle.dumps(state, protocol=2)
    checkpoint.save(str(tmp_path / "ckpt"), 3, {"step": 3}, keep=5)  # an older, valid checkpoint beside it
    crafted(tmp_path / "ckpt" / "step_00000007.pt", payload)
    with pytest.raises(checkpoint.UnsafeCheckpointError,
                       match=r"contains code/objects rlrun does not load: posix\.system") as e:
        checkpoint.load_latest(str(tmp_path / "ckpt"))  # refused, not skipped for the older one
    assert isinstance(e.value, checkpoint.CheckpointError)
    assert not marker.exists()


@pytest.mark.slow
def test_resume_from_a_crafted_checkpoint_exits_2_and_runs_nothing(tmp_path):
    marker = tmp_path / "MARKER"
    crafted(tmp_path / "ckpt" / "step_00000005.pt", torch_payload({"step": 5, "evil": Payload(marker)}))
    out = subprocess.run([sys.executable, "-m", "rlrun", "experiment=smoke", f"checkpoint.dir={tmp_path}/ckpt",
                          "resume=true", "progress=false", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db"],
                         cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "contains code/objects rlrun does not load: posix.system" in out.stderr
    assert "Traceback" not in out.stderr
    assert not marker.exists()


def test_loop_state_round_trips_exactly_without_unpickling_code(tmp_path):
    """Every kind of state the recipes checkpoint: RNG states (python, numpy, torch), Counters, OrderedDicts of
    tensors, dicts keyed by ints, tuples, numpy scalars, micro-batch dicts of tensors."""
    random.seed(3)
    np.random.seed(3)
    state = {"rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
             "totals": Counter(ref_run=4), "model": OrderedDict(w=torch.randn(3, 2)), "values": {17: (0.25, -1.5)},
             "queue": [{"ids": torch.arange(5), "mask": torch.ones(5, dtype=torch.bool), "reward": 0.5}],
             "np_scalar": np.float32(0.1), "np_int": np.int64(2**40), "nothing": None, "flag": True}
    checkpoint.write(str(tmp_path / "s.pt"), state)
    back = checkpoint.read(str(tmp_path / "s.pt"))
    assert back["rng"]["python"] == state["rng"]["python"]
    ns = back["rng"]["numpy"]
    assert ns[0] == "MT19937" and ns[1].dtype == np.uint32 and np.array_equal(ns[1], state["rng"]["numpy"][1])
    assert ns[2:] == state["rng"]["numpy"][2:]
    np.random.set_state(ns)
    a = np.random.rand(4)
    np.random.set_state(state["rng"]["numpy"])
    assert np.array_equal(a, np.random.rand(4))  # the same stream, bit for bit
    assert torch.equal(back["rng"]["torch"], state["rng"]["torch"])
    assert back["totals"] == Counter(ref_run=4) and back["values"] == {17: (0.25, -1.5)}
    assert torch.equal(back["model"]["w"], state["model"]["w"])
    assert torch.equal(back["queue"][0]["ids"], state["queue"][0]["ids"]) and back["queue"][0]["reward"] == 0.5
    assert type(back["np_scalar"]) is np.float32 and back["np_scalar"] == state["np_scalar"]
    assert type(back["np_int"]) is np.int64 and back["np_int"] == 2**40
    assert back["nothing"] is None and back["flag"] is True


def test_a_state_that_could_not_be_resumed_from_is_refused_when_saved(tmp_path):
    with pytest.raises(checkpoint.CheckpointError, match="cannot load.*builtins.print"):
        checkpoint.write(str(tmp_path / "s.pt"), {"step": 1, "fn": print})
    assert not (tmp_path / "s.pt").exists()


class Allowed:
    pass


def test_deepspeed_files_are_checked_before_deepspeed_loads_them(tmp_path):
    """DeepSpeed loads its own files with torch.load(weights_only=False): rlrun checks them statically first."""
    marker = tmp_path / "MARKER"
    root = tmp_path / "step_00000002"
    root.mkdir()
    torch.save({"module": {"w": torch.ones(2)}, "ds_version": "0.19"}, root / "mp_rank_00_model_states.pt")
    torch.save({"scaler": Allowed()}, root / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    checkpoint.write(str(root / "rlrun_rank0.pt"), {"step": 2})  # rlrun's own: read by checkpoint.read
    allowed = {f"{Allowed.__module__}.Allowed"}
    checkpoint.check_foreign(str(root), allowed)  # plain data and the allowed classes pass
    with pytest.raises(checkpoint.UnsafeCheckpointError, match=r"test_reliability\.Allowed"):
        checkpoint.check_foreign(str(root), set())
    torch.save({"evil": Payload(marker)}, root / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with pytest.raises(checkpoint.UnsafeCheckpointError, match=r"zero_pp_rank_1.*posix\.system"):
        checkpoint.check_foreign(str(root), allowed)
    assert not marker.exists()


# --- never RUNNING -------------------------------------------------------------------------------------------

HOOK = """
import os, pathlib, sys, time
from rlrun import models, tracking

def pause(orig):
    def paused(*args, **kwargs):
        pathlib.Path(os.environ["HOOK_MARKER"]).write_text("here")
        time.sleep(120)
        return orig(*args, **kwargs)
    return paused

if os.environ["HOOK_AT"] == "model build":
    models.build = pause(models.build)
elif os.environ["HOOK_AT"] == "run just created":
    tracking.mlflow.log_params = pause(tracking.mlflow.log_params)  # called right after create_run
elif os.environ["HOOK_AT"] == "a step that hangs":  # the third optimizer step never ends by itself
    from rlrun.recipes import grpo
    steps, original = [0], grpo.train_step
    hang = pause(original)

    def third_hangs(*args, **kwargs):
        steps[0] += 1
        return (hang if steps[0] == 3 else original)(*args, **kwargs)

    grpo.train_step = third_hangs
from rlrun.cli import main
main()
"""


def wait_for(cond, p, seconds=240):
    deadline = time.time() + seconds
    while not cond() and p.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert p.poll() is None, f"the run ended before it could be interrupted: {p.stderr.read()[-2000:]}"
    assert cond(), "timed out"


def loss_steps(db) -> int:
    import sqlite3

    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1) as con:
            return con.execute("SELECT COUNT(DISTINCT step) FROM metrics WHERE key = 'train/loss'").fetchone()[0]
    except sqlite3.Error:
        return 0


def signalled_hook_run(tmp_path, sig, hook_env: dict, ready) -> list:
    """A smoke run through HOOK, sent `sig` once `ready()`; asserts it exited 128 + sig with its one run KILLED, and
    returns the runs."""
    (tmp_path / "hook.py").write_text(HOOK)
    p = subprocess.Popen([sys.executable, str(tmp_path / "hook.py"), "experiment=smoke", "train.steps=200",
                          "progress=false", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
                          f"checkpoint.dir={tmp_path}/ckpt"], cwd=tmp_path, env={**ENV, **hook_env},
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(ready, p)
        p.send_signal(sig)
        p.wait(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 128 + sig, p.stderr.read()[-2000:]
    _, found = runs(tmp_path / "mlflow.db")
    assert [r.info.status for r in found] == ["KILLED"]
    return found


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("moment", ["model build", "run just created", "mid step"])
def test_a_signal_at_any_moment_never_leaves_the_run_running(tmp_path, moment, sig):
    marker = tmp_path / "reached"
    ready = (lambda: loss_steps(tmp_path / "mlflow.db") >= 2) if moment == "mid step" else marker.exists
    found = signalled_hook_run(tmp_path, sig, {"HOOK_AT": moment, "HOOK_MARKER": str(marker)}, ready)
    assert "interrupted" in found[0].data.tags.get("error", "")
    if moment == "mid step":  # the step in flight finished and was checkpointed
        state, _ = checkpoint.load_latest(str(tmp_path / "ckpt"))
        assert state["step"] == loss_steps(tmp_path / "mlflow.db")


@pytest.mark.slow
def test_sighup_ends_the_run_killed_with_its_checkpoint(tmp_path):
    """A closed terminal or ssh session: handled like SIGTERM (the step finishes, is checkpointed, KILLED)."""
    (tmp_path / "hook.py").write_text(HOOK)
    p = subprocess.Popen([sys.executable, str(tmp_path / "hook.py"), "experiment=smoke", "train.steps=200",
                          "progress=false", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
                          f"checkpoint.dir={tmp_path}/ckpt"], cwd=tmp_path, env={**ENV, "HOOK_AT": "none",
                          "HOOK_MARKER": ""}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: loss_steps(tmp_path / "mlflow.db") >= 2, p)
        p.send_signal(signal.SIGHUP)
        p.wait(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 128 + signal.SIGHUP, p.stderr.read()[-2000:]
    _, found = runs(tmp_path / "mlflow.db")
    assert [r.info.status for r in found] == ["KILLED"]
    state, _ = checkpoint.load_latest(str(tmp_path / "ckpt"))
    assert state["step"] == loss_steps(tmp_path / "mlflow.db")


@pytest.mark.slow
def test_sigterm_stops_a_step_that_does_not_end_within_the_grace_period(tmp_path):
    """The first SIGTERM lets the step in flight finish, but only for checkpoint.stop_grace_s: a step that hangs is
    then interrupted, the run ends KILLED with the checkpoints written before (a scheduler's SIGKILL would find
    it RUNNING otherwise)."""
    (tmp_path / "hook.py").write_text(HOOK)
    marker, out = tmp_path / "reached", open(tmp_path / "stdout", "w")  # the log is on stdout
    p = subprocess.Popen([sys.executable, str(tmp_path / "hook.py"), "experiment=smoke", "train.steps=200",
                          "progress=false", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", "eval.every=0",
                          f"checkpoint.dir={tmp_path}/ckpt", "checkpoint.every=1", "checkpoint.stop_grace_s=2"],
                         cwd=tmp_path, env={**ENV, "HOOK_AT": "a step that hangs", "HOOK_MARKER": str(marker)},
                         stdout=out, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(marker.exists, p)
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=90)  # the hung step sleeps 120 s: ending before then is the grace period's doing
    finally:
        if p.poll() is None:
            p.kill()
        out.close()
    err = p.stderr.read() + (tmp_path / "stdout").read_text()
    assert p.returncode == 143, err[-2000:]
    assert "the step did not end within checkpoint.stop_grace_s=2 s of the signal: stopping now" in err
    _, found = runs(tmp_path / "mlflow.db")
    assert [r.info.status for r in found] == ["KILLED"]
    assert checkpoint.load_latest(str(tmp_path / "ckpt"))[0]["step"] == 2  # the two steps before the hung one


def test_the_grace_period_interrupts_a_deferred_stop_that_never_comes():
    """signals.deferred(): after the first signal the block gets the grace period, then KeyboardInterrupt."""
    signals.set_grace(0.2)
    try:
        with pytest.raises(KeyboardInterrupt, match="grace period"):
            with signals.deferred() as stop:
                os.kill(os.getpid(), signal.SIGTERM)
                for _ in range(400):  # a wait that would outlast any grace period
                    time.sleep(0.05)
        assert stop["stop"] and signals.received() == signal.SIGTERM
    finally:
        signals.set_grace(signals.GRACE_S)
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_sighup_is_handled_like_sigterm():
    previous = signals.interrupt_on_signals()
    try:
        with pytest.raises(KeyboardInterrupt, match="SIGHUP"):
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(1)
        assert signals.received() == signal.SIGHUP and signals.exit_code() == 129
    finally:
        signals.restore(previous)


@pytest.mark.parametrize("name", ["SIGUSR2", "SIGXCPU"])
def test_sigusr2_and_sigxcpu_are_handled_like_sigterm(name):
    """SLURM's `--signal=USR2@60` pre-emption warning and a soft CPU-time limit: by default each kills the process
    at once (the run left RUNNING); handled, each stops the run like SIGTERM, exit 128 + its number."""
    sig = getattr(signal, name)
    previous = signals.interrupt_on_signals()
    try:
        # checked before the signal is sent: unhandled, it would kill the test process itself
        assert signal.getsignal(sig) not in (signal.SIG_DFL, signal.SIG_IGN, None)
        with pytest.raises(KeyboardInterrupt, match=name):
            os.kill(os.getpid(), sig)
            time.sleep(1)
        assert signals.received() == sig and signals.exit_code() == 128 + sig
    finally:
        signals.restore(previous)


@pytest.mark.slow  # a smoke run stopped after 2 steps: ~15 s each
@pytest.mark.parametrize("name", ["SIGUSR2", "SIGXCPU"])
def test_sigusr2_and_sigxcpu_end_the_run_killed_with_its_checkpoint(tmp_path, name):
    sig = getattr(signal, name)
    signalled_hook_run(tmp_path, sig, {"HOOK_AT": "none", "HOOK_MARKER": ""},
                       lambda: loss_steps(tmp_path / "mlflow.db") >= 2)
    state, _ = checkpoint.load_latest(str(tmp_path / "ckpt"))
    assert state["step"] == loss_steps(tmp_path / "mlflow.db")


def test_signals_held_delays_a_signal_until_the_block_is_done():
    previous = signals.interrupt_on_signals()
    try:
        done = []
        with pytest.raises(KeyboardInterrupt):
            with signals.held():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)
                done.append("marked")  # not interrupted
        assert done == ["marked"] and signals.received() == signal.SIGTERM
    finally:
        signals.restore(previous)


# --- checkpoint.dir before training; dead training ------------------------------------------------------------

@pytest.mark.slow
def test_an_unwritable_checkpoint_dir_is_refused_before_training(tmp_path):
    (tmp_path / "a_file").write_text("not a folder")
    out = subprocess.run([sys.executable, "-m", "rlrun", "experiment=smoke", "progress=false",
                          f"checkpoint.dir={tmp_path}/a_file/ckpt", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db"],
                         cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"checkpoint.dir='{tmp_path}/a_file/ckpt' is not writable" in out.stderr
    assert "Traceback" not in out.stderr
    # refused before the MLflow run is created: no run at all (not even one ended FAILED)
    assert not (tmp_path / "mlflow.db").exists() or runs(tmp_path / "mlflow.db")[1] == []


@pytest.mark.parametrize("multirun", [False, True])
def test_an_output_folder_that_cannot_be_written_is_one_line_and_exit_2(tmp_path, multirun):
    """What a read-only working folder does to Hydra's outputs/ (a folder under a file fails the same way, also
    for root, who may write in read-only folders)."""
    (tmp_path / "a_file").write_text("not a folder")
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    out = subprocess.run([sys.executable, "-m", "rlrun", *(["-m", "seed=0,1"] if multirun else []),
                          "experiment=smoke", f"{key}={tmp_path}/a_file/out"], cwd=tmp_path, env=ENV,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1] == (
        f"rlrun: error: cannot write the run's output folder {tmp_path}/a_file/out (Not a directory); run rlrun "
        f"from a writable folder or set {key}=/a/writable/folder")
    assert not (tmp_path / "mlflow.db").exists()  # refused before any run was created


def test_an_output_folder_on_a_full_disk_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    """A disk that takes a new file but not its bytes (ENOSPC at the first write Hydra makes): one line."""
    import errno

    from rlrun import folders

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(folders.os, "fsync", full)
    with pytest.raises(SystemExit) as e:
        folders.refuse_unwritable(tmp_path / "outputs" / "run", "hydra.run.dir")
    assert e.value.code == 2 and os.listdir(tmp_path) == []
    assert capsys.readouterr().err.strip() == (
        f"rlrun: error: cannot write the run's output folder {tmp_path}/outputs/run (No space left on device); "
        "free space on that disk or set hydra.run.dir=/a/writable/folder")


def test_check_writable():
    checkpoint.check_writable(None)
    checkpoint.check_writable("")
    with pytest.raises(checkpoint.CheckpointError, match="checkpoint.dir='/proc/nope' is not writable"):
        checkpoint.check_writable("/proc/nope")


@pytest.mark.parametrize("dead", [0.0, math.nan, math.inf])
def test_watch_gradients_warns_once_after_n_dead_steps(dead):
    h = {}
    assert runner.watch_gradients(h, 1.6) is None
    for _ in range(runner.DEAD_GRADIENT_STEPS - 1):
        assert runner.watch_gradients(h, dead) is None
    text = runner.watch_gradients(h, dead)
    assert text and f"for {runner.DEAD_GRADIENT_STEPS} consecutive steps" in text and "train.lr" in text
    assert all(runner.watch_gradients(h, dead) is None for _ in range(20))  # once per run


def test_watch_gradients_resets_on_a_live_step():
    h = {}
    for _ in range(3):
        for _ in range(runner.DEAD_GRADIENT_STEPS - 1):
            assert runner.watch_gradients(h, 0.0) is None
        assert runner.watch_gradients(h, 1e-9) is None  # tiny but alive: the count starts again
    assert runner.watch_gradients(h, 0.5) is None


def test_watch_gradients_blames_equal_rewards_not_the_learning_rate_when_every_group_tied():
    h = {}
    for _ in range(runner.DEAD_GRADIENT_STEPS - 1):
        assert runner.watch_gradients(h, 0.0, equal_rewards=True) is None
    text = runner.watch_gradients(h, 0.0, equal_rewards=True)
    assert "every prompt group had equal rewards" in text and "learning rate is not the cause" in text
    mixed = {}  # one dead step with signal in the rewards: the weights, not the reward
    runner.watch_gradients(mixed, 0.0, equal_rewards=False)
    for _ in range(runner.DEAD_GRADIENT_STEPS - 1):
        text = runner.watch_gradients(mixed, 0.0, equal_rewards=True)
    assert "lower train.lr" in text and "equal rewards" not in text


@pytest.mark.slow  # a 2-step run
def test_a_grpo_step_logs_the_share_of_groups_without_reward_signal(tmp_path):
    from rlrun.cli import run

    new_store(tmp_path)
    cfg = make_cfg("experiment=smoke", "train.steps=2", "eval.every=0", "task.reward=helpers:constant_reward",
                   tmp_path=tmp_path)
    run(cfg, "constant")
    client, [r] = runs(tmp_path / "mlflow.db")
    assert history(client, r.info.run_id, "equal_reward_groups_frac") == [1.0, 1.0]


# --- two processes, one new sqlite store ----------------------------------------------------------------------

RACE = """
import sys, time
from rlrun import tracking
import mlflow  # imported before the barrier, so both processes reach the store together
start = float(sys.argv[2])
while time.time() < start:
    time.sleep(0.001)
client, exp = tracking.connect(f"sqlite:///{sys.argv[1]}", "race")
run = client.create_run(exp)
client.set_terminated(run.info.run_id)
print("ok", exp)
"""


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("attempt", [1, 2, 3])
def test_two_processes_create_a_new_sqlite_store_together(tmp_path, attempt):
    db = tmp_path / "mlflow.db"
    start = time.time() + 8  # both are importing mlflow by then
    ps = [subprocess.Popen([sys.executable, "-c", RACE, str(db), str(start)], env=ENV, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=180) for p in ps]
    for p, (out, err) in zip(ps, outs):
        assert p.returncode == 0 and out.strip() == "ok 1", err[-2000:]
    _, found = runs(db)
    assert len(found) == 2 and {r.info.status for r in found} == {"FINISHED"}


def test_every_test_the_reliability_page_names_exists():
    """docs/reliability.md lists each guarantee with its tests (`tests/<folder>/test_x.py::name`, or `::name` after one
    of the same file): each must be a test function in that file, so the page cannot point at a test that is gone."""
    import ast
    import re

    text = open(os.path.join(ROOT, "docs", "reliability.md"), encoding="utf-8").read()
    named, current = [], None
    for file, name in re.findall(r"`(?:tests/(?:\w+/)*)?(test_\w+\.py)?(?:::(\w+))?`", text):
        current = file or current
        if name:
            named.append((current, name))
    assert len(named) > 20
    for file, name in named:
        (path,) = Path(ROOT, "tests").rglob(file)  # tests/unit/<package>/, e2e/, distributed/
        tree = ast.parse(path.read_text(encoding="utf-8"))
        assert name in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}, f"{file}::{name}"
