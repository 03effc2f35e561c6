"""Faults end with one message naming the cause and the fix, the run FAILED or KILLED, nothing left in /dev/shm,
exit 2 for a user's cause (1 for a fault outside the config): a generator stopped, killed or silent, a small
/dev/shm, a device the machine lacks, a non-finite loss, a model folder with code in it."""

import contextlib
import glob
import math
import os
import signal
import subprocess
import sys
import time
from collections import namedtuple
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch
from conftest import TEST_PATH, make_cfg
from helpers import history, runs, tiny_model

from rlrun import models, pipeline
from rlrun.config import ConfigError, validate
from rlrun.errors import RolloutError

ROOT = str(Path(__file__).resolve().parents[2])
ENV = {**os.environ, "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "false", "OMP_NUM_THREADS": "1",
       "PYTHONPATH": f"{TEST_PATH}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
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
    from rlrun import faults

    with pytest.raises(ConfigError, match=r"rollout.worker_device=cuda:1, but this machine has (no CUDA device|1 "
                                          r"CUDA device)"):
        faults.check_devices(cfg_for("rollout.worker_device=cuda:1"))
    faults.check_devices(cfg_for("rollout.worker_device=cpu"))
    faults.check_devices(cfg_for("rollout.pipeline=sync", "rollout.worker_device=cuda:1"))  # unused: no check


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
            time.sleep(3)  # the rollouts it had made are trained on: the trainer now waits on it
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


# -- training that diverges; model folders with code in them ---------------------------------------------------------
@pytest.mark.slow
def test_a_non_finite_loss_under_bf16_is_one_message_exit_2_and_failed(tmp_path):
    p = rlrun(tmp_path, "train.precision=bf16", "train.lr=1e30", "train.steps=6")
    p.wait(timeout=300)
    text = (tmp_path / "console.txt").read_text()
    assert p.returncode == 2, text[-2000:]
    assert "rlrun: error: training diverged: loss is nan at step" in text and "train.precision=fp32" in text
    assert "Traceback" not in text
    _, [r] = runs(tmp_path / "mlflow.db")
    assert r.info.status == "FAILED"


@pytest.mark.slow  # a 20-step smoke run that stops at step 1: ~15 s
def test_a_run_whose_weights_break_while_the_loss_stays_finite_is_diverged_not_finished(tmp_path):
    """bf16 with train.lr=1e8: the loss stays finite while the gradient overflows and the weights turn NaN; then
    every completion gets the same reward, train.skip_zero_advantage (on) drops every row and the loss is 0. The
    run ended FINISHED with every exported weight NaN; now it stops where the gradient norm breaks."""
    p = rlrun(tmp_path, "train.precision=bf16", "train.lr=1e8", "train.steps=20", f"export.dir={tmp_path}/model")
    p.wait(timeout=300)
    text = (tmp_path / "console.txt").read_text()
    assert p.returncode == 2, text[-2000:]
    assert "rlrun: error: training diverged: the gradient norm is nan at step 1" in text, text[-2000:]
    assert "train.precision=fp32" in text and "Traceback" not in text
    client, [r] = runs(tmp_path / "mlflow.db")
    assert r.info.status == "FAILED"
    norms = history(client, r.info.run_id, "grad_norm")
    assert len(norms) == 2 and math.isnan(norms[-1])  # logged as it was, not as 0
    assert not (tmp_path / "model").exists()  # nothing exported


def test_a_broken_weight_is_named():
    """The weights check itself: a NaN or inf anywhere in a parameter names it; finite weights pass."""
    from rlrun.runner.frame import broken_weight

    model, _ = tiny_model()
    assert broken_weight(model) is None
    name, p = list(model.named_parameters())[3]
    with torch.no_grad():
        p.view(-1)[5] = float("inf")
    assert broken_weight(model) == name


def test_a_policy_whose_forward_is_not_finite_is_not_exported():
    """Finite weights whose forward overflows (bf16 weights of 1e8): the final check stops the run before the
    export, as diverged."""
    from rlrun.runner.frame import Frame, NonFiniteLossError

    model, _ = tiny_model()
    frame = Frame.__new__(Frame)  # only what check_forward reads
    frame.engine = SimpleNamespace(model=model, device=torch.device("cpu"))
    frame.check_forward()  # a healthy model passes
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1e10)  # finite, but the forward overflows into NaN
    with pytest.raises(NonFiniteLossError, match="the policy's forward gives NaN or inf at the end of training"):
        frame.check_forward()


class Payload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def model_folder(tmp_path):
    from helpers import tiny_model

    model, tok = tiny_model()
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return model, folder


def test_a_weights_file_that_pickles_code_is_refused_naming_it(tmp_path):
    model, folder = model_folder(tmp_path)
    (folder / "model.safetensors").unlink()
    torch.save({**model.state_dict(), "evil": Payload(tmp_path / "PWNED")}, folder / "pytorch_model.bin")
    with pytest.raises(models.ModelError, match=r"a weights file would run code when loaded \(pytorch_model.bin "
                                                r"asks for posix.system\); it was refused without running it"):
        models.load_hf(str(folder), "float32")
    assert not (tmp_path / "PWNED").exists()


CUSTOM = "import pathlib\npathlib.Path({marker!r}).write_text('ran')\n"


def with_custom_code(tmp_path):
    import json

    _, folder = model_folder(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "modeling_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.Evil"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "modeling_evil.py").write_text(CUSTOM.format(marker=str(tmp_path / "PWNED")))
    return folder


def test_a_model_folder_with_custom_code_is_refused_and_none_of_it_runs(tmp_path):
    folder = with_custom_code(tmp_path)
    with pytest.raises(models.ModelError, match=r"names code of its own \(auto_map: modeling_evil.Evil, "
                                                r"modeling_evil.EvilConfig\); rlrun never runs code from a model "
                                                r"folder \(it loads with trust_remote_code=False\)"):
        models.load_hf(str(folder), "float32")
    assert not (tmp_path / "PWNED").exists()


@pytest.mark.slow
def test_custom_code_is_not_run_even_when_a_terminal_answers_yes(tmp_path):
    """transformers asks `Do you wish to run the custom code? [y/N]` on a terminal: rlrun never lets it ask."""
    import pty

    folder = with_custom_code(tmp_path)
    master, slave = pty.openpty()
    os.write(master, b"y\ny\ny\n")  # whatever is asked, a terminal that says yes
    try:
        out = subprocess.run([sys.executable, "-m", "rlrun", "experiment=smoke", "model=hf", f"model.path={folder}",
                              "tracking=none", "progress=false"], cwd=tmp_path, env=ENV, stdin=slave,
                             capture_output=True, text=True, timeout=300)
    finally:
        os.close(slave)
        os.close(master)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "rlrun never runs code from a model folder" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "PWNED").exists()
