"""Processes rlrun starts (the reward worker, the generator) run in a process group of their own, so that they and
everything they start (a reward's subprocess, vLLM's engine process) end together: `kill_group` sends SIGKILL to
the group while its leader is still unreaped (its pid, the group's id, cannot then belong to another process), and
`die_with_parent` makes a child kill its own group when the process that started it dies (kill -9 included).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time


def exited(pid: int) -> bool:
    """The child `pid` has exited; it is not reaped (so its pid, its process group's id, stays its own)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped already, or not our child
        return True


def kill_group(pid: int, wait_s: float = 0.0) -> None:
    """After up to `wait_s` for the child `pid` (a group leader) to exit by itself, SIGKILL to its whole process
    group (a stopped process and one that ignores SIGTERM included). The caller reaps it afterwards."""
    deadline = time.monotonic() + wait_s
    while not exited(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    if not child(pid):  # reaped already: its pid may now be another process's, so no group is killed
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)  # stopped before it made its group (its startup): not in it


def child(pid: int) -> bool:
    """`pid` is still this process's child, running or exited but not reaped."""
    try:
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        return True
    except ChildProcessError:
        return False


def end_group(*_) -> None:
    """Kill this process's own group (itself and everything it started)."""
    os.killpg(0, signal.SIGKILL)


def die_with_parent(parent: int) -> None:
    """In a child that leads its own process group: when `parent` dies (kill -9 included), the kernel sends SIGUSR2
    (Linux: PR_SET_PDEATHSIG) and the child kills its group, itself and whatever it started."""
    signal.signal(signal.SIGUSR2, end_group)
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGUSR2)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # elsewhere: the child still notices its parent is gone where it polls for it
    if os.getppid() != parent:
        end_group()
