"""Checkpoints: atomic, checksummed, newest valid one wins.

A checkpoint is one file `step_NNNNNNNN.pt`: a first line naming its owner (`rlrun-checkpoint owner=<id>`: the
run lineage that wrote it, kept across resumes), a 64-character sha256 of the payload, then the payload
(torch.save of the training state). Rotation (`keep`) removes only the owner's own checkpoints: never a file of
another run, one an older rlrun wrote (no owner line), or a file that merely matches `step_*.pt`. It is written
to a temporary name, flushed to disk and renamed, so a kill during a write leaves either the previous checkpoint
or the new one, never a partial one under the real name. On load a file
whose checksum or decoding fails is skipped with a warning and the previous one is used.

Loading a checkpoint never runs code: the payload is read with `torch.load(weights_only=True)`, which rebuilds
only tensors and plain data (dict, list, tuple, str, int, float, bool, None, ...) and refuses any other object
before creating it. Numpy arrays and scalars (numpy's RNG state) are stored as tagged plain data (`_encode`) and
rebuilt on load (`_decode`), so no numpy global is needed either. A checkpoint that needs anything else (a
function, a class, a pickle that calls `os.system`) is refused with `UnsafeCheckpointError` naming what it asks
for; it is not skipped for an older one: a checkpoint folder holding such a file is not to be trusted. A state
that could not be loaded back this way is refused when it is saved, not at resume.

Under engine=deepspeed a checkpoint is a folder `step_NNNNNNNN/` (DeepSpeed's own model and ZeRO optimizer files,
plus one `rlrun_rank{R}.pt` per rank with that rank's loop state and RNG) and a manifest `step_NNNNNNNN.manifest`
with the sha256 of every file in it. The manifest is written last (atomically, by rank 0, after all ranks wrote),
so a checkpoint without one, or with a file that no longer matches it, is incomplete and skipped. The manifest
names the owner too, and rotation removes only the owner's sealed checkpoints.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import io
import json
import logging
import os
import pickle
import re
import shutil

import numpy as np
import torch

from . import folders, nofollow, ranks
from .errors import CheckpointError

log = logging.getLogger(__name__)


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint that asks for code or objects beyond tensors and plain data: refused, never unpickled."""


OWNER = b"rlrun-checkpoint owner="  # a checkpoint file's first line: this, the owner's id, a newline
_NAME = re.compile(r"step_\d{8}\.(pt|manifest)")  # what `tag` names: nothing else is ever rotated away
_warned: set = set()  # folders whose foreign checkpoints were reported (once per process)
_TAG = "__rlrun_numpy__"  # the key of a numpy array or scalar stored as plain data


def _encode(obj):
    """`obj` with numpy arrays and scalars replaced by tagged plain data (exact: ints and floats round-trip)."""
    if isinstance(obj, np.ndarray):
        if obj.dtype.hasobject:
            raise CheckpointError("a numpy array of Python objects cannot be checkpointed")
        return {_TAG: "array", "dtype": obj.dtype.str, "shape": list(obj.shape), "data": obj.ravel().tolist()}
    if isinstance(obj, np.generic):
        return {_TAG: "scalar", "dtype": obj.dtype.str, "data": obj.item()}
    if isinstance(obj, dict):  # OrderedDict and Counter keep their type (both load with weights_only)
        out = {k: _encode(v) for k, v in obj.items()}
        return out if type(obj) is dict else type(obj)(out)
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_encode(v) for v in obj)
    return obj


def _decode(obj):
    if isinstance(obj, dict):
        kind = obj.get(_TAG)
        if kind == "array":
            return np.array(obj["data"], dtype=np.dtype(obj["dtype"])).reshape(obj["shape"])
        if kind == "scalar":
            return np.dtype(obj["dtype"]).type(obj["data"])
        out = {k: _decode(v) for k, v in obj.items()}
        return out if type(obj) is dict else type(obj)(out)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_decode(v) for v in obj)
    return obj


def _unsafe_globals(payload: bytes) -> list[str]:
    """The globals (functions, classes) a torch.save payload asks for beyond what weights_only allows, read by
    disassembling the pickle statically (nothing in it runs)."""
    try:
        return torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(payload))
    except Exception:  # noqa: BLE001 - not a zip checkpoint (a bare pickle): scan its opcodes ourselves
        import pickletools

        found, strings = [], []
        try:
            for op, arg, _ in pickletools.genops(payload):
                if op.name in ("GLOBAL", "INST"):
                    found.append(str(arg).replace(" ", "."))
                elif op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE"):
                    strings.append(arg)
                elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                    found.append(f"{strings[-2]}.{strings[-1]}")
        except Exception:  # noqa: BLE001 - garbage after the pickle: report what was found so far
            pass
        return found or ["(not a torch checkpoint)"]


