"""The terms of the plan, each a count of tensor bytes written next to what allocates it (see the package docstring).

The per-token constants of a decoder layer were counted with saved-tensor hooks (tests/unit/plan/test_plan.py checks
them at hidden 64-512, with and without GQA, for each precision path): they are what autograd keeps, exactly.
"""

from __future__ import annotations

from .. import algorithms, registry
from ..config import ConfigError
from ..heads.common import ROWS  # rows of the heads' entropy block buffer
from ..losses.bound import sequence_level

MIB = 2**20
FP32 = 4
SAMPLER_COPIES = 7  # [rows, vocab] fp32 tensors alive at once in a decode step (logits copy, log-softmax, noise...)
# Bytes a decoder layer (attention + gated MLP) saves for backward, per token, per unit of hidden / kv / intermediate
# width, by the dtype its activations are in: fp32 (norm inputs and outputs, q/k/v before and after rotary,
# attention output, residuals; gate, up, act(gate), act(gate) * up); bf16 autocast over fp32 weights (matmul
# outputs in bf16, the residual stream and the norms in fp32); bf16 weights (bf16, the norms' fp32 upcasts).
SAVED = {"fp32": (32, 8, 16), "autocast": (34, 0, 8), "bf16": (20, 4, 8)}
OUTSIDE = {"fp32": 8, "autocast": 8, "bf16": 6}  # bytes per token and unit of hidden saved outside the layers
# (the embedding output and the final norm's input and output; the norm computes in fp32)
LIVE_H, LIVE_I = 4, 3  # elements per token alive at once in one layer without grad (the MLP's intermediates)
# What a head's first call at a size keeps allocated beyond its working set (BLAS packing buffers that grow with the
# hidden size: measured 3.1-3.3 MiB at hidden 64, 6.3-6.8 MiB at 256, whatever the vocab and tokens): counted by
# head.size=auto so that a fresh process stays within the budget.
FIRST_CALL, FIRST_CALL_PER_HIDDEN = 5 * MIB // 2, 20 * 2**10
# CPU only: glibc serves blocks under the meter's mmap threshold (1 MiB, meters.py) from its heap, and of the blocks
# that the [tokens, hidden] tensors of a train pass free, not all are reused before the peak: RSS exceeded the live
# tensors by 2 MiB + 22 such fp32 blocks per layer whose internals are saved (measured at hidden 32-256, 2-8 layers,
# 640 positions per forward, 4 micro-batches: 5-85 MiB, each within 3 MiB of this), by about 13 under bf16 autocast
# (half of them bf16; hidden 128 and 256), and by nothing once a block is 1 MiB or more (hidden 512 there). bf16
# weights: 11, half of fp32's, not measured. Only when a step has a second forward (micro-batches that accumulate,
# or the packs of batching=packed|shared_prompt): a step of one forward starts on the heap the previous step left
# and reuses it (bench plan, 2048 tokens in one micro-batch: over-predicted by the whole term, 13-35 MiB, with it;
# within 10% without).
HEAP_THRESHOLD, HEAP_BASE, HEAP_BLOCKS = MIB, 2 * MIB, {"fp32": 22, "autocast": 13, "bf16": 11}
# activations=checkpoint: each layer rerun in backward leaves blocks too, interleaved with its weight gradients (and
# under autocast its bf16 weight casts), so the first counts as a saved layer and every further one adds: fp32 10
# (measured 10.2-10.8 per layer at hidden 128 and 256, 4 layers, padded and packed; 6.7 at 8 layers padded),
# autocast 13 (12-19: padded 12, packed 14-17, shared_prompt 18-20), bf16 weights 5 (half of fp32's, not measured).
# Counting them as one layer in all missed every checkpointed step with a second forward by 13-43 MiB (-9 to -23%).
HEAP_RECOMPUTED = {"fp32": 10, "autocast": 13, "bf16": 5}
# LoRA: each adapted linear whose output is [tokens, hidden] (q, k, v, o, down) makes its adapter's output, the
# scaled copy and the sum as sub-MiB temporaries while its small [tokens, rank] input to B stays saved between them:
# 13 more blocks per layer whose internals are saved, in fp32 (measured 8.5-14 at hidden 128 and 256, padded and
# shared_prompt, all-linear targets; without them a padded LoRA step at hidden 256 was planned 24% under). bf16
# temporaries are half the bytes, so half the blocks of this unit (autocast: one point, checkpointed, where RSS
# varied 56-87 MiB from run to run; counted on every layer it was 50 MiB over, on the layers that save as here
# within the floor). A checkpointed layer's forward saves nothing between its temporaries: not counted.
HEAP_LORA = {"fp32": 13, "autocast": 7, "bf16": 7}


def activation_kind(param_bytes: int, autocast: bool) -> str:
    """The dtype family of the activations: fp32, autocast (bf16 compute over fp32 weights) or bf16 weights."""
    if param_bytes == FP32:
        return "autocast" if autocast else "fp32"
    return "bf16"


