"""LoRA through peft (model.lora.enabled=true): only the adapters train, every head gives the same run, the
adapters-off reference is the initial policy, and the export is a model you can load (merged or as adapters)."""

import copy
from types import SimpleNamespace

import pytest
import torch
from conftest import make_cfg, new_store
from helpers import HEAD_ALTERNATIVES, history, runs, tiny_model

from rlrun import models, registry
from rlrun.config import ConfigError, validate

pytest.importorskip("peft", reason="peft is not installed: pip install -e '.[lora]'")

LORA = SimpleNamespace(enabled=True, rank=4, alpha=8.0, dropout=0.0, target_modules=["all-linear"],
                       reference="adapters_off", export="merged")


def tiny(tie=False):
    return tiny_model(0, arch="qwen2", intermediate_size=64, layers=2, heads=2, max_positions=64,
                      tie_embeddings=tie)


def token_logprobs(model, ids):
    backbone, weight = models.split(model)
    hidden = models.hidden_states(backbone, ids, torch.ones_like(ids))[:, :-1].reshape(-1, weight.shape[1])
    return registry.get("head", "dense").logprobs(hidden, weight, ids[:, 1:].reshape(-1))


def train_adapters(policy, ids, steps=3):
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        (-token_logprobs(policy, ids).mean()).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("tie", [False, True])
def test_only_the_adapters_train_and_the_lm_head_stays_frozen(tie):
    model, _ = tiny(tie)
    base_head = models.split(model)[1]
    policy = models.add_lora(model, LORA)
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    backbone, weight = models.split(policy)  # the heads see the base model's lm head, frozen
    assert weight is base_head and not weight.requires_grad
    assert any("lora_" in n for n, _ in backbone.named_parameters())  # and a backbone that runs the adapters


def test_adapters_off_reference_equals_a_frozen_copy_of_the_initial_policy():
    model, tok = tiny()
    frozen = copy.deepcopy(model).requires_grad_(False)
    policy = models.add_lora(model, LORA)
    ids = torch.randint(4, len(tok), (4, 12))
    train_adapters(policy, ids)
    engine = SimpleNamespace(model=policy, reference=None)
    with torch.no_grad():
        trained = token_logprobs(policy, ids)
        with models.reference(engine) as ref:
            off = token_logprobs(ref, ids)
        after = token_logprobs(policy, ids)
        expected = token_logprobs(frozen, ids)
    assert torch.equal(off, expected)  # bit for bit: the base layers alone
    assert (trained - expected).abs().max() > 1e-3 and torch.equal(after, trained)  # adapters back on after


def test_lora_with_vllm_is_refused():
    with pytest.raises(ConfigError, match="rollout=hf with LoRA"):
        validate(make_cfg("model.lora.enabled=true", "rollout=vllm"))


def test_bad_target_modules_name_the_key():
    model, _ = tiny()
    with pytest.raises(models.ModelError, match="model.lora.target_modules"):
        models.add_lora(model, SimpleNamespace(**{**vars(LORA), "target_modules": ["no_such_proj"]}))


@pytest.mark.parametrize("how", ["merged", "adapter"])
def test_export_merged_or_as_adapters_loads_back_to_the_trained_policy(tmp_path, how):
    from transformers import AutoModelForCausalLM

    from rlrun.export import export

    model, tok = tiny()
    base = copy.deepcopy(model)
    policy = models.add_lora(model, LORA)
    ids = torch.randint(4, len(tok), (4, 12))
    train_adapters(policy, ids)
    folder = export(policy, tok, str(tmp_path / "model"), lora=how)
    if how == "merged":  # a plain transformers folder
        loaded = AutoModelForCausalLM.from_pretrained(folder)
    else:  # peft's adapter folder, onto the base model
        import peft

        loaded = peft.PeftModel.from_pretrained(base, folder)
    with torch.no_grad():
        assert torch.allclose(token_logprobs(loaded, ids), token_logprobs(policy, ids), atol=1e-5)
    assert any(p.requires_grad for p in policy.parameters())  # the export left the adapters in place


def test_an_adapter_export_of_a_model_built_in_code_carries_its_base(tmp_path, monkeypatch):
    """model=tiny has no folder to load a base from: the export writes it in base/ and points the adapter at it,
    so peft's AutoPeftModelForCausalLM loads the trained policy from the folder alone, from any working folder."""
    import peft

    from rlrun.export import export

    model, tok = tiny()
    policy = models.add_lora(model, LORA)
    ids = torch.randint(4, len(tok), (4, 12))
    train_adapters(policy, ids)
    folder = export(policy, tok, str(tmp_path / "model"), lora="adapter")
    monkeypatch.chdir(tmp_path.parent)
    loaded = peft.AutoPeftModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        assert torch.allclose(token_logprobs(loaded, ids), token_logprobs(policy, ids), atol=1e-5)
    from safetensors.torch import load_file

    assert not any("lora" in k for k in load_file(f"{folder}/base/model.safetensors"))  # the base, not the adapters


def lora_run(tmp_path, *overrides):
    from rlrun.cli import run

    new_store(tmp_path)
    run(make_cfg("experiment=smoke", "model.lora.enabled=true", "model.lora.rank=4", "train.steps=4",
                 "train.lr=3e-2", "rollout.max_new_tokens=6", "eval.every=0", *overrides, tmp_path=tmp_path))
    client, (r,) = runs(tmp_path / "mlflow.db")
    assert r.info.status == "FINISHED"
    return {k: history(client, r.info.run_id, k) for k in ("loss", "grad_norm", "reward_mean", "kl",
                                                            "rewards/accuracy")}


def assert_same(got, ref, keys):
    for k in keys:
        assert len(got[k]) == len(ref[k]) > 0, k
        assert torch.allclose(torch.tensor(got[k]), torch.tensor(ref[k]), rtol=1e-4, atol=1e-6), k


@pytest.mark.slow
def test_grpo_lora_runs_are_the_same_in_every_head_and_with_either_reference(tmp_path):
    """KL on (so the reference pass matters) and two passes per rollout (so the old-policy pass runs too)."""
    grpo = ("loss.kl_coef=0.1", "train.num_iterations=2")
    dense = lora_run(tmp_path / "dense", *grpo)
    assert min(dense["grad_norm"]) > 1e-4 and max(dense["kl"]) > 0  # the adapters moved the policy off the base
    for head in HEAD_ALTERNATIVES:
        assert_same(lora_run(tmp_path / head, *grpo, f"head={head}"), dense, ("loss", "grad_norm", "reward_mean"))
    copied = lora_run(tmp_path / "copy", *grpo, "model.lora.reference=copy")
    assert_same(copied, dense, ("loss", "grad_norm", "reward_mean", "kl"))


@pytest.mark.slow
def test_dpo_lora_runs_are_the_same_with_dense_and_chunked(tmp_path):
    dense = lora_run(tmp_path / "dense", "loss=dpo", "train.lr=1e-2")
    assert min(dense["grad_norm"]) > 1e-5
    chunked = lora_run(tmp_path / "chunked", "loss=dpo", "train.lr=1e-2", "head=chunked")
    assert_same(chunked, dense, ("loss", "grad_norm", "rewards/accuracy"))
