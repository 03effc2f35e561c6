"""Typed configs: the schema of conf/ (schema.py), the rules across keys (rules.py), and `validate` (validate.py).

`validate(cfg)` turns the composed DictConfig into a `RunConfig` of plain dataclasses, or raises one `ConfigError`
listing every problem (unknown key, unset value, wrong type, value outside its choices or bounds, broken rule),
each with its key, value and fix; the CLI prints it and exits 2. Nothing here imports torch or any other heavy
library, so a refused config answers in about the time Hydra takes to compose it.

Why not Hydra's ConfigStore (structured configs as the schema of conf/*.yaml): Hydra merges against a structured
config key by key and stops at the first mismatch with its own message and exit code 1; rlrun's contract is one
error that lists every problem at once, exit code 2. So the YAML files stay untyped for Hydra and are checked here
after composition. They are also the one place where default values live: the dataclasses have none.
"""

from .schema import (
    AlwaysPolicy,
    ArithTask,
    CheckpointConfig,
    ChunkedHead,
    CispoLoss,
    DapoLoss,
    DeepSpeedEngine,
    DenseHead,
    DpoLoss,
    GspoLoss,
    HFModel,
    HFRollout,
    JsonlTask,
    MLflowTracking,
    NoTracking,
    OffOffload,
    OnOffload,
    ReplayRollout,
    RunConfig,
    SingleEngine,
    SkipPolicy,
    SmolLM2Model,
    TiledHead,
    TinyModel,
    TisConfig,
    TrainConfig,
    VLLMRollout,
    WindowPolicy,
    WordProblemsTask,
)
from .validate import OPTIONS, ConfigError, choices, validate

__all__ = ["OPTIONS", "ConfigError", "RunConfig", "choices", "validate", "AlwaysPolicy", "ArithTask",
           "CheckpointConfig", "ChunkedHead", "CispoLoss", "DapoLoss", "DeepSpeedEngine", "DenseHead", "DpoLoss",
           "GspoLoss", "HFModel", "HFRollout", "JsonlTask", "MLflowTracking", "NoTracking", "OffOffload",
           "OnOffload", "ReplayRollout", "SingleEngine", "SkipPolicy", "SmolLM2Model", "TiledHead", "TinyModel",
           "TisConfig", "TrainConfig", "VLLMRollout", "WindowPolicy", "WordProblemsTask"]
