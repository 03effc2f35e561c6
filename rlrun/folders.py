"""What rlrun may write and delete: it never removes or overwrites a file it did not write.

- An export folder carries a mark (`rlrun_export.json`, written first): an export replaces only an empty folder or
  an earlier rlrun export, and `export.dir` is checked before training (not the working folder, not beside the
  checkpoints or the MLflow store, writable, room for the model).
- A `checkpoint.dir` belongs to one run at a time: an fcntl lock (`.rlrun.lock`, naming its owner) held for the
  run, released by the kernel when the process dies (kill -9 included), so a stale lock never blocks a resume. A
  new run (not a resume) refuses a folder that already holds checkpoints: rotation would delete them.
- A write that fails for space or permission says which path, how many bytes it needed and how many were free.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import socket
import sys
import time
from urllib.parse import urlparse

from . import nofollow
from .errors import CheckpointError, ExportError

MARK = "rlrun_export.json"
LOCK = ".rlrun.lock"
ROOM = 1.2  # an export needs the model's bytes plus this margin (config, tokenizer, file system rounding)


def inside(path: str, folder: str) -> bool:
    """`path` is `folder` or below it (both absolute, symlinks resolved)."""
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return os.path.commonpath([path, folder]) == folder


def is_export(folder: str) -> bool:
    """An empty folder, or one an rlrun export wrote (its mark is there)."""
    return os.path.isdir(folder) and (not os.listdir(folder) or os.path.isfile(os.path.join(folder, MARK)))


def mark(folder: str) -> None:
    info = {"written_by": "rlrun", "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "pid": os.getpid(),
            "note": "rlrun replaces this folder on the next export to it; it removes no folder without this file"}
    with open(os.path.join(folder, MARK), "w", encoding="utf-8") as f:
        json.dump(info, f, indent=1)


def _listing(folder: str) -> str:
    names = sorted(os.listdir(folder))
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def store_path(uri: str | None) -> str | None:
    """The local file or folder of an MLflow store (sqlite or file), None for a server."""
    if not uri:
        return None
    parsed = urlparse(uri)
    if parsed.scheme == "sqlite":
        path = uri[len("sqlite:///"):].split("?")[0]
        return os.path.abspath(path) if path and path != ":memory:" else None
    return os.path.abspath(parsed.path or uri) if parsed.scheme in ("", "file") else None


def export_problems(folder: str, checkpoint_dir: str | None, store: str | None) -> list[str]:
    """Why `folder` must not be an export folder ([] if it may): what it would delete or mix with."""
    folder = os.path.abspath(folder)
    fix = "set export.dir to a new folder (or leave it unset: model/ in the run's output)"
    out = []
    if inside(os.getcwd(), folder):
        out.append(f"export.dir={folder!r} is the working folder or holds it: an export replaces its folder, which "
                   f"would delete everything in it; {fix}")
    if checkpoint_dir and (inside(folder, checkpoint_dir) or inside(checkpoint_dir, folder)):
        out.append(f"export.dir={folder!r} overlaps checkpoint.dir={checkpoint_dir!r}: replacing the export would "
                   f"delete the checkpoints; {fix}")
    if store and (inside(store, folder) or inside(folder, store)):
        out.append(f"export.dir={folder!r} overlaps the MLflow store {store!r}; {fix}")
    for path in (folder, folder + ".tmp"):
        if os.path.lexists(path) and not os.path.isdir(path):
            out.append(f"export.dir: {path!r} is a file, which rlrun will not replace; {fix}")
        elif os.path.isdir(path) and not is_export(path):
            out.append(f"export.dir: {path!r} holds files rlrun did not write ({_listing(path)}); rlrun replaces "
                       f"only an empty folder or an earlier rlrun export (one with {MARK}); {fix}")
    return out


def probe_write(folder: str) -> None:
    """Create `folder` and write and remove a small file in it (OSError when it cannot be written)."""
    os.makedirs(folder, exist_ok=True)
    probe = os.path.join(folder, f".rlrun_write_test.{os.getpid()}")
    fd = nofollow.create_fresh(probe)  # never through a link planted at the name
    try:
        os.write(fd, b"ok")
    finally:
        os.close(fd)
    os.remove(probe)


def check_export(folder: str | None, checkpoint_dir: str | None, tracking_uri: str | None) -> None:
    """Before training: `folder` may be replaced by the export, and its parent can be written."""
    if not folder:
        return
    problems = export_problems(folder, checkpoint_dir, store_path(tracking_uri))
    if problems:
        raise ExportError("\n".join(problems))
    parent = os.path.dirname(os.path.abspath(folder))
    try:
        probe_write(parent)
    except OSError as e:
        raise ExportError(f"export.dir={folder!r}: cannot write in {parent!r} ({e.strerror or e}); choose a folder "
                          "you can write to, or export.enabled=false.") from None


def free_bytes(path: str) -> int:
    """Free bytes on the file system that holds `path` (or would: its nearest existing parent)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def model_bytes(model) -> int:
    """The bytes of a model's weights (ZeRO-3: the whole, not this rank's partition)."""
    return sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in model.parameters())


