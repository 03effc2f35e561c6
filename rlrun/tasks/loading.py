"""Reading data: the historic JSONL reader (task=jsonl) and local files / folders through the `datasets` library
(task=dataset). Nothing here downloads: a path that does not exist is refused before `datasets` is imported."""

from __future__ import annotations

import bz2
import contextlib
import gzip
import io
import json
import lzma
import os
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from .base import MISSING, TaskError

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
COMPRESSED = (".gz", ".bz2", ".xz", ".zst")
# A row longer than this is refused before anything parses or tokenizes it: it is far beyond any model's context,
# and one 10 MB line once took a run to 18 GB of memory and the kernel's OOM killer.
MAX_ROW_BYTES = 1 << 20


def check_lines(path) -> list[int]:
    """The numbers of a JSONL file's non-blank lines (a row's file:line); TaskError naming file:line for the first
    line that is longer than MAX_ROW_BYTES or is not UTF-8 text (read as bytes: nothing is decoded or parsed
    before it passed)."""
    numbers = []
    with open(path, "rb") as f:
        for lineno, line in enumerate(iter(lambda: f.readline(MAX_ROW_BYTES + 1), b""), 1):
            if len(line) > MAX_ROW_BYTES:  # read at most this much of a line: a file with no newline stays cheap
                raise TaskError(f"{path}:{lineno}: this line is longer than {MAX_ROW_BYTES:,} bytes; longer rows "
                                "are refused (far longer than any model's context). Shorten or drop it.")
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as e:
                raise TaskError(f"{path}:{lineno}: not UTF-8 text (byte 0x{line[e.start]:02x} at column "
                                f"{e.start + 1}); save the file as UTF-8.") from None
            if line.strip():
                numbers.append(lineno)
    return numbers


def read_jsonl(path: str, fields: tuple[str, ...]) -> list[dict]:
    """Records of a JSONL file, each checked for `fields`; errors name the file and line."""
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise TaskError(f"task.path={path!r} cannot be read ({e.strerror}); point it at a JSONL file.") from e
    out = []
    with f:
        check_lines(path)
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise TaskError(f"{path}:{lineno}: not valid JSON ({e.msg}); one JSON object per line.") from e
            if not isinstance(rec, dict):
                raise TaskError(f"{path}:{lineno}: expected a JSON object with keys {list(fields)}.")
            missing = [k for k in fields if not isinstance(rec.get(k), str)]
            if missing:
                raise TaskError(f"{path}:{lineno}: missing or non-string field(s) {missing}; need {list(fields)}.")
            out.append({k: rec[k] for k in fields})
    if not out:
        raise TaskError(f"task.path={path!r} has no records.")
    return out


@dataclass
class Split:
    """The rows of one split, with where each came from (for error messages)."""

    path: str
    name: str
    rows: list[dict]
    columns: list[str]
    lines: list[int] | None = None  # JSONL: the file line of each row
    literals: list[dict] | None = None  # JSON: per row, {column: the number as written in the file}

    def where(self, i: int) -> str:
        return f"{self.path}:{self.lines[i]}" if self.lines else f"{self.path} ({self.name} row {i})"


def resolve(path) -> Path:
    """The local file or folder `path` names; anything else is refused, saying rlrun never downloads."""
    if path in (None, "", MISSING):
        raise TaskError("task=dataset needs task.path=FILE_OR_FOLDER (a local jsonl, json, parquet, csv or arrow "
                        "file, a folder of such files, or a folder written by datasets' save_to_disk).")
    p = Path(str(path)).expanduser()
    if p.exists():
        return p.resolve()
    where = f"(relative paths start at the working directory {os.getcwd()})"
    name = str(path)
    hub_like = re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?", name) and p.suffix not in FORMATS \
        and p.suffix not in COMPRESSED and ("/" in name or not p.suffix)  # 'owner/name' or 'name'
    if not hub_like:
        raise TaskError(f"task.path={path!r}: no such file or folder {where}; rlrun reads local data only.")
    raise TaskError(
        f"task.path={name!r} is not a local file or folder {where}, and rlrun never downloads data. If it is a "
        "Hugging Face Hub dataset, download it first on a machine with internet, e.g. python -c \"import datasets; "
        f"datasets.load_dataset({name!r}).save_to_disk('{Path(name).name}')\" (add the config name, e.g. 'main', "
        "if it has several), copy that folder here and pass task.path=FOLDER; or write a split to a file with "
        ".to_json('train.jsonl') and pass that file.")


def _format(p: Path) -> str:
    suffixes = [s for s in p.suffixes if s not in COMPRESSED]
    fmt = FORMATS.get(suffixes[-1] if suffixes else "")
    if fmt is None:
        raise TaskError(f"task.path={str(p)!r}: unknown file type {''.join(p.suffixes) or '(none)'}; supported: "
                        f"{sorted(FORMATS)} (optionally compressed: {list(COMPRESSED)}), or a folder.")
    return fmt


