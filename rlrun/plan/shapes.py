"""What the plan needs of a model and its data: the shapes (from a meta-device model: no weights are built) and the
token counts of a micro-batch."""

from __future__ import annotations

from dataclasses import dataclass

from .. import activations, algorithms, models, precision, registry


@dataclass
class Shapes:
    """What the arithmetic needs of a model."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    kv_dim: int  # kv heads x head dim
    params: int  # every parameter (tied ones once)
    trainable: int  # parameters with gradients and optimizer state
    head_trainable: bool  # the lm-head weight gets a gradient (not with LoRA)
    param_bytes: int  # bytes per weight as it lives on the device
    layer_matrices: int = 0  # trainable 2-D weights of the decoder layers (bf16 autocast caches a copy of each)
    layer_weights: int = 0  # every 2-D weight of the decoder layers, frozen ones too (autocast casts each per call)
    embedding: str = "frozen"  # the input embedding: "frozen", "trained" (its own) or "tied" (the lm head's, trained)


def weight_dtype(cfg) -> str:
    """The dtype the weights live in on the device: DeepSpeed's bf16 mode casts the module to bf16; otherwise
    model.dtype (train.precision=bf16 on engine=single keeps them fp32: they are the master copy)."""
    return "bfloat16" if precision.path(cfg) == "bf16-deepspeed" else cfg.model.dtype


def shapes_of(model, dtype: str) -> Shapes:
    """Shapes of a built model (real or on the meta device), LoRA adapters included; `dtype`: weight_dtype(cfg)."""
    lm = models.unwrap(model)
    c = lm.config.get_text_config(decoder=True)
    _, weight = models.split(model)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    params = list(model.parameters())  # whole: the runner plans before the engine partitions them (ZeRO-3)
    vocab, hidden = weight.shape
    matrices = [p for p in activations.decoder_layers(model).parameters() if p.dim() == 2]
    embedded = lm.get_input_embeddings().weight
    embedding = "frozen" if not embedded.requires_grad else "tied" if embedded is weight else "trained"
    return Shapes(vocab=vocab, hidden=hidden, intermediate=getattr(c, "intermediate_size", 0)
                  or 4 * c.hidden_size, layers=c.num_hidden_layers, kv_dim=kv * head_dim,
                  params=sum(p.numel() for p in params), trainable=sum(p.numel() for p in params if p.requires_grad),
                  head_trainable=bool(weight.requires_grad), param_bytes=models.DTYPES[dtype].itemsize,
                  layer_matrices=sum(p.numel() for p in matrices if p.requires_grad),
                  layer_weights=sum(p.numel() for p in matrices), embedding=embedding)


def meta_model(mcfg, seed: int):
    """(the model on the meta device, its tokenizer): shapes without weights, LoRA adapters added as in a run."""
    import torch

    model, tokenizer = registry.get("model", mcfg.name).meta(mcfg, seed)
    models.split(model)
    if mcfg.lora.enabled:
        with torch.device("meta"):
            model = models.add_lora(model, mcfg.lora)
    return model, tokenizer


def lengths(cfg, tokenizer, rows: list[dict]) -> tuple[int, int, int]:
    """(rows per micro-batch, positions per row, response tokens per micro-batch), upper bounds from the data."""
    from ..tasks.lengths import token_lengths

    mb = cfg.train.micro_batch
    prompts = token_lengths(tokenizer, [r["prompt"] for r in rows]) or [0]
    if algorithms.of(cfg).pairs:  # chosen and rejected of each pair, each with the EOS the pair encoder appends
        sides = [token_lengths(tokenizer, [r[k] for r in rows]) for k in ("chosen", "rejected")]
        longest = max(max(c, r) + 1 for c, r in zip(*sides))
        return 2 * mb, max(p + max(c, r) + 1 for p, c, r in zip(prompts, *sides)), 2 * mb * longest
    cut = getattr(cfg.task, "max_prompt_tokens", None)
    prompt = min(max(prompts), cut) if cut else max(prompts)
    new = cfg.rollout.max_new_tokens
    return mb, prompt + new, mb * new


def task_rows(cfg, tokenizer) -> list[dict]:
    """The rows a run sizes its micro-batches from: the task's training rows, or its preference pairs (DPO)."""
    from .. import tasks

    if algorithms.of(cfg).pairs:
        return tasks.load_pairs(cfg.task, cfg.seed, tokenizer)[0]
    return tasks.load(cfg.task, cfg.seed, tokenizer).train


def inputs(cfg) -> tuple[Shapes, int, int, int]:
    """(shapes, rows, positions per row, response tokens) per micro-batch of a validated config, from a meta-device
    model and the task's rows: what predict needs, without building any weights."""
    model, tokenizer = meta_model(cfg.model, cfg.seed)
    return (shapes_of(model, weight_dtype(cfg)), *lengths(cfg, tokenizer, task_rows(cfg, tokenizer)))
