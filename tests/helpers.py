"""Reward functions for tests, plugged in through `task.reward=helpers:NAME`, MLflow store readers, and what several
test files share: `free_port`, an `mlflow server`, the tiny model (`tiny_cfg`, `tiny_model`).

The counting rewards keep their counts in `calls`, which conftest's autouse fixture empties before every test
(`reset`): a test that runs one of them in-process never sees the calls of a test that ran before it. Under
torchrun every rank imports this module afresh, so each process counts from zero there too.
"""

import math
import os
from collections import Counter
from pathlib import Path

from rlrun import registry

TINY_YAML = Path(__file__).resolve().parent.parent / "conf" / "model" / "tiny.yaml"


def pairs_bound(domains) -> int:
    """The most rows a greedy all-pairs covering array of these axes' option counts takes: the density bound
    v*w*(1 + ln C(k, 2)) of a greedy that completes the most missing pairs a row (Bryce and Colbourn's deterministic
    density algorithm), v*w the two largest counts (the least any such array needs), k axes. Far below the product
    of all counts: a test that asserts it fails where every combination is listed."""
    counts = sorted(domains, reverse=True)
    return math.floor(counts[0] * counts[1] * (1 + math.log(max(1, math.comb(len(counts), 2)))))


# The options tests parametrize over, from the registry (the one list of option names), the baseline first.
HEADS = list(registry.REGISTRY["head"])
HEAD_ALTERNATIVES = HEADS[1:]  # the heads compared with dense


def tiled_heads() -> list[str]:
    """The heads that hold a tile, never [tokens, vocab] (their TILED fact; imports the heads, so torch)."""
    return [h for h in HEADS if registry.get("head", h).TILED]
LAYOUTS = list(registry.REGISTRY["batching"])[1:]  # the batching options compared with padded

calls: Counter = Counter()  # completions scored so far by each counting reward, in this process


def reset() -> None:
    calls.clear()


def nan_reward(completion: str, answer: str) -> float:
    """Always NaN: Task.score refuses it (TaskError naming this reward, the completion and the value)."""
    return math.nan


def constant_reward(completion: str, answer: str) -> float:
    """The same reward for every completion: every prompt group ties, every advantage is 0."""
    return 0.5


def interrupt_after_two_rollouts(completion: str, answer: str) -> float:
    """Ctrl-C at the trainer (pid $RLRUN_TEST_TRAINER_PID) while the third rollout is scored. A reward runs in the
    run's reward worker, where a KeyboardInterrupt it raises is its own failure, not a Ctrl-C."""
    import signal

    calls["interrupt"] += 1
    if calls["interrupt"] == 17:  # smoke rollouts have 8 completions: during the third rollout
        os.kill(int(os.environ["RLRUN_TEST_TRAINER_PID"]), signal.SIGINT)
    return 0.5


def half_constant_reward(completion: str, answer: str) -> float:
    """Prompts with an even answer: 1.0 whatever the completion (their groups tie: dynamic sampling drops them);
    odd answers: a value that differs between completions (their groups carry a signal)."""
    if int(answer) % 2 == 0:
        return 1.0
    return (sum(map(ord, completion)) % 7) / 7


def fail_on_rank1_second_rollout(completion: str, answer: str) -> float:
    """Rank 1 raises while scoring its second rollout (engine=deepspeed tests)."""
    calls["rank1"] += 1
    if os.environ.get("RANK") == "1" and calls["rank1"] > 4:  # 4 completions per rank per smoke rollout
        raise RuntimeError("reward server unreachable (test)")
    return 0.5


def runs(db: str):
    """All MLflow runs of the store at `db` (a path), newest first."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{db}")
    exps = [e.experiment_id for e in client.search_experiments()]
    return client, client.search_runs(exps, order_by=["attributes.start_time DESC"])


def history(client, run_id: str, key: str) -> list[float]:
    """The values of the metric the code calls `key` (`loss`; MLflow: `train/loss`), in step order."""
    from rlrun.tracking import metric_key

    return [m.value for m in sorted(client.get_metric_history(run_id, metric_key(key)), key=lambda m: m.step)]


def steps(client, run_id: str, key: str) -> list[int]:
    """The steps at which the metric the code calls `key` was logged, in order."""
    from rlrun.tracking import metric_key

    return sorted(m.step for m in client.get_metric_history(run_id, metric_key(key)))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(folder, port: int, env: dict):
    """A real `mlflow server` on 127.0.0.1:`port` with its sqlite store and artifacts in `folder` (reused when it
    is started again there); -> (process, url) once /health answers. Stop it with `stop_server`."""
    import subprocess
    import sys
    import time
    import urllib.request
    from pathlib import Path

    import pytest

    mlflow_bin = str(Path(sys.executable).parent / "mlflow")
    proc = subprocess.Popen([mlflow_bin, "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
                             "--backend-store-uri", f"sqlite:///{folder}/mlflow.db",
                             "--artifacts-destination", str(Path(folder) / "artifacts")],
                            cwd=folder, env=env, stdout=open(Path(folder) / "server.log", "a"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            stop_server(proc)
            pytest.fail(f"mlflow server did not start:\n{(Path(folder) / 'server.log').read_text()[-3000:]}")
        time.sleep(0.5)


def stop_server(proc) -> None:
    """Stop a server from `start_server`: its process group (the server and its workers), nothing else."""
    import signal
    import subprocess

    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def tiny_cfg(**overrides):
    """The `model=tiny` config as shipped (conf/model/tiny.yaml) with `overrides`, as an OmegaConf node."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(TINY_YAML)
    cfg.update(overrides)
    return cfg


def tiny_model(seed: int = 0, **overrides):
    """(model, tokenizer) as rlrun builds `model=tiny` with `overrides` (tokenizer padded on the left)."""
    from rlrun import models

    return models.build(tiny_cfg(**overrides), seed)


def finished(proc, timeout: float) -> tuple[int, str]:
    """(exit code, stderr) of an rlrun process started with stderr=PIPE. If it has not ended within `timeout`
    seconds the test fails with every thread's stack (rlrun prints them on SIGUSR1) instead of a bare timeout."""
    import signal
    import subprocess

    try:
        _, err = proc.communicate(timeout=timeout)
        return proc.returncode, err or ""
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)
        try:
            proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"{' '.join(map(str, proc.args))[-300:]} still running after {timeout:g} s; its "
                             f"stacks:\n{(err or '')[-6000:]}") from None


def sleep_then_save(seconds: float, out_path: str) -> None:
    """A child for render.in_child that takes `seconds` and then saves {"slept": seconds}: a run to cut short."""
    import time

    import torch

    time.sleep(seconds)
    torch.save({"slept": seconds}, out_path)



def axes_of(*args, **kwargs):
    """rlrun.axes.of: the axes a test's step runs with, from option names."""
    from rlrun import axes

    return axes.of(*args, **kwargs)


def rewritten(module, name: str, old: str, new: str):
    """An injector replacing `old` by `new` in the source of `module.name` (a fault inside a function's
    body, where no function can be patched alone): the held-out trial's faults, as its patches wrote them."""
    import inspect
    import textwrap

    def inject(monkeypatch):
        source = textwrap.dedent(inspect.getsource(getattr(module, name)))
        assert old in source, f"{name} no longer holds {old!r}: rewrite the fault"
        space = dict(vars(module))
        exec(compile(source.replace(old, new), inspect.getfile(module), "exec"), space)  # noqa: S102 - a test fault
        monkeypatch.setattr(module, name, space[name])

    inject.__name__ = f"{name}: {new.strip()}"
    return inject
