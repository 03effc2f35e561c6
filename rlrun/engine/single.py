"""One process, one device: plain torch AdamW, gradient clipping, LR schedule.

Every engine offers the same few methods, which is all the training loops use: `backward`, `step`, `lr`,
`offload`/`onload`, `generation` (weights ready for generate), `gather` (objects from every rank), and
`save`/`load_state_dict` of checkpoints. `engine=deepspeed` (engine/deepspeed.py) implements them with DeepSpeed ZeRO.
"""

from __future__ import annotations

import contextlib
import math
import os

import torch

from .. import checkpoint
from .. import offload as host_offload

# What is true of engine=single, asked by the planner, rlrun.precision and the check (never its name):
BF16_PATH = "bf16-autocast"  # train.precision=bf16: autocast over the fp32 weights, which are the master copy
OWN_MASTER = False  # no optimizer of its own keeps a master copy: the check's master-weights probe runs
GRADIENTS_AS_BACKWARD = True  # backward makes each layer's gradient as it frees that layer's saved tensors
ZERO_STAGES: tuple[int, ...] = ()  # no state sharded over ranks (`rlrun plan` suggests an engine that has some)


def world_size() -> int:
    return 1


def zero_stage(e) -> int:
    """The ZeRO stage that shards its state: none."""
    return 0


def dtype(e, precision: str) -> str:
    """fp32 | bf16 the run computes in: train.precision's."""
    return precision


def offloads_optimizer(e) -> bool:
    return False


def offloads_params(e) -> bool:
    return False


def check_device(e):
    """Where `rlrun check` probes a configuration of this engine: its own device."""
    return device(e)


def device(cfg) -> torch.device:
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(cfg.device)


def lr_lambda(schedule: str, warmup: int, total: int):
    if schedule not in ("constant", "cosine", "linear"):  # the validator refuses it first; never train on a typo
        raise ValueError(f"train.lr_schedule={schedule!r}; supported: ['constant', 'cosine', 'linear']")

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(total - warmup, 1)
        if schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
        if schedule == "linear":
            return max(0.0, 1.0 - progress)
        return 1.0

    return f


def optimizer(model, train_cfg):
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=train_cfg.lr, betas=tuple(train_cfg.betas),
                            weight_decay=train_cfg.weight_decay, foreach=False)
    schedule = lr_lambda(train_cfg.lr_schedule, train_cfg.warmup_steps, train_cfg.steps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    return opt, sched


class Engine:
    rank, world, main = 0, 1, True

    def __init__(self, cfg, policy, reference, grad_accum: int):
        self.device = device(cfg.engine)
        if self.device.type == "cpu":  # DeepSpeed, imported by libraries even here, would warn it found no GPU
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        self.model = policy.to(self.device)
        self.reference = None if reference is None else reference.to(self.device)
        self.optimizer, self.scheduler = optimizer(policy, cfg.train)
        self.grad_clip, self.offload_enabled = cfg.train.grad_clip, cfg.offload.enabled

    def backward(self, loss: torch.Tensor, boundary: bool | None = None) -> None:
        """`loss` is this micro-batch's share of the step's loss (already divided by the step's token count); the
        optimizer steps in `step`, so the boundary is not needed here."""
        loss.backward()

    def step(self) -> float:
        """Clip, optimizer step, LR step, zero grads; returns the gradient norm before clipping."""
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(grad_norm)

    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def offload(self) -> None:
        host_offload.to_host(self.optimizer, self.offload_enabled, self.device)

    def onload(self) -> None:
        host_offload.to_device(self.optimizer, self.offload_enabled, self.device)

    def offload_effective(self) -> bool:
        return host_offload.effective(self.offload_enabled, self.device)

    def generation(self):
        return contextlib.nullcontext()

    def gather(self, obj) -> list:
        return [obj]

    def save(self, folder: str, step: int, state: dict, keep: int) -> str:
        """Checkpoint: the loop's `state` plus model, optimizer, schedule and reference, in one atomic file."""
        return checkpoint.save(folder, step, {**state, **self.state_dict()}, keep)

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "reference": None if self.reference is None else self.reference.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.reference is not None:
            self.reference.load_state_dict(state["reference"])
