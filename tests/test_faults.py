"""Faults end with one message naming the cause and the fix, the run FAILED or KILLED, nothing left in /dev/shm,
exit 2 for a user's cause (1 for a fault outside the config): a generator stopped, killed or silent, a small
/dev/shm, a device the machine lacks, a non-finite loss, a model folder with code in it."""

import contextlib
import glob
import os
import signal
import subprocess
import sys
import time
from collections import namedtuple
from types import SimpleNamespace

import psutil
import pytest
import torch
from conftest import make_cfg
from helpers import runs

from rlrun import models, pipeline
from rlrun.config import ConfigError, validate
from rlrun.errors import RolloutError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "false", "OMP_NUM_THREADS": "1",
       "PYTHONPATH": f"{ROOT}/tests{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
METER = SimpleNamespace(phase=lambda name: contextlib.nullcontext())


def cfg_for(*overrides):
    return validate(make_cfg("experiment=smoke", "rollout.pipeline=async", "train.steps=20", *overrides))


def prompts_for(r):
    texts = [f"{r}+{i}=" for i in range(4)]
    return [{"prompt": t} for t in texts], texts, [1000 * r + i for i in range(4)]


def shm_files() -> set[str]:
    return set(glob.glob(f"/dev/shm/torch_{os.getpid()}_*"))


@contextlib.contextmanager
def deadline(seconds: float):
    """TimeoutError if the block has not returned by then (what a hang would do, turned into a failure)."""
    def late(signum, frame):
        raise TimeoutError(f"still waiting after {seconds} s")

    previous = signal.signal(signal.SIGALRM, late)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# -- the generator (rollout.pipeline=async) -------------------------------------------------------------------------
@pytest.mark.slow  # starts a generator process
def test_a_stopped_generator_is_one_error_not_a_hang_and_is_killed():
    cfg = cfg_for("rollout.worker_timeout_s=2")
    model, _ = models.build(cfg.model, cfg.seed)
    pipe = pipeline.Pipeline(cfg, window=1, grad_accum=1, device=torch.device("cpu"))
    try:
        pipe.start(model, 0)
        pid = pipe.proc.pid
        os.kill(pid, signal.SIGSTOP)  # a debugger, a kill -STOP, a machine out of memory swapping
        pipe.ahead(0, model, prompts_for, METER)
        with deadline(120), pytest.raises(pipeline.GeneratorLost, match=r"has given no sign of life for \d+ s "
                                                                        r"\(rollout.worker_timeout_s=2\)"):
            pipe.take()
    finally:
        pipe.close()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_small_dev_shm_is_refused_before_the_slots_are_made(monkeypatch):
    cfg = cfg_for()
    model, _ = models.build(cfg.model, cfg.seed)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(pipeline.shutil, "disk_usage", lambda p: usage(64 << 20, 64 << 20, 1000))
    before = shm_files()
    pipe = pipeline.Pipeline(cfg, window=1, grad_accum=1, device=torch.device("cpu"))
    try:
        with pytest.raises(RolloutError, match=r"rollout.pipeline=async needs about \d+ MiB of shared memory "
                                               r"\(/dev/shm: .*\) and /dev/shm has 0 MiB free.*--shm-size"):
            pipe.start(model, 0)
        assert pipe.proc is None and shm_files() == before
    finally:
        pipe.close()


def test_a_shared_memory_failure_is_one_error_and_leaves_nothing_in_dev_shm(monkeypatch):
    """What torch does when /dev/shm fills up while it makes a segment: an error, and the segment's file left."""
    cfg = cfg_for()
    model, _ = models.build(cfg.model, cfg.seed)
    left = f"/dev/shm/torch_{os.getpid()}_123_0"

    def full(self):
        open(left, "wb").close()
        raise RuntimeError(f"unable to allocate shared memory(shm) for file <{left[8:]}>: No space left on device "
                           "(28)")

    monkeypatch.setattr(torch.Tensor, "share_memory_", full)
    pipe = pipeline.Pipeline(cfg, window=1, grad_accum=1, device=torch.device("cpu"))
    try:
        with pytest.raises(RolloutError, match=r"could not make its shared memory in /dev/shm \(unable to "
                                               r"allocate shared memory.*--shm-size"):
            pipe.start(model, 0)
        assert not os.path.exists(left) and pipe.proc is None
    finally:
        pipe.close()


def failing_build(cfg, state, device):
    from rlrun.errors import ModelError

    raise ModelError("model.path='/models/x' has no config.json (test)")