def check_space(folder: str | None, nbytes: int) -> None:
    """Before training: room for an export of `nbytes` (the model's weights) in `folder`."""
    if not folder:
        return
    need, free = int(nbytes * ROOM), free_bytes(folder)
    if free < need:
        raise ExportError(f"export.dir={os.path.abspath(folder)!r}: the model needs about {need / 2**20:.0f} MiB "
                          f"and its file system has {free / 2**20:.0f} MiB free; free space, set export.dir to "
                          "another disk, or export.enabled=false.")


def no_room(path: str, e: OSError, nbytes: int, fix: str) -> str:
    """One message for a write that failed for space or permission (the path, bytes needed and free, the fix)."""
    why = "no space left" if e.errno in (errno.ENOSPC, errno.EDQUOT) else (e.strerror or str(e))
    try:
        free = f"{free_bytes(path) / 2**20:.1f} MiB free"
    except OSError:
        free = "free space unknown"
    return f"{path}: could not be written ({why}; it needs {nbytes / 2**20:.1f} MiB, {free}); {fix}"


def replace_export(tmp: str, folder: str) -> str:
    """Move the finished export `tmp` to `folder`, replacing only an empty folder or an earlier rlrun export (moved
    aside, then removed). If `folder` came to hold anything else during training, the export is kept beside it
    under a new name instead, and that name is returned."""
    if os.path.lexists(folder) and not is_export(folder):
        kept = f"{folder}.rlrun-{time.strftime('%Y%m%d-%H%M%S')}"
        os.replace(tmp, kept)
        print(f"rlrun: warning: {folder} now holds files rlrun did not write; the export is in {kept}",
              file=sys.stderr)
        return kept
    old = None
    if os.path.lexists(folder):
        old = f"{folder}.old{os.getpid()}"
        os.replace(folder, old)
    os.replace(tmp, folder)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return folder


def clear_tmp(tmp: str) -> None:
    """Remove a leftover `<export>.tmp` of an interrupted export (only one rlrun wrote)."""
    if os.path.lexists(tmp):
        if not is_export(tmp):
            raise ExportError(f"{tmp!r} holds files rlrun did not write; move them, rlrun exports through it.")
        shutil.rmtree(tmp)


def checkpoint_steps(folder: str) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.startswith("step_") and n.endswith((".pt", ".manifest")))


@contextlib.contextmanager
def own_checkpoints(folder: str | None, resuming: bool):
    """Hold `folder` (checkpoint.dir) for this run: refused while another live run holds it, and, for a new run,
    when it already holds checkpoints (rotation would delete them). Released when the block ends or the process
    dies."""
    if not folder:
        yield
        return
    import fcntl

    os.makedirs(folder, exist_ok=True)
    existing = checkpoint_steps(folder)
    if existing and not resuming:
        raise CheckpointError(f"checkpoint.dir={folder!r} already holds checkpoints ({existing[-1]} and "
                              f"{len(existing) - 1} more) of an earlier run; a new run would rotate them away. "
                              "resume=true continues that run; to start a new one choose an empty folder.")
    path = os.path.join(folder, LOCK)
    fd = nofollow.open_existing(path, os.O_RDWR | os.O_CREAT)  # a link there: LinkError, nothing written
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        owner = ""
        with contextlib.suppress(OSError):
            owner = os.pread(fd, 4096, 0).decode(errors="replace").strip()
        os.close(fd)
        raise CheckpointError(f"checkpoint.dir={folder!r} is in use by another run ({owner or 'owner unknown'}); "
                              "two runs in one checkpoint folder would delete each other's checkpoints. Wait "
                              "for it to end, or choose another checkpoint.dir.") from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%H:%M:%S')}: "
                      f"{' '.join(sys.argv)[:300]}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock
