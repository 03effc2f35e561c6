"""Ctrl-C and SIGTERM, in one place. Three regimes, each a function here:

- `interrupt_on_signals()` from process start: a signal raises KeyboardInterrupt, so whatever runs (config, model
  build, MLflow run creation) unwinds through the code that marks the run KILLED instead of dying RUNNING;
- `deferred()` while the loop steps: the step in flight finishes (and is checkpointed), then the loop stops; a
  second signal interrupts at once;
- `held()` while a run's final status is written: the signal waits until the block is done, then takes effect.

`received()` is the last signal seen, so the exit status can name it (130 Ctrl-C, 143 SIGTERM); `stop_asked()` is
when a deferred stop was asked for, so code that waits on something it cannot interrupt (a reward in its worker
process) can give up after a grace period instead of holding the run past a scheduler's SIGKILL.

`stacks_on_sigusr1()`: `kill -USR1 <pid>` prints every thread's stack to stderr and the run goes on; where a run
that looks stuck is waiting.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import signal
import time

log = logging.getLogger("rlrun")
SIGNALS = (signal.SIGINT, signal.SIGTERM)
_state = {"received": None, "stop_at": None}


def stop_asked() -> float | None:
    """time.monotonic() of the first signal `deferred()` is holding back (None: none, or not in that regime)."""
    return _state["stop_at"]


def received() -> int | None:
    """The last SIGINT/SIGTERM this process received through rlrun's handlers (None: none)."""
    return _state["received"]


def exit_code() -> int:
    """The shell's exit status for the signal that stopped the run: 130 for Ctrl-C, 143 for SIGTERM."""
    return 128 + (_state["received"] or signal.SIGINT)


def install(handler) -> dict:
    """Set `handler` for SIGINT and SIGTERM; returns {signal: the handler it replaced} (for `restore`). Outside the
    main thread signals are handled there, and nothing is installed."""
    previous = {}
    for sig in SIGNALS:
        try:
            previous[sig] = signal.signal(sig, handler)
        except ValueError:  # not the main thread
            pass
    return previous


def restore(previous: dict) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def interrupt_on_signals() -> dict:
    """SIGTERM, like Ctrl-C, raises KeyboardInterrupt. Returns the replaced handlers."""

    def handler(signum, frame):
        _state["received"] = signum
        raise KeyboardInterrupt(signal.Signals(signum).name)

    return install(handler)


@contextlib.contextmanager
def deferred():
    """Ctrl-C / SIGTERM finish the current step instead of killing it mid-way; `flag["stop"]` says one arrived."""
    flag = {"stop": False}

    def handler(signum, frame):
        _state["received"] = signum
        if flag["stop"]:
            raise KeyboardInterrupt
        flag["stop"] = True
        _state["stop_at"] = time.monotonic()
        log.warning("signal %s: stopping after this step (again to stop now)", signal.Signals(signum).name)

    previous = install(handler)
    try:
        yield flag
    finally:
        _state["stop_at"] = None
        restore(previous)


@contextlib.contextmanager
def held():
    """Ctrl-C / SIGTERM wait until the block is done (marking a run's final status), then take effect."""
    waiting = []
    previous = install(lambda signum, frame: waiting.append(signum))
    try:
        yield
    finally:
        restore(previous)
        if waiting:
            signal.raise_signal(waiting[0])


def stacks_on_sigusr1() -> None:
    """`kill -USR1 <pid>`: every thread's Python stack on stderr, the process unharmed (faulthandler's C handler
    runs even while the interpreter is blocked in a lock or a system call)."""
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
