"""What rlrun may write and delete: it never removes or overwrites a file it did not write.

- The export folder: rlrun/exportdir.py (replaced only when it holds exactly what the earlier export wrote; one
  export at a time); room for the model is checked here (`check_space`).
- A `checkpoint.dir` belongs to one run at a time: an fcntl lock (`.rlrun.lock`, naming its owner) held for the
  run, released by the kernel when the process dies (kill -9 included), so a stale lock never blocks a resume. A
  new run (not a resume) refuses a folder that already holds checkpoints: rotation would delete them.
- A write that fails for space or permission says which path, how many bytes it needed and how many were free.
- A run refused before it starts leaves no output folder of Hydra's making: what Hydra wrote there is removed,
  then the folders left empty; a folder you named is not touched (`discard_refused`).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import shutil
import socket
import sys
import tempfile
import time

from . import nofollow
from .errors import CheckpointError, ExportError

LOCK = ".rlrun.lock"
HELD: set[str] = set()  # the checkpoint folders this process holds (resolved): their exports need no lock of their own
ROOM = 1.2  # an export needs the model's bytes plus this margin (config, tokenizer, file system rounding)


def inside(path: str, folder: str) -> bool:
    """`path` is `folder` or below it (both absolute, symlinks resolved)."""
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return os.path.commonpath([path, folder]) == folder


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


def discard_refused(run_dir: str, job_name: str, stop: str = ".") -> None:
    """A refused run's output folder, when it is Hydra's own fresh one (outputs/<date>/<time> below `stop`, the
    working directory): what Hydra wrote there (.hydra/, `<job_name>.log`) is removed, then each folder left empty
    up to `stop`. A folder you chose (hydra.run.dir=...) is left as it is: its log may hold earlier runs' lines."""
    rel = os.path.relpath(os.path.abspath(run_dir), os.path.abspath(stop))
    if not re.fullmatch(r"outputs/\d{4}-\d{2}-\d{2}/\d{2}-\d{2}-\d{2}", rel.replace(os.sep, "/")):
        return
    shutil.rmtree(os.path.join(run_dir, ".hydra"), ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(run_dir, f"{job_name}.log"))
    folder, stop = os.path.abspath(run_dir), os.path.abspath(stop)
    while folder != stop and inside(folder, stop):
        try:
            os.rmdir(folder)  # only an empty folder
        except OSError:
            return
        folder = os.path.dirname(folder)


def sha256(path: str) -> str:
    """A file's SHA-256, read in 1 MiB blocks (the checkpoint and export manifests)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


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
        HELD.add(os.path.realpath(folder))
        yield
    finally:
        HELD.discard(os.path.realpath(folder))
        os.close(fd)  # releases the lock


# -- Hydra's folders, refused before Hydra writes to them (the sweep callback's on_run_start / on_multirun_start) --

def refuse_unwritable(folder, key: str) -> None:
    """Exit 2 with one line, before Hydra tries to create the run's output folder, if it cannot be created (a
    read-only working folder, say) or its disk is full (a test write of 64 KiB, flushed to the disk), instead of
    Hydra's traceback. Creates nothing: a refused sweep leaves no trace."""
    path = os.path.abspath(str(folder))
    existing = path
    while not os.path.exists(existing):  # the nearest folder that exists must take a new entry
        existing = os.path.dirname(existing)
    try:
        if not os.path.isdir(existing):
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
        with tempfile.TemporaryFile(dir=existing) as f:  # the one sure test (root, read-only mounts, a full disk)
            f.write(b"\0" * 65536)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        full = e.errno in (errno.ENOSPC, errno.EDQUOT)
        fix = "free space on that disk or set" if full else "run rlrun from a writable folder or set"
        print(f"rlrun: error: cannot write the run's output folder {path} ({e.strerror}); {fix} "
              f"{key}=/a/writable/folder", file=sys.stderr)
        sys.exit(2)


def refuse_links(folder, job_name: str, key: str) -> None:
    """Exit 2 with one line when a file Hydra writes in the run's output folder (its .hydra/ configs, the job's log)
    would be written through a symbolic link planted at its name (an existing hydra.run.dir someone prepared)."""
    path = os.path.abspath(str(folder))
    for name in (".hydra", ".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml", f"{job_name}.log",
                 "mlflow_spill.jsonl"):
        if os.path.islink(os.path.join(path, name)):
            print(f"rlrun: error: {os.path.join(path, name)} is a symbolic link (to "
                  f"{os.readlink(os.path.join(path, name))}); rlrun never writes through a link. Remove it, or set "
                  f"{key}=/a/new/folder", file=sys.stderr)
            sys.exit(2)


def refuse_outside(config) -> None:
    """Exit 2 with one line when Hydra would write outside the run's output folder: `hydra.output_subdir` (its
    config.yaml, hydra.yaml, overrides.yaml) absolute or climbing out with `..` (it replaced a user's config.yaml,
    or overrides.yaml in the parent folder), `hydra.sweep.subdir` doing the same from the sweep's folder (every job's
    .hydra/ and log went there), or `hydra.job.name` (the job's log, `<name>.log`) holding a path.
    Like every other folder option, each stays inside the run folder; `hydra.output_subdir=null` writes none."""
    from omegaconf import OmegaConf

    problems = []
    subdir = OmegaConf.select(config, "hydra.output_subdir", default=None)
    if subdir is not None:
        norm = os.path.normpath(str(subdir))
        if os.path.isabs(norm) or norm == ".." or norm.startswith(".." + os.sep):
            problems.append(f"hydra.output_subdir={subdir} is outside the run's output folder; give a folder "
                            "inside it (the default: .hydra), or null to write none")
    multirun = str(OmegaConf.select(config, "hydra.mode", default="")) == "RunMode.MULTIRUN"
    sweep_subdir = OmegaConf.select(config, "hydra.sweep.subdir", default=None, throw_on_resolution_failure=False)
    if multirun and sweep_subdir is not None:  # (a single run has no subdir)
        norm = os.path.normpath(str(sweep_subdir))
        if os.path.isabs(norm) or norm == ".." or norm.startswith(".." + os.sep):
            problems.append(f"hydra.sweep.subdir={sweep_subdir} is outside the sweep's folder (hydra.sweep.dir): every "
                            "job's output (.hydra/, its log) would be written there; give a folder inside it (the "
                            "default: ${hydra.job.num})")
    name = str(OmegaConf.select(config, "hydra.job.name", default="") or "")
    if name and (os.sep in name or "/" in name or name in (".", "..")):
        problems.append(f"hydra.job.name={name} holds a path: the job's log, <name>.log, would be written outside "
                        "the run's output folder; give a plain name")
    for problem in problems:
        print(f"rlrun: error: {problem}", file=sys.stderr)
    if problems:
        sys.exit(2)
