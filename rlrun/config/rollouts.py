"""The rollout group's options (rollout=hf|vllm|replay), part of the schema (schema.py imports them): kept here so
that each module stays short."""

import re
from dataclasses import dataclass
from typing import Annotated, Literal

from .types import Check, Dtype, NonNegInt, PosInt, Positive, Registered

# -- rollout ------------------------------------------------------------------------------------------------------
Temperature = Annotated[float, Check(lambda v: v > 0, "> 0: the trainer's logprobs are taken at the sampling "
                                                        "temperature")]
TopP = Annotated[float, Check(lambda v: 0 < v <= 1, "in (0, 1]")]
# the k most likely tokens only (0: off), applied before top_p as transformers and vLLM apply them
TopK = Annotated[int, Check(lambda v: v >= 0, "an integer >= 0 (0: off)")]


# drafted tokens per verify pass: each costs a position of every running row's forward, accepted or not
SpeculateK = Annotated[int, Check(lambda v: 1 <= v <= 32, "an integer from 1 to 32 (drafted tokens a verify pass)")]


Device = Annotated[str, Check(lambda v: re.fullmatch(r"cpu|cuda(:\d+)?", v) is not None, "cpu, cuda or cuda:N")]


@dataclass
class HFRollout:
    name: Literal["hf"]
    temperature: Temperature
    top_p: TopP
    top_k: TopK
    max_new_tokens: PosInt
    sync_weights: bool  # read by the GRPO recipe for every rollout; hf samples from the trainer's model itself
    pipeline: Annotated[str, Registered("pipeline")]  # sync | async (rlrun/pipeline)
    max_staleness: NonNegInt
    worker_threads: PosInt | None
    worker_device: Device | None
    worker_timeout_s: Positive  # async: the trainer gives up on a generator without a heartbeat this long
    record: str | None = None  # a folder: every rollout trained on is written there (rlrun/rollout/record.py)
    decode: Annotated[str, Registered("decode")] = "eager"  # compiled: static KV cache, compiled step (decoding.py)
    speculate: Annotated[str, Registered("speculate")] = "off"  # prompt | history: drafts verified (speculate.py)
    speculate_k: SpeculateK = 4  # drafted tokens a row and verify pass at most
    speculate_from: str | None = None  # history: a rollout.record folder whose completions it drafts from at start


@dataclass
class VLLMRollout:
    name: Literal["vllm"]
    temperature: Temperature
    top_p: TopP
    top_k: TopK
    max_new_tokens: PosInt
    mode: Literal["inprocess", "process"]
    sync_weights: bool
    dtype: Dtype
    enforce_eager: bool
    max_model_len: PosInt
    kv_cache_gib: Positive
    gpu_memory_utilization: Annotated[float, Check(lambda v: 0 < v <= 1, "in (0, 1]")]
    tensor_parallel_size: PosInt
    sleep: bool
    pipeline: Annotated[str, Registered("pipeline")]
    max_staleness: NonNegInt
    worker_threads: PosInt | None
    worker_device: Device | None
    worker_timeout_s: Positive  # async: the trainer gives up on a generator without a heartbeat this long
    record: str | None = None  # a folder: every rollout trained on is written there (rlrun/rollout/record.py)
    speculate: Annotated[str, Registered("speculate")] = "off"  # only off: a rule says why (config/rules.py)


@dataclass
class ReplayRollout:
    """rollout=replay: the rollouts of a record, in order; the sampler's settings must be the record's."""

    name: Literal["replay"]
    path: str  # the rollout.record folder of an earlier run
    temperature: Temperature
    top_p: TopP
    top_k: TopK
    max_new_tokens: PosInt
    pipeline: Literal["sync"]  # read in step, nothing to overlap
