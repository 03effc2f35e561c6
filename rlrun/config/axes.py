"""The options of the efficiency axes (head, logprob_policy, offload, batching, activations): the config groups
that change how a run computes, not what it trains (rlrun.tools.equivalence compares them). Part of the schema
(schema.py imports them into RunConfig)."""

from dataclasses import dataclass
from typing import Annotated, Literal

from .types import Check, PosInt

# -- head ---------------------------------------------------------------------------------------------------------
TileSize = Annotated[int, Check(lambda v: v >= 1, "a positive integer (tokens per tile/chunk)")] | Literal["auto"]


@dataclass
class DenseHead:
    name: Literal["dense"]
    size: PosInt | None  # ignored: dense builds the full logits


@dataclass
class TiledHead:
    name: Literal["tiled"]
    size: TileSize  # auto: the planner picks the largest within memory_budget_mib (rlrun/plan/)
    memory_budget_mib: PosInt | None  # null: a tenth of the memory free at start


@dataclass
class ChunkedHead:  # TiledHead's keys
    name: Literal["chunked"]
    size: TileSize
    memory_budget_mib: PosInt | None


# -- logprob_policy, offload --------------------------------------------------------------------------------------
@dataclass
class AlwaysPolicy:
    name: Literal["always"]


@dataclass
class WindowPolicy:
    name: Literal["window"]


@dataclass
class SkipPolicy:
    name: Literal["skip"]


@dataclass
class OffOffload:
    name: Literal["off"]
    enabled: bool


@dataclass
class OnOffload:
    name: Literal["on"]
    enabled: bool


# -- batching -----------------------------------------------------------------------------------------------------
@dataclass
class PaddedBatching:
    name: Literal["padded"]
    max_tokens: PosInt  # positions per forward (unused by padded)


@dataclass
class PackedBatching:
    name: Literal["packed"]
    max_tokens: PosInt  # positions per forward


@dataclass
class SharedPromptBatching:
    name: Literal["shared_prompt"]
    max_tokens: PosInt  # positions per forward


# -- activations --------------------------------------------------------------------------------------------------
@dataclass
class KeepActivations:
    name: Literal["keep"]
    every: PosInt  # unused by keep (kept so `activations.every=...` composes across the axis)


@dataclass
class CheckpointActivations:
    name: Literal["checkpoint"]
    every: PosInt  # checkpoint every N-th decoder layer (1: all of them)


@dataclass
class OffloadActivations:
    name: Literal["offload"]
    every: PosInt  # unused by offload
