"""rlrun never deletes or overwrites what it did not write (rlrun/folders.py): export.dir is checked before training
and replaced only when it is an earlier rlrun export; a checkpoint.dir belongs to one run at a time; a write that
fails for space leaves no .tmp and says the path, the bytes and the fix."""

import errno
import os
import subprocess
import sys
import time
from collections import namedtuple

import pytest
import torch
from conftest import make_cfg, new_store
from helpers import runs, tiny_model

from rlrun import checkpoint, export, exportdir, folders
from rlrun.errors import CheckpointError, ExportError


def run(tmp_path, *overrides):
    from rlrun.cli import run as cli_run

    return cli_run(make_cfg("experiment=smoke", "train.steps=2", "eval.every=0", *overrides, tmp_path=tmp_path), "t")


def users_folder(path):
    path.mkdir(parents=True, exist_ok=True)
    (path / "notes.txt").write_text("mine")
    return path


@pytest.mark.parametrize("where", [".", "cwd_parent", "user_files", "checkpoints", "a_file", "store"])
def test_an_export_dir_rlrun_would_wipe_is_refused_before_any_run(tmp_path, where):
    new_store(tmp_path)
    ckpt = tmp_path / "ckpt"
    folder = {".": ".", "cwd_parent": str(tmp_path.parent), "user_files": str(users_folder(tmp_path / "mine")),
              "checkpoints": str(ckpt), "a_file": str(tmp_path / "file.bin"), "store": str(tmp_path)}[where]
    (tmp_path / "file.bin").write_bytes(b"data")
    os.chdir(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(ExportError, match="export.dir"):
        run(tmp_path, f"export.dir={folder}", f"checkpoint.dir={ckpt}")
    assert set(before) <= {p.name for p in tmp_path.iterdir()} and not os.listdir(ckpt)
    assert not runs(tmp_path / "mlflow.db")[1]  # refused before the MLflow run was created
    assert (tmp_path / "file.bin").read_bytes() == b"data"
    if where == "user_files":
        assert (tmp_path / "mine" / "notes.txt").read_text() == "mine"


def test_a_second_export_replaces_the_first_and_nothing_else(tmp_path):
    new_store(tmp_path)
    run(tmp_path, f"export.dir={tmp_path / 'model'}")
    assert (tmp_path / "model" / exportdir.MARK).is_file()
    first = (tmp_path / "model" / "model.safetensors").stat().st_mtime_ns
    run(tmp_path, f"export.dir={tmp_path / 'model'}", "seed=1")
    assert (tmp_path / "model" / "model.safetensors").stat().st_mtime_ns != first
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("model")) == ["model"]


def test_a_folder_that_gained_user_files_during_training_is_kept_and_the_export_goes_beside_it(tmp_path):
    model, tok = tiny_model()
    users_folder(tmp_path / "model")
    where = export.export(model, tok, str(tmp_path / "model"))
    assert where != str(tmp_path / "model") and os.path.isfile(os.path.join(where, "config.json"))
    assert sorted(os.listdir(tmp_path / "model")) == ["notes.txt"]


def test_an_export_that_runs_out_of_space_leaves_no_tmp_and_names_the_bytes(tmp_path, monkeypatch):
    model, tok = tiny_model()

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(type(model), "save_pretrained", full)
    with pytest.raises(ExportError, match=r"no space left; it needs [0-9.]+ MiB") as e:
        export.export(model, tok, str(tmp_path / "model"))
    assert str(tmp_path / "model") in str(e.value)
    assert os.listdir(tmp_path) == []


def test_a_disk_without_room_for_the_model_is_refused_before_training(tmp_path, monkeypatch):
    new_store(tmp_path)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(folders.shutil, "disk_usage", lambda p: usage(10**9, 10**9, 1000))
    with pytest.raises(ExportError, match=r"the model needs about \d+ MiB and its file system has 0 MiB free"):
        run(tmp_path, f"export.dir={tmp_path / 'model'}")
    [r] = runs(tmp_path / "mlflow.db")[1]
    assert r.info.status == "FAILED" and not r.data.metrics.get("loss")  # before the first step


