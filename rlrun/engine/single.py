"""One process, one device: plain torch AdamW, gradient clipping, LR schedule."""

from __future__ import annotations

import math

import torch


def device(cfg) -> torch.device:
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(cfg.device)


def lr_lambda(schedule: str, warmup: int, total: int):
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
