"""Checkpoints: atomic, checksummed, newest valid one wins.

A checkpoint is one file `step_NNNNNNNN.pt`: a 64-character sha256 of the payload, then the payload (torch.save
of the training state). It is written to a temporary name, flushed to disk and renamed, so a kill during a write
leaves either the previous checkpoint or the new one, never a partial one under the real name. On load a file
whose checksum or unpickling fails is skipped with a warning and the previous one is used.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import io
import logging
import os
import signal

import torch

log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    pass


def save(folder: str, step: int, state: dict, keep: int) -> str:
    os.makedirs(folder, exist_ok=True)
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getvalue()
    path = os.path.join(folder, f"step_{step:08d}.pt")
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(hashlib.sha256(payload).hexdigest().encode())
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    for old in sorted(glob.glob(os.path.join(folder, "step_*.pt")))[:-keep]:
        os.remove(old)
    return path


def read(path: str) -> dict:
    with open(path, "rb") as f:
        data = f.read()
    digest, payload = data[:64].decode(errors="replace"), data[64:]
    if hashlib.sha256(payload).hexdigest() != digest:
        raise CheckpointError(f"{path}: checksum mismatch (truncated or corrupted)")
    return torch.load(io.BytesIO(payload), weights_only=False)


def load_latest(where: str) -> tuple[dict, str]:
    """The newest valid checkpoint in folder `where` (or the file `where`), skipping corrupted ones."""
    paths = [where] if os.path.isfile(where) else sorted(glob.glob(os.path.join(where, "step_*.pt")), reverse=True)
    if not paths:
        raise CheckpointError(f"no checkpoint in {where!r}; set checkpoint.dir to the folder of the run to resume.")
    for path in paths:
        try:
            return read(path), path
        except Exception as e:  # noqa: BLE001 - any unreadable checkpoint is skipped
            log.warning("skipping checkpoint %s: %s", path, e)
    raise CheckpointError(f"no valid checkpoint in {where!r} (all {len(paths)} unreadable)")


# Keys that may differ between a checkpoint and its resume: they do not change what is trained.
MAY_CHANGE = ("train.steps", "progress", "run_name", "resume")
MAY_CHANGE_PREFIXES = ("tracking.", "checkpoint.", "head.")


def changed_keys(saved: dict[str, str], now: dict[str, str]) -> list[str]:
    keys = set(saved) | set(now)
    return sorted(k for k in keys if saved.get(k) != now.get(k)
                  and k not in MAY_CHANGE and not k.startswith(MAY_CHANGE_PREFIXES))


@contextlib.contextmanager
def deferred_interrupts():
    """Ctrl-C / SIGTERM finish the current step (so a checkpoint can be written) instead of killing it mid-way;
    `flag["stop"]` says one arrived. A second signal interrupts at once."""
    flag = {"stop": False}
    previous = {}

    def handler(signum, frame):
        if flag["stop"]:
            raise KeyboardInterrupt
        flag["stop"] = True
        log.warning("signal %s: stopping after this step (again to stop now)", signal.Signals(signum).name)

    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            previous[sig] = signal.signal(sig, handler)
        except ValueError:  # not the main thread: leave signals alone
            pass
    try:
        yield flag
    finally:
        for sig, h in previous.items():
            signal.signal(sig, h)
