"""What the cluster's daemons share: a failure that names its step, commands and waits that say which step they
belong to, free ports, the cluster's state file, and the processes that belong to a cluster folder.

Every daemon the script starts carries RLRUN_CLUSTER_DIR=<its folder> in its environment, which the processes it
starts inherit (slurmstepd from slurmd, gunicorn's workers from `mlflow server`, postgres's backends): `stop` finds
what is left of a cluster by that mark and by descent, and ends it, so nothing of it outlives `stop` while another
cluster on the same machine (another folder) is left alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shlex
import signal
import socket
import stat
import subprocess
import time
from collections.abc import Callable

MARK = "RLRUN_CLUSTER_DIR"
STATE = "cluster.json"


class ClusterError(RuntimeError):
    """A step of starting or stopping the cluster failed; the message names the step, the cause, the fix and the
    last lines of the step's log."""


def tail(path: str | None, lines: int = 12) -> str:
    if not path or not os.path.exists(path):
        return ""
    with open(path, errors="replace") as f:
        text = f.read()[-20000:].splitlines()[-lines:]
    return f"\n  last lines of {path}:\n" + "\n".join(f"    {line}" for line in text) if text else ""


def fail(step: str, why: str, log: str | None = None):
    raise ClusterError(f"{step}: {why}{tail(log)}")


def as_user(user: str | None) -> dict:
    """Popen's arguments that run a command as `user` (root only: anyone else runs everything as themselves)."""
    if not user or os.geteuid() != 0:
        return {}
    entry = pwd.getpwnam(user)
    return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}


def owner(path: str, user: str | None, mode: int) -> None:
    """`path` (a folder, created) owned by `user` where we are root, with `mode`."""
    os.makedirs(path, exist_ok=True)
    if user and os.geteuid() == 0:
        entry = pwd.getpwnam(user)
        os.chown(path, entry.pw_uid, entry.pw_gid)
    os.chmod(path, mode)


def environment(folder: str, **extra: str) -> dict[str, str]:
    return {**os.environ, MARK: folder, **extra}


def run(step: str, cmd: list[str], user: str | None = None, env: dict | None = None, log: str | None = None,
        timeout: float = 120, check: bool = True, stdin: str | None = None) -> subprocess.CompletedProcess:
    """Run `cmd` (as `user`, `stdin` its input); a non-zero exit fails `step` with its output and the log's last
    lines."""
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, input=stdin,
                              **as_user(user))
    except FileNotFoundError:
        fail(step, f"{cmd[0]} is not installed (Debian: apt-get install -y slurm-wlm munge postgresql)")
    except subprocess.TimeoutExpired:
        fail(step, f"`{shlex.join(cmd)}` did not end within {timeout:g} s", log)
    if check and done.returncode != 0:
        said = (done.stderr.strip() or done.stdout.strip())[-1500:]
        fail(step, f"`{shlex.join(cmd)}` exited {done.returncode}: {said}", log)
    return done


def spawn(cmd: list[str], log: str, env: dict, user: str | None = None) -> subprocess.Popen:
    """Start a daemon that stays in the foreground (its own session, output appended to `log`)."""
    with open(log, "a") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, **as_user(user))


def wait_for(step: str, ready: Callable[[], bool], timeout: float, log: str | None = None,
             alive: Callable[[], bool] | None = None) -> None:
    """Poll `ready` until it holds; fail `step` when `alive` says the daemon died, or after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not ready():
        if alive is not None and not alive():
            fail(step, "the daemon exited while starting", log)
        if time.monotonic() > deadline:
            fail(step, f"not ready after {timeout:g} s", log)
        time.sleep(0.2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def read_pid(path: str) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        with open(path) as f:
            return int(f.readline().strip())
    return None


def state(pid: int) -> str:
    """The process's state letter (R, S, T: stopped, Z: ended, not reaped), "" when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def alive(pid: int | None) -> bool:
    return pid is not None and pid > 0 and state(pid) not in ("Z", "")


def stop_pid(pid: int | None, group: bool = False, wait_s: float = 20) -> bool:
    """SIGTERM to `pid` (its process group with `group`), SIGKILL after `wait_s`; True if it was running."""
    if not alive(pid):
        return False
    assert pid is not None
    kill = os.killpg if group else os.kill
    with contextlib.suppress(ProcessLookupError, PermissionError):
        kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if alive(pid):
            kill(pid, signal.SIGKILL)
    return True


def parents() -> dict[int, int]:
    """{pid: parent pid} of every process."""
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                with open(f"/proc/{name}/stat") as f:
                    out[int(name)] = int(f.read().rsplit(")", 1)[1].split()[1])
    return out


def command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def ours(pid: int, folder: str) -> bool:
    """`pid` belongs to the cluster in `folder`: its environment carries the mark, or it is a slurmstepd working in
    the cluster's folder (slurmstepd overwrites its environment, and its parent is init)."""
    with contextlib.suppress(OSError):
        with open(f"/proc/{pid}/environ", "rb") as f:
            if f"{MARK}={folder}".encode() in f.read().split(b"\0"):
                return True
        if command(pid) == "slurmstepd":
            return os.readlink(f"/proc/{pid}/cwd").startswith(folder + os.sep)
    return False


def descendants(roots: set[int], tree: dict[int, int]) -> set[int]:
    found, grew = set(roots), True
    while grew:
        more = {pid for pid, parent in tree.items() if parent in found} - found
        grew, found = bool(more), found | more
    return found


def marked(folder: str) -> list[int]:
    """The live processes of the cluster in `folder` (`ours`) and their descendants (a job's processes below its
    slurmstepd)."""
    tree = parents()
    found = descendants({pid for pid in tree if ours(pid, folder)}, tree)
    return sorted(p for p in found if p != os.getpid() and alive(p))


def describe(pid: int) -> str:
    with contextlib.suppress(OSError):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            words = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        return f"{pid} ({words[:120]})"
    return str(pid)


def reachable(folder: str, user: str) -> None:
    """`user` (a daemon's account) can reach `folder`: every folder above it is searchable by others or theirs."""
    if os.geteuid() != 0:
        return
    uid = pwd.getpwnam(user).pw_uid
    path = os.path.dirname(os.path.abspath(folder))
    while path != os.path.dirname(path):
        st = os.stat(path)
        if st.st_uid != uid and not st.st_mode & stat.S_IXOTH:
            fail("the cluster folder", f"{folder} is below {path} (mode {stat.S_IMODE(st.st_mode):o}), which the "
                 f"{user} user cannot enter; choose a folder under /tmp or /srv (e.g. "
                 "python -m rlrun.cluster start /tmp/rlrun-cluster), or chmod o+x that folder")
        path = os.path.dirname(path)


def load(folder: str) -> dict:
    path = os.path.join(folder, STATE)
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def save(folder: str, state: dict) -> None:
    path = os.path.join(folder, STATE)
    with open(path + ".tmp", "w") as f:
        json.dump(state, f, indent=1)
    os.replace(path + ".tmp", path)
