"""Rewards that misbehave: a bound on each call, a reward that exits or kills its process, SIGTERM while a reward
hangs, a weighted total that overflows, a reward that changes its row or the working directory. The run calls its
rewards in a worker process (rlrun/tasks/worker.py); a library caller of Task.score calls them in-process, and
both give copies and restore the working directory."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import TEST_PATH
from helpers import runs

from rlrun import checkpoint, tasks
from rlrun.tasks import scoring

ROOT = str(Path(__file__).resolve().parents[3])
ENV = {**os.environ, "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "false", "OMP_NUM_THREADS": "1",
       "PYTHONPATH": f"{TEST_PATH}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
ROWS = [{"prompt": "3+4=", "answer": "7", "tags": []}] * 4  # one group: the same row object 4 times


def hangs(completion, answer):
    time.sleep(600)
    return 1.0


def exits(completion, answer):
    sys.exit(0)


def hard_exit(completion, answer):
    os._exit(0)


def interrupts(completion, answer):
    raise KeyboardInterrupt


def huge(completion, answer):
    return 1.7e308


def huge_int(completion, answer):
    return 10**400  # float() of it raises OverflowError


def appends(completion, answer, tags):
    tags.append("seen")
    return float(len(tags))


def moves(completion, answer):
    here = os.getcwd()
    os.chdir("/")
    return float(here == os.environ["HOME_DIR"])


def spawns(completion, answer):
    """Starts a process that ignores SIGTERM and outlives the call (its pid in $CHILDREN)."""
    child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                              "signal.SIG_IGN); time.sleep(600)"])
    with open(os.environ["CHILDREN"], "a") as f:
        f.write(f"{child.pid}\n")
    if os.environ.get("THEN_HANG"):
        time.sleep(600)
    return 1.0


def clock_reads_zero(completion, answer):
    """From its first call on, the worker's clock reads 0, as a time half-written into a record shared without a
    lock can read (CI once saw a 60 s reward timeout fire in a test that took under 40 s)."""
    time.monotonic = lambda: 0.0
    time.sleep(0.3)  # long enough for the trainer to look at the record while a call runs
    return 1.0


def alive(pid: int) -> bool:
    """Running (a zombie waiting for init to reap it is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def gone(pids, seconds=10.0) -> bool:
    deadline = time.monotonic() + seconds  # SIGKILL is immediate; the bound only covers the kernel's reaping
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(alive(p) for p in pids)


def task_of(fn, weight=1.0):
    return tasks.Task("t", ROWS, [], scoring.load_rewards(None, [{"fn": f"test_reward_worker:{fn}", "weight": weight}],
                                                        {"prompt", "answer", "tags"}))


def score_isolated(task, timeout_s=30.0):
    with tasks.isolated(task, timeout_s):
        return task.score(["7"] * 4, ROWS)


WHERE = "on completion 0 of 4 (prompt '3+4=', answer '7', completion '7')"


def test_a_reward_call_is_bounded_and_the_error_names_the_reward_and_the_row():
    with pytest.raises(tasks.TaskError) as e:  # the reward sleeps for minutes: the bound is what ends the call
        score_isolated(task_of("hangs"), timeout_s=1.0)
    assert str(e.value).startswith(f"reward 'hangs' (test_reward_worker:hangs) {WHERE} did not return within 1 s "
                                   "(task.reward_timeout_s=1)"), str(e.value)


def test_a_call_is_timed_by_the_trainers_clock_not_by_a_time_the_worker_wrote():
    totals, _ = score_isolated(task_of("clock_reads_zero"), timeout_s=30.0)
    assert totals == [1.0] * 4  # was: completion 1 "did not return within 30 s" at once


@pytest.mark.parametrize("fn,needle", [
    ("exits", "raised SystemExit(0) at"),
    ("interrupts", "raised KeyboardInterrupt at"),
    ("hard_exit", "ended the reward worker process (exit code 0)"),
])
def test_a_reward_that_exits_is_a_task_error_naming_it(fn, needle):
    with pytest.raises(tasks.TaskError) as e:
        score_isolated(task_of(fn))
    msg = str(e.value)
    assert msg.startswith(f"reward '{fn}' (test_reward_worker:{fn}) {WHERE}") and needle in msg, msg


def test_sys_exit_in_process_is_a_task_error_too():
    with pytest.raises(tasks.TaskError, match=r"reward 'exits' .* raised SystemExit\(0\)"):
        task_of("exits").score(["7"] * 4, ROWS)


@pytest.mark.parametrize("isolated", [False, True], ids=["in-process", "worker"])
def test_a_total_that_overflows_names_the_reward_and_the_row(isolated):
    task = task_of("huge", weight=10.0)
    with pytest.raises(tasks.TaskError) as e:
        score_isolated(task) if isolated else task.score(["7"] * 4, ROWS)
    assert str(e.value).startswith(f"reward 'huge' (test_reward_worker:huge) {WHERE} returned 1.7e+308 with weight "
                                   "10.0: the weighted total is inf"), str(e.value)


@pytest.mark.parametrize("isolated", [False, True], ids=["in-process", "worker"])
def test_an_int_too_large_for_a_float_names_the_reward_and_the_row(isolated):
    """Was an OverflowError that ended the reward worker: blamed on SIGKILL or the OOM killer."""
    with pytest.raises(tasks.TaskError) as e:
        score_isolated(task_of("huge_int")) if isolated else task_of("huge_int").score(["7"] * 4, ROWS)
    assert str(e.value).startswith(f"reward 'huge_int' (test_reward_worker:huge_int) {WHERE} returned an int of "
                                   "1329 bits, too large for a float"), str(e.value)


@pytest.mark.parametrize("isolated", [False, True], ids=["in-process", "worker"])
def test_a_reward_gets_copies_of_mutable_columns(isolated):
    task = task_of("appends")
    totals, _ = score_isolated(task) if isolated else task.score(["7"] * 4, ROWS)
    assert totals == [1.0, 1.0, 1.0, 1.0]  # identical completions, identical rewards (were 1, 2, 3, 4)
    assert ROWS[0]["tags"] == []  # the task's rows are untouched


@pytest.mark.parametrize("isolated", [False, True], ids=["in-process", "worker"])
def test_the_working_directory_is_restored_after_each_call(tmp_path, monkeypatch, isolated):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME_DIR", str(tmp_path))
    task = task_of("moves")
    totals, _ = score_isolated(task) if isolated else task.score(["7"] * 4, ROWS)
    assert totals == [1.0] * 4  # every call started in the run's directory
    assert os.getcwd() == str(tmp_path)


def test_the_worker_scores_like_the_process_bit_for_bit():
    t = tasks.Task("t", ROWS, [], scoring.load_rewards("rlrun.tasks:partial_credit", None, {"prompt", "answer"}))
    completions = ["7", "8", "17", "x"]
    with tasks.isolated(t, 30):
        got = t.score(completions, ROWS)
    assert got == t.score(completions, ROWS) and got[0][:2] == [1.0, 0.5]


def test_closing_the_worker_closes_each_descriptor_once(monkeypatch):
    """The end of a run closes the worker while the tracking thread sends; a descriptor number closed twice would
    by then be that thread's sqlite store (seen: "disk I/O error", the run left RUNNING). Here the number freed by
    the first close is taken again at once, as another thread's open() would; it must survive close()."""
    from rlrun.tasks import worker

    task = task_of("appends")
    with tasks.isolated(task, 30):
        task.score(["7"] * 4, ROWS)
        w, kill, taken = task.worker, worker._kill, []

        def kill_then_reuse(proc, wait_s=0.0):
            if not taken:  # the number close() just freed, reused
                spare = os.open(os.devnull, os.O_RDONLY)
                taken.append(os.dup2(spare, w.fd_out))
                os.close(spare)
            kill(proc, wait_s)

        monkeypatch.setattr(worker, "_kill", kill_then_reuse)
    assert len(taken) == 1
    try:
        os.fstat(taken[0])  # EBADF if close() closed it a second time
    finally:
        os.close(taken[0])


def test_a_reward_worker_killed_between_batches_is_a_task_error_naming_the_rewards():
    """The OOM killer's way (SIGKILL while the trainer trains): the next batch is one message, not BrokenPipeError."""
    task = task_of("appends")
    with tasks.isolated(task, 30):
        task.score(["7"] * 4, ROWS)
        os.kill(task.worker.proc.pid, signal.SIGKILL)
        os.waitid(os.P_PID, task.worker.proc.pid, os.WEXITED | os.WNOWAIT)  # dead (not reaped) before the batch
        with pytest.raises(tasks.TaskError) as e:
            task.score(["7"] * 4, ROWS)
    assert str(e.value).startswith("the reward worker process, which runs the rewards appends "
                                   "(test_reward_worker:appends), ended between two batches (killed by SIGKILL); "
                                   "SIGKILL is how the kernel's OOM killer ends a process"), str(e.value)


@pytest.mark.parametrize("how", ["at the end", "on a timeout"])
def test_what_a_reward_starts_is_killed_with_the_worker(tmp_path, monkeypatch, how):
    """The worker and whatever a reward starts are one process group, killed together (a child that ignores
    SIGTERM included)."""
    monkeypatch.setenv("CHILDREN", str(tmp_path / "children"))
    if how == "on a timeout":
        monkeypatch.setenv("THEN_HANG", "1")
    task = task_of("spawns")
    with tasks.isolated(task, 3.0):
        try:
            task.score(["7"] * 4, ROWS)
        except tasks.TaskError as e:
            assert how == "on a timeout" and "did not return within 3 s" in str(e)
        pids = [int(x) for x in (tmp_path / "children").read_text().split()]
        assert pids and (how == "on a timeout" or all(alive(p) for p in pids))
    assert gone(pids), [p for p in pids if alive(p)]


def test_reward_timeout_must_be_positive(cfg_factory):
    from rlrun.config import ConfigError, validate

    with pytest.raises(ConfigError, match="task.reward_timeout_s"):
        validate(cfg_factory("task.reward_timeout_s=0"))


# --- through the entry point --------------------------------------------------------------------------------------

REWARDS = """
import os, pathlib, time
def hang_after_a_checkpoint(completion, answer):
    if list(pathlib.Path("ckpt").glob("step_*.pt")):
        pathlib.Path("reached").touch()
        time.sleep(600)
    return 0.5
def quits(completion, answer):
    os._exit(0)
def oom_killed(completion, answer):  # the worker is SIGKILLed half a second after a call (the trainer trains)
    import signal, threading
    if not threading.active_count() > 1:
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGKILL)).start()
    return 0.5
"""


def rlrun(tmp_path, *args):
    (tmp_path / "rewards.py").write_text(REWARDS)
    with open(tmp_path / "console.txt", "w") as console:  # the log is on stdout, errors on stderr
        return subprocess.Popen([sys.executable, "-m", "rlrun", "experiment=smoke", "progress=false", "eval.every=0",
                                 f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", *args], cwd=tmp_path, env=ENV,
                                stdout=console, stderr=subprocess.STDOUT)


@pytest.mark.slow
def test_sigterm_while_a_reward_hangs_stops_the_run_within_seconds_killed(tmp_path):
    p = rlrun(tmp_path, "task.reward=rewards.py:hang_after_a_checkpoint", "checkpoint.dir=ckpt", "checkpoint.every=1",
              "train.steps=50")
    try:
        deadline = time.time() + 240
        while not (tmp_path / "reached").exists() and p.poll() is None and time.time() < deadline:
            time.sleep(0.1)
        assert (tmp_path / "reached").exists(), (tmp_path / "console.txt").read_text()[-2000:]
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=300)  # a watchdog only: the reward would sleep 600 s; what ended it is said below
    finally:
        if p.poll() is None:
            p.kill()
    err = (tmp_path / "console.txt").read_text()
    assert p.returncode == 143, err[-2000:]
    assert "reward 'hang_after_a_checkpoint'" in err and "was still running 3 s after the signal" in err
    _, [r] = runs(tmp_path / "mlflow.db")
    assert r.info.status == "KILLED"
    state, _ = checkpoint.load_latest(str(tmp_path / "ckpt"))  # the checkpoints written before are usable
    assert state["step"] >= 1


@pytest.mark.slow
def test_os_exit_in_a_reward_fails_the_run_naming_the_reward(tmp_path):
    p = rlrun(tmp_path, "task.reward=rewards.py:quits")
    p.wait(timeout=300)
    err = (tmp_path / "console.txt").read_text()
    assert p.returncode == 2, err[-2000:]  # was 0, with the run left RUNNING
    assert "error: reward 'quits' (rewards.py:quits) on completion 0 of" in err
    assert "ended the reward worker process (exit code 0)" in err and "Traceback" not in err
    _, [r] = runs(tmp_path / "mlflow.db")
    assert r.info.status == "FAILED" and "'quits'" in r.data.tags["error"]


@pytest.mark.slow  # a smoke run refused while its data loads (~25 s here)
def test_a_reward_module_that_exits_at_import_fails_the_run_naming_it(tmp_path):
    """`os._exit(7)` at a reward module's top level: the run ended at once, exit 7, no message, left RUNNING."""
    (tmp_path / "exits_at_import.py").write_text("import os\nos._exit(7)\n\ndef r(completion, answer):\n"
                                                 "    return 1.0\n")
    p = rlrun(tmp_path, "task.reward=exits_at_import.py:r")
    p.wait(timeout=300)
    err = (tmp_path / "console.txt").read_text()
    assert p.returncode == 2, err[-2000:]
    assert "task.reward='exits_at_import.py:r': importing 'exits_at_import.py' called os._exit(7)" in err, err[-2000:]
    _, found = runs(tmp_path / "mlflow.db")
    assert all(r.info.status == "FAILED" for r in found)  # none left RUNNING (none at all if refused before it)


@pytest.mark.slow  # `rlrun check` in a subprocess, refused while it loads the data (~10 s)
def test_rlrun_check_says_which_reward_module_exits_at_import(tmp_path):
    """`rlrun check` with such a module: exit 7 and no output at all."""
    (tmp_path / "exits_at_import.py").write_text("import os\nos._exit(7)\n\ndef r(completion, answer):\n"
                                                 "    return 1.0\n")
    r = subprocess.run([sys.executable, "-m", "rlrun", "check", "experiment=smoke", "task.reward=exits_at_import.py:r"],
                       cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert "importing 'exits_at_import.py' called os._exit(7)" in r.stderr, r.stderr[-2000:]


def test_sys_exit_in_a_reward_module_at_import_is_a_task_error_naming_it(tmp_path, monkeypatch):
    (tmp_path / "quits_at_import.py").write_text("import sys\nsys.exit(3)\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(tasks.TaskError, match=r"importing 'quits_at_import.py' called sys.exit\(3\)"):
        scoring.import_reward("quits_at_import.py:r")


@pytest.mark.slow
@pytest.mark.parametrize("pipeline", ["sync", "async"])
def test_a_reward_worker_killed_from_outside_fails_the_run_naming_the_reward(tmp_path, pipeline):
    p = rlrun(tmp_path, "task.reward=rewards.py:oom_killed", "train.steps=50", f"rollout.pipeline={pipeline}")
    p.wait(timeout=300)
    err = (tmp_path / "console.txt").read_text()
    assert p.returncode == 2, err[-2000:]
    assert "oom_killed (rewards.py:oom_killed)" in err or "reward 'oom_killed' (rewards.py:oom_killed)" in err
    assert "killed by SIGKILL" in err and "OOM killer" in err
    assert "Traceback" not in err and "BrokenPipeError" not in err
    _, [r] = runs(tmp_path / "mlflow.db")
    assert r.info.status == "FAILED" and "oom_killed" in r.data.tags["error"]


TRAINER = """
import os, sys, time
sys.path[:0] = {tests!r}.split(os.pathsep)  # conftest's TEST_PATH: test_reward_worker's folder
from test_reward_worker import ROWS, task_of
from rlrun import tasks
task = task_of("spawns")
with tasks.isolated(task, 30):
    task.score(["7"] * 4, ROWS)
    print(task.worker.proc.pid, flush=True)
    time.sleep(600)
"""


@pytest.mark.slow  # a trainer process of its own, killed
def test_a_killed_trainer_takes_the_reward_worker_and_what_it_started_with_it(tmp_path):
    env = {**ENV, "CHILDREN": str(tmp_path / "children")}
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER.format(tests=TEST_PATH)], env=env,
                               stdout=subprocess.PIPE, text=True)
    try:
        worker = int(trainer.stdout.readline())
        pids = [int(x) for x in (tmp_path / "children").read_text().split()]
        assert all(alive(p) for p in [worker, *pids])
    finally:
        trainer.kill()
        trainer.wait()
    assert gone([worker, *pids]), [p for p in [worker, *pids] if alive(p)]
