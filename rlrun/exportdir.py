"""The export folder: rlrun replaces it only when it holds exactly what an earlier rlrun export wrote, one export
writes to it at a time, and a link given as `export.dir` is written through to its folder, never replaced.

- A manifest (`rlrun_export.json`, written last) lists every file the export wrote, with its size and sha256. A
  folder is replaced only when it is empty or holds exactly those files, unchanged: anything else (a file of
  yours added, a listed file edited, a link, an older rlrun's export that lists no files) is refused, naming what
  would be lost. `<folder>.tmp`, the folder an export is written in first, carries the manifest from its start
  (`"complete": false`), so the one an interrupted export left is known as rlrun's and removed.
- One export per folder at a time: an fcntl lock on `.<name>.rlrun.lock` beside the folder (naming its holder),
  held by a run from before training to its end and by `export()` while it writes; released by the kernel when the
  process dies, and the file removed when the hold ends.
- `export.dir` that is a symbolic link to a folder: the export goes into that folder (`resolve`), and the link stays
  as it was; a link to nothing, or to a file, is refused.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from urllib.parse import urlparse

from . import folders, nofollow
from .errors import ExportError

MARK = "rlrun_export.json"
NOTE = ("rlrun replaces this folder on the next export to it only while it holds exactly the files listed here, "
        "unchanged; anything else in it is never deleted")
FIX = "set export.dir to a new folder (or leave it unset: model/ in the run's output)"
_held: dict[str, int] = {}  # lock file -> fd, the export locks this process holds (taking one again is a no-op)


def resolve(folder: str) -> str:
    """`folder` made absolute; a symbolic link to a folder -> that folder (the export goes there and the link
    stays); a link to nothing or to a file is ExportError."""
    folder = os.path.abspath(folder)
    if not os.path.islink(folder):
        return folder
    target = os.path.realpath(folder)
    if not os.path.isdir(target):
        what = "a file" if os.path.exists(target) else "nothing"
        raise ExportError(f"export.dir={folder!r} is a symbolic link to {what} ({target}); rlrun exports into the "
                          f"folder a link points to and never replaces the link itself; {FIX}")
    return target


def _walk(folder: str):
    """(relative path, is a regular file) of every entry below `folder`, links not followed (a link is listed,
    never entered)."""
    for root, dirs, names in os.walk(folder):
        for name in dirs + names:
            path = os.path.join(root, name)
            yield os.path.relpath(path, folder), os.path.isfile(path) and not os.path.islink(path)


def mark(folder: str, complete: bool = False) -> None:
    """Write the manifest of `folder`: in progress (`complete=False`, the first file of an export), or the list of
    every file in it with its size and sha256 (the last)."""
    files = {rel: {"size": os.path.getsize(p), "sha256": folders.sha256(p)}
             for rel, regular in _walk(folder) if regular and rel != MARK
             for p in [os.path.join(folder, rel)]} if complete else None
    info = {"written_by": "rlrun", "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "pid": os.getpid(), "note": NOTE,
            "complete": complete, "files": files}
    nofollow.write_replacing(os.path.join(folder, MARK), json.dumps(info, indent=1).encode())


def manifest(folder: str) -> dict | None:
    """The manifest in `folder` (None: none, not a regular file, or unreadable)."""
    path = os.path.join(folder, MARK)
    if os.path.islink(path) or not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            info = json.load(f)
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) and info.get("written_by") == "rlrun" else None


def foreign(folder: str, in_progress_ok: bool = False) -> list[str]:
    """What replacing `folder` would delete that the earlier export did not write, as paths relative to it: [] for
    an empty folder or an unchanged earlier export. `in_progress_ok`: a folder marked as an export in progress
    (`<folder>.tmp` of an interrupted one) is rlrun's whole."""
    info = manifest(folder)
    if info is None:  # no export's mark: every entry is foreign, and the top level names them (export.dir=/ or a
        # home walked the whole tree, minutes, before refusing)
        try:
            top = sorted(os.listdir(folder))
        except OSError:
            return []
        return [n + (os.sep if os.path.isdir(os.path.join(folder, n)) and not os.path.islink(os.path.join(folder, n))
                     else "") for n in top]
    entries = list(_walk(folder))
    if not entries:
        return []
    listed = (info or {}).get("files")
    if info is not None and listed is None and in_progress_ok and info.get("complete") is False:
        return []
    listed = listed if isinstance(listed, dict) else {}
    out = []
    for rel, regular in entries:
        if rel == MARK and info is not None:
            continue
        if not regular:  # a folder counts as written when it holds a listed file; a link never does
            if os.path.islink(os.path.join(folder, rel)) or not any(f.startswith(rel + os.sep) for f in listed):
                out.append(rel + ("" if os.path.islink(os.path.join(folder, rel)) else os.sep))
        elif rel not in listed or not _unchanged(os.path.join(folder, rel), listed[rel]):
            out.append(rel)
    return sorted(out)


