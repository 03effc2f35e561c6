"""Memory you can know before the run: each phase's peak, predicted from arithmetic on the config and the model's
shapes (a meta-device model: no weights are built), with what dominates it.

A phase's *growth* is what it allocates on top of what was in use when it began (what `mem/<phase>_growth_mib`
measures); the *resident* memory is what lives across phases on the device (weights, the reference copy,
optimizer state, gradients during training). Predicted device peak = resident + growth. Every term is a count of
tensor bytes, written next to the code that allocates it:

- generate: the KV cache (2 x layers x rows x (prompt + new tokens) x kv heads x head dim) and, per decode step,
  the last position's logits and the sampler's [rows, vocab] fp32 temporaries (rollout/hf.py).
- old / ref logprobs (no grad): one layer's activations at a time, the final hidden states, and the head: dense
  holds two [tokens, vocab] fp32 tensors at once (the tempered logits and their log-softmax); tiled/chunked one
  [tile, vocab] fp32 tile.
- train: the gradients of the trainable parameters, the backbone's activations saved for backward, and the head:
  dense three [tokens, vocab] fp32 tensors in backward (log-softmax, its gradient and the incoming one); tiled one
  tile and its 16-row entropy buffer, chunked one tile; and, from the second micro-batch on, the next lm-head
  gradient before it is added to the one already there (plus the fp32 accumulator of tiled/chunked when the
  weights are not fp32); loss.agg other than token_mean and loss=gspo add the step's per-token weights and sequence
  ids, and gspo on tiled every token's logprob from its first sweep (`objective_parts`).
- generate with train.dynamic_sampling: the rollouts of the earlier rounds, kept until the rollout is chosen.

Tokens per micro-batch are an upper bound: GRPO responses as long as rollout.max_new_tokens (a rollout stops when
every row has ended), prompts as long as the longest one of the task; DPO pairs as long as the longest pair.
batching=packed|shared_prompt: a forward holds at most batching.max_tokens positions (and its mask, rows x width^2
booleans) however many rows the micro-batches have; shared_prompt lays out each group's prompt once.
On CPU the measured growth is the process RSS (meters.py), so allocator slack and first-call buffers add a few MiB.
docs/plan.md and docs/benchmarks.md have the measured accuracy.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import batching as packing
from . import logprobs, models, ranks
from .config import ConfigError
from .heads.common import ROWS  # rows of the tiled head's entropy buffer
from .meters import plan_growth_key, plan_peak_key

MIB = 2**20
FP32 = 4
SAMPLER_COPIES = 7  # [rows, vocab] fp32 tensors alive at once in a decode step (logits copy, log-softmax, noise...)
# Activations per token and layer, in elements of the model dtype, of a decoder layer (attention + gated MLP):
# saved for backward (norm inputs and outputs, q/k/v before and after rotary, attention output, residuals; gate,
# up, act(gate), act(gate) * up) and, without grad, alive at once in one layer (the MLP's three intermediates).
SAVED_H, SAVED_I = 12, 4
LIVE_H, LIVE_I = 4, 3


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
    param_bytes: int


@dataclass
class Phase:
    """A phase's predicted growth, as named parts in bytes, on top of `resident` bytes."""

    parts: dict[str, int]
    resident: dict[str, int]

    @property
    def growth(self) -> int:
        return sum(self.parts.values())

    @property
    def peak(self) -> int:
        return self.growth + sum(self.resident.values())

    def dominant(self) -> str:
        return max(self.parts, key=self.parts.get) if self.parts else "-"


@dataclass
class Plan:
    phases: dict[str, Phase]
    tokens: int  # response tokens per micro-batch (the heads' N)
    seq_len: int  # prompt + response positions per row
    head_size: int | None  # tokens per tile/chunk (dense: None)
    shapes: Shapes
    world: int = 1  # ranks
    device_type: str = "cpu"


def shapes_of(model, dtype: str) -> Shapes:
    """Shapes of a built model (real or on the meta device), LoRA adapters included."""
    lm = models.unwrap(model)
    c = lm.config.get_text_config(decoder=True)
    _, weight = models.split(model)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    params = list(model.parameters())  # whole: the runner plans before the engine partitions them (ZeRO-3)
    vocab, hidden = weight.shape
    return Shapes(vocab=vocab, hidden=hidden, intermediate=getattr(c, "intermediate_size", 0)
                  or 4 * c.hidden_size, layers=c.num_hidden_layers, kv_dim=kv * head_dim,
                  params=sum(p.numel() for p in params), trainable=sum(p.numel() for p in params if p.requires_grad),
                  head_trainable=bool(weight.requires_grad), param_bytes=models.DTYPES[dtype].itemsize)


