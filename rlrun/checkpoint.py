"""Checkpoints: atomic, checksummed, newest valid one wins.

A checkpoint is one file `step_NNNNNNNN.pt`: a 64-character sha256 of the payload, then the payload (torch.save
of the training state). It is written to a temporary name, flushed to disk and renamed, so a kill during a write
leaves either the previous checkpoint or the new one, never a partial one under the real name. On load a file
whose checksum or unpickling fails is skipped with a warning and the previous one is used.

Under engine=deepspeed a checkpoint is a folder `step_NNNNNNNN/` (DeepSpeed's own model and ZeRO optimizer files,
plus one `rlrun_rank{R}.pt` per rank with that rank's loop state and RNG) and a manifest `step_NNNNNNNN.manifest`
with the sha256 of every file in it. The manifest is written last (atomically, by rank 0, after all ranks wrote),
so a checkpoint without one, or with a file that no longer matches it, is incomplete and skipped.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import io
import json
import logging
import os
import shutil
import signal

import torch

from .errors import CheckpointError

log = logging.getLogger(__name__)


def tag(step: int) -> str:
    return f"step_{step:08d}"


def _write_atomic(path: str, chunks: list[bytes]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        for chunk in chunks:
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write(path: str, state: dict) -> str:
    """One checksummed file, written atomically."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getvalue()
    _write_atomic(path, [hashlib.sha256(payload).hexdigest().encode(), payload])
    return path


def save(folder: str, step: int, state: dict, keep: int) -> str:
    path = write(os.path.join(folder, tag(step) + ".pt"), state)
    for old in sorted(glob.glob(os.path.join(folder, "step_*.pt")))[:-keep]:
        os.remove(old)
    return path


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_manifest(folder: str, step: int, keep: int) -> str:
    """Seal the sharded checkpoint folder of `step` (every rank has written), then drop the oldest beyond `keep`."""
    root = os.path.join(folder, tag(step))
    files = {os.path.relpath(os.path.join(d, n), root): _sha256(os.path.join(d, n))
             for d, _, names in os.walk(root) for n in names}
    path = os.path.join(folder, tag(step) + ".manifest")
    _write_atomic(path, [json.dumps({"step": step, "files": files}, indent=1).encode()])
    for old in sorted(glob.glob(os.path.join(folder, "step_*.manifest")))[:-keep]:
        os.remove(old)
        shutil.rmtree(old.removesuffix(".manifest"), ignore_errors=True)
    return path


def read_sharded(manifest: str, rank: int) -> dict:
    """This rank's loop state from a sealed sharded checkpoint, after checking every file against the manifest."""
    with open(manifest) as f:
        files = json.load(f)["files"]
    root = manifest.removesuffix(".manifest")
    for rel, digest in files.items():
        path = os.path.join(root, rel)
        if not os.path.isfile(path) or _sha256(path) != digest:
            raise CheckpointError(f"{path}: missing or changed since the checkpoint was sealed")
    state = read(os.path.join(root, f"rlrun_rank{rank}.pt"))
    state["deepspeed_checkpoint"] = (os.path.dirname(root), os.path.basename(root))
    return state


def read(path: str) -> dict:
    with open(path, "rb") as f:
        data = f.read()
    digest, payload = data[:64].decode(errors="replace"), data[64:]
    if hashlib.sha256(payload).hexdigest() != digest:
        raise CheckpointError(f"{path}: checksum mismatch (truncated or corrupted)")
    return torch.load(io.BytesIO(payload), weights_only=False)


def load_latest(where: str) -> tuple[dict, str]:
    """The newest valid checkpoint in folder `where` (or the file `where`), skipping corrupted ones."""
    found = glob.glob(os.path.join(where, "step_*.pt")) + glob.glob(os.path.join(where, "step_*.manifest"))
    paths = [where] if os.path.isfile(where) else sorted(found, key=os.path.basename, reverse=True)
    if not paths:
        raise CheckpointError(f"no checkpoint in {where!r}; set checkpoint.dir to the folder of the run to resume.")
    rank = int(os.environ.get("RANK", "0"))
    for path in paths:
        try:
            return (read_sharded(path, rank) if path.endswith(".manifest") else read(path)), path
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
