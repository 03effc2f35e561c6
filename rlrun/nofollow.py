"""Files rlrun writes in a folder someone else chose (checkpoint.dir, export.dir, the run's output folder, the
warm-start cache, an MLflow store's folder) are created without following a symbolic link: a link planted at the
name would otherwise make rlrun write into the file it points to (a checkpoint into a file of yours, a lock line
over your shell's startup file).

- `create(path)`: a new file, `O_CREAT | O_EXCL | O_NOFOLLOW`: it never opens anything that is already there;
- `open_existing(path, flags)`: a file that may already be there (a lock, a log appended to), `O_NOFOLLOW`, and
  only a regular file;
- `write_replacing(path, data)`: through a new `<path>.tmp<pid>` renamed over `path` (a rename replaces a name,
  never writes through it).

A link in the way is `LinkError`, one message naming the link and where it points; nothing is written.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat

from .errors import LinkError

NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def refuse_link(path: str, what: str = "") -> None:
    """LinkError when `path` is a symbolic link (what: the name's role, e.g. 'checkpoint.dir's lock')."""
    if os.path.islink(path):
        raise LinkError(link_message(path, what))


def link_message(path: str, what: str = "") -> str:
    try:
        target = os.readlink(path)
    except OSError:
        target = "?"
    role = f" ({what})" if what else ""
    return (f"{path}{role} is a symbolic link (to {target}); rlrun never writes through a link, which would "
            "overwrite the file it points to. Remove the link, or choose another folder.")


def create(path: str, mode: int = 0o644) -> int:
    """A new file at `path`, opened for writing (fd). FileExistsError when a file is there; LinkError when a link
    is (dangling or not)."""
    try:
        return os.open(path, NEW, mode)
    except FileExistsError:
        refuse_link(path)
        raise


def create_fresh(path: str, mode: int = 0o644) -> int:
    """`create`, after removing a regular file left at `path` (a temporary name of rlrun's own, left by a process
    that was killed while writing); a link there is LinkError and is left."""
    try:
        return create(path, mode)
    except FileExistsError:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            raise
        os.remove(path)
        return create(path, mode)


def open_existing(path: str, flags: int, mode: int = 0o644) -> int:
    """`os.open(path, flags | O_NOFOLLOW)` for a file that may exist (a lock, a log appended to): a link there is
    LinkError, anything but a regular file an OSError."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), mode)
    except OSError as e:
        if e.errno == errno.ELOOP or os.path.islink(path):
            raise LinkError(link_message(path)) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, f"{path} is not a regular file")
    return fd


def write_replacing(path: str, data: bytes, fsync: bool = False) -> None:
    """`path` holds `data` afterwards, written through a new temporary file renamed over it: a link at `path` is
    LinkError (not replaced); a failed write leaves no temporary file."""
    refuse_link(path)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        fd = create_fresh(tmp)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            if not os.path.islink(tmp):
                os.remove(tmp)
        raise


def appending(path: str):
    """`path` opened to append text to, created if missing; never through a symbolic link."""
    return os.fdopen(open_existing(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "a")
