"""DeepSpeed ZeRO-2/3 data parallel: the same loops across processes and machines.

Launch one process per device with `deepspeed` or `torchrun` (docs/deepspeed.md); a plain `rlrun
engine=deepspeed` runs one rank. Each rank holds a slice of every rollout / DPO batch; DeepSpeed averages
gradients over ranks, so `backward` multiplies the rank's loss (already divided by the GLOBAL token or pair count)
by the world size: the gradient is then exactly the 1-rank gradient of the same global batch.

The optimizer is a client torch AdamW (`engine.optimizer=torch`, no compilation) or DeepSpeed's own
(`engine.optimizer=deepspeed`: FusedAdam on GPU, CPUAdam when the optimizer is offloaded; both compile on first
use). Under ZeRO-3 the heads gather the partitioned lm-head weight themselves (heads/common.py `gathered`).
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import logging
import os
import socket
from typing import Any

import torch
import torch.distributed as dist

from .. import checkpoint, nofollow, precision, ranks
from .. import offload as host_offload
from . import single

log = logging.getLogger(__name__)

# The classes DeepSpeed's own checkpoint files pickle besides tensors and plain data (0.19, ZeRO-2/3), the only
# ones a DeepSpeed checkpoint may ask for.
DEEPSPEED_GLOBALS = ("deepspeed.runtime.zero.config.ZeroStageEnum", "deepspeed.utils.tensor_fragment.fragment_address",
                     "deepspeed.runtime.fp16.loss_scaler.LossScaler",
                     "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler")


# What is true of engine=deepspeed, asked by the planner, rlrun.precision and the check (never its name):
BF16_PATH = "bf16-deepspeed"  # train.precision=bf16: bf16 weights, DeepSpeed's fp32 master copy in its optimizer
OWN_MASTER = True  # its ZeRO optimizer keeps the master copy (checked by tests/distributed/test_distributed.py)
GRADIENTS_AS_BACKWARD = False  # gradients go to its reduce buckets; the planner keeps every one beside the activations
ZERO_STAGES = (2, 3)  # the stages `rlrun plan` suggests (engine.zero_stage)


def world_size() -> int:
    """The ranks the launcher starts (WORLD_SIZE: set it to plan a multi-rank run)."""
    return ranks.world_size()


def zero_stage(e) -> int:
    return e.zero_stage


def dtype(e, precision: str) -> str:
    """fp32 | bf16: engine.dtype where set (the validator made it agree with train.precision), else the latter."""
    return e.dtype if e.dtype != "auto" else precision


def offloads_optimizer(e) -> bool:
    return e.offload_optimizer != "none"


def offloads_params(e) -> bool:
    return e.zero_stage == 3 and e.offload_param != "none"


def check_device(e) -> str:
    """`rlrun check` probes a DeepSpeed configuration in one process on CPU (its ranks: the `ranks` probe)."""
    return "cpu"


@contextlib.contextmanager
def weights_only_loads(ds):
    """DeepSpeed's checkpoint engine loads with torch.load(weights_only=True), DEEPSPEED_GLOBALS allowed."""
    classes = []
    for name in DEEPSPEED_GLOBALS:
        module, _, attr = name.rpartition(".")
        with contextlib.suppress(ImportError, AttributeError):
            classes.append(getattr(importlib.import_module(module), attr))
    engine = ds.checkpoint_engine

    def load(path, map_location=None):
        with torch.serialization.safe_globals(classes):
            return torch.load(path, map_location=map_location, weights_only=True)

    engine.load = load  # an instance attribute over the class's method
    try:
        yield
    finally:
        del engine.load


class RankFailure(RuntimeError):
    """Another rank stopped: a collective lost its peer."""


_OWNED = {"group": False}  # whether this module created the process group (an in-process vLLM makes its own)


def shutdown() -> None:
    """Leave the process group this module joined (at the end of a run, failed or not)."""
    if _OWNED["group"] and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        _forget_groups()
    _OWNED["group"] = False


