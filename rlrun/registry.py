"""Group -> option -> the object that implements it, as "module" or "module:attribute" import strings: the one
list of option names.

The one dispatch mechanism: every option of every config group is found here with `get(group, name)`, and what
is true of it (exactness, the phases it changes, its memory term: rlrun/axes.py) is said on that object. Names
equal the YAML file stems in conf/<group>/ and the option dataclasses in rlrun.config (a test checks all three
agree); `recipe` is keyed by the loss group's options (the loss stays the user's one switch of algorithm), and
`precision`, `pipeline`, `decode` and `speculate` by the values of `train.precision`, `rollout.pipeline`,
`rollout.decode` and `rollout.speculate`.
Components are imported by `get` on first use, so importing this module (the CLI does, before validation) imports
no torch. `register` adds
an option from outside the package (a plugin, a test): its object and its config dataclass, nothing else to edit.
"""

from __future__ import annotations

import importlib
from typing import Any

REGISTRY: dict[str, dict[str, Any]] = {
    # per-token GRPO terms, wrapped by rlrun.losses.objective; dpo: the sequence-pair loss the DPO recipe calls
    "loss": {"dapo": "rlrun.losses.dapo:token_loss", "cispo": "rlrun.losses.cispo:token_loss",
             "gspo": "rlrun.losses.gspo:token_loss", "dpo": "rlrun.losses.dpo:dpo_loss"},
    "head": {"dense": "rlrun.heads.dense", "tiled": "rlrun.heads.tiled", "chunked": "rlrun.heads.chunked"},
    "logprob_policy": {"always": "rlrun.logprobs:Always", "window": "rlrun.logprobs:Window",
                       "skip": "rlrun.logprobs:Skip"},
    "offload": {"off": "rlrun.offload:Off", "on": "rlrun.offload:On"},  # the engines move the state when enabled
    "batching": {"padded": "rlrun.batching.layouts:Padded", "packed": "rlrun.batching.layouts:Packed",
                 "shared_prompt": "rlrun.batching.layouts:SharedPrompt"},
    "activations": {"keep": "rlrun.activations:Keep", "checkpoint": "rlrun.activations:Checkpoint",
                    "offload": "rlrun.activations:Offload"},
    "precision": {"fp32": "rlrun.precision:Fp32", "bf16": "rlrun.precision:Bf16"},
    "pipeline": {"sync": "rlrun.recipes.sources:Sync", "async": "rlrun.recipes.sources:Async"},
    "decode": {"eager": "rlrun.rollout.decoding:Eager", "compiled": "rlrun.rollout.decoding:Compiled"},
    "speculate": {"off": "rlrun.rollout.speculate:Off", "prompt": "rlrun.rollout.speculate:Prompt",
                  "history": "rlrun.rollout.speculate:History"},
    # models.Source: load(cfg, seed) -> (model, tokenizer), meta(cfg, seed) -> (model on the meta device, tokenizer)
    "model": {"tiny": "rlrun.models:tiny", "hf": "rlrun.models:hf", "smollm2": "rlrun.models:smollm2"},
    "task": {"arith": "rlrun.tasks.arith:read", "word_problems": "rlrun.tasks.word_problems:read",
             "jsonl": "rlrun.tasks.jsonl:read",
             "dataset": "rlrun.tasks.dataset:read"},
    "rollout": {"hf": "rlrun.rollout.hf", "vllm": "rlrun.rollout.vllm", "replay": "rlrun.rollout.replay"},
    "engine": {"single": "rlrun.engine.single", "deepspeed": "rlrun.engine.deepspeed"},
    "tracking": {"mlflow": "rlrun.tracking.mlflow:MLflow", "none": "rlrun.tracking.tracker:Null"},
    "recipe": {"dapo": "rlrun.algorithms:GRPO", "cispo": "rlrun.algorithms:GRPO",
               "gspo": "rlrun.algorithms:GRPO", "dpo": "rlrun.algorithms:DPO"},
}
# The axes: the groups whose options change how a run computes (efficiency, the first five: exact against their
# baseline) or its arithmetic and schedule (precision, pipeline: approximate; decode: rollout=hf's decode loop, to fp32
# tolerance; speculate: whether it drafts and verifies, to fp32 tolerance). Each group lists its baseline first.
EFFICIENCY = ("head", "logprob_policy", "offload", "batching", "activations")
AXES = (*EFFICIENCY, "precision", "pipeline", "decode", "speculate")
# groups that are not config groups: the config group whose options key them, or the config key whose values do
KEYED_BY = {"recipe": "loss", "precision": "train.precision", "pipeline": "rollout.pipeline",
            "decode": "rollout.decode", "speculate": "rollout.speculate"}