def test_a_checkpoint_write_that_runs_out_of_space_keeps_the_last_good_one(tmp_path, monkeypatch):
    checkpoint.save(str(tmp_path), 1, {"step": 1, "w": torch.ones(3)}, keep=2)

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint.os, "fsync", full)
    with pytest.raises(CheckpointError, match=r"step_00000002.pt: could not be written \(no space left; it needs"):
        checkpoint.save(str(tmp_path), 2, {"step": 2, "w": torch.ones(3)}, keep=2)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["step_00000001.pt"]  # no .tmp left
    state, _ = checkpoint.load_latest(str(tmp_path))
    assert state["step"] == 1


def test_a_checkpoint_dir_is_held_by_one_run_at_a_time(tmp_path):
    with folders.own_checkpoints(str(tmp_path), resuming=False):
        with pytest.raises(CheckpointError, match=r"in use by another run \(pid \d+"):
            with folders.own_checkpoints(str(tmp_path), resuming=True):
                pass
    with folders.own_checkpoints(str(tmp_path), resuming=True):  # released when the first run ended
        pass


@pytest.mark.slow  # a process that holds the lock and is killed (~2 s)
def test_a_killed_run_leaves_no_stale_lock(tmp_path):
    code = (f"import time; from rlrun import folders\nwith folders.own_checkpoints({str(tmp_path)!r}, False):\n"
            "    print('held', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    with pytest.raises(CheckpointError, match=f"pid {proc.pid}"):
        with folders.own_checkpoints(str(tmp_path), resuming=True):
            pass
    proc.kill()
    proc.wait()
    time.sleep(0.1)
    with folders.own_checkpoints(str(tmp_path), resuming=True):
        pass


@pytest.mark.slow  # ~6 s: three short runs
def test_a_new_run_refuses_a_folder_of_another_runs_checkpoints(tmp_path):
    new_store(tmp_path)
    ckpt = tmp_path / "ckpt"
    run(tmp_path, f"checkpoint.dir={ckpt}")
    before = sorted(os.listdir(ckpt))
    with pytest.raises(CheckpointError, match="already holds checkpoints .* resume=true continues that run"):
        run(tmp_path, f"checkpoint.dir={ckpt}", "seed=2")
    assert sorted(os.listdir(ckpt)) == before
    run(tmp_path, f"checkpoint.dir={ckpt}", "resume=true", "train.steps=3")  # a resume may use it


def test_an_export_dir_that_cannot_be_written_is_refused_before_training(tmp_path):
    (tmp_path / "a_file").write_text("not a folder")
    with pytest.raises(ExportError, match=r"export.dir='.*a_file/model': cannot write in '.*a_file' \(File "
                                          r"exists\); choose a folder you can write to, or export.enabled=false"):
        exportdir.check_export(str(tmp_path / "a_file" / "model"), None, None)
    assert (tmp_path / "a_file").read_text() == "not a folder"


# --- the export folder: exactly what the earlier export wrote, one export at a time, links written through ---------

def exported(tmp_path, name="V"):
    model, tok = tiny_model()
    return model, tok, export.export(model, tok, str(tmp_path / name))


def test_an_export_folder_that_gained_your_files_is_refused_naming_them(tmp_path):
    model, tok, folder = exported(tmp_path)
    (tmp_path / "V" / "notes.txt").write_text("mine")
    (tmp_path / "V" / "evals").mkdir()
    (tmp_path / "V" / "evals" / "scores.json").write_text("{}")
    with pytest.raises(ExportError, match=r"holds files the earlier rlrun export did not write, or changed since "
                                          r"\(evals/, notes.txt\)"):
        exportdir.check_export(folder, None, None)
    kept = export.export(model, tok, folder)  # gained them during training: the export goes beside it
    assert kept != folder and (tmp_path / "V" / "notes.txt").read_text() == "mine"
    assert (tmp_path / "V" / "evals" / "scores.json").read_text() == "{}"


def test_a_run_refuses_an_export_folder_with_your_files_before_training(tmp_path):
    new_store(tmp_path)
    _, _, folder = exported(tmp_path)
    (tmp_path / "V" / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match=r"\(notes.txt\)"):
        run(tmp_path, f"export.dir={folder}")
    assert (tmp_path / "V" / "notes.txt").read_text() == "mine" and not runs(tmp_path / "mlflow.db")[1]


def test_an_edited_file_of_an_export_is_yours(tmp_path):
    _, _, folder = exported(tmp_path)
    (tmp_path / "V" / "config.json").write_text('{"edited": "by you"}')
    with pytest.raises(ExportError, match=r"or changed since \(config.json\)"):
        exportdir.check_export(folder, None, None)


def test_an_older_rlruns_export_that_lists_no_files_is_not_replaced(tmp_path):
    _, _, folder = exported(tmp_path)
    (tmp_path / "V" / exportdir.MARK).write_text('{"written_by": "rlrun", "pid": 1}')
    with pytest.raises(ExportError, match="an export of an older rlrun, whose rlrun_export.json lists no files"):
        exportdir.check_export(folder, None, None)


def test_an_unchanged_export_is_replaced_and_nothing_is_left_beside_it(tmp_path):
    model, tok, folder = exported(tmp_path)
    assert export.export(model, tok, folder) == folder
    assert sorted(os.listdir(tmp_path)) == ["V"]


def test_one_export_per_folder_at_a_time(tmp_path):
    """A second run exporting to a folder another one holds is refused before training, naming the holder."""
    new_store(tmp_path)
    folder = str(tmp_path / "V")
    fd = exportdir._lock(exportdir.lock_path(folder), folder)  # another run's hold (a lock of another open file)
    os.pwrite(fd, b"pid 4242 on host since 10:00:00: rlrun seed=1\n", 0)
    try:
        with pytest.raises(ExportError, match=r"is being exported to by another run \(pid 4242 on host"):
            run(tmp_path, f"export.dir={folder}")
        model, tok = tiny_model()
        with pytest.raises(ExportError, match="pid 4242"):
            export.export(model, tok, folder)
    finally:
        os.close(fd)
    assert not os.path.exists(folder) and not runs(tmp_path / "mlflow.db")[1]


def test_an_export_dir_that_is_a_link_is_written_through_and_the_link_kept(tmp_path):
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "V")
    model, tok = tiny_model()
    for _ in range(2):  # the first into the empty folder, the second replacing the first
        assert export.export(model, tok, str(tmp_path / "V")) == str(tmp_path / "real")
        assert os.path.islink(tmp_path / "V") and os.path.isfile(tmp_path / "V" / "config.json")
        assert sorted(os.listdir(tmp_path)) == ["V", "real"]  # no `.old` link or folder left


@pytest.mark.parametrize("target", ["nothing", "a_file"])
def test_an_export_dir_linked_to_nothing_or_a_file_is_refused(tmp_path, target):
    if target == "a_file":
        (tmp_path / "a_file").write_text("yours")
    os.symlink(tmp_path / target, tmp_path / "V")
    with pytest.raises(ExportError, match=f"is a symbolic link to {target.replace('_', ' ')}"):
        exportdir.check_export(str(tmp_path / "V"), None, None)
    assert os.path.islink(tmp_path / "V") and not (tmp_path / "nothing").exists()


def test_a_link_at_the_exports_tmp_name_is_refused(tmp_path):
    (tmp_path / "yours").mkdir()
    os.symlink(tmp_path / "yours", tmp_path / "V.tmp")
    with pytest.raises(ExportError, match="V.tmp' is a symbolic link"):
        exportdir.check_export(str(tmp_path / "V"), None, None)
    model, tok = tiny_model()
    with pytest.raises(ExportError, match="V.tmp' is a symbolic link"):
        export.export(model, tok, str(tmp_path / "V"))
    assert os.listdir(tmp_path / "yours") == []