@pytest.mark.slow  # starts a generator process
def test_a_user_error_in_the_generator_is_one_message():
    cfg = cfg_for()
    model, _ = models.build(cfg.model, cfg.seed)
    pipe = pipeline.Pipeline(cfg, window=1, grad_accum=1, device=torch.device("cpu"), build=failing_build)
    try:
        with pytest.raises(RolloutError, match=r"^the generator process \(rollout.pipeline=async\): "
                                               r"model.path='/models/x' has no config.json \(test\)$"):
            pipe.start(model, 0)
    finally:
        pipe.close()


@pytest.mark.skipif(torch.cuda.device_count() > 1, reason="this machine has a cuda:1")
def test_a_device_the_machine_lacks_is_refused_before_the_model_is_built():
    from rlrun.runner import lifecycle

    with pytest.raises(ConfigError, match=r"rollout.worker_device=cuda:1, but this machine has (no CUDA device|1 "
                                          r"CUDA device)"):
        lifecycle.check_devices(cfg_for("rollout.worker_device=cuda:1"))
    lifecycle.check_devices(cfg_for("rollout.worker_device=cpu"))
    lifecycle.check_devices(cfg_for("rollout.pipeline=sync", "rollout.worker_device=cuda:1"))  # unused: no check


def children(pid: int) -> list:
    try:
        return psutil.Process(pid).children()
    except psutil.NoSuchProcess:
        return []


def rlrun(tmp_path, *args):
    out = open(tmp_path / "console.txt", "w")  # the log is on stdout, errors on stderr
    return subprocess.Popen([sys.executable, "-m", "rlrun", "experiment=smoke", "progress=false", "eval.every=0",
                             f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", *args], cwd=tmp_path, env=ENV,
                            stdout=out, stderr=subprocess.STDOUT)


@pytest.mark.slow
@pytest.mark.parametrize("then", ["the heartbeat timeout", "SIGTERM"])
def test_a_run_whose_generator_is_stopped_ends_with_one_message(tmp_path, then):
    """kill -STOP of the generator: the run ends FAILED when its heartbeat is rollout.worker_timeout_s old, or
    KILLED when a SIGTERM comes first (the wait is interrupted after checkpoint.stop_grace_s)."""
    timeout = "3" if then == "the heartbeat timeout" else "600"
    p = rlrun(tmp_path, "rollout.pipeline=async", "train.steps=100000", f"rollout.worker_timeout_s={timeout}",
              "checkpoint.stop_grace_s=2", f"checkpoint.dir={tmp_path}/ckpt")
    try:
        start = time.monotonic()  # the generator has started (its heartbeat beats) and steps are taken
        while "generator start:" not in (tmp_path / "console.txt").read_text() and p.poll() is None:
            assert time.monotonic() - start < 240, "the generator did not start"
            time.sleep(0.2)
        [generator] = [c for c in children(p.pid) if "spawn_main" in " ".join(c.cmdline())]
        time.sleep(1)
        generator.suspend()
        if then == "SIGTERM":
            p.send_signal(signal.SIGTERM)
        p.wait(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    text = (tmp_path / "console.txt").read_text()
    _, [r] = runs(tmp_path / "mlflow.db")
    if then == "SIGTERM":
        assert p.returncode == 143 and r.info.status == "KILLED", text[-2000:]
        assert "did not end within checkpoint.stop_grace_s=2 s of the signal" in text
    else:
        assert p.returncode == 1 and r.info.status == "FAILED", text[-2000:]
        assert "rlrun: error: the generator process (pid" in text and "rollout.worker_timeout_s=3" in text
        assert "Traceback" not in text
    assert not psutil.pid_exists(generator.pid) or generator.status() == psutil.STATUS_ZOMBIE


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() > 1, reason="this machine has a cuda:1")
def test_a_worker_device_the_machine_lacks_is_one_message_before_anything_is_built(tmp_path):
    p = rlrun(tmp_path, "rollout.pipeline=async", "rollout.worker_device=cuda:1")
    p.wait(timeout=300)
    text = (tmp_path / "console.txt").read_text()
    assert p.returncode == 2, text[-2000:]
    assert "rollout.worker_device=cuda:1, but this machine has" in text and "Traceback" not in text
    assert not (tmp_path / "mlflow.db").exists() or not runs(tmp_path / "mlflow.db")[1]  # no run left behind