def _bad_jsonl_line(p: Path) -> str | None:
    """'file:line: reason' of the first line of a JSONL file that is not a JSON object, or whose field changes
    JSON type from an earlier line (what pyarrow refuses, naming neither file nor line); None if none is."""
    kinds: dict[str, tuple[str, int]] = {}  # field -> (its JSON type, the line it was first seen on)
    with open(p, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                return f"{p}:{lineno}: not valid JSON ({e.msg}); one JSON object per line."
            if not isinstance(rec, dict):
                return f"{p}:{lineno}: expected a JSON object, got {type(rec).__name__}."
            for k, v in rec.items():
                if v is None:
                    continue
                kind = _JSON_KINDS.get(type(v), "number")
                first = kinds.setdefault(k, (kind, lineno))
                if first[0] != kind:
                    return (f"{p}:{lineno}: field {k!r} is a {kind} here but a {first[0]} on line {first[1]}; a "
                            "column needs one type in every row (quote numbers meant as text).")
    return None


_JSON_KINDS = {str: "string", bool: "boolean", list: "list", dict: "object"}


@contextlib.contextmanager
def _quiet_datasets():
    """No progress bars while loading, and a throwaway cache (rows are kept in memory: nothing piles up in
    ~/.cache, and an edited file is always read afresh)."""
    try:
        import datasets  # here, not at the top: `import rlrun.tasks` stays fast for the CLI
    except ImportError as e:
        raise TaskError(f"task=dataset reads files with the datasets library, which cannot be imported ({e}); "
                        "pip install datasets (a dependency of rlrun: pip install -e .).") from e
    was_on = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        with tempfile.TemporaryDirectory(prefix="rlrun-datasets-") as cache:
            yield datasets, cache
    finally:
        if was_on:
            datasets.enable_progress_bars()


def _open_text(path: Path):
    """A (possibly compressed) data file as text, decompressed the way `datasets` reads it."""
    kind = path.suffix.lower()
    if kind == ".zst":
        try:
            import zstandard
        except ImportError:
            raise TaskError(f"{path}: reading .zst files needs the zstandard package: pip install zstandard.") from None
        return io.TextIOWrapper(zstandard.open(path, "rb"), encoding="utf-8", newline="")
    openers: dict[str, Callable[..., IO[str]]] = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}
    opener = openers.get(kind)
    if opener is None:
        return open(path, encoding="utf-8", newline="")
    return opener(path, "rt", encoding="utf-8", newline="")


def _text_columns(files: list[Path], datasets):
    """CSV has no types: every column is read as the text in the file ('007', '1.50', '+3' stay so; a number type
    would reach a reward as '7', '1.5', '3.0', which no exact match scores). The columns of all `files`."""
    import csv

    names = {}
    for f in files:
        with _open_text(f) as text:
            names.update(dict.fromkeys(next(csv.reader(text), [])))
    return datasets.Features({name: datasets.Value("string") for name in names})


def _json_records(path: Path) -> list | None:
    """The records of a JSON / JSON-lines file with every number kept as the text written in the file; None for a
    file that is not a list of objects (datasets read it some other way: nothing to recover)."""
    with _open_text(path) as f:
        if ".jsonl" in [x.lower() for x in path.suffixes]:
            return [json.loads(line, parse_float=str, parse_int=str) for line in f if line.strip()]
        records = json.load(f, parse_float=str, parse_int=str)
    return records if isinstance(records, list) else None


def _as_written(value, text):
    """The file's number `text` where it is the number `value` (an int written as 7 stays 7 where pyarrow made the
    column float); None where it is not the same number (the rows and records do not line up)."""
    if not isinstance(text, str):
        return None
    try:
        exact = int(text) if re.fullmatch(r"-?\d+", text) else float(text)
    except ValueError:
        return None
    return exact if exact == value else None


def _literals(rows: list[dict], files: list[Path]) -> list[dict] | None:
    """Per row, {column: the number as written} for the number cells of JSON `rows` read from `files` in that order
    (numbers made exact in `rows` too: 7 stays an int); None when the files do not give the rows back one for one."""
    records = []
    try:
        for f in files:
            found = _json_records(f)
            if found is None:
                return None
            records += found
    except (OSError, ValueError):
        return None
    if len(records) < len(rows):
        return None
    out = []
    for row, rec in zip(rows, records):
        texts = {}
        for k, v in row.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v:
                if not isinstance(rec, dict) or _as_written(v, rec.get(k)) is None:
                    return None
                texts[k] = rec[k]
        out.append(texts)
    for row, texts in zip(rows, out):  # every row lined up: only now change them
        row.update({k: _as_written(row[k], t) for k, t in texts.items()})
    return out