def _unchanged(path: str, entry) -> bool:
    return (isinstance(entry, dict) and os.path.getsize(path) == entry.get("size")
            and folders.sha256(path) == entry.get("sha256"))


def named(paths: list[str]) -> str:
    """A short list of paths for a message: the top-level names (a folder with a trailing /), the first few."""
    top = sorted({p.split(os.sep)[0] + (os.sep if os.sep in p else "") for p in paths})
    return ", ".join(top[:5]) + (f" and {len(top) - 5} more" if len(top) > 5 else "")


def older(folder: str) -> bool:
    """An export an older rlrun wrote: its mark lists no files, so what was added to it cannot be told."""
    info = manifest(folder)
    return info is not None and info.get("files") is None and info.get("complete") is not False


def export_problems(folder: str, checkpoint_dir: str | None, store: str | None) -> list[str]:
    """Why `folder` must not be an export folder ([] if it may): what it would delete or mix with."""
    inside = folders.inside
    out = []
    if inside(os.getcwd(), folder):
        out.append(f"export.dir={folder!r} is the working folder or holds it: an export replaces its folder, which "
                   f"would delete everything in it; {FIX}")
    if checkpoint_dir and (inside(folder, checkpoint_dir) or inside(checkpoint_dir, folder)):
        out.append(f"export.dir={folder!r} overlaps checkpoint.dir={checkpoint_dir!r}: replacing the export would "
                   f"delete the checkpoints; {FIX}")
    if store and (inside(store, folder) or inside(folder, store)):
        out.append(f"export.dir={folder!r} overlaps the MLflow store {store!r}; {FIX}")
    for path in (folder, folder + ".tmp"):
        if os.path.islink(path) or (os.path.lexists(path) and not os.path.isdir(path)):
            what = "a symbolic link" if os.path.islink(path) else "a file"
            out.append(f"export.dir: {path!r} is {what}, which rlrun will not replace; {FIX}")
        elif os.path.isdir(path) and older(path):
            out.append(f"export.dir: {path!r} is an export of an older rlrun, whose {MARK} lists no files: rlrun "
                       f"cannot tell whether files of yours were added since, so it will not replace it; remove it "
                       f"yourself if nothing in it is yours, or {FIX}")
        elif os.path.isdir(path) and (extra := foreign(path, in_progress_ok=path.endswith(".tmp"))):
            out.append(f"export.dir: {path!r} holds files the earlier rlrun export did not write, or changed "
                       f"since ({named(extra)}); rlrun replaces only an empty folder or an earlier export that "
                       f"holds exactly the files its {MARK} lists; move them, or {FIX}")
    return out


def store_path(uri: str | None) -> str | None:
    """The local file or folder of an MLflow store (sqlite or file), None for a server."""
    if not uri:
        return None
    parsed = urlparse(uri)
    if parsed.scheme == "sqlite":
        path = uri[len("sqlite:///"):].split("?")[0]
        return os.path.abspath(path) if path and path != ":memory:" else None
    return os.path.abspath(parsed.path or uri) if parsed.scheme in ("", "file") else None


