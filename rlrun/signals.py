"""Ctrl-C, SIGTERM and SIGHUP (a closed terminal or ssh session, handled like SIGTERM), in one place; SIGUSR2
(SLURM's `--signal=USR2@60` warning before pre-emption) and SIGXCPU (a soft CPU-time limit, `ulimit -t`) too: by
default each kills the process at once, which would leave the run RUNNING, so they are handled like SIGTERM. Three
regimes, each a function here:

- `interrupt_on_signals()` from process start: a signal raises KeyboardInterrupt, so whatever runs (config, model
  build, MLflow run creation) unwinds through the code that marks the run KILLED instead of dying RUNNING;
- `deferred()` while the loop steps: the step in flight finishes (and is checkpointed), then the loop stops; a
  second signal interrupts at once, and so does the end of the grace period (`checkpoint.stop_grace_s`, set by
  `set_grace`): a step that does not end within it (a hung generator, a long step) is interrupted, so a
  scheduler's SIGTERM-then-SIGKILL finds the run already ended KILLED with its earlier checkpoints;
- `held()` while a run's final status is written: the signal waits until the block is done, then takes effect.

`received()` is the last signal seen, so the exit status can name it (130 Ctrl-C, 143 SIGTERM, 129 SIGHUP, 140
SIGUSR2, 152 SIGXCPU: 128 + the signal's number, as a shell reports a process the signal killed);
`stop_asked()` is when a deferred stop was asked for, so code that waits on something it cannot interrupt (a
reward in its worker process) can give up after a grace period instead of holding the run past a scheduler's
SIGKILL.

`stacks_on_sigusr1()`: `kill -USR1 <pid>` prints every thread's stack to stderr and the run goes on; where a run
that looks stuck is waiting.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import signal
import time
from typing import Any

log = logging.getLogger("rlrun")
# the signals that stop a run; the last two would otherwise kill it at once and leave it RUNNING
SIGNALS = (signal.SIGINT, signal.SIGTERM) + tuple(getattr(signal, name) for name in ("SIGHUP", "SIGUSR2", "SIGXCPU")
                                                  if hasattr(signal, name))
GRACE_S = 10.0  # checkpoint.stop_grace_s's default: after a signal, how long the step in flight may still take
_state: dict[str, Any] = {"received": None, "stop_at": None, "grace_s": GRACE_S}  # signal, monotonic time, seconds


def set_grace(seconds: float) -> None:
    """How long `deferred()` lets the step in flight finish after a signal (checkpoint.stop_grace_s)."""
    _state["grace_s"] = float(seconds)


def stop_asked() -> float | None:
    """time.monotonic() of the first signal `deferred()` is holding back (None: none, or not in that regime)."""
    return _state["stop_at"]


def received() -> int | None:
    """The last of SIGNALS this process received through rlrun's handlers (None: none)."""
    return _state["received"]


def exit_code() -> int:
    """The shell's exit status for the signal that stopped the run: 130 for Ctrl-C, 143 SIGTERM, 129 SIGHUP, 140
    SIGUSR2, 152 SIGXCPU."""
    return 128 + (_state["received"] or signal.SIGINT)


def install(handler) -> dict:
    """Set `handler` for each of SIGNALS; returns {signal: the handler it replaced} (for `restore`).
    Outside the main thread signals are handled there, and nothing is installed."""
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
    """Each of SIGNALS, like Ctrl-C, raises KeyboardInterrupt. Returns the replaced handlers."""

    def handler(signum, frame):
        _state["received"] = signum
        raise KeyboardInterrupt(signal.Signals(signum).name)

    return install(handler)


@contextlib.contextmanager
def deferred():
    """Each of SIGNALS finishes the current step instead of killing it mid-way; `flag["stop"]` says one arrived.
    A second signal, or the grace period running out (SIGALRM), raises KeyboardInterrupt at once."""
    flag = {"stop": False}

    def handler(signum, frame):
        _state["received"] = signum
        if flag["stop"]:
            raise KeyboardInterrupt
        flag["stop"] = True
        _state["stop_at"] = time.monotonic()
        grace = _state["grace_s"]
        log.warning("signal %s: stopping after this step, or in %g s at the latest (checkpoint.stop_grace_s); "
                    "again to stop now", signal.Signals(signum).name, grace)
        with contextlib.suppress(ValueError):  # not the main thread: no timer
            signal.signal(signal.SIGALRM, late)
            signal.setitimer(signal.ITIMER_REAL, max(grace, 0.01))

    def late(signum, frame):
        log.warning("the step did not end within checkpoint.stop_grace_s=%g s of the signal: stopping now, without "
                    "it (the checkpoints written before are kept)", _state["grace_s"])
        raise KeyboardInterrupt("the grace period after the signal ran out")

    previous = install(handler)
    alarm = signal.getsignal(signal.SIGALRM)
    try:
        yield flag
    finally:
        _state["stop_at"] = None
        if flag["stop"]:
            signal.setitimer(signal.ITIMER_REAL, 0)
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(signal.SIGALRM, alarm)
        restore(previous)


@contextlib.contextmanager
def held():
    """Each of SIGNALS waits until the block is done (marking a run's final status), then take effect."""
    waiting = []
    previous = install(lambda signum, frame: waiting.append(signum))
    try:
        yield
    finally:
        restore(previous)
        if waiting:
            signal.raise_signal(waiting[0])


def stacks_on_sigusr1() -> None:
    """`kill -USR1 <pid>`: every thread's Python stack on stderr, the process unharmed.

    A Python-level handler, not `faulthandler.register`: faulthandler's C handler walks the other threads' frames
    while they run, and a thread pushing or popping a frame (or ending) under it crashed the run with SIGSEGV
    (CI saw it; tests/unit/test_signals.py reproduces it). Run by the interpreter, the dump holds the GIL, so every
    other thread's stack stands still while it is read. The cost: a main thread inside one long C call (a torch
    op) prints when that call returns; one blocked on a lock, a sleep or a system call prints at once (PEP 475).
    faulthandler writes straight to the file descriptor, so a dump that lands mid-print cannot trip over
    sys.stderr's own lock."""
    if hasattr(signal, "SIGUSR1"):
        signal.signal(signal.SIGUSR1, _dump_stacks)


def _dump_stacks(signum, frame) -> None:
    faulthandler.dump_traceback(all_threads=True)