def layer_bytes(s, kind: str) -> int:
    """Bytes one decoder layer saves for backward per token."""
    per_h, per_kv, per_i = SAVED[kind]
    return per_h * s.hidden + per_kv * s.kv_dim + per_i * s.intermediate


def saved_activations(option, s, layer_tokens: int, kind: str, device_type: str) -> dict[str, int]:
    """What the train pass keeps for its backward under the `activations` option object `option` (its `memory`
    term, given this module's per-token bytes). The layers' inputs are the residual stream: fp32 under autocast."""
    return option.memory(s, layer_tokens, layer_bytes(s, kind), layer_tokens * OUTSIDE[kind] * s.hidden,
                         2 if kind == "bf16" else FP32, device_type)


END_OF_BACKWARD = "the input embedding's gradient at the end of backward (tied: with the lm head's, held since)"


def end_of_backward(s, forwards: int) -> int:
    """Bytes besides the accumulated gradients at the end of a backward, once the activations are freed: the input
    embedding's backward makes a dense [vocab, hidden] gradient. Tied to the lm head, the lm head's gradient of that
    same weight waits in autograd's buffer from the head's backward to the embedding's (the last), and the two are
    summed into a third before they reach .grad: three [vocab, hidden] tensors beside the gradients, two in a step's
    only backward, whose sum becomes .grad itself (measured with transformers' Llama, vocab 32000, hidden 512:
    188 MiB of new tensors in a second backward, 3 x 62.5). Untied, the embedding's own gradient is one, and none
    in a step's only backward (it becomes .grad). A frozen embedding (LoRA) makes none."""
    per = s.vocab * s.hidden * s.param_bytes
    copies = {"tied": 3, "trained": 1}.get(s.embedding, 0) - (1 if forwards == 1 and s.embedding != "frozen" else 0)
    return per * copies


def mask_copy(mask_elements: int, kind: str) -> int:
    """Bytes of torch sdpa's additive copy of a boolean attention mask ([rows, 1, L, L] with padding, a pack's rows
    with packing), in the queries' dtype (fp32; bf16 under autocast and with bf16 weights). Every attention call
    makes one, and a layer that saves its internals keeps it for backward: L^2 per row, so at long sequences of a
    narrow model it is a large part of what a layer saves (576 positions at hidden 32: 40.5 MiB a layer for 32 rows,
    beside 60 MiB of its other saved tensors). With no padding transformers passes no mask and nothing is copied."""
    return mask_elements * (FP32 if kind == "fp32" else 2)


def heap_slack(s, layer_tokens: int, layers: int, kind: str, recomputed: int = 0, lora: bool = False) -> int:
    """CPU only: the heap blocks that freed [tokens, hidden] tensors leave in a train pass whose forward saves the
    internals of `layers` layers at once (with `lora`, their adapters' temporaries too) and whose backward reruns
    `recomputed` more checkpointed layers (beyond one counted in `layers`); 0 when such a tensor is served from its
    own mapping."""
    block = layer_tokens * s.hidden * FP32
    blocks = (HEAP_BLOCKS[kind] + HEAP_LORA[kind] * lora) * layers + HEAP_RECOMPUTED[kind] * recomputed
    return HEAP_BASE + blocks * block if block < HEAP_THRESHOLD else 0


def head_parts(head, size: int | None, tokens: int, s, *, grad: bool, accumulate: bool = False,
               entropy_grad: bool = False, top_p: float = 1.0, top_k: int = 0) -> dict[str, int]:
    """The lm head's working set for `tokens` response tokens: what `head` (a head module: its `memory` term)
    materialises and, with `grad`, the extra gradient buffers (the lm-head gradient itself is counted with the other
    gradients). Weights that are not fp32 (DeepSpeed's bf16 mode) are cast to fp32 once per call: the logits are
    never computed in bf16."""
    parts = head.memory(size, tokens, s.vocab, grad=grad, trainable=s.head_trainable, entropy_grad=entropy_grad,
                        top_p=top_p, top_k=top_k)
    weight = s.vocab * s.hidden
    if s.param_bytes != FP32:
        parts["lm-head weight cast to fp32 (bf16 weights)"] = weight * FP32
    if grad and s.head_trainable:
        # the next micro-batch's lm-head gradient, before it is added to the one already there, beyond what the
        # head's backward has freed by then (dense: two of its three [tokens, vocab] tensors): the larger counts
        freed = head.freed_before_weight_grad(tokens, s.vocab)
        if accumulate and weight * s.param_bytes > freed:
            label = "next lm-head gradient" + (f" (beyond the {freed // (tokens * s.vocab * FP32)} logits tensors "
                                               "freed before it)" if freed else "")
            parts[label] = weight * s.param_bytes - freed
        if head.TILED and s.param_bytes != FP32:  # the fp32 accumulator, cast to the weight dtype at the end
            parts["lm-head gradient accumulator (fp32)"] = weight * FP32
    return parts


