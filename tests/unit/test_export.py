"""Export: a plain transformers folder that loads without rlrun, scores tokens as the trainer does, keeps the
character tokenizer, and continues training through `model=hf`."""

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import tiny_model
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlrun import export, models

TEXTS = ["3+4=7", "12+30=42", "hello, world!", "a b?"]


def tiny(tie: bool = False, seed: int = 0):
    model, tok = tiny_model(seed, tie_embeddings=tie)
    with torch.no_grad():  # not the init: any weight the export dropped or re-initialised would show
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    return model, tok


def trainer_logprobs(model, ids):
    """The trainer's path: backbone hidden states @ lm-head weight (rlrun.models.split), log-softmax, gather."""
    backbone, weight = models.split(model)
    h = models.hidden_states(backbone, ids, torch.ones_like(ids))
    return torch.log_softmax(h[:, :-1] @ weight.T, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def plain_logprobs(model, ids):
    logits = model(input_ids=ids).logits
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


@pytest.mark.parametrize("tie", [False, True])
def test_export_reloads_with_plain_transformers(tmp_path, tie):
    model, tok = tiny(tie)
    folder = export.export(model, tok, str(tmp_path / "policy"))
    assert folder == str(tmp_path / "policy") and not os.path.exists(folder + ".tmp")
    loaded = AutoModelForCausalLM.from_pretrained(folder)  # no rlrun involved
    loaded_tok = AutoTokenizer.from_pretrained(folder)
    assert loaded.config.tie_word_embeddings == tie
    ids = torch.tensor([tok("12+3=15", add_special_tokens=False).input_ids + [tok.eos_token_id]])
    with torch.no_grad():
        want = trainer_logprobs(model, ids)
        torch.testing.assert_close(trainer_logprobs(loaded, ids), want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(plain_logprobs(loaded, ids), want, rtol=1e-5, atol=1e-6)
    for name, t in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name
    # the tokenizer round-trips: same ids, same text, same special tokens, left padding for generation
    for text in TEXTS:
        assert loaded_tok(text, add_special_tokens=False).input_ids == tok(text, add_special_tokens=False).input_ids
        assert loaded_tok.decode(tok(text, add_special_tokens=False).input_ids) == text
    for attr in ("pad_token_id", "eos_token_id", "bos_token_id", "unk_token_id", "padding_side"):
        assert getattr(loaded_tok, attr) == getattr(tok, attr), attr
    assert len(loaded_tok) == len(tok)


def test_every_exported_file_has_the_same_mode(tmp_path):
    """safetensors wrote model.safetensors 0600 while config.json and the tokenizer beside it were 0644: another
    user who can read the export could read everything but the weights."""
    mask = os.umask(0o022)
    try:
        folder = export.export(*tiny(), str(tmp_path / "policy"))
    finally:
        os.umask(mask)
    modes = {}
    for top, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(top, name)
            modes[os.path.relpath(path, folder)] = oct(os.stat(path).st_mode & 0o777)
    assert "model.safetensors" in modes and set(modes.values()) == {"0o644"}, modes


def test_exported_model_generates_and_loads_through_rlrun(tmp_path):
    model, tok = tiny()
    folder = export.export(model, tok, str(tmp_path / "policy"))
    loaded, loaded_tok = models.load_hf(folder, "float32")
    enc = loaded_tok(["3+4=", "12+3="], return_tensors="pt", padding=True, add_special_tokens=False)
    args = dict(do_sample=False, max_new_tokens=4, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    want = model.generate(**tok(["3+4=", "12+3="], return_tensors="pt", padding=True, add_special_tokens=False),
                          **args)
    assert torch.equal(loaded.generate(**enc, **args), want)
    rebuilt, _ = models.build(OmegaConf.create({"name": "hf", "path": folder, "dtype": "float32"}), 0)
    assert torch.equal(rebuilt.lm_head.weight, model.lm_head.weight)


def test_export_replaces_an_existing_folder(tmp_path):
    model, tok = tiny(seed=0)
    target = str(tmp_path / "policy")
    export.export(model, tok, target)  # an earlier export, unchanged: replaced (a file added to it is kept:
    other, _ = tiny(seed=1)  # test_folders.py::test_an_export_folder_that_gained_your_files_is_refused_naming_them)
    export.export(other, tok, target)
    assert sorted(os.listdir(tmp_path)) == ["policy"]  # no .tmp, .old folder or lock left behind
    reloaded = AutoModelForCausalLM.from_pretrained(target)
    assert torch.equal(reloaded.lm_head.weight, other.lm_head.weight)
    config = json.loads((tmp_path / "policy" / "tokenizer_config.json").read_text())
    assert config["padding_side"] == "left"


@pytest.mark.slow
def test_training_continues_from_an_export(tmp_path):
    model, tok = tiny()
    folder = export.export(model, tok, str(tmp_path / "policy"))
    env = {**os.environ, "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "false"}
    r = subprocess.run([sys.executable, "-m", "rlrun", "experiment=smoke", "model=hf", f"model.path={folder}",
                        "tracking=none", "progress=false", f"hydra.run.dir={tmp_path / 'run'}"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


ZERO3_SCRIPT = '''
import sys, torch
from conftest import make_cfg
from rlrun import export, models
from rlrun.engine import deepspeed as ds_engine

folder, tied = sys.argv[1], sys.argv[2]
cfg = make_cfg("experiment=smoke", "engine=deepspeed", "engine.zero_stage=3", "train.micro_batch=4",
               f"model.tie_embeddings={tied}")
policy, tok = models.build(cfg.model, 0)
full = {k: v.clone() for k, v in policy.state_dict().items()}
engine = ds_engine.Engine(cfg, policy, None, grad_accum=1)
assert all(p.numel() == 0 for p in engine.model.parameters())  # partitioned: no rank holds a whole tensor
out = export.export(engine.model, tok, folder, engine=engine)
assert (out is not None) == (engine.rank == 0)
if engine.rank == 0:
    torch.save(full, folder + "-reference.pt")
ds_engine.shutdown()  # leave the process group as a run does: exiting with gloo's threads alive can abort a rank
'''


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("tied", [False, True])
def test_zero3_export_gathers_the_partitioned_weights(tmp_path, tied):
    pytest.importorskip("deepspeed")
    from torchrun import torchrun

    script = tmp_path / "zero3_export.py"
    script.write_text(ZERO3_SCRIPT)
    folder = str(tmp_path / "policy")
    r = torchrun(2, [str(script), folder, str(tied).lower()], cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    reference = torch.load(folder + "-reference.pt")
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    for name, t in reference.items():
        assert torch.equal(loaded.state_dict()[name], t), name
    assert sorted(os.listdir(tmp_path)) == ["policy", "policy-reference.pt", "zero3_export.py"]


def test_a_folder_without_an_export_s_mark_is_refused_without_walking_it(tmp_path, monkeypatch):
    """export.dir=/ (or a large home) walked the whole tree before refusing: minutes, no word. Without rlrun's mark
    every entry is foreign, and the top level names them."""
    from rlrun import exportdir

    (tmp_path / "deep" / "er").mkdir(parents=True)
    (tmp_path / "deep" / "er" / "file").write_text("x")
    (tmp_path / "notes.txt").write_text("mine")

    def no_walk(*args, **kwargs):
        raise AssertionError("walked a folder that has no export's mark")

    monkeypatch.setattr(exportdir.os, "walk", no_walk)
    assert exportdir.foreign(str(tmp_path)) == ["deep/", "notes.txt"]
