"""Group -> option -> the component that implements it, as "module" or "module:attribute" import strings.

Names equal the YAML file stems in conf/<group>/ and the option dataclasses in rlrun.config (a test checks all
three agree). Components are imported by `get` on first use, so importing this module (the CLI does, before
validation) imports no torch.
"""

from __future__ import annotations

import importlib

REGISTRY: dict[str, dict[str, str]] = {
    "loss": {"dapo": "rlrun.losses.dapo:token_loss", "cispo": "rlrun.losses.cispo:token_loss",  # POLICY_LOSSES
             "dpo": "rlrun.losses.dpo:dpo_loss"},
    "head": {"dense": "rlrun.heads.dense", "tiled": "rlrun.heads.tiled", "chunked": "rlrun.heads.chunked"},
    # the policy is a name rlrun.logprobs.plan interprets; the module is what implements all three
    "logprob_policy": {"always": "rlrun.logprobs", "window": "rlrun.logprobs", "skip": "rlrun.logprobs"},
    "offload": {"on": "rlrun.offload", "off": "rlrun.offload"},  # the engines call it when offload.enabled
    "model": {"tiny": "rlrun.models:tiny_model", "hf": "rlrun.models:load_hf"},
    "task": {"arith": "rlrun.tasks:load", "jsonl": "rlrun.tasks:load", "dataset": "rlrun.tasks:load"},
    "rollout": {"hf": "rlrun.rollout.hf", "vllm": "rlrun.rollout.vllm"},
    "engine": {"single": "rlrun.engine.single", "deepspeed": "rlrun.engine.deepspeed"},
    "tracking": {"mlflow": "rlrun.tracking.mlflow:MLflow", "none": "rlrun.tracking.tracker:Null"},
}


def get(group: str, name: str):
    """The component for `group=name`, imported now; KeyError naming the supported options otherwise."""
    if group not in REGISTRY:
        raise KeyError(f"no config group {group!r}; groups: {sorted(REGISTRY)}")
    names = REGISTRY[group]
    if name not in names:
        raise KeyError(f"{group}={name!r} is not supported; supported: {sorted(names)}")
    module, _, attribute = names[name].partition(":")
    obj = importlib.import_module(module)
    for part in attribute.split(".") if attribute else ():
        obj = getattr(obj, part)
    return obj