def check_export(folder: str | None, checkpoint_dir: str | None, tracking_uri: str | None) -> None:
    """Before training: `folder` may be replaced by the export, and its parent can be written."""
    if not folder:
        return
    folder = resolve(folder)
    problems = export_problems(folder, checkpoint_dir, store_path(tracking_uri))
    if problems:
        raise ExportError("\n".join(problems))
    parent = os.path.dirname(folder)
    try:
        folders.probe_write(parent)
    except OSError as e:
        raise ExportError(f"export.dir={folder!r}: cannot write in {parent!r} ({e.strerror or e}); choose a folder "
                          "you can write to, or export.enabled=false.") from None


def replace_export(tmp: str, folder: str) -> str:
    """Move the finished export `tmp` to `folder`, replacing only an empty folder or an unchanged earlier export
    (moved aside, then removed). If `folder` came to hold anything else during training, or became a link, the
    export is kept beside it under a new name instead, and that name is returned."""
    extra = ([os.path.basename(folder)] if os.path.islink(folder) or (os.path.lexists(folder) and
             not os.path.isdir(folder)) else foreign(folder) if os.path.lexists(folder) else [])
    if extra:
        kept = f"{folder}.rlrun-{time.strftime('%Y%m%d-%H%M%S')}"
        os.replace(tmp, kept)
        print(f"rlrun: warning: {folder} now holds what the earlier export did not write ({named(extra)}); it is "
              f"left as it is and the export is in {kept}", file=sys.stderr)
        return kept
    old = None
    if os.path.lexists(folder):  # renamed over a new empty folder of a unique name: never over anything else
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(folder)}.old", dir=os.path.dirname(folder))
        os.replace(folder, old)
    os.replace(tmp, folder)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return folder


def clear_tmp(tmp: str) -> None:
    """Remove a leftover `<export>.tmp` of an interrupted export (only one rlrun wrote)."""
    if os.path.islink(tmp) or (os.path.lexists(tmp) and not os.path.isdir(tmp)):
        raise ExportError(f"{tmp!r} is {'a symbolic link' if os.path.islink(tmp) else 'a file'}; rlrun exports "
                          "through a folder of that name and will not replace it: move it.")
    if os.path.lexists(tmp):
        extra = foreign(tmp, in_progress_ok=True)
        if extra:
            raise ExportError(f"{tmp!r} holds files rlrun did not write ({named(extra)}); move them, rlrun exports "
                              "through it.")
        shutil.rmtree(tmp)


def lock_path(folder: str) -> str:
    return os.path.join(os.path.dirname(folder), f".{os.path.basename(folder)}.rlrun.lock")


@contextlib.contextmanager
def own_export(folder: str | None):
    """Hold `folder` (resolved: see `resolve`) for one export at a time: ExportError naming the holder while another
    process holds it. Taken again in the process that holds it, it is a no-op. The lock file is removed when the
    hold ends (a process that opened it before then finds, once it has the lock, that the name is gone: busy)."""
    if not folder:
        yield
        return
    path = lock_path(resolve(folder))
    if path in _held:
        yield
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = _lock(path, folder)
    try:
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%H:%M:%S')}: "
                      f"{' '.join(sys.argv)[:300]}\n".encode(), 0)
        _held[path] = fd
        yield
    finally:
        _held.pop(path, None)
        with contextlib.suppress(OSError):
            os.remove(path)  # while still held
        os.close(fd)  # releases the lock


def _lock(path: str, folder: str) -> int:
    """The fd of `path`, exclusively flock-ed and still the file at that name; ExportError when another holds it."""
    import fcntl

    fd = nofollow.open_existing(path, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.fstat(fd).st_ino != os.lstat(path).st_ino:
            raise FileNotFoundError(path)  # removed by the holder as it let go: a new hold has begun or will
    except OSError:
        owner = os.pread(fd, 4096, 0).decode(errors="replace").strip()
        os.close(fd)
        raise ExportError(f"export.dir={folder!r} is being exported to by another run ({owner or 'owner unknown'}); "
                          "the later export would replace the earlier one. Wait for it to end, or choose another "
                          "export.dir.") from None
    return fd
