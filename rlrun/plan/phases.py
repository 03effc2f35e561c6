"""Each phase's predicted growth and peak for a validated config (the arithmetic of terms.py put together)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import activations, algorithms, logprobs, models, offload, precision, registry
from ..losses import bound
from ..meters import plan_growth_key, plan_peak_key
from . import terms
from .shapes import Shapes
from .terms import FP32, LIVE_H, LIVE_I, MIB, SAMPLER_COPIES


@dataclass
class Phase:
    """A phase's predicted growth, as named parts in bytes, on top of `resident` bytes; `apart`: working sets the
    phase also allocates but that are freed before its peak (listed, not counted)."""

    parts: dict[str, int]
    resident: dict[str, int]
    apart: dict[str, int] = field(default_factory=dict)

    @property
    def growth(self) -> int:
        return sum(self.parts.values())

    @property
    def peak(self) -> int:
        return self.growth + sum(self.resident.values())

    def dominant(self) -> str:
        return max(self.parts, key=lambda part: self.parts[part]) if self.parts else "-"


@dataclass
class Plan:
    phases: dict[str, Phase]
    tokens: int  # response tokens per micro-batch (the heads' N)
    seq_len: int  # prompt + response positions per row
    head_size: int | None  # tokens per tile/chunk (dense: None)
    shapes: Shapes
    world: int = 1  # ranks
    device_type: str = "cpu"
    layer_tokens: int = 0  # positions per forward of the train pass
    kind: str = "fp32"  # the activations' dtype family (terms.activation_kind)
    rows: int = 0  # rows per micro-batch (predict's `rows`: `trained` plans again from it)
    step_tokens: int = 0  # response tokens per micro-batch before any layout (predict's `tokens`)


def world_size(cfg) -> int:
    """Ranks the run will have: the launcher's WORLD_SIZE (set it to plan a multi-rank run: WORLD_SIZE=8 rlrun
    plan engine=deepspeed ...)."""
    return registry.get("engine", cfg.engine.name).world_size()


def grad_accum(cfg, world: int) -> int:
    return max(cfg.train.batch_size // (cfg.train.micro_batch * world), 1)


def passes(cfg, world: int) -> tuple[bool, bool, bool]:
    """(old-policy pass, reference pass, a reference copy in memory) of a run, as its logprob policy decides."""
    t, algo = cfg.train, algorithms.of(cfg)
    policy = logprobs.option(cfg.logprob_policy.name)
    before_loss = bound.old_before_loss(cfg.loss)  # sequence-level correction reads the old logprobs first
    needs_old = algo.samples and policy.ever_needs_old(t.rollout_batch // world // t.micro_batch * t.num_iterations,
                                                  grad_accum(cfg, world), before_loss)
    needs_ref = algo.reference or policy.builds_reference(getattr(cfg.loss, "kl_coef", 0.0))
    ref_copy = needs_ref and not models.adapters_off_reference(cfg.model.lora, getattr(cfg.loss, "reference_path",
                                                                                        None))
    return needs_old, needs_ref, ref_copy


def sampled_top_p(cfg) -> float:
    """The top-p of the distribution the heads compute logprobs of: GRPO's sampler's (rollout.top_p); DPO's 1."""
    return cfg.rollout.top_p if algorithms.of(cfg).samples else 1.0


def sampled_top_k(cfg) -> int:
    """The top-k of that distribution: GRPO's sampler's (rollout.top_k, 0: off); DPO's 0."""
    return cfg.rollout.top_k if algorithms.of(cfg).samples else 0


RECOMPUTED = "one layer recomputed in backward"
# the train parts that are the saved-activation term (plan/train_activations_mib)
MASK_COPIES = "attention mask as sdpa's additive copy"
HEAP = "CPU heap: blocks under 1 MiB freed and kept (allocator)"  # the part that is the allocator's, not tensors
ACTIVATIONS = ("activations saved", "layer inputs kept", RECOMPUTED, "one layer's saved tensors", "saved outside",
               MASK_COPIES)


