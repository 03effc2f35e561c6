"""engine=deepspeed in this process: the config it hands to DeepSpeed (the 2-rank runs are in test_distributed)."""

import pytest
from conftest import make_cfg

from rlrun.engine import deepspeed


def test_deepspeed_config_follows_the_run_config(monkeypatch):
    plain = deepspeed.ds_config(make_cfg("engine=deepspeed"), grad_accum=1)  # as shipped: ZeRO-2, nothing offloaded
    assert plain["zero_optimization"] == {"stage": 2, "stage3_gather_16bit_weights_on_model_save": False}
    assert plain["train_batch_size"] == plain["train_micro_batch_size_per_gpu"]  # one rank (no WORLD_SIZE)
    cfg = make_cfg("engine=deepspeed", "engine.zero_stage=3", "engine.optimizer=deepspeed",
                   "engine.offload_optimizer=cpu", "engine.offload_param=cpu", "train.micro_batch=2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    ds = deepspeed.ds_config(cfg, grad_accum=4)
    assert ds["train_micro_batch_size_per_gpu"] == 2 and ds["gradient_accumulation_steps"] == 4
    assert ds["train_batch_size"] == 2 * 4 * 2  # micro batch x accumulation x ranks
    zero = ds["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_optimizer"]["device"] == zero["offload_param"]["device"] == "cpu"
    assert ds["gradient_clipping"] == cfg.train.grad_clip and ds["bf16"] == {"enabled": False}


def test_offload_moves_the_optimizer_states_tensors_and_leaves_its_scalars():
    """move_state counts and moves AdamW's moments; its `step` scalars stay where the optimizer keeps them (on a
    GPU, a step counter brought onto the device would make every optimizer step synchronise on it). The meta device
    stands in for a GPU here."""

    import torch

    from rlrun import offload

    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    assert offload.move_state(opt, "meta") == 2 * 4 * (8 * 4 + 4)  # exp_avg, exp_avg_sq of weight and bias
    for state in opt.state.values():
        assert state["exp_avg"].is_meta and state["exp_avg_sq"].is_meta and state["step"].device.type == "cpu"
    assert offload.move_state(opt, "meta") == 0


def test_the_cpu_backend_starts_without_deepspeeds_shm_kernel(monkeypatch):
    """DeepSpeed compiles its shared-memory all-reduce kernel (g++, up to minutes) when its CPU backend starts, for
    inference only; rlrun's process group starts without it, and DeepSpeed's builder is put back afterwards."""
    import importlib

    import torch
    ds_torch = importlib.import_module("deepspeed.comm.torch")  # by name: the attribute is torch

    built = []
    monkeypatch.setattr(ds_torch, "build_shm_op", lambda: built.append(1) or "kernel")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with deepspeed._no_shm_kernel():
        assert ds_torch.build_shm_op() is None
    assert ds_torch.build_shm_op() == "kernel" and built == [1]


@pytest.mark.slow  # two short in-process runs
def test_two_deepspeed_runs_in_one_process_like_a_sweeps_jobs():
    """A sweep runs its jobs in one process: each engine=deepspeed run joins and leaves a process group, and the
    next one must not meet the groups DeepSpeed cached from the last (it failed with "Group ... is not
    registered")."""
    from rlrun.cli import run

    args = ["experiment=smoke", "train.steps=2", "engine=deepspeed", "export.enabled=false", "checkpoint.dir=null"]
    first = run(make_cfg(*args), "first")
    second = run(make_cfg(*args, "head=tiled"), "second")
    # the same samples (sampling does not depend on the head) and an exact head: the same rewards
    assert first["reward_first"] == second["reward_first"] and first["reward_last"] == second["reward_last"]
