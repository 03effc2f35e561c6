"""`kill -USR1 <pid>` prints every thread's stack and the process goes on, even while other threads start, end and
change their stacks under the dump (CI saw faulthandler's C-level handler crash a run with SIGSEGV there)."""

import signal
import subprocess
import sys
import textwrap

import pytest

CHURN = textwrap.dedent("""
    import os, subprocess, sys, threading
    sys.setrecursionlimit(5000)
    from rlrun import signals
    signals.stacks_on_sigusr1()

    def deep(depth=0):  # pushes and pops frames across the thread's data-stack chunks
        return deep(depth + 1) if depth < 300 else depth

    stop = []
    def churn():  # threads that start, recurse and end while the dump walks the thread list
        while not stop:
            t = threading.Thread(target=deep)
            t.start()
            t.join()
            deep()

    workers = [threading.Thread(target=churn) for _ in range(3)]
    for w in workers:
        w.start()
    # Signals from another process, so they land while this thread waits without the GIL and the others run.
    subprocess.run(["sh", "-c", "for i in $(seq 300); do kill -USR1 %d; sleep 0.002; done" % os.getpid()])
    stop.append(True)
    for w in workers:
        w.join()
    print("survived")
""")


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="SIGUSR1 is POSIX-only")
def test_sigusr1_dumps_while_threads_churn_without_crashing():
    out = subprocess.run([sys.executable, "-c", CHURN], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"rc {out.returncode}: {out.stderr[-2000:]}"
    assert out.stdout.strip() == "survived"
    assert out.stderr.count("Current thread") >= 1 and "in churn" in out.stderr  # the other threads' stacks too


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="SIGUSR1 is POSIX-only")
def test_sigusr1_handler_is_python_level_not_faulthandlers_c_handler():
    """The dump must run with the GIL held: a Python handler, and faulthandler not registered for the signal."""
    import faulthandler

    from rlrun import signals

    previous = signal.getsignal(signal.SIGUSR1)
    try:
        signals.stacks_on_sigusr1()
        assert callable(signal.getsignal(signal.SIGUSR1))
        assert faulthandler.unregister(signal.SIGUSR1) is False  # False: faulthandler held no handler for it
    finally:
        signal.signal(signal.SIGUSR1, previous)
