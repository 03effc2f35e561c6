"""What a run's faults say, decided here (outside the runner, which branches on no option's name): a device the
config names that the machine lacks (checked before anything is built), and a loss that is no longer finite."""

from __future__ import annotations

from . import algorithms, precision, registry
from .config import ConfigError


def diverged(cfg, error: Exception) -> str:
    """The message for a non-finite loss: where, and what to change (under bf16: try fp32 first)."""
    text = str(error)
    if precision.reduced(cfg):
        text += (" The run computes in bfloat16 (train.precision=bf16), whose 8-bit mantissa rounds away what fp32 "
                 "keeps: rerun with train.precision=fp32 to see whether these settings are stable there, then lower "
                 "train.lr (or raise train.warmup_steps) for bf16.")
    return f"training diverged: {text} Checkpoints written before this step, if any, are kept."


def check_devices(cfg) -> None:
    """The CUDA devices the config names (engine.device, rollout.worker_device with rollout.pipeline=async) exist on
    this machine: ConfigError naming each and what the machine has, before the model is built."""
    import torch

    named = {"engine.device": getattr(cfg.engine, "device", None)}
    pipeline = getattr(cfg.rollout, "pipeline", None) or registry.baseline("pipeline")
    if algorithms.of(cfg).samples and registry.get("pipeline", pipeline).generator_process:
        named["rollout.worker_device"] = cfg.rollout.worker_device
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    problems = []
    for key, device in named.items():
        if not device or not str(device).startswith("cuda"):
            continue
        index = int(device.split(":")[1]) if ":" in device else 0
        if index >= count:
            has = (f"{count} CUDA device(s), cuda:0 to cuda:{count - 1}" if count else
                   "no CUDA device (torch.cuda.is_available() is False)")
            problems.append(f"{key}={device}, but this machine has {has}; name a device it has (cpu, or cuda:N "
                            "below that count) or leave it unset (engine.device=auto; rollout.worker_device=null: "
                            "the trainer's)")
    if problems:
        raise ConfigError(problems)