def _forget_groups() -> None:
    """DeepSpeed keeps the groups it made (a clone of the world group, made by its first engine) in module globals
    and never drops them: after destroy_process_group they name a dead group, and the next run in this process (a
    sweep's next job) failed on it ("Group ... is not registered"). Each run's engine makes its own again."""
    import sys

    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is None:
        return
    for name, value in list(vars(groups).items()):
        if isinstance(value, dist.ProcessGroup):
            setattr(groups, name, None)
        elif isinstance(value, dict) and any(isinstance(v, dist.ProcessGroup) for v in value.values()):
            value.clear()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(backend: str, timeout_s: int) -> None:
    """Join the process group the launcher described (env://); a process started without a launcher is rank 0 of 1."""
    import deepspeed

    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not dist.is_initialized():
        with _no_shm_kernel():
            deepspeed.init_distributed(dist_backend=backend, timeout=datetime.timedelta(seconds=timeout_s),
                                       verbose=False)
        _OWNED["group"] = True


@contextlib.contextmanager
def _no_shm_kernel():
    """DeepSpeed's CPU backend compiles (g++ through ninja: 30-110 s on this project's CI machine, again for each
    new venv) and loads a shared-memory all-reduce kernel when it starts. Only its inference all-reduce uses that
    kernel, never training, so it is not built; all-reduce goes through the process group (gloo)."""
    ds_torch: Any = importlib.import_module("deepspeed.comm.torch")  # by name: the attribute is torch

    if torch.cuda.is_available() or not hasattr(ds_torch, "build_shm_op"):
        yield
        return
    built = ds_torch.build_shm_op
    ds_torch.build_shm_op = lambda: None
    try:
        yield
    finally:
        ds_torch.build_shm_op = built