def meta_model(mcfg, seed: int):
    """(the model on the meta device, its tokenizer): shapes without weights, LoRA adapters added as in a run."""
    import torch

    if mcfg.name == "tiny":
        tokenizer = models.char_tokenizer()
        with torch.device("meta"):
            model = models.tiny_model(mcfg, tokenizer, seed)
    else:
        from transformers import AutoModelForCausalLM

        config, tokenizer = models.load_hf_config(mcfg.path)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=models.DTYPES[mcfg.dtype])
    models.split(model)
    if mcfg.lora.enabled:
        with torch.device("meta"):
            model = models.add_lora(model, mcfg.lora)
    return model, tokenizer


def lengths(cfg, tokenizer, rows: list[dict]) -> tuple[int, int, int]:
    """(rows per micro-batch, positions per row, response tokens per micro-batch), upper bounds from the data."""
    from .tasks.lengths import token_lengths

    mb = cfg.train.micro_batch
    prompts = token_lengths(tokenizer, [r["prompt"] for r in rows]) or [0]
    if cfg.loss.name == "dpo":  # chosen and rejected of each pair, each with the EOS the pair encoder appends
        sides = [token_lengths(tokenizer, [r[k] for r in rows]) for k in ("chosen", "rejected")]
        longest = max(max(c, r) + 1 for c, r in zip(*sides))
        return 2 * mb, max(p + max(c, r) + 1 for p, c, r in zip(prompts, *sides)), 2 * mb * longest
    cut = getattr(cfg.task, "max_prompt_tokens", None)
    prompt = min(max(prompts), cut) if cut else max(prompts)
    new = cfg.rollout.max_new_tokens
    return mb, prompt + new, mb * new


def head_parts(name: str, size: int | None, tokens: int, s: Shapes, *, grad: bool, accumulate: bool = False,
               entropy_grad: bool = False) -> dict[str, int]:
    """The lm head's working set for `tokens` response tokens: the logits it materialises and, with `grad`, the
    extra gradient buffers (the lm-head gradient itself is counted with the other gradients)."""
    row = s.vocab * FP32
    if name == "dense":
        k = (3 + 2 * entropy_grad) if grad else 2  # + exp(logp) and its product when the entropy has a gradient
        parts = {f"dense logits ({k} x {tokens} tokens x vocab {s.vocab}, fp32)": k * tokens * row}
    else:
        parts = {f"one {name} tile ({min(size, tokens)} tokens x vocab {s.vocab}, fp32)": min(size, tokens) * row}
        if grad and name == "tiled":  # chunked fills it in its no-grad forward, before the backward's peak
            parts["entropy block buffer (16 rows x vocab, fp32)"] = min(ROWS, tokens) * row
    if grad and s.head_trainable:
        weight = s.vocab * s.hidden
        if accumulate:  # the next micro-batch's lm-head gradient, before it is added to the one already there
            parts["next lm-head gradient"] = weight * s.param_bytes
        if name != "dense" and s.param_bytes != FP32:  # the fp32 accumulator, cast to the weight dtype at the end
            parts["lm-head gradient accumulator (fp32)"] = weight * FP32
    return parts


def auto_size(budget: int, tokens: int, s: Shapes, name: str, accumulate: bool) -> int:
    """head.size=auto: the largest tile/chunk (a multiple of 16 tokens, at most `tokens`) whose train working set
    stays within `budget` bytes; ConfigError when not even 16 tokens fit."""
    fixed = sum(head_parts(name, 0, tokens, s, grad=True, accumulate=accumulate).values())
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
    from .meters import proc_bytes

    return proc_bytes("/proc/meminfo", "MemAvailable") // 10


def world_size(cfg) -> int:
    """Ranks the run will have: the launcher's WORLD_SIZE (set it to plan a multi-rank run: WORLD_SIZE=8 rlrun
    plan engine=deepspeed ...)."""
    return ranks.world_size() if cfg.engine.name == "deepspeed" else 1


