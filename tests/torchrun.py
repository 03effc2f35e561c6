"""Launch rlrun (or a script) on N CPU ranks with torchrun and gloo, as a user would."""

import os
import subprocess
import sys
from pathlib import Path

from conftest import TEST_PATH
from helpers import free_port

ROOT = Path(__file__).resolve().parent.parent


def torchrun(nproc: int, args: list[str], cwd, timeout: int = 600, wait: bool = True):
    """`torchrun --nproc_per_node N ARGS` (ARGS: `-m rlrun ...` or a script): the finished process, or with
    wait=False the running one, in a session of its own (os.killpg(p.pid, ...) reaches every rank)."""
    path = f"{TEST_PATH}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path, MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING="false",
               TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
           *args]
    if not wait:
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def rlrun(nproc: int, tmp_path, *overrides: str, timeout: int = 600, wait: bool = True):
    """`torchrun -m rlrun` with tracking into tmp_path/mlflow.db and Hydra's output under tmp_path."""
    return torchrun(nproc, ["-m", "rlrun", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", "progress=false",
                            f"hydra.run.dir={tmp_path}/outputs", *overrides], cwd=tmp_path, timeout=timeout, wait=wait)
