"""A run's rollouts on disk (`rollout.record=DIR`) and read back in order (`rollout=replay rollout.path=DIR`).

A record lets training-side variants (head, batching, activations, offload, logprob policy, precision, loss, micro
batch) train on the very same rollouts: their curves then differ by their own arithmetic only, never by a sampled
token that rounding flipped, and generation is paid once (docs/replay.md).

The format (FORMAT 2), one folder:

- `record.json`: {"format": 2, "fixed": {key: value}} - what the rollouts depend on (FIXED: the sampler's settings,
  the group and rollout sizes, dynamic sampling, the seed, the task, the model with a digest of its weight files,
  and the warm start, which changes the weights that drew them), checked against a replaying run's config;
- `rollout_NNNNNN.safetensors`, one per rollout in the order the run trained on them: the tensors of TENSORS (the
  left-padded prompt + response ids, masks, the sampler's logprobs of the sampled tokens, which rows ended with EOS)
  and, as the safetensors metadata key `rlrun`, one JSON object: `prompt_len`, the task rows, the completions, each
  row's total reward (`totals`) and each reward function's values (`by_reward`);
- `rollouts.jsonl`, one line per rollout: {"n", "file", "sha256", "step", "version", "rows"}: the file's digest, the
  first optimizer step that trained on it, and the optimizer steps of the weights that drew it. The record's digest
  is the sha256 of this file.

Each rollout's file is written under a temporary name and renamed, then its line appended (and fsynced): a run
killed mid-write leaves every listed rollout whole. A resumed recording run (`resume=true`) cuts the index back to
the rollouts its checkpoint had consumed and writes the rest again (a resume is bit-identical, so are they).
With data parallel (engine=deepspeed, W ranks) a record is still the whole rollout: the recording run gathers the
ranks' shares onto rank 0, which writes them in rank order, padded as one process pads (`join`); a replaying run of
any world reads the whole rollout and takes its rank's rows (`share`). The rows are a run's global order either
way (sampling.prompts_of), so a record made on 2 ranks holds the rollouts one process would record, and replays on 1
or 4.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from typing import Any

from ..config import warm_start as warm_start_config
from ..errors import RecordError
from ..folders import sha256
from ..nofollow import appending, write_replacing

# 2: the warm start and the model's weight files are fixed too (a format 1 record fixes neither: a replay of it with
# warm_start.enabled=true, or after the weights at model.path changed, trained off-policy without a word)
FORMAT = 2
HEADER, INDEX = "record.json", "rollouts.jsonl"
# the temporary name write_replacing gives a record's file (`<name>.tmp<pid>`)
LEFTOVER = re.compile(r"(record\.json|rollouts\.jsonl|rollout_\d{6}\.safetensors)\.tmp\d+")
TENSORS = ("input_ids", "attention_mask", "response_mask", "gen_logprobs", "finished")
# What a record's rollouts depend on: a replaying run must have the same (the training side is free).
FIXED = ("rollout.temperature", "rollout.top_p", "rollout.top_k", "rollout.max_new_tokens", "train.group_size",
         "train.rollout_batch", "train.dynamic_sampling", "seed", "task", "model", "warm_start")
# keys inside a FIXED node that no rollout depends on: how long a reward call may take (a record holds the rewards
# it got), and DPO's pair columns. Left out of a record and of the comparison (a record made before says them)
UNFIXED = ("task.reward_timeout_s", "task.chosen_key", "task.rejected_key")
# FIXED keys added since records were first made, as a record without them was drawn: rollout.top_k off
RECORDED_BEFORE = {"rollout.top_k": 0}
# the files of a model folder that hold its weights (transformers' names), digested into the record (weights_digest)
WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack")
_digests: dict[tuple, str] = {}  # (path, size, mtime) -> sha256: a paired sweep asks once per job, the files once


def fixed(cfg) -> dict:
    """The FIXED values of a config (typed or DictConfig), as plain JSON values; the model without model.lora (the
    adapters are trained, a training-side choice)."""
    from omegaconf import OmegaConf

    out = {}
    for key in FIXED:
        node = cfg
        for part in key.split("."):
            node = getattr(node, part)
        value: Any = node
        if dataclasses.is_dataclass(node) and not isinstance(node, type):
            value = dataclasses.asdict(node)
        elif OmegaConf.is_config(node):
            value = OmegaConf.to_container(node, resolve=True)
        if key == "model":
            value = {k: v for k, v in value.items() if k != "lora"}
            value["weights_sha256"] = weights_digest(node)
        if key == "warm_start":
            value = warm_start(cfg)
        if isinstance(value, dict):
            value = {k: v for k, v in value.items() if f"{key}.{k}" not in UNFIXED}
        out[key] = json.loads(json.dumps(value, default=str))
    return out


def warm_start(cfg) -> dict:
    """What the warm start does to the weights the rollouts were drawn with: whether it runs (`auto` resolved) and,
    when it does, what it computes (warmstart.options: not `cache`, which changes where it is kept, not the result)."""
    if not warm_start_config.applies(cfg):
        return {"applies": False}
    node = cfg.warm_start
    if dataclasses.is_dataclass(node) and not isinstance(node, type):  # a typed config
        node = dataclasses.asdict(node)
    return {"applies": True, **warm_start_config.options(node)}


def weights_digest(model_cfg) -> str | None:
    """The sha256 over the weight files of `model.path` (a folder: its WEIGHT_FILES by name and content; a file: a
    GGUF), so that a record refuses a replay after the weights at the same path changed; None for a model without
    local files (model=tiny, built in code; a hub id, which is not downloaded to check a config)."""
    path = getattr(model_cfg, "path", None)
    if not path:
        return None
    path = os.path.expanduser(str(path))
    if os.path.isfile(path):
        files = [path]
    elif os.path.isdir(path):
        gguf = getattr(model_cfg, "gguf_file", None)
        names = sorted(n for n in os.listdir(path) if n.endswith(WEIGHT_FILES))
        files = [os.path.join(path, n) for n in names] + ([os.path.join(path, gguf)] if gguf else [])
    else:
        return None
    h = hashlib.sha256()
    for file in files:
        st = os.stat(file)
        key = (os.path.realpath(file), st.st_size, st.st_mtime_ns)
        if key not in _digests:
            _digests[key] = sha256(file)
        h.update(f"{os.path.basename(file)}\0{_digests[key]}\n".encode())
    return h.hexdigest()


def _flat(value, prefix: str = ""):
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _flat(v, f"{prefix}.{k}" if prefix else k)
    else:
        yield prefix, value


def differences(recorded: dict, now: dict) -> list[str]:
    """`key was X in the record, now Y` for each FIXED value (flattened) that differs."""
    a, b = {**RECORDED_BEFORE, **dict(_flat(recorded))}, dict(_flat(now))
    return [f"{k} was {a.get(k)!r} in the record, now {b.get(k)!r}" for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k) and k not in UNFIXED]


class Record:
    """A record folder opened for reading: its header, its index (each line's file checked when read)."""

    def __init__(self, path: str, key: str = "rollout.path"):
        self.path, self.key = path, key  # `key`: the config key that named the folder (in every error)
        header = os.path.join(path, HEADER)
        if not os.path.isdir(path):
            raise RecordError(f"{key}={path!r} is not a folder; give the rollout.record folder of an earlier "
                              "run (docs/replay.md)")
        try:
            with open(header) as f:
                self.header = json.load(f)
        except (OSError, ValueError) as e:
            raise RecordError(f"{key}={path!r}: {header} cannot be read ({type(e).__name__}: {e}); it is not "
                              "a rollout record, or a damaged one. Record one with rollout.record=DIR.") from None
        if self.header.get("format") != FORMAT:
            raise RecordError(f"{key}={path!r}: record format {self.header.get('format')!r}, this rlrun "
                              f"reads format {FORMAT} (format 1 fixes neither the warm start nor the model's "
                              "weights, so a replay could not be checked against them): record it again")
        self.entries = read_index(path)

    @property
    def digest(self) -> str:
        index = os.path.join(self.path, INDEX)
        return sha256(index) if os.path.exists(index) else hashlib.sha256(b"").hexdigest()

    def __len__(self) -> int:
        return len(self.entries)

    def read(self, n: int, device) -> tuple[dict, dict]:
        """Rollout `n`: (its tensors on `device`, its metadata), after checking the file against its digest. The
        file is read once: the bytes hashed are the bytes loaded."""
        from safetensors.torch import load

        if n >= len(self.entries):
            raise RecordError(f"{self.key}={self.path!r} holds {len(self.entries)} rollouts and this run needs "
                              f"rollout {n + 1}: lower train.steps, or record a longer run")
        entry = self.entries[n]
        file = os.path.join(self.path, entry["file"])
        try:
            with open(file, "rb") as f:
                data = f.read()
        except OSError:
            data = None
        if data is None or hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise RecordError(f"{self.key}={self.path!r}: {file} is missing or changed since it was recorded (its "
                              "sha256 differs from rollouts.jsonl's); the record cannot be replayed. Record it again.")
        try:
            # safetensors' layout: an 8-byte little-endian header length, then the JSON header with __metadata__
            header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
            meta = json.loads(header["__metadata__"]["rlrun"])
            loaded = load(data)
            tensors = {k: loaded[k].to(device) for k in TENSORS}
        except (KeyError, ValueError, TypeError, OSError) as e:  # e.g. written by another version of the format
            raise RecordError(f"{self.key}={self.path!r}: {file} is not a rollout of record format {FORMAT} "
                              f"({type(e).__name__}: {e}). Record it again.") from None
        tensors["finished"] = tensors["finished"].bool()
        tensors["response_mask"] = tensors["response_mask"].bool()
        return tensors, {**meta, "version": entry["version"], "step": entry["step"]}


def parts_of(d) -> tuple[dict, dict]:
    """A drawn rollout (sampling.Drawn) as a record holds it: (its tensors of TENSORS on the CPU, its metadata)."""
    roll = d.roll
    tensors = {"input_ids": roll.input_ids, "attention_mask": roll.attention_mask,
               "response_mask": roll.response_mask.to(dtype=roll.input_ids.dtype),
               "gen_logprobs": roll.gen_logprobs, "finished": roll.finished.to(dtype=roll.input_ids.dtype)}
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    task_rewards = {k: v for k, v in d.by_reward.items() if k != "overlong_penalty"}  # shaping is re-applied
    meta = {"prompt_len": roll.prompt_len, "rows": d.rows, "completions": roll.completions, "totals": d.totals,
            "by_reward": task_rewards}
    return tensors, meta


def join(parts: list[tuple[dict, dict]], pad_id: int) -> tuple[dict, dict]:
    """The ranks' shares of one rollout (`parts_of` each, in rank order) as the whole rollout: every share's prompts
    left-padded and responses right-padded to the widest share (with `pad_id`, masks 0, logprobs 0), as one
    process pads the rollout it generates whole."""
    import torch

    prompt = max(m["prompt_len"] for _, m in parts)
    width = max(t["input_ids"].shape[1] - m["prompt_len"] for t, m in parts)  # the longest response

    def padded(t: dict, m: dict) -> dict:
        left, right = prompt - m["prompt_len"], width - (t["input_ids"].shape[1] - m["prompt_len"])
        out = {}
        for k in ("input_ids", "attention_mask"):
            fill = pad_id if k == "input_ids" else 0
            out[k] = torch.nn.functional.pad(t[k], (left, right), value=fill)
        for k in ("response_mask", "gen_logprobs"):
            out[k] = torch.nn.functional.pad(t[k], (0, right), value=0)
        out["finished"] = t["finished"]
        return out

    tensors = [padded(t, m) for t, m in parts]
    whole = {k: torch.cat([t[k] for t in tensors]) for k in TENSORS}
    metas = [m for _, m in parts]
    meta = {"prompt_len": prompt, **{k: [x for m in metas for x in m[k]] for k in ("rows", "completions", "totals")},
            "by_reward": {name: [x for m in metas for x in m["by_reward"][name]] for name in metas[0]["by_reward"]}}
    return whole, meta


def share(tensors: dict, meta: dict, rank: int, world: int) -> tuple[dict, dict]:
    """Rank `rank`'s rows of a whole rollout (a contiguous block of whole groups, as sampling.prompts_of gives each
    rank), without the columns none of them uses: the prompt and response widths that rank pads its own to."""
    n = len(meta["rows"]) // world
    rows = slice(rank * n, (rank + 1) * n)
    used = tensors["attention_mask"][rows].ne(0).any(0).nonzero().flatten().tolist()
    first, last = min(used[0], meta["prompt_len"]), max(used[-1] + 1, meta["prompt_len"])
    response = slice(0, last - meta["prompt_len"])
    out = {k: tensors[k][rows, first:last] for k in ("input_ids", "attention_mask")}
    out.update({k: tensors[k][rows, response] for k in ("response_mask", "gen_logprobs")})
    out["finished"] = tensors["finished"][rows]
    mine = {"prompt_len": meta["prompt_len"] - first,
            **{k: meta[k][rows] for k in ("rows", "completions", "totals")},
            "by_reward": {name: values[rows] for name, values in meta["by_reward"].items()}}
    return out, {**meta, **mine}


def read_index(path: str) -> list[dict]:
    """The index's entries, in order; RecordError naming the line that is not one."""
    index = os.path.join(path, INDEX)
    if not os.path.exists(index):
        return []
    entries: list[dict] = []
    with open(index) as f:
        for i, line in enumerate(f, 1):
            try:
                entry = json.loads(line)
                ok = entry["n"] == len(entries) and {"file", "sha256", "step", "version"} <= set(entry)
            except (ValueError, KeyError, TypeError):
                ok = False
            if not ok:
                raise RecordError(f"{index}: line {i} is not the record of rollout {len(entries)} (a torn or edited "
                                  "index); the record cannot be read. Record it again.")
            entries.append(entry)
    return entries


def check_folder(path: str, cfg, resumed: bool) -> list[dict]:
    """The entries a recording run continues from: none for a new or empty folder; a record's, when this run
    resumes the run that recorded it (same FIXED values). RecordError for any other folder."""
    if os.path.islink(path) and not os.path.exists(path):  # the recorder's makedirs would fail mid-run on it
        raise RecordError(f"rollout.record={path!r} is a symbolic link to nothing ({os.readlink(path)}); give a new "
                          "folder, or make the folder it points to")
    if not os.path.exists(os.path.join(path, HEADER)):
        if os.path.isdir(path) and os.listdir(path):
            raise RecordError(f"rollout.record={path!r} is a folder with other files; choose an empty or new folder "
                              "for the record")
        if os.path.exists(path) and not os.path.isdir(path):
            raise RecordError(f"rollout.record={path!r} is a file; give a folder for the record")
        return []
    earlier = Record(path)
    if not resumed:
        raise RecordError(f"rollout.record={path!r} holds a record already ({len(earlier)} rollouts); a new run "
                          "would mix its rollouts into it. Choose an empty folder, or resume=true to continue the "
                          "run that recorded it.")
    changed = differences(earlier.header["fixed"], fixed(cfg))
    if changed:
        raise RecordError(f"rollout.record={path!r} was recorded with another config: " + "; ".join(changed))
    return earlier.entries


def as_dataset(tracker, rec: Record, context: str) -> None:
    """The record `rec` as a dataset of the run (MLflow: a dataset input, context `recorded` or `replay`), named by
    its folder, its digest the record's (the sha256 of its index)."""
    tracker.dataset(f"rollouts {os.path.basename(os.path.abspath(rec.path))}", rec.digest, rec.path, context,
                    {"rollouts": len(rec), "format": FORMAT})


class Recorder:
    """Writes the rollouts of a run to `path` (check_folder says which folders it may write to)."""

    def __init__(self, path: str, cfg, resumed: bool):
        self.path = path
        self.entries = check_folder(path, cfg, resumed)
        # resumed: a writer killed mid-write left its temporary file (nofollow.write_replacing)
        if resumed and os.path.exists(os.path.join(path, HEADER)):
            for name in os.listdir(path):
                if LEFTOVER.fullmatch(name) and not os.path.islink(os.path.join(path, name)):
                    os.remove(os.path.join(path, name))
        if not os.path.exists(os.path.join(path, HEADER)):
            os.makedirs(path, exist_ok=True)
            header = {"format": FORMAT, "fixed": fixed(cfg)}
            write_replacing(os.path.join(path, HEADER), (json.dumps(header, indent=1) + "\n").encode(), fsync=True)

    def write(self, n: int, tensors: dict, meta: dict, version: int, step: int) -> None:
        """Rollout number `n` (`parts_of` a drawn rollout, or the ranks' shares `join`ed; drawn by the weights after
        `version` optimizer steps, first trained at `step`). A resumed run writes from its checkpoint's rollout on:
        later lines are cut first."""
        from safetensors.torch import save

        if n > len(self.entries):
            raise RecordError(f"rollout.record={self.path!r} holds {len(self.entries)} rollouts and this run is at "
                              f"rollout {n}: a record must start with the run (set rollout.record when it starts)")
        if n < len(self.entries):  # resumed: the rollouts after the checkpoint are recorded again
            self.entries = self.entries[:n]
            self._write_index()
        name = f"rollout_{n:06d}.safetensors"
        # one metadata key: safetensors writes its metadata map in an arbitrary order, so a file's digest would vary
        data = save(tensors, metadata={"rlrun": json.dumps(meta, default=str, sort_keys=True)})
        write_replacing(os.path.join(self.path, name), data, fsync=True)
        self.entries.append({"n": n, "file": name, "sha256": hashlib.sha256(data).hexdigest(), "step": step,
                             "version": version, "rows": len(meta["rows"])})
        with appending(os.path.join(self.path, INDEX)) as f:  # never through a link
            f.write(json.dumps(self.entries[-1]) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def _write_index(self) -> None:
        text = "".join(json.dumps(e) + "\n" for e in self.entries)
        write_replacing(os.path.join(self.path, INDEX), text.encode(), fsync=True)