def train_parts(cfg, s, layer_tokens: int, tokens: int, size, *, world: int, device_type: str, kind: str,
                mask: dict, mask_elements: int, heap_tokens: int, forwards: int) -> dict[str, int]:
    """The train pass at its peak in a forward after the step's first: the gradients already accumulated, what the
    forward saved for backward (activations; autocast's bf16 weight copies), and the larger of two moments: the
    head's backward (its working set and the next lm-head gradient) or, with checkpointing, a layer's recompute
    (its internals and weight copies again). On CPU also the heap blocks freed small tensors leave (terms.py).
    `forwards`: a step's forwards, each with its backward (padded: the micro-batches that accumulate; packed and
    shared_prompt: also the packs of each); `heap_tokens`: the positions of one, for the heap term;
    `mask_elements`: its attention mask's (terms.mask_copy: each layer that saves its internals keeps a copy)."""
    zero = registry.get("engine", cfg.engine.name).zero_stage(cfg.engine)
    a = activations.option(cfg.activations)
    n = a.checkpointed_layers(s.layers)
    parts = {"gradients": s.trainable * s.param_bytes // (world if zero >= 2 else 1)}
    saved = terms.saved_activations(a, s, layer_tokens, kind, device_type)
    recompute = {RECOMPUTED: saved.pop(RECOMPUTED)} if RECOMPUTED in saved else {}
    parts.update(saved)
    copy = terms.mask_copy(mask_elements, kind)
    if s.layers > n:
        parts[f"{MASK_COPIES} (saved by {s.layers - n} layers)"] = copy * (s.layers - n)
    if recompute:  # the layer rerun in backward makes its own
        recompute[f"{MASK_COPIES} (the layer rerun)"] = copy
    if kind == "autocast":  # cast once per forward of a layer; a checkpointed layer's casts live while it reruns.
        # Every weight, frozen ones too: a frozen weight's cast is saved for its input's gradient (SmolLM2 with LoRA:
        # 201 MiB of them, planned as the adapters' 9 MiB before)
        copies = s.layer_weights * 2 // s.layers
        parts["bf16 weight copies (autocast, saved for backward)"] = copies * (s.layers - n)
        recompute = recompute and {**recompute, "its bf16 weight copies (autocast)": copies}
    parts.update(mask)
    head = terms.head_parts(registry.get("head", cfg.head.name), size, tokens, s, grad=True,
                            accumulate=forwards > 1,  # each forward's backward adds to the lm-head gradient
                            entropy_grad=bool(getattr(cfg.loss, "entropy_coef", 0.0)), top_p=sampled_top_p(cfg),
                            top_k=sampled_top_k(cfg))
    parts.update(head if sum(head.values()) >= sum(recompute.values()) else recompute)
    parts.update(terms.objective_parts(cfg, cfg.train.batch_size // world * cfg.rollout.max_new_tokens, tokens))
    if forwards == 1 and registry.get("engine", cfg.engine.name).GRADIENTS_AS_BACKWARD:
        # one forward a step (no gradient made before it): backward makes each layer's gradient as it frees that
        # layer's saved tensors, so at the head's backward only the lm head's exists, and all of them only at the
        # end, the activations gone. The peak is the larger of the two (issue #53: skip_zero_advantage's few kept
        # rows in one pack, planned with every gradient beside every activation, +28-41%)
        head_grad = s.vocab * s.hidden * s.param_bytes if s.head_trainable else 0
        rest = sum(v for k, v in parts.items() if k != "gradients")
        parts["gradients"] = max(min(parts["gradients"], head_grad), parts["gradients"] - rest)
    end = terms.end_of_backward(s, forwards)
    if end and parts["gradients"] + end > sum(parts.values()):  # the activations are gone by then
        parts = {"gradients": parts["gradients"], terms.END_OF_BACKWARD: end}
    # the blocks the forward before the peak's left; a step of one forward reuses the last step's heap
    if device_type == "cpu" and forwards > 1:
        parts[HEAP] = terms.heap_slack(
            s, heap_tokens, s.layers - n + (n > 0), kind, recomputed=max(n - 1, 0), lora=cfg.model.lora.enabled)
    return parts


def live_bytes(s, kind: str) -> int:
    """Bytes per token alive at once in one layer without grad: the residual stream's few [hidden] tensors (fp32
    under autocast) and the MLP's intermediates (bf16 under autocast)."""
    h_bytes, i_bytes = (FP32, FP32) if kind == "fp32" else (FP32, 2) if kind == "autocast" else (2, 2)
    return LIVE_H * s.hidden * h_bytes + LIVE_I * s.intermediate * i_bytes


def lora_bytes(s, kind: str) -> int:
    """Bytes per token a LoRA-adapted layer holds at once beyond the plain layer, without grad: one [intermediate]
    tensor, the adapter's output added to the base MLP projection's (measured op by op at hidden 128-512)."""
    return s.intermediate * (FP32 if kind == "fp32" else 2)


def generate_parts(cfg, s, seq_len: int, world: int, weights: dict) -> dict[str, int]:
    """generate: the KV cache, the sampler's [rows, vocab] fp32 temporaries, one layer's prefill activations."""
    b, rows = s.param_bytes, cfg.train.rollout_batch // world
    sampler = f"sampler ({SAMPLER_COPIES} x {rows} rows x vocab, fp32)"
    kind = terms.activation_kind(b, precision.autocasts(cfg))
    gen = {"KV cache": 2 * s.layers * rows * seq_len * s.kv_dim * b,
           sampler: SAMPLER_COPIES * rows * s.vocab * FP32,
           "prefill activations (one layer)": rows * (seq_len - cfg.rollout.max_new_tokens) * live_bytes(s, kind)}
    decode = registry.option_of(cfg, "decode")  # rollout.decode's term (rollout/decoding.py); vllm, replay: none
    gen.update(registry.get("decode", decode or registry.baseline("decode")).memory(gen["KV cache"]))
    spec = registry.option_of(cfg, "speculate")  # rollout.speculate's terms (rollout/speculate.py); vllm: none
    gen.update(registry.get("speculate", spec or registry.baseline("speculate")).memory(
        gen["KV cache"], gen[sampler], getattr(cfg.rollout, "speculate_k", 0)))
    if registry.get("engine", cfg.engine.name).zero_stage(cfg.engine) == 3:  # whole weights gathered for generate
        gen["weights gathered for generate (ZeRO-3)"] = s.params * b - sum(weights.values())
    t = cfg.train
    if t.dynamic_sampling and t.dynamic_sampling_max_rounds > 1:  # ids, masks (int64), response mask, logprobs
        rounds = t.dynamic_sampling_max_rounds - 1
        gen[f"dynamic sampling: rollouts of {rounds} earlier round(s)"] = rounds * rows * (
            seq_len * 16 + cfg.rollout.max_new_tokens * 5)
    return gen


def asynchronous(cfg, s, gen: Phase, device_type: str) -> tuple[Phase, dict[str, int]]:
    """The generate phase as rollout.pipeline runs it and what the trainer's phases carry besides: the option's
    memory term (recipes/sources.py: sync changes nothing; async plans its worker's own copy of the weights)."""
    from ..axes import source_of

    return source_of(cfg).memory(cfg, s, gen, device_type)


@dataclass
class Layout:
    """What a pass over micro-batches of `rows` rows lays out in one forward: its positions (`layer_tokens`), its
    attention mask's part and elements, the positions of the CPU heap term's forward, the forwards of a step, and
    the heads' response tokens of one forward."""

    layer_tokens: int
    mask: dict[str, int]
    mask_elements: int
    heap_tokens: int
    forwards: int
    tokens: int


def laid_out(cfg, rows: int, seq_len: int, tokens: int, accum: int) -> Layout:
    """The Layout of a pass over micro-batches of `rows` rows of `seq_len` positions and `tokens` response tokens
    (`accum` micro-batches a step): padded as they are, packed / shared_prompt in forwards of batching.max_tokens."""
    layout = registry.get("batching", cfg.batching.name)(cfg.batching)
    layer_tokens = rows * seq_len
    # padded rows: [rows, 1, seq_len, seq_len] (prompts and answers padded)
    out = Layout(layer_tokens, {}, layer_tokens * seq_len, layer_tokens, accum, tokens)
    packed = layout.planned_forward(cfg, rows * accum, seq_len, tokens // rows)
    if packed is None:
        return out
    step_tokens = tokens * accum
    layer_tokens, width, tokens = packed  # a forward holds at most max_tokens positions, whatever the rows
    # whole units (rows of `width`) fill a forward to at most max_tokens, so a full one is usually a little under
    # it: its [positions, hidden] tensors go to the heap where max_tokens' would just reach 1 MiB
    heap = layer_tokens if layer_tokens < cfg.batching.max_tokens else layer_tokens // width * width
    return Layout(layer_tokens, {f"attention mask ({layer_tokens} positions in rows of {width}, bool)":
                                 layer_tokens * width}, layer_tokens * width, heap, -(-step_tokens // tokens), tokens)


def predict(cfg, s, rows: int, seq_len: int, tokens: int, *, world: int = 1, device_type: str = "cpu",
            head_size: int | None = None, device_gib: float | None = None, trained_rows: int | None = None) -> Plan:
    """The plan of a validated config for a model of shapes `s`, `rows` sequences of `seq_len` positions and
    `tokens` response tokens per micro-batch, on one of `world` ranks. `head_size` overrides cfg.head.size
    (needed when it is `auto`). `trained_rows`: the rows per micro-batch the train and old-policy passes compute
    where train.skip_zero_advantage left rows of advantage 0 out (padded: the largest micro-batch's; packed and
    shared_prompt, which lay out the step's kept rows anew: the step's kept rows over its micro-batches); None:
    every row, the bound a run must fit (what `rlrun plan` shows: rewards decide how many are left out)."""
    b, head, path = s.param_bytes, registry.get("head", cfg.head.name), precision.path(cfg)
    size = head_size if head_size is not None else cfg.head.size
    kind = terms.activation_kind(b, path == "bf16-autocast")
    needs_old, needs_ref, ref_copy = passes(cfg, world)
    weights, adam = terms.resident(cfg, s, world=world, device_type=device_type, ref_copy=ref_copy, path=path,
                                   device_gib=device_gib)
    accum = grad_accum(cfg, world)
    full = laid_out(cfg, rows, seq_len, tokens, accum)
    kept = rows if trained_rows is None else max(1, min(trained_rows, rows))
    trained = full if kept == rows else laid_out(cfg, kept, seq_len, tokens // rows * kept, accum)

    def logprob_phase(policy: bool, weights: dict, adapters: bool, lay: Layout) -> Phase:
        held = {"final hidden states": 2 * lay.layer_tokens * s.hidden * b, **lay.mask}
        if policy and kind == "autocast":  # the autocast cache keeps the casts of weights that require grad
            held["bf16 weight copies (autocast cache)"] = s.layer_matrices * 2
        layer = {"one layer's activations (no grad)": lay.layer_tokens * live_bytes(s, kind)}
        layer[f"{MASK_COPIES} (one layer's, no grad)"] = terms.mask_copy(lay.mask_elements, kind)  # freed as it returns
        if adapters:  # LoRA on (the reference runs with them off, or is a copy without them)
            layer["LoRA: an adapter's output beside its layer's (no grad)"] = lay.layer_tokens * lora_bytes(s, kind)
        lm_head = terms.head_parts(head, size, lay.tokens, s, grad=False, top_p=sampled_top_p(cfg),
                                   top_k=sampled_top_k(cfg))
        # Without grad a layer's working set is freed when it returns, before the head runs: on CUDA (allocated
        # bytes) the phase peaks at the larger of the two (their sum over-predicted tiled heads' pass 2x on an
        # H200, docs/gpu.md). CPU RSS keeps the freed layer's heap blocks (glibc): there both count (bench plan).
        freed: dict[str, int] = {}
        if device_type == "cpu":
            peak_set = {**layer, **lm_head}
        else:
            peak_set, freed = (layer, lm_head) if sum(layer.values()) > sum(lm_head.values()) else (lm_head, layer)
        offloaded = offload.option(cfg.offload).frees_state(device_type)  # optimizer state on the host for these
        return Phase({**held, **peak_set}, {**weights, **({} if offloaded else adam)}, apart=freed)

    phases, trainer = {}, weights  # trainer: what the trainer's phases hold resident besides optimizer state
    if algorithms.of(cfg).samples:
        gen = Phase(generate_parts(cfg, s, seq_len, world, weights), {**weights, **adam})
        phases["generate"], extra = asynchronous(cfg, s, gen, device_type)
        trainer = {**weights, **extra}
    if needs_old:  # skipping: only the rows that will be trained (recipes/skipping.logprobs)
        phases["old_logprobs"] = logprob_phase(True, trainer, cfg.model.lora.enabled, trained)
    if needs_ref:
        phases["ref_logprobs"] = logprob_phase(not ref_copy, trainer, False, full)
    train = train_parts(cfg, s, trained.layer_tokens, trained.tokens, size, world=world, device_type=device_type,
                        kind=kind, mask=trained.mask, mask_elements=trained.mask_elements,
                        heap_tokens=trained.heap_tokens, forwards=trained.forwards)
    phases["train"] = Phase(train, {**trainer, **adam})
    return Plan(phases, trained.tokens, seq_len, size if head.TILED else None, s, world, device_type,
                trained.layer_tokens, kind, rows, tokens)


def trained(cfg, plan: Plan, kept: list[int] | None, head_size: int | None, seq_len: int | None = None,
            tokens: int | None = None) -> Plan:
    """`plan` again for a step's micro-batches as they came: `seq_len` positions a row and `tokens` response
    positions a micro-batch (the longest micro-batch's; None: the plan's, every completion run to
    rollout.max_new_tokens) and `kept` rows each (train.skip_zero_advantage; None: every row). Padded computes each
    micro-batch with its kept rows (one, masked, where none), so its peak is the largest's; packed and
    shared_prompt lay out the step's kept rows anew."""
    seq_len, tokens = seq_len or plan.seq_len, tokens or plan.step_tokens
    rows = None
    if kept is not None:
        layout = registry.get("batching", cfg.batching.name)(cfg.batching)
        padded = layout.planned_forward(cfg, plan.rows, seq_len, tokens // plan.rows) is None
        rows = max(max(kept), 1) if padded else max(1, -(-sum(kept) // len(kept)))
    return predict(cfg, plan.shapes, plan.rows, seq_len, tokens, world=plan.world, device_type=plan.device_type,
                   head_size=head_size, trained_rows=rows)


TOLERANCE, FLOOR_MIB = 0.15, 32.0  # the plan's target: within 15% or 32 MiB of what is measured, the larger


def within(predicted_mib: float, measured_mib: float) -> bool:
    """Whether a predicted phase (MiB) is within the plan's target of the measured one."""
    return abs(predicted_mib - measured_mib) <= max(TOLERANCE * measured_mib, FLOOR_MIB)


def metrics(plan: Plan) -> dict[str, float]:
    """plan/<phase>_growth_mib and plan/<phase>_peak_mib (resident + growth), beside the measured mem/*."""
    out = {}
    for name, ph in plan.phases.items():
        out[plan_growth_key(name)] = ph.growth / MIB
        out[plan_peak_key(name)] = ph.peak / MIB
    if plan.head_size is not None:
        out["plan/head_size"] = float(plan.head_size)
    if "train" in plan.phases:  # the terms activations= and train.precision change
        train = plan.phases["train"]
        out["plan/train_activations_mib"] = sum(v for k, v in train.parts.items() if k.startswith(ACTIVATIONS)) / MIB
        out["plan/resident_mib"] = sum(train.resident.values()) / MIB
    return out



def resolve_size(cfg, s, tokens: int, device_type: str, world: int = 1, device_bytes: int | None = None) -> int | None:
    """head.size, with `auto` replaced by the largest tile within head.memory_budget_mib (null: a tenth of
    `device_bytes` when given, the device a plan is for; else default_budget, from the memory free now)."""
    if cfg.head.size != "auto":
        return cfg.head.size
    budget = cfg.head.memory_budget_mib
    if budget is not None:
        budget = budget * MIB
    else:
        budget = device_bytes // 10 if device_bytes else terms.default_budget(device_type)
    return terms.auto_size(budget, tokens, s, registry.get("head", cfg.head.name), grad_accum(cfg, world) > 1)