def key_of(group: str) -> str:
    """The config key that holds an axis's option: `<group>.name`, or the key KEYED_BY names (train.precision)."""
    key = KEYED_BY.get(group, group)
    return key if "." in key else f"{key}.name"


def option_of(cfg, group: str) -> str | None:
    """The option `cfg` (a config object or a DictConfig) chose on `group`'s axis; None where it has no such key."""
    value = cfg
    for part in key_of(group).split("."):
        value = getattr(value, part, None)
    return None if value is None else str(value)

# Group -> the typing.Protocol every option of the group satisfies (tests/unit/test_protocols.py checks each one).
PROTOCOLS: dict[str, str] = {
    "head": "rlrun.heads.protocol:Head",
    "engine": "rlrun.engine.protocol:EngineModule",
    "rollout": "rlrun.rollout.protocol:RolloutModule",
    "task": "rlrun.tasks.protocol:TaskReader",
    "tracking": "rlrun.tracking.tracker:Tracker",
    "logprob_policy": "rlrun.logprobs:LogprobPolicy",
    "offload": "rlrun.offload:Offload",
    "batching": "rlrun.batching.protocol:Layout",
    "activations": "rlrun.activations.protocol:Activations",
    "precision": "rlrun.precision:Precision",
    "pipeline": "rlrun.pipeline.protocol:Source",
}


# Config group -> option name -> the dataclass its node is validated against, for options added by `register` (the
# shipped ones are in rlrun/config's schema); the validator reads both.
CONFIGS: dict[str, dict[str, type]] = {}


# Group -> the options `register` added (from outside the package); the rest of REGISTRY is what rlrun ships.
ADDED: dict[str, set[str]] = {}


def register(group: str, name: str, target, config: type | None = None) -> None:
    """Add option `name` to `group`: `target` is its object (or an import string); `config`, the dataclass its
    config node is validated against (a config group's option: its `name: Literal[name]` and its keys), so that
    `group=name` composes (with its YAML on Hydra's search path), validates, and is found by `get`. An axis keyed
    by a config key (precision, pipeline, decode: KEYED_BY) takes no config: `train.precision=name` validates once
    `name` is registered."""
    if name not in REGISTRY.get(group, {}):  # replacing a shipped option's object keeps it shipped
        ADDED.setdefault(group, set()).add(name)
    REGISTRY.setdefault(group, {})[name] = target
    if config is not None:
        CONFIGS.setdefault(group, {})[name] = config


def unregister(group: str, name: str) -> None:
    """Undo `register` of an option it added (tests); rlrun's own options stay."""
    if name not in ADDED.get(group, ()):
        return
    REGISTRY.get(group, {}).pop(name, None)
    CONFIGS.get(group, {}).pop(name, None)
    ADDED.get(group, set()).discard(name)


def shipped(group: str) -> list[str]:
    """The options of `group` rlrun ships (conf/, the schema), in the registry's order: not those `register` added."""
    return [n for n in REGISTRY[group] if n not in ADDED.get(group, ())]


def load(path):
    """The object an import string names: "module" or "module:attribute.attribute" (an object: itself)."""
    if not isinstance(path, str):
        return path
    module, _, attribute = path.partition(":")
    obj = importlib.import_module(module)
    for part in attribute.split(".") if attribute else ():
        obj = getattr(obj, part)
    return obj


def baseline(group: str) -> str:
    """The option of an axis the others are compared with: the first the registry lists (tests/unit/test_axes.py checks
    that its object says `exactness = "baseline"`)."""
    return next(iter(REGISTRY[group]))


def get(group: str, name: str):
    """The component for `group=name`, imported now; KeyError naming the supported options otherwise."""
    if group not in REGISTRY:
        raise KeyError(f"no config group {group!r}; groups: {sorted(REGISTRY)}")
    names = REGISTRY[group]
    if name not in names:
        raise KeyError(f"{group}={name!r} is not supported; supported: {sorted(names)}")
    return load(names[name])


def protocol(group: str):
    """The Protocol the options of `group` satisfy (imported now)."""
    return load(PROTOCOLS[group])