def loads(payload: bytes, path: str) -> dict:
    """Decode a checkpoint payload with weights_only=True; UnsafeCheckpointError if it asks for more."""
    try:
        state = torch.load(io.BytesIO(payload), weights_only=True)
    except pickle.UnpicklingError as e:
        if "Weights only load failed" not in str(e) and "Unsupported" not in str(e):
            raise CheckpointError(f"{path}: cannot be decoded ({str(e).splitlines()[0][:200]})") from None
        names = _unsafe_globals(payload)
        raise UnsafeCheckpointError(
            f"{path}: contains code/objects rlrun does not load: {', '.join(names[:10]) or 'unknown'}. It was "
            "refused without being unpickled. rlrun writes only tensors and plain data; a checkpoint asking for "
            "more was not written by rlrun (or by an older rlrun that pickled numpy state): delete it, or resume "
            "from a checkpoint you wrote.") from None
    return _decode(state)


def tag(step: int) -> str:
    return f"step_{step:08d}"


def _write_atomic(path: str, chunks: list[bytes]) -> None:
    """Through `<path>.tmp` (created new, never through a link: rlrun.nofollow), flushed and renamed; a write that
    fails (disk full, permission) leaves no `.tmp`, the previous checkpoints untouched, and one message with the
    path, the bytes needed and the fix. A link at `path` or `<path>.tmp` is LinkError naming it."""
    tmp = path + ".tmp"
    nofollow.refuse_link(path, "a checkpoint's name")
    try:
        with os.fdopen(nofollow.create_fresh(tmp), "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            if not os.path.islink(tmp):
                os.remove(tmp)
        fix = "free space or set checkpoint.dir to another disk; the checkpoints written before are unchanged."
        raise CheckpointError(folders.no_room(path, e, sum(map(len, chunks)), fix)) from None


def write(path: str, state: dict) -> str:
    """One checksummed file, written atomically, its first line naming `state["owner"]` (see `owner_of`)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    buf = io.BytesIO()
    torch.save(_encode(state), buf)
    payload = buf.getvalue()
    unsafe = _unsafe_globals(payload)
    if unsafe:  # it could not be resumed from: say so now, not at resume
        raise CheckpointError(f"{path}: the training state holds objects a checkpoint cannot load ({', '.join(unsafe)}"
                              "); a recipe's state_dict must return tensors and plain data only.")
    owner = OWNER + str(state.get("owner") or "").encode() + b"\n"
    _write_atomic(path, [owner, hashlib.sha256(payload).hexdigest().encode(), payload])
    return path


def check_writable(folder: str | None) -> None:
    """Before training: `checkpoint.dir` can be created and written (not first found out at the first save)."""
    if not folder:
        return
    try:
        folders.probe_write(folder)
    except OSError as e:
        raise CheckpointError(f"checkpoint.dir={folder!r} is not writable ({e.strerror or e}); choose a folder you "
                              "can write to, or leave checkpoint.dir unset to train without checkpoints.") from None


def owner_of(path: str) -> str | None:
    """Who wrote a checkpoint: the owner id on a file's first line or in a manifest; None when it names none (an
    older rlrun's, or not rlrun's) or cannot be read."""
    try:
        if path.endswith(".manifest"):
            with open(path, encoding="utf-8") as f:
                owner = json.load(f).get("owner")
            return owner if isinstance(owner, str) else None
        with open(path, "rb") as f:
            line = f.readline(200)
    except (OSError, ValueError, AttributeError):
        return None
    return line[len(OWNER):].rstrip(b"\n").decode(errors="replace") if line.startswith(OWNER) else None


def rotate(folder: str, suffix: str, owner: str, keep: int) -> list[str]:
    """The checkpoints (`suffix`: .pt or .manifest) of `owner` in `folder` beyond the newest `keep`: those rotation
    removes. Anything else (another run's, an older rlrun's, a user's `step_best.pt`) is left, and said once."""
    names = sorted(n for n in os.listdir(folder) if _NAME.fullmatch(n) and n.endswith(suffix))
    own = [n for n in names if owner_of(os.path.join(folder, n)) == owner]
    others = [n for n in os.listdir(folder) if n.startswith("step_") and n.endswith(suffix) and n not in own]
    if others and folder not in _warned:
        _warned.add(folder)
        log.warning("checkpoint.dir %s holds %d checkpoint(s) this run did not write (%s); rotation leaves them",
                    folder, len(others), ", ".join(sorted(others)[:3]))
    return [os.path.join(folder, n) for n in own[:-keep]]


def save(folder: str, step: int, state: dict, keep: int) -> str:
    path = write(os.path.join(folder, tag(step) + ".pt"), state)
    for old in rotate(folder, ".pt", str(state.get("owner") or ""), keep):
        os.remove(old)
    return path


def write_manifest(folder: str, step: int, keep: int, owner: str | None = None) -> str:
    """Seal the sharded checkpoint folder of `step` (every rank has written), then drop `owner`'s oldest beyond
    `keep`."""
    root = os.path.join(folder, tag(step))
    files = {os.path.relpath(os.path.join(d, n), root): folders.sha256(os.path.join(d, n))
             for d, _, names in os.walk(root) for n in names}
    path = os.path.join(folder, tag(step) + ".manifest")
    _write_atomic(path, [json.dumps({"step": step, "owner": owner or "", "files": files}, indent=1).encode()])
    for old in rotate(folder, ".manifest", owner or "", keep):
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
        if not os.path.isfile(path) or folders.sha256(path) != digest:
            raise CheckpointError(f"{path}: missing or changed since the checkpoint was sealed")
    state = read(os.path.join(root, f"rlrun_rank{rank}.pt"))
    state["deepspeed_checkpoint"] = (os.path.dirname(root), os.path.basename(root))
    return state


def read(path: str) -> dict:
    with open(path, "rb") as f:
        data = f.read()
    if data.startswith(OWNER):  # files of older rlruns start with the digest
        data = data.partition(b"\n")[2]
    digest, payload = data[:64].decode(errors="replace"), data[64:]
    if hashlib.sha256(payload).hexdigest() != digest:
        raise CheckpointError(f"{path}: checksum mismatch (truncated or corrupted)")
    return loads(payload, path)


def check_foreign(root: str, allowed: set[str]) -> None:
    """Before another library (DeepSpeed) loads the `.pt` files under `root` with its own torch.load: each may ask
    only for what weights_only allows plus the classes in `allowed`, read by static disassembly (nothing runs)."""
    for d, _, names in os.walk(root):
        for n in sorted(names):
            if not n.endswith(".pt") or n.startswith("rlrun_rank"):
                continue
            path = os.path.join(d, n)
            try:
                found = torch.serialization.get_unsafe_globals_in_checkpoint(path)
            except Exception as e:  # noqa: BLE001 - not a torch.save zip: nothing rlrun or DeepSpeed writes
                raise UnsafeCheckpointError(f"{path}: not a torch checkpoint ({e}); refused without loading it.") from e
            extra = sorted(set(found) - allowed)
            if extra:
                raise UnsafeCheckpointError(f"{path}: contains code/objects rlrun does not load: {', '.join(extra)}. "
                                            "It was refused without being unpickled.")


def load_latest(where: str) -> tuple[dict, str]:
    """The newest valid checkpoint in folder `where` (or the file `where`), skipping corrupted ones."""
    found = [p for p in glob.glob(os.path.join(where, "step_*")) if _NAME.fullmatch(os.path.basename(p))]
    paths = [where] if os.path.isfile(where) else sorted(found, key=os.path.basename, reverse=True)
    if not paths:
        raise CheckpointError(f"no checkpoint in {where!r}; set checkpoint.dir to the folder of the run to resume.")
    rank = ranks.rank()
    for path in paths:
        try:
            return (read_sharded(path, rank) if path.endswith(".manifest") else read(path)), path
        except UnsafeCheckpointError:  # never skipped for an older one: the folder is not to be trusted
            raise
        except Exception as e:  # noqa: BLE001 - any unreadable checkpoint is skipped
            log.warning("skipping checkpoint %s: %s", path, e)
    raise CheckpointError(f"no valid checkpoint in {where!r} (all {len(paths)} unreadable)")


# Keys that may differ between a checkpoint and its resume: they do not change what is trained.
MAY_CHANGE = ("train.steps", "progress", "run_name", "resume", "rollout.worker_timeout_s")
MAY_CHANGE_PREFIXES = ("tracking.", "checkpoint.", "head.", "plan.", "eval.", "log.", "export.", "report.")


# keys added since checkpoints were first written, as a checkpoint without them trained: rollout.top_k off
SAVED_BEFORE = {"rollout.top_k": "0"}


def changed_keys(saved: dict[str, str], now: dict[str, str]) -> list[str]:
    saved = {**SAVED_BEFORE, **saved}
    keys = set(saved) | set(now)
    return sorted(k for k in keys if saved.get(k) != now.get(k)
                  and k not in MAY_CHANGE and not k.startswith(MAY_CHANGE_PREFIXES))
