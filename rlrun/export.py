"""Export the policy as a plain transformers folder: `save_pretrained` weights and config plus the tokenizer.

The folder loads with `AutoModelForCausalLM.from_pretrained(folder)` and `AutoTokenizer.from_pretrained(folder)`
alone (the embedded character tokenizer is a `PreTrainedTokenizerFast`, saved as tokenizer.json), and through
rlrun's own `model=hf model.path=<folder>`. It is written atomically: into `<folder>.tmp`, then renamed, so a
crash never leaves a half-written folder under the final name. It replaces only an empty folder or an earlier
rlrun export that holds exactly what that export wrote, one export per folder at a time, and `export.dir` given as
a link is written into the folder it points to (rlrun/exportdir.py). A LoRA adapter of a model built in code
(model=tiny) gets its base model in `base/` beside it. Under `engine=deepspeed` with ZeRO-3 each rank holds a slice
of every parameter: all ranks gather them (a collective), rank 0 writes, the others wait at a barrier. With
ZeRO-1/2 every rank already holds the full weights; rank 0 writes.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil

import torch

from . import exportdir, folders, models
from .errors import ExportError


def _zero3(engine) -> bool:
    config = getattr(engine, "config", None) or {}
    return config.get("zero_optimization", {}).get("stage") == 3


def _gathered(model, engine):
    """All parameters whole on every rank while inside (ZeRO-3), else nothing to do."""
    if engine is None or not _zero3(engine):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None)


def cpu_state_dict(model) -> dict[str, torch.Tensor]:
    """A CPU copy of the state dict; tensors that share storage (tied embeddings) stay shared, so save_pretrained
    sees the tie it expects."""
    copies: dict[tuple, torch.Tensor] = {}
    out = {}
    for name, t in model.state_dict().items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        if key not in copies:
            copies[key] = t.detach().to("cpu", copy=True)
        out[name] = copies[key]
    return out


def _keep_padding_side(folder: str, tokenizer) -> None:
    """transformers saves the padding side given at construction, not one set later (rlrun sets "left" for
    generation): write the current one, so batched generation from the folder pads on the right side."""
    path = os.path.join(folder, "tokenizer_config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    config["padding_side"] = tokenizer.padding_side
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)


def _save(model, wrapped, state, tokenizer, tmp: str, lora: str) -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one shard of a small model: no bar in rlrun's console
    try:
        if wrapped is not None and lora == "adapter":
            wrapped.save_pretrained(tmp)
        else:
            model.save_pretrained(tmp, state_dict=state)
    finally:
        hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(tmp)
    _keep_padding_side(tmp, tokenizer)


def _with_base(base, base_state, tokenizer, tmp: str, folder: str) -> None:
    """An adapter of a model built in code (model=tiny) has no base to load onto: write the base (the weights the
    adapters were trained on) in `base/` beside the adapter and point the adapter's config at it."""
    base.save_pretrained(os.path.join(tmp, "base"), state_dict=base_state)
    tokenizer.save_pretrained(os.path.join(tmp, "base"))
    path = os.path.join(tmp, "adapter_config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    config["base_model_name_or_path"] = os.path.join(folder, "base")  # absolute: peft resolves it from the cwd
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)


def _needs_base(wrapped, lora: str) -> bool:
    """An adapter export whose base model has no folder to load from (built in code, not from a path)."""
    if wrapped is None or lora != "adapter":
        return False
    name = getattr(wrapped.get_base_model().config, "_name_or_path", "") or ""
    return not os.path.isdir(name)


def export(model, tokenizer, folder: str, *, engine=None, lora: str = "merged") -> str | None:
    """Write `model` (unwrapped from DeepSpeed/DDP/PEFT wrappers) and `tokenizer` to `folder`; returns the folder
    on the rank that wrote it, None on the others. `engine`: the run's engine (rlrun.engine.*), for ZeRO-3
    gathering and the rank; None means one process. A model with LoRA adapters is written with the adapters merged
    into its weights (`lora="merged"`: a plain transformers folder) or as peft's adapter folder (`"adapter"`:
    `PeftModel.from_pretrained(base, folder)` loads it onto the base model)."""
    wrapped = models.peft_model(model)
    lm = models.unwrap(model)
    rank = getattr(engine, "rank", 0) if engine is not None else 0
    folder = exportdir.resolve(folder) if rank == 0 else os.path.abspath(folder)  # a link: into its folder
    base = None
    with _gathered(lm, engine):  # collective: every rank enters, whoever writes
        if rank == 0 and wrapped is not None and lora == "merged":
            lm = copy.deepcopy(wrapped).merge_and_unload()  # a copy: training goes on with the adapters
        if rank == 0 and _needs_base(wrapped, lora):
            model_only = copy.deepcopy(wrapped).unload()  # the base without the adapter layers
            base = (model_only, cpu_state_dict(model_only))
        state = cpu_state_dict(lm) if rank == 0 else None
    if rank == 0:
        folder = _write(lm, wrapped, state, tokenizer, folder, lora, base)
    if engine is not None and getattr(engine, "world", 1) > 1:
        import torch.distributed as dist

        dist.barrier()  # the folder exists for every rank once this returns
    return folder if rank == 0 else None


def _same_modes(folder: str) -> None:
    """Every file of the export gets the mode a new file gets here (0644 under the usual umask 022): safetensors
    writes `model.safetensors` through a temporary file of mode 0600, which another user (a shared evaluation
    job) could not read while the tokenizer and config beside it are readable. The folder is new and ours
    (`<folder>.tmp`), so there is no link of anyone's in it; a link there anyway is left as it is."""
    mask = os.umask(0o022)  # the only way to read the umask is to set it; put back at once
    os.umask(mask)
    for top, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(top, name)
            if not os.path.islink(path):
                os.chmod(path, 0o666 & ~mask)


def _write(lm, wrapped, state, tokenizer, folder: str, lora: str, base: tuple[torch.nn.Module, dict] | None) -> str:
    """Into a new `<folder>.tmp` (its manifest first, marked in progress; listing every file last), then renamed
    over `folder` (rlrun.exportdir.replace_export), holding the folder's export lock (a checkpoint's export: the
    checkpoint folder's lock); a write that fails leaves no `.tmp` and names the path, the bytes and the fix."""
    tmp = f"{folder}.tmp"
    covered = os.path.realpath(os.path.dirname(folder)) in folders.HELD
    with exportdir.own_export(None if covered else folder):
        exportdir.clear_tmp(tmp)
        os.mkdir(tmp)  # new: never an existing folder, never through a link
        try:
            exportdir.mark(tmp)
            _save(lm, wrapped, state, tokenizer, tmp, lora)
            if base is not None:
                _with_base(*base, tokenizer, tmp, folder)
            _same_modes(tmp)
            exportdir.mark(tmp, complete=True)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            nbytes = sum(t.numel() * t.element_size() for t in (state or {}).values())
            raise ExportError(folders.no_room(folder, e, nbytes, "free space or set export.dir to another disk; "
                                              "the last checkpoint, if any, holds the trained weights.")) from None
        return exportdir.replace_export(tmp, folder)
