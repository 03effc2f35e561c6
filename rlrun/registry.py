"""Group -> option -> the component that implements it, as "module" or "module:attribute" import strings.

The one dispatch mechanism: every option of every config group is found here with `get(group, name)`. Names equal
the YAML file stems in conf/<group>/ and the option dataclasses in rlrun.config (a test checks all three agree);
`recipe` is keyed by the loss group's options (the loss stays the user's one switch of algorithm). Components are
imported by `get` on first use, so importing this module (the CLI does, before validation) imports no torch.
"""

from __future__ import annotations

import importlib

REGISTRY: dict[str, dict[str, str]] = {
    # per-token GRPO terms, wrapped by rlrun.losses.objective; dpo: the sequence-pair loss the DPO recipe calls
    "loss": {"dapo": "rlrun.losses.dapo:token_loss", "cispo": "rlrun.losses.cispo:token_loss",
             "gspo": "rlrun.losses.gspo:token_loss", "dpo": "rlrun.losses.dpo:dpo_loss"},
    "head": {"dense": "rlrun.heads.dense", "tiled": "rlrun.heads.tiled", "chunked": "rlrun.heads.chunked"},
    # the policy is a name rlrun.logprobs.plan interprets; the module is what implements all three
    "logprob_policy": {"always": "rlrun.logprobs", "window": "rlrun.logprobs", "skip": "rlrun.logprobs"},
    "offload": {"on": "rlrun.offload", "off": "rlrun.offload"},  # the engines call it when offload.enabled
    # the recipes' training passes read the layout (rlrun.batching.packs) when batching is not padded
    "batching": {"padded": "rlrun.batching", "packed": "rlrun.batching", "shared_prompt": "rlrun.batching"},
    # setup wraps the policy's decoder layers (checkpoint); the train passes run inside activations.saving
    "activations": {"keep": "rlrun.activations", "checkpoint": "rlrun.activations", "offload": "rlrun.activations"},
    "model": {"tiny": "rlrun.models:tiny", "hf": "rlrun.models:hf"},  # (cfg, seed) -> (model, tokenizer)
    "task": {"arith": "rlrun.tasks.arith:read", "jsonl": "rlrun.tasks.jsonl:read",
             "dataset": "rlrun.tasks.dataset:read"},
    "rollout": {"hf": "rlrun.rollout.hf", "vllm": "rlrun.rollout.vllm"},
    "engine": {"single": "rlrun.engine.single", "deepspeed": "rlrun.engine.deepspeed"},
    "tracking": {"mlflow": "rlrun.tracking.mlflow:MLflow", "none": "rlrun.tracking.tracker:Null"},
    "recipe": {"dapo": "rlrun.recipes.grpo", "cispo": "rlrun.recipes.grpo", "gspo": "rlrun.recipes.grpo",
               "dpo": "rlrun.recipes.dpo"},
}
KEYED_BY = {"recipe": "loss"}  # groups that are not config groups: the config group whose options key them

# Group -> the typing.Protocol every option of the group satisfies (tests/test_protocols.py checks each one).
PROTOCOLS: dict[str, str] = {
    "head": "rlrun.heads.protocol:Head",
    "engine": "rlrun.engine.protocol:EngineModule",
    "rollout": "rlrun.rollout.protocol:RolloutModule",
    "task": "rlrun.tasks.protocol:TaskReader",
    "tracking": "rlrun.tracking.tracker:Tracker",
}


def load(path: str):
    """The object an import string names: "module" or "module:attribute.attribute"."""
    module, _, attribute = path.partition(":")
    obj = importlib.import_module(module)
    for part in attribute.split(".") if attribute else ():
        obj = getattr(obj, part)
    return obj


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