def first_call(s) -> int:
    return FIRST_CALL + FIRST_CALL_PER_HIDDEN * s.hidden


def auto_size(budget: int, tokens: int, s, head, accumulate: bool) -> int:
    """head.size=auto: the largest tile/chunk (a multiple of 16 tokens, at most `tokens`) whose train working set,
    plus the buffers a first call keeps, stays within `budget` bytes; ConfigError when not even 16 tokens fit."""
    fixed = sum(head_parts(head, 0, tokens, s, grad=True, accumulate=accumulate).values()) + first_call(s)
    name = head.__name__.rsplit(".", 1)[-1]
    size = (budget - fixed) // (s.vocab * FP32)
    if size < min(ROWS, tokens):
        raise ConfigError([f"head.size=auto: head.memory_budget_mib={budget / MIB:.0f} leaves room for {max(size, 0)} "
                           f"tokens per {name} tile at vocab {s.vocab} (the fixed part is {fixed / MIB:.0f} MiB); "
                           f"raise head.memory_budget_mib (16 tokens need {(fixed + 16 * s.vocab * FP32) / MIB:.0f}) "
                           "or set head.size=N."])
    return tokens if size >= tokens else size // ROWS * ROWS


def default_budget(device_type: str) -> int:
    """head.memory_budget_mib=null: a tenth of the memory free now (CUDA: free device memory; CPU: MemAvailable)."""
    if device_type == "cuda":
        import torch

        return torch.cuda.mem_get_info()[0] // 10
    from ..meters import proc_bytes

    return proc_bytes("/proc/meminfo", "MemAvailable") // 10


def resident(cfg, s, *, world: int, device_type: str, ref_copy: bool, path: str, device_gib: float | None = None):
    """(weights, optimizer state) living on one rank's device across phases: ZeRO partitions optimizer state
    (stages 2 and 3) and weights (stage 3) over the ranks; bf16 keeps fp32 master weights and fp32 AdamW moments
    (engine=single: the weights themselves are the fp32 master; DeepSpeed: a master copy beside bf16 weights);
    DeepSpeed offloads and `offload=on` (logprob passes only, see predict) take them off a CUDA device; vLLM on
    CUDA reserves gpu_memory_utilization of the device."""
    b, e, cuda = s.param_bytes, cfg.engine, device_type != "cpu"
    engine = registry.get("engine", e.name)
    zero = engine.zero_stage(e)
    shard = (lambda n, stage: n // world if zero >= stage else n)  # noqa: E731
    weights = {}
    if not (cuda and engine.offloads_params(e)):
        label = "weights (fp32, the master copy)" if path == "bf16-autocast" else "weights"
        weights[label] = shard(s.params * b, 3)
        if ref_copy:
            weights["reference copy"] = shard(s.params * b, 3)
    if cuda and device_gib:
        weights.update(registry.get("rollout", cfg.rollout.name).reserved(cfg.rollout, device_gib))
    master = path == "bf16-deepspeed"  # fp32 master copy + two fp32 moments per parameter
    label = ("optimizer state (fp32 master + AdamW)" if master else
             "optimizer state (AdamW: 2 x trainable, fp32)" if path == "bf16-autocast" else
             "optimizer state (AdamW: 2 x trainable)")
    offloaded = cuda and engine.offloads_optimizer(e)
    optimizer = {} if offloaded else {label: shard(s.trainable * (3 * FP32 if master else 2 * b), 1)}
    return weights, optimizer


def objective_parts(cfg, step_tokens: int, tokens: int) -> dict[str, int]:
    """What the objective adds to the train phase, for the step's `step_tokens` response tokens (per rank) and a
    forward's `tokens`: loss.agg's per-token weights (fp32) and loss=gspo's sequence ids (int64), made for the
    whole step before its first forward (losses/agg.py); gspo on tiled: every token's logprob of a forward from
    the first no-grad sweep (fp32; the sweep's tile is the size of the fused pass's, so no more). What a loss is
    (sequence-level) and what a head does with it (a sweep) is said on them (losses.bound, the head's facts)."""
    parts: dict[str, int] = {}
    name = cfg.loss.name
    if not algorithms.of(cfg).samples:  # a sequence-pair loss (DPO): no per-token objective over a rollout
        return parts
    if cfg.loss.agg != "token_mean":
        parts[f"loss.agg={cfg.loss.agg}: per-token weights of the step (fp32)"] = step_tokens * FP32
    if sequence_level(name):
        parts[f"loss={name}: per-token sequence ids of the step (int64)"] = step_tokens * 8
        if registry.get("head", cfg.head.name).SWEEPS_SEQUENCE_LEVEL:
            parts[f"loss={name} on {cfg.head.name}: logprobs of the first sweep (fp32)"] = tokens * FP32
    return parts
