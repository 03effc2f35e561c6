"""Every copy of the policy comes from one builder (rlrun/policy.py) and computes as the trainer does.

For every train.precision x rollout.pipeline x LoRA, the copies a run starts with (trainer, reference, and the
generator: the trainer's own copy when generation is synchronous, the worker process's `build` when it is not) run
one probe batch: same precision path, same adapters, and the same logprobs at the same weights version (the
generator's bit for bit; the reference, the base the adapters start from, to fp tolerance). The bf16 x async cases
fail on code where the generator builds its own copy without the trainer's precision.
"""

import pytest
import torch
from conftest import make_cfg

from rlrun import models, policy, precision, registry
from rlrun.config import validate
from rlrun.heads import dense
from rlrun.pipeline import worker

COMBOS = [(p, q, lora) for p in registry.REGISTRY["precision"] for q in registry.REGISTRY["pipeline"]
          for lora in (False, True)]


def config(prec: str, pipeline: str, lora: bool, *more: str):
    return validate(make_cfg("experiment=smoke", f"train.precision={prec}", f"rollout.pipeline={pipeline}",
                             f"model.lora.enabled={str(lora).lower()}", "model.lora.reference=copy", *more))


def copies(cfg) -> dict:
    """The copies of the policy a run of `cfg` starts with, as setup and the generator process build them."""
    base, _ = models.build(cfg.model, cfg.seed)
    reference = policy.build(cfg, "reference", base=base)
    trainer = policy.build(cfg, "trainer", base=base)
    if registry.get("pipeline", cfg.rollout.pipeline).generates_here:  # the trainer's own copy generates
        generator = trainer
    else:
        state = {k: v.detach().clone() for k, v in trainer.state_dict().items()}
        generator, _, _ = worker.build(cfg, state, "cpu")
    return {"trainer": trainer, "reference": reference, "generator": generator}


def probe_logprobs(model) -> torch.Tensor:
    """Per-token logprobs of a fixed probe batch (2 rows, the second left-padded) under `model`, no grad."""
    ids = torch.tensor([[5, 9, 12, 7, 30, 11, 8, 6], [0, 0, 14, 22, 9, 5, 17, 10]])
    mask = torch.tensor([[1] * 8, [0, 0] + [1] * 6])
    backbone, weight = models.split(model)
    with torch.no_grad():
        hidden = models.hidden_states(backbone, ids, mask)[:, :-1].reshape(-1, weight.shape[1])
        return dense.logprobs(hidden, weight, ids[:, 1:].reshape(-1))


def adapters(model) -> dict:
    """The LoRA adapters of `model` by name (empty without LoRA)."""
    return {n: p.detach() for n, p in model.named_parameters() if "lora_" in n}


@pytest.mark.parametrize("prec,pipeline,lora", COMBOS, ids=[f"{p}-{q}-lora{int(lo)}" for p, q, lo in COMBOS])
def test_every_copy_of_the_policy_computes_as_the_trainer(prec, pipeline, lora):
    cfg = config(prec, pipeline, lora)
    got = copies(cfg)
    path = precision.autocasting(got["trainer"])
    assert path == (prec == "bf16")  # engine=single: bf16 is the autocast path
    assert {role: precision.autocasting(m) for role, m in got.items()} == dict.fromkeys(got, path)
    trainer, generator = adapters(got["trainer"]), adapters(got["generator"])
    assert bool(trainer) == lora and trainer.keys() == generator.keys()
    assert all(torch.equal(trainer[n], generator[n]) for n in trainer)
    assert not adapters(got["reference"])  # the base the adapters start from
    lp = {role: probe_logprobs(m) for role, m in got.items()}
    assert torch.equal(lp["generator"], lp["trainer"])  # the same weights version, the same arithmetic
    assert torch.allclose(lp["reference"], lp["trainer"], rtol=0, atol=1e-6)  # adapters start at zero


def test_the_builder_knows_each_role_and_what_it_gets():
    cfg = config("fp32", "sync", False, "activations=checkpoint")
    base, _ = models.build(cfg.model, cfg.seed)
    reference = policy.build(cfg, "reference", base=base)
    trainer = policy.build(cfg, "trainer", base=base)
    from rlrun import activations

    assert activations.checkpointed(trainer) and not activations.checkpointed(reference)  # a gradient: trainer only
    assert not any(p.requires_grad for p in reference.parameters())
    assert all(p.requires_grad for p in trainer.parameters())
    with pytest.raises(ValueError, match="role 'critic'"):
        policy.build(cfg, "critic")


def test_deepspeeds_bf16_generator_computes_in_bf16_weights_as_its_trainer():
    """engine=deepspeed train.precision=bf16: DeepSpeed's module computes in bf16 weights; the generator's copy is
    cast to match (the trainer's and the reference's copies DeepSpeed casts itself)."""
    cfg = validate(make_cfg("experiment=smoke", "engine=deepspeed", "engine.zero_stage=2", "train.precision=bf16",
                            "rollout.pipeline=async"))
    assert precision.option(cfg).path == "bf16-deepspeed"
    base, _ = models.build(cfg.model, cfg.seed)
    generator = policy.build(cfg, "generator", base=base)
    trainer = policy.build(cfg, "trainer", base=models.build(cfg.model, cfg.seed)[0])
    assert {p.dtype for p in generator.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in trainer.parameters()} == {torch.float32}  # DeepSpeed's bf16 block casts it


def test_a_vllm_generator_in_another_precision_is_refused_unless_corrected():
    from rlrun.config import ConfigError

    with pytest.raises(ConfigError) as e:
        validate(make_cfg("rollout=vllm", "train.precision=bf16"))
    assert any("rollout.dtype=float32 while the trainer computes in train.precision=bf16" in p
               and "Set rollout.dtype=bfloat16, or correct for the gap with loss.tis.enabled=true" in p
               for p in e.value.problems)
    for fine in (["rollout.dtype=bfloat16"], ["loss.tis.enabled=true"]):
        try:  # where vLLM is not installed, its absence is the one problem left
            validate(make_cfg("rollout=vllm", "train.precision=bf16", *fine))
        except ConfigError as e:
            assert not any("rollout.dtype" in p for p in e.problems)
