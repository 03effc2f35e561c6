import helpers
import pytest
import torch
from omegaconf import OmegaConf

from rlrun import models


def tiny_cfg(**kw):
    return helpers.tiny_cfg(**{"intermediate_size": 64, "layers": 1, "heads": 4, "kv_heads": 2, "max_positions": 64,
                               **kw})


def test_char_tokenizer_roundtrip():
    tok = models.char_tokenizer()
    ids = tok("3+4=7", add_special_tokens=False).input_ids
    assert len(ids) == 5 and tok.decode(ids) == "3+4=7"
    assert tok.eos_token_id == 2 and tok.pad_token_id == 0


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("tied", [False, True])
def test_tiny_model_architectures_and_tying(arch, tied):
    model, tok = models.build(tiny_cfg(arch=arch, tie_embeddings=tied), seed=3)
    assert type(model).__name__.lower().startswith(arch)
    backbone, weight = models.split(model)
    assert (weight is model.get_input_embeddings().weight) == tied
    assert weight.shape[0] == len(tok)
    again, _ = models.build(tiny_cfg(arch=arch, tie_embeddings=tied), seed=3)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))


def test_vocab_size_override_for_memory_benchmarks():
    model, tok = models.build(tiny_cfg(vocab_size=1000), seed=0)
    assert models.split(model)[1].shape[0] == 1000 > len(tok)


def test_hf_checkpoint_roundtrip(tmp_path):
    model, tok = models.build(tiny_cfg(tie_embeddings=True), seed=0)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded, tok2 = models.build(OmegaConf.create(dict(name="hf", path=str(tmp_path), dtype="float32")), seed=0)
    ids = torch.tensor([tok("1+2=", add_special_tokens=False).input_ids])
    assert tok2("1+2=", add_special_tokens=False).input_ids == ids[0].tolist()
    assert torch.allclose(model(ids).logits, loaded(ids).logits, atol=1e-6)
    assert tok2.padding_side == "left"


def test_bad_model_paths(tmp_path):
    with pytest.raises(models.ModelError, match="is not a directory"):
        models.load_hf(str(tmp_path / "nope"), "float32")
    with pytest.raises(models.ModelError, match="no config.json"):
        models.load_hf(str(tmp_path), "float32")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(models.ModelError, match="could not load"):
        models.load_hf(str(tmp_path), "float32")


def test_lm_head_with_bias_is_refused():
    model, _ = models.build(tiny_cfg(), seed=0)
    head = model.get_output_embeddings()
    model.set_output_embeddings(torch.nn.Linear(head.in_features, head.out_features, bias=True))
    with pytest.raises(models.ModelError, match="bias"):
        models.split(model)


def test_unknown_arch_and_dtype_are_refused_by_the_config_not_at_build(cfg_factory):
    # the typed config is the one validator: models.build trusts model.arch / model.dtype
    from rlrun.config import ConfigError, validate

    with pytest.raises(ConfigError) as e:
        validate(cfg_factory("model.arch=gpt9", "model.dtype=float8"))
    assert "model.arch='gpt9' is not supported" in str(e.value)
    assert "model.dtype='float8' is not supported" in str(e.value)