def ds_config(cfg, grad_accum: int) -> dict:
    e, t = cfg.engine, cfg.train
    zero: dict = {"stage": e.zero_stage, "stage3_gather_16bit_weights_on_model_save": False}
    if e.offload_optimizer != "none":
        zero["offload_optimizer"] = {"device": e.offload_optimizer, "pin_memory": torch.cuda.is_available()}
    if e.offload_param != "none":
        zero["offload_param"] = {"device": e.offload_param, "pin_memory": torch.cuda.is_available()}
    return {
        "train_micro_batch_size_per_gpu": t.micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "train_batch_size": t.micro_batch * grad_accum * ranks.world_size(),
        "gradient_clipping": t.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": precision.reduced(cfg)},  # train.precision=bf16: fp32 master in ZeRO
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


class Engine:
    def __init__(self, cfg, policy, reference, grad_accum: int):
        import deepspeed

        init_distributed(cfg.engine.backend, cfg.engine.timeout_s)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.main = self.rank == 0
        local = int(os.environ.get("LOCAL_RANK", "0"))
        self.grad_norm_known = True  # until DeepSpeed reports none (step)
        self.device = torch.device(f"cuda:{local}") if torch.cuda.is_available() else torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.config = ds_config(cfg, grad_accum)
        self.offload_enabled = cfg.offload.enabled
        if cfg.engine.optimizer == "torch":
            opt, sched = single.optimizer(policy, cfg.train)
        else:  # DeepSpeed's optimizer from the config; the schedule wraps it after initialize
            self.config["optimizer"] = {"type": "AdamW", "params": {
                "lr": cfg.train.lr, "betas": list(cfg.train.betas), "weight_decay": cfg.train.weight_decay}}
            opt, sched = None, None
        self.ds, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=policy, optimizer=opt, lr_scheduler=sched, config=self.config,
            model_parameters=None if opt is not None else [p for p in policy.parameters() if p.requires_grad])
        if self.scheduler is None:
            schedule = single.lr_lambda(cfg.train.lr_schedule, cfg.train.warmup_steps, cfg.train.steps)
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule)
            self.ds.lr_scheduler = self.scheduler
        self.model = self.ds.module
        self.reference = None
        if reference is not None:  # frozen: ZeRO-3 partitions it too; no optimizer, no gradients
            ref_cfg = {k: v for k, v in self.config.items() if k != "optimizer"}
            ref_cfg["zero_optimization"] = {"stage": cfg.engine.zero_stage if cfg.engine.zero_stage == 3 else 0}
            self.reference = deepspeed.initialize(model=reference.requires_grad_(False), config=ref_cfg)[0].module
            self.reference.eval()

    def backward(self, loss: torch.Tensor, boundary: bool | None = None) -> None:
        if boundary is not None:  # packed batching: forwards per step vary, so the loop says which is the last
            self.ds.set_gradient_accumulation_boundary(boundary)
        # DeepSpeed averages gradients over ranks; the loss is already a share of the GLOBAL mean, so undo that.
        self.ds.backward(loss * self.world, scale_wrt_gas=False)
        self.ds.step()  # DeepSpeed counts micro-steps here; the optimizer runs at the accumulation boundary
        # The loops call the backbone and heads directly, not the engine's forward, which is where DeepSpeed marks a
        # new micro-step for ZeRO-3 (else the next micro-batch's gradients overwrite this one's instead of adding).
        if hasattr(self.optimizer, "clear_backward_seen_flag"):
            self.optimizer.clear_backward_seen_flag()

    def step(self) -> float:
        """The optimizer already stepped inside the last `backward` (the accumulation boundary): report its norm."""
        norm = self.ds.get_global_grad_norm()
        self.grad_norm_known = norm is not None  # NaN for "not reported" is not a diverged run (runner.Frame.log)
        return float(norm) if norm is not None else float("nan")

    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def offload_effective(self) -> bool:
        return host_offload.effective(self.offload_enabled, self.device)

    def _engine_offload(self) -> bool:
        # DeepSpeed's own state offload exists for ZeRO-3 with its FusedAdam (GPU); otherwise the ZeRO-wrapped torch
        # optimizer's state is moved with plain copies, as in single-process runs.
        return (self.config["zero_optimization"]["stage"] == 3 and hasattr(self.ds, "offload_states")
                and type(self.optimizer.optimizer).__name__ == "FusedAdam")

    def offload(self) -> None:
        if not self.offload_effective():
            return
        if self._engine_offload():
            self.ds.offload_states()
        else:
            host_offload.move_state(self.optimizer.optimizer, "cpu")

    def onload(self) -> None:
        if not self.offload_effective():
            return
        if self._engine_offload():
            self.ds.reload_states()
        else:
            host_offload.move_state(self.optimizer.optimizer, self.device)

    def generation(self):
        """ZeRO-3: gather every parameter once for the whole generate call, not once per decoded token."""
        if self.config["zero_optimization"]["stage"] != 3:
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(self.model.parameters()), modifier_rank=None)

    def save(self, folder: str, step: int, state: dict, keep: int) -> str:
        """DeepSpeed's own checkpoint (model, ZeRO optimizer partitions, LR schedule) plus each rank's loop state and
        RNG, sealed by a manifest once every rank has written (checkpoint.py). A link at the step's folder name is
        refused (LinkError), never written through."""
        nofollow.refuse_link(os.path.join(folder, checkpoint.tag(step)), "a checkpoint's folder")
        self.ds.save_checkpoint(folder, tag=checkpoint.tag(step), save_latest=False)
        checkpoint.write(os.path.join(folder, checkpoint.tag(step), f"rlrun_rank{self.rank}.pt"),
                         {**state, "world_size": self.world})
        dist.barrier()
        path = checkpoint.write_manifest(folder, step, keep, state.get("owner")) if self.main else ""
        dist.barrier()
        return path

    def load_state_dict(self, state: dict) -> None:
        """DeepSpeed's loader calls torch.load(weights_only=False) on its files: each is first checked statically
        to ask for nothing beyond tensors, plain data and DeepSpeed's own few state classes, and the load itself
        then runs with weights_only=True (those classes allowlisted) in place of DeepSpeed's unrestricted one."""
        folder, tag = state["deepspeed_checkpoint"]
        checkpoint.check_foreign(os.path.join(folder, tag), set(DEEPSPEED_GLOBALS))
        with weights_only_loads(self.ds):
            path, _ = self.ds.load_checkpoint(folder, tag=tag, load_optimizer_states=True,
                                              load_lr_scheduler_states=True)
        if path is None:
            raise checkpoint.CheckpointError(f"DeepSpeed could not load {folder}/{tag}")

    def gather(self, obj) -> list:
        out = [None] * self.world
        try:
            dist.all_gather_object(out, obj)
        except RuntimeError as e:
            raise RankFailure(f"rank {self.rank}: another rank stopped (see its error above): {e}") from e
        return out

