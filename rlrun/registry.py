"""Name -> component for every config group. Keys equal the YAML file stems in conf/<group>/."""

from . import models, tasks, tracking
from .engine import deepspeed as ds_engine
from .engine import single
from .heads import HEADS
from .logprobs import POLICIES
from .losses import POLICY_LOSSES
from .losses.dpo import dpo_loss
from .rollout import hf
from .rollout import vllm as vllm_rollout

REGISTRY: dict[str, dict] = {
    "loss": {**POLICY_LOSSES, "dpo": dpo_loss},
    "head": dict(HEADS),
    "logprob_policy": {name: name for name in POLICIES},
    "offload": {"on": True, "off": False},
    "model": {"tiny": models.tiny_model, "hf": models.load_hf},
    "task": {"arith": tasks.arith_examples, "jsonl": tasks.read_jsonl},
    "rollout": {"hf": hf, "vllm": vllm_rollout},
    "engine": {"single": single, "deepspeed": ds_engine},
    "tracking": {"mlflow": tracking.MLflow, "none": tracking.Null},
}


def get(group: str, name: str):
    names = REGISTRY[group]
    if name not in names:
        raise KeyError(f"{group}={name!r} is not supported; supported: {sorted(names)}")
    return names[name]