def resident(cfg, s: Shapes, *, world: int, device_type: str, ref_copy: bool, device_gib: float | None = None):
    """(weights, optimizer state) living on one rank's device across phases: ZeRO partitions optimizer state
    (stages 2 and 3) and weights (stage 3) over the ranks; DeepSpeed bf16 keeps fp32 master weights and fp32
    AdamW moments; DeepSpeed offloads and `offload=on` (logprob passes only, see predict) take them off a CUDA
    device; vLLM on CUDA reserves gpu_memory_utilization of the device."""
    b, e, cuda = s.param_bytes, cfg.engine, device_type != "cpu"
    zero = e.zero_stage if e.name == "deepspeed" else 0
    shard = (lambda n, stage: n // world if zero >= stage else n)  # noqa: E731
    weights = {}
    if not (cuda and zero == 3 and e.offload_param != "none"):
        weights["weights"] = shard(s.params * b, 3)
        if ref_copy:
            weights["reference copy"] = shard(s.params * b, 3)
    if cuda and cfg.rollout.name == "vllm" and device_gib:
        weights["vLLM engine (gpu_memory_utilization x device)"] = int(cfg.rollout.gpu_memory_utilization
                                                                      * device_gib * 2**30)
    master = e.name == "deepspeed" and e.dtype == "bf16"  # fp32 master copy + two fp32 moments per parameter
    label = "optimizer state (fp32 master + AdamW)" if master else "optimizer state (AdamW: 2 x trainable)"
    offloaded = cuda and e.name == "deepspeed" and e.offload_optimizer != "none"
    optimizer = {} if offloaded else {label: shard(s.trainable * (3 * FP32 if master else 2 * b), 1)}
    return weights, optimizer


def saved_activations(cfg, s: Shapes, layer_tokens: int, device_type: str) -> dict[str, int]:
    """What the train pass keeps for its backward, per `activations`: every layer's internals (keep); a
    checkpointed layer's input only, plus one layer's internals while it is recomputed (checkpoint); nothing on
    the device when offloaded to the host (offload, on an accelerator)."""
    b, a = s.param_bytes, cfg.activations
    per_layer = layer_tokens * (SAVED_H * s.hidden + SAVED_I * s.intermediate) * b
    if a.name == "offload" and device_type != "cpu":
        return {"activations saved for backward (in host memory: activations=offload)": 0}
    if a.name != "checkpoint":
        return {"activations saved for backward": s.layers * per_layer}
    n = len(range(0, s.layers, a.every))  # checkpointed layers
    return {f"layer inputs kept ({n} checkpointed layers)": n * layer_tokens * s.hidden * b,
            f"activations saved for backward ({s.layers - n} layers kept whole)": (s.layers - n) * per_layer,
            "one layer recomputed in backward": per_layer}


def predict(cfg, s: Shapes, rows: int, seq_len: int, tokens: int, *, world: int = 1, device_type: str = "cpu",
            head_size: int | None = None, device_gib: float | None = None) -> Plan:
    """The plan of a validated config for a model of shapes `s`, `rows` sequences of `seq_len` positions and
    `tokens` response tokens per micro-batch, on one of `world` ranks. `head_size` overrides cfg.head.size
    (needed when it is `auto`)."""
    b, head, t = s.param_bytes, cfg.head.name, cfg.train
    size = head_size if head_size is not None else cfg.head.size
    grad_accum = max(t.batch_size // (t.micro_batch * world), 1)
    zero = cfg.engine.zero_stage if cfg.engine.name == "deepspeed" else 0
    dpo, kl = cfg.loss.name == "dpo", getattr(cfg.loss, "kl_coef", 0.0)
    policy, lora = cfg.logprob_policy.name, cfg.model.lora
    tis = getattr(cfg.loss, "tis", None)
    needs_old = not dpo and (logprobs.ever_needs_old(policy, t.rollout_batch // world // t.micro_batch
                                                     * t.num_iterations, grad_accum)
                             or (policy != "skip" and tis.enabled and tis.level == "sequence"))
    needs_ref = dpo or logprobs.needs_reference_model(policy, kl)
    ref_copy = needs_ref and not (lora.enabled and lora.reference == "adapters_off"
                                  and not getattr(cfg.loss, "reference_path", None))
    weights, adam = resident(cfg, s, world=world, device_type=device_type, ref_copy=ref_copy, device_gib=device_gib)
    grads = s.trainable * b // (world if zero >= 2 else 1)
    layer_tokens, mask = rows * seq_len, {}
    if cfg.batching.name != "padded":  # a forward holds at most max_tokens positions, whatever the rows
        layer_tokens, width = packing.planned_forward(cfg, rows * grad_accum, seq_len, tokens // rows)
        tokens = min(cfg.batching.max_tokens, tokens * grad_accum)
        mask = {f"attention mask ({layer_tokens} positions in rows of {width}, bool)": layer_tokens * width}
    live = LIVE_H * s.hidden + LIVE_I * s.intermediate  # per token, one layer, no grad

    def logprob_phase() -> Phase:
        parts = {"one layer's activations (no grad)": layer_tokens * live * b,
                 "final hidden states": 2 * layer_tokens * s.hidden * b, **mask}
        parts.update(head_parts(head, size, tokens, s, grad=False))
        offloaded = cfg.offload.enabled and device_type != "cpu"  # optimizer state on the host for these passes
        return Phase(parts, {**weights, **({} if offloaded else adam)})

    phases = {}
    if not dpo:
        gen_rows = t.rollout_batch // world
        sampler = f"sampler ({SAMPLER_COPIES} x {gen_rows} rows x vocab, fp32)"
        gen = {"KV cache": 2 * s.layers * gen_rows * seq_len * s.kv_dim * b,
               sampler: SAMPLER_COPIES * gen_rows * s.vocab * FP32,
               "prefill activations (one layer)": gen_rows * (seq_len - cfg.rollout.max_new_tokens) * live * b}
        if zero == 3:  # the engine gathers whole weights for generate
            gen["weights gathered for generate (ZeRO-3)"] = s.params * b - weights.get("weights", 0)
        if t.dynamic_sampling and t.dynamic_sampling_max_rounds > 1:  # ids, masks (int64), response mask, logprobs
            rounds = t.dynamic_sampling_max_rounds - 1
            gen[f"dynamic sampling: rollouts of {rounds} earlier round(s)"] = rounds * gen_rows * (
                seq_len * 16 + cfg.rollout.max_new_tokens * 5)
        phases["generate"] = Phase(gen, {**weights, **adam})
    if needs_old:
        phases["old_logprobs"] = logprob_phase()
    if needs_ref:
        phases["ref_logprobs"] = logprob_phase()
    train = {"gradients": grads, **saved_activations(cfg, s, layer_tokens, device_type), **mask}
    train.update(head_parts(head, size, tokens, s, grad=True, accumulate=grad_accum > 1,
                            entropy_grad=bool(getattr(cfg.loss, "entropy_coef", 0.0))))
    train.update(objective_parts(cfg, t.batch_size // world * cfg.rollout.max_new_tokens, tokens))
    phases["train"] = Phase(train, {**weights, **adam})
    return Plan(phases, tokens, seq_len, size if head != "dense" else None, s, world, device_type)


def objective_parts(cfg, step_tokens: int, tokens: int) -> dict[str, int]:
    """What the objective adds to the train phase, for the step's `step_tokens` response tokens (per rank) and a
    forward's `tokens`: loss.agg's per-token weights (fp32) and loss=gspo's sequence ids (int64), made for the
    whole step before its first forward (losses/agg.py); gspo on tiled: every token's logprob of a forward from
    the first no-grad sweep (fp32; the sweep's tile is the size of the fused pass's, so no more)."""
    parts, gspo = {}, cfg.loss.name == "gspo"
    if cfg.loss.name == "dpo":
        return parts
    if cfg.loss.agg != "token_mean":
        parts[f"loss.agg={cfg.loss.agg}: per-token weights of the step (fp32)"] = step_tokens * FP32
    if gspo:
        parts["loss=gspo: per-token sequence ids of the step (int64)"] = step_tokens * 8
    if gspo and cfg.head.name == "tiled":
        parts["loss=gspo on tiled: logprobs of the first sweep (fp32)"] = tokens * FP32
    return parts


def metrics(plan: Plan) -> dict[str, float]:
    """plan/<phase>_growth_mib and plan/<phase>_peak_mib (resident + growth), beside the measured mem/*."""
    out = {}
    for name, ph in plan.phases.items():
        out[plan_growth_key(name)] = ph.growth / MIB
        out[plan_peak_key(name)] = ph.peak / MIB
    if plan.head_size is not None:
        out["plan/head_size"] = float(plan.head_size)
    return out


def table(plan: Plan, device: Plan | None = None, device_gib: float | None = None) -> str:
    """The plan as text: per phase the predicted growth, the peak, and the largest part of the growth; with
    `device` (the same run planned for CUDA) and `device_gib`, whether it fits a device of that size."""
    s = plan.shapes
    lines = [f"model: {s.params / 1e6:.2f}M parameters ({s.trainable / 1e6:.2f}M trainable), vocab {s.vocab}, "
             f"hidden {s.hidden}, {s.layers} layers; planned for {plan.world} rank(s), per rank",
             f"micro-batch: {plan.tokens} response tokens, {plan.seq_len} positions per row"
             + (f"; head tile {plan.head_size} tokens" if plan.head_size else "")]
    head = ["phase", "growth MiB", "peak MiB", "largest part of the growth"]
    rows = [[name, f"{ph.growth / MIB:.0f}", f"{ph.peak / MIB:.0f}", ph.dominant()] for name, ph in
            plan.phases.items()]
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(4)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [head] + rows]
    lines.append("peak = resident (weights, reference copy, optimizer state) + growth")
    if device is not None and device_gib:
        name, ph = max(device.phases.items(), key=lambda kv: kv[1].peak)
        cap, peak = device_gib * 2**30, ph.peak
        verdict = "fits" if peak <= cap else f"does not fit: over by {(peak - cap) / 2**30:.2f} GiB"
        lines.append(f"on a CUDA device of {device_gib:g} GiB: predicted peak {peak / 2**30:.2f} GiB ({name}), "
                     f"{verdict}; add the CUDA context and allocator slack, a few hundred MiB.")
    return "\n".join(lines)


def detail(plan: Plan) -> str:
    """Every part of every phase, in MiB (the plan artifact and `rlrun plan`)."""
    lines = []
    for name, ph in plan.phases.items():
        lines.append(f"{name}: growth {ph.growth / MIB:.1f} MiB on resident {sum(ph.resident.values()) / MIB:.1f}")
        lines += [f"    {v / MIB:10.1f}  {k}" for k, v in sorted(ph.parts.items(), key=lambda kv: -kv[1])]
        lines += [f"    {v / MIB:10.1f}  {k} (resident)" for k, v in ph.resident.items()]
    return "\n".join(lines)


def resolve_size(cfg, s: Shapes, tokens: int, device_type: str, world: int = 1,
                 device_bytes: int | None = None) -> int | None:
    """head.size, with `auto` replaced by the largest tile within head.memory_budget_mib (null: a tenth of
    `device_bytes` when given, the device a plan is for; else default_budget, from the memory free now)."""
    if cfg.head.size != "auto":
        return cfg.head.size
    budget = cfg.head.memory_budget_mib
    if budget is not None:
        budget = budget * MIB
    else:
        budget = device_bytes // 10 if device_bytes else default_budget(device_type)
    grad_accum = max(cfg.train.batch_size // (cfg.train.micro_batch * world), 1)
    return auto_size(budget, tokens, s, cfg.head.name, grad_accum > 1)


def inputs(cfg) -> tuple[Shapes, int, int, int]:
    """(shapes, rows, positions per row, response tokens) per micro-batch of a validated config, from a meta-device
    model and the task's rows: what predict needs, without building any weights."""
    from . import tasks

    model, tokenizer = meta_model(cfg.model, cfg.seed)
    rows = tasks.load_pairs(cfg.task, cfg.seed, tokenizer)[0] if cfg.loss.name == "dpo" else \
        tasks.load(cfg.task, cfg.seed, tokenizer).train
    return (shapes_of(model, cfg.model.dtype), *lengths(cfg, tokenizer, rows))


def report(cfg) -> str:
    """`rlrun plan`: the plan of a validated config without building its weights (a meta-device model), as on
    this machine's CPU, plus whether it fits a CUDA device of plan.device_gib; then every part."""
    s, n_rows, seq_len, tokens = inputs(cfg)
    world, gib = world_size(cfg), cfg.plan.device_gib
    # head.size=auto with no budget: a tenth of the device planned for (plan.device_gib), as a run on it would take
    size = resolve_size(cfg, s, tokens, "cpu", world, device_bytes=int(gib * 2**30) if gib else None)
    cpu = predict(cfg, s, n_rows, seq_len, tokens, world=world, head_size=size)
    cuda = predict(cfg, s, n_rows, seq_len, tokens, world=world, device_type="cuda", head_size=size,
                   device_gib=gib) if gib else None
    note = ""
    if cfg.head.size == "auto":
        within = (f"head.memory_budget_mib={cfg.head.memory_budget_mib}" if cfg.head.memory_budget_mib else
                  f"a tenth of plan.device_gib={gib:g} GiB; a run chooses from its own device's free memory" if gib
                  else "a tenth of this machine's free memory; a run chooses from its own device's free memory")
        note = f"head.size=auto: {size} tokens per tile, within {within}\n"
    return note + table(cpu, cuda, gib) + "\n\nparts (MiB, CPU):\n" + detail(cpu)
