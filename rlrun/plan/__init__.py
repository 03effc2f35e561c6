"""Memory you can know before the run: each phase's peak, predicted from arithmetic on the config and the model's
shapes (a meta-device model: no weights are built), with what dominates it.

A phase's *growth* is what it allocates on top of what was in use when it began (what `mem/<phase>_growth_mib`
measures); the *resident* memory is what lives across phases on the device (weights, the reference copy,
optimizer state). Predicted device peak = resident + growth. Every term is a count of tensor bytes (terms.py):

- generate: the KV cache (2 x layers x rows x (prompt + new tokens) x kv heads x head dim) and, per decode step,
  the last position's logits and the sampler's [rows, vocab] fp32 temporaries (rollout/hf.py).
- old / ref logprobs (no grad): the final hidden states, under bf16 autocast the policy's bf16 weight copies
  (autocast's cache), one layer's activations and the head's working set: dense holds two [tokens, vocab] fp32
  tensors at once (the tempered logits and their log-softmax); tiled/chunked one [tile, vocab] fp32 tile. On a
  CUDA device only the larger of the layer's and the head's counts (the layer's is freed when it returns); CPU
  RSS keeps the freed layer's heap blocks, so there both do.
- train, at its peak (the head's backward in a micro-batch after the first): the gradients already accumulated,
  the backbone's activations saved for backward (per `activations` option), autocast's bf16 weight copies, and
  the head: dense three [tokens, vocab] fp32 tensors in backward; tiled/chunked one tile and a 16-row entropy
  buffer; the next lm-head gradient before it is added to the one already there (plus the fp32 accumulator of
  tiled/chunked and the fp32 cast of the lm-head weight when the weights are bf16). On CPU also the heap blocks
  that freed sub-MiB tensors leave (glibc), which RSS counts and CUDA's allocated bytes do not.
  loss.agg other than token_mean and loss=gspo add the step's per-token weights and sequence ids, and gspo on
  tiled every token's logprob from its first sweep (`objective_parts`).
- generate with train.dynamic_sampling: the rollouts of the earlier rounds, kept until the rollout is chosen.
- rollout.pipeline=async: generate is planned on the worker process's own copy of the weights; the trainer's
  phases carry the two shared weight slots (CPU) or the worker's generate peak (an accelerator they share).
- resident: weights (fp32 masters under train.precision=bf16 on engine=single; bf16 weights plus an fp32 master
  inside DeepSpeed's optimizer), the reference copy, AdamW's two moments; ZeRO shards them over the ranks.

Tokens per micro-batch are an upper bound: GRPO responses as long as rollout.max_new_tokens (a rollout stops when
every row has ended), prompts as long as the longest one of the task; DPO pairs as long as the longest pair.
batching=packed|shared_prompt: a forward holds at most batching.max_tokens positions (and its mask, rows x width^2
booleans) however many rows the micro-batches have; shared_prompt lays out each group's prompt once.
docs/plan.md and docs/benchmarks.md have the measured accuracy.

Modules: shapes.py (the model and the micro-batch), terms.py (each term), phases.py (the prediction), text.py
(`rlrun plan`: the text, the activations term per option, the switches that would make a run fit).
"""

from .phases import HEAP, Phase, Plan, grad_accum, metrics, predict, resolve_size, trained, within, world_size
from .shapes import Shapes, inputs, lengths, meta_model, shapes_of, weight_dtype
from .terms import (
    FP32,
    MIB,
    SAVED,
    activation_kind,
    auto_size,
    default_budget,
    first_call,
    head_parts,
    layer_bytes,
    objective_parts,
    resident,
    saved_activations,
)
from .text import activation_lines, detail, fit_lines, report, table

__all__ = ["FP32", "HEAP", "MIB", "SAVED", "Phase", "Plan", "Shapes", "activation_kind", "activation_lines",
           "auto_size", "default_budget", "detail", "first_call", "fit_lines", "grad_accum", "head_parts", "inputs",
           "layer_bytes", "lengths", "meta_model", "metrics", "objective_parts", "predict", "report", "resident",
           "resolve_size", "saved_activations", "trained", "within", "shapes_of", "table", "weight_dtype", "world_size"]