def _is_data(f: Path) -> bool:
    suffixes = [x.lower() for x in f.suffixes if x.lower() not in COMPRESSED]
    return bool(suffixes) and suffixes[-1] in FORMATS


def _check_folder(p: Path) -> None:
    """A folder `datasets` would read must hold data files: an empty one, or one of other files (or one named
    like a file, `x.jsonl/`), is one message here, not datasets' "Couldn't resolve pattern **"."""
    files = [f for f in p.rglob("*") if f.is_file() and not any(x.startswith(".") for x in f.relative_to(p).parts)]
    if any(_is_data(f) for f in files):
        return
    named = f" (named like a {''.join(p.suffixes)} file)" if _is_data(p) else ""
    held = "it is empty" if not files else "it holds " + ", ".join(str(f.relative_to(p)) for f in files[:4]) + (
        f" and {len(files) - 4} more" if len(files) > 4 else "")
    raise TaskError(f"task.path={str(p)!r} is a folder{named} with no data file in it ({held}). task=dataset reads a "
                    f"file ({', '.join(FORMATS)}, optionally {'/'.join(COMPRESSED)}), a folder of such files (their "
                    "names give the splits: train.jsonl, test.jsonl) or a folder written by save_to_disk: point "
                    "task.path at one of those.")


def _open(p: Path, datasets, cache: str) -> tuple[dict, str | None, dict]:
    """({split name: datasets.Dataset}, the format, {split name: its files in the order read}) of a file or
    folder; a save_to_disk folder has no files (None, {})."""
    if p.is_dir() and ((p / "dataset_dict.json").exists() or (p / "state.json").exists()):
        d = datasets.load_from_disk(str(p), keep_in_memory=True)
        return (dict(d) if isinstance(d, datasets.DatasetDict) else {"train": d}), None, {}
    if p.is_dir():
        _check_folder(p)
        builder = datasets.load_dataset_builder(str(p), cache_dir=cache)
        fmt, files = builder.name, {str(k): [Path(f) for f in v] for k, v in builder.config.data_files.items()}
    else:
        fmt, files = _format(p), {"train": [p]}
    text = {"features": _text_columns([f for v in files.values() for f in v], datasets)} if fmt == "csv" else {}
    if p.is_dir():
        d = datasets.load_dataset(str(p), cache_dir=cache, keep_in_memory=True, **text)
    else:
        d = datasets.load_dataset(fmt, data_files=str(p), cache_dir=cache, keep_in_memory=True, **text)
    return dict(d), fmt, files


def load_splits(path, names: list[tuple[str, str]], max_rows: int | None) -> list[Split]:
    """The splits `names` ([(config key, split name)]) of the local data at `path`, each cut to `max_rows`."""
    p = resolve(path)
    line_numbers = {}  # a JSONL file's row -> file line, for error messages
    for file in ([p] if p.is_file() else sorted(p.rglob("*"))):  # a folder: its JSON-lines shards too
        if file.is_file() and file.suffix.lower() == ".jsonl":
            line_numbers[file] = check_lines(file)
    with _quiet_datasets() as (datasets, cache):
        try:
            splits, fmt, files = _open(p, datasets, cache)
        except TaskError:
            raise
        except Exception as e:
            raise TaskError(_unreadable(p, e)) from e
        out = []
        for key, name in names:
            if name not in splits:
                single = "; a single file is split 'train': hold out rows with task.eval_size" if p.is_file() else ""
                raise TaskError(f"{key}={name!r} is not a split of {p}; its splits: {sorted(splits)}{single}.")
            ds = splits[name]
            lines = line_numbers.get(p) if p.is_file() else None
            lines = lines if lines is not None and len(lines) == len(ds) else None  # one row per non-blank line
            if max_rows is not None:
                ds = ds.select(range(min(max_rows, len(ds))))
            rows = ds.to_list()
            literals = _literals(rows, files.get(name, [])) if fmt == "json" else None
            out.append(Split(str(p), name, rows, list(ds.column_names), lines, literals))
    return out


def _unreadable(p: Path, e: BaseException) -> str:
    """Why `datasets` failed on `p`, said the rlrun way where we can tell (pyarrow names neither file nor line)."""
    bad = _bad_jsonl_line(p) if p.is_file() and p.suffix == ".jsonl" else None
    if bad:
        return bad
    if (p.is_file() and p.stat().st_size == 0) or "corresponds to no data" in str(e):  # datasets' "no rows"
        return f"task.path={str(p)!r} has no rows."
    return f"task.path={str(p)!r}: the datasets library cannot read it ({type(e).__name__}: {_cause(e)})."


def _cause(e: BaseException) -> str:
    """The innermost message of a chained exception (datasets wraps pyarrow's), on one line."""
    while (inner := e.__cause__ or e.__context__) is not None:
        e = inner
    return re.sub(r"\s+", " ", str(e)).strip()[:300]
