"""engine=deepspeed in this process: the config it hands to DeepSpeed (the 2-rank runs are in test_distributed)."""

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
