"""No file written through a link (rlrun/nofollow.py): every file rlrun creates in a folder someone else chose is
created with O_NOFOLLOW / O_EXCL; a link planted at the name is an error naming it, and the file it points to is
left as it was."""

import os

import pytest
import torch

from rlrun import checkpoint, folders, nofollow
from rlrun.errors import LinkError
from rlrun.tracking import spill


@pytest.fixture
def victim(tmp_path):
    """A file of the user's that a planted link points at."""
    path = tmp_path / "yours" / ".bashrc"
    path.parent.mkdir()
    path.write_text("# yours\n")
    return path


def planted(link, target):
    link.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(target, link)
    return link


def test_a_link_at_the_checkpoint_lock_is_refused_and_its_target_untouched(tmp_path, victim):
    link = planted(tmp_path / "ckpt" / folders.LOCK, victim)
    with pytest.raises(LinkError, match=rf"{link} is a symbolic link \(to {victim}\); rlrun never writes through"):
        with folders.own_checkpoints(str(tmp_path / "ckpt"), resuming=False):
            pass
    assert victim.read_text() == "# yours\n" and os.path.islink(link)


@pytest.mark.parametrize("name", ["step_00000002.pt.tmp", "step_00000002.pt"])
def test_a_link_at_a_checkpoints_name_is_refused_and_its_target_untouched(tmp_path, victim, name):
    link = planted(tmp_path / "ckpt" / name, victim)
    with pytest.raises(LinkError, match=f"{link} .*is a symbolic link"):
        checkpoint.save(str(tmp_path / "ckpt"), 2, {"step": 2, "w": torch.ones(3)}, keep=2)
    assert victim.read_text() == "# yours\n" and os.path.islink(link)


def test_a_dangling_link_is_refused_and_creates_nothing(tmp_path):
    """A link to a name that does not exist yet: following it would create the file there."""
    target = tmp_path / "site-packages" / "evil.pth"
    target.parent.mkdir()
    planted(tmp_path / "ckpt" / "step_00000001.pt.tmp", target)
    with pytest.raises(LinkError):
        checkpoint.save(str(tmp_path / "ckpt"), 1, {"step": 1}, keep=2)
    assert not target.exists()


def test_a_tmp_file_a_killed_write_left_is_replaced(tmp_path):
    (tmp_path / "step_00000003.pt.tmp").write_bytes(b"half a checkpoint")
    checkpoint.save(str(tmp_path), 3, {"step": 3}, keep=2)
    assert sorted(os.listdir(tmp_path)) == ["step_00000003.pt"]
    assert checkpoint.load_latest(str(tmp_path))[0]["step"] == 3


def test_the_write_probe_never_writes_through_a_link(tmp_path, victim):
    planted(tmp_path / "out" / f".rlrun_write_test.{os.getpid()}", victim)
    with pytest.raises(LinkError):
        folders.probe_write(str(tmp_path / "out"))
    assert victim.read_text() == "# yours\n"


def test_the_spill_file_its_lock_and_its_set_aside_records_never_follow_a_link(tmp_path, victim):
    path = str(tmp_path / "mlflow_spill.jsonl")
    for name in (path + ".lock", path):
        link = planted(tmp_path / os.path.basename(name), victim)
        with pytest.raises(LinkError):
            with spill.locked(path), spill.appending(path) as f:
                f.write("{}\n")
        os.remove(link)
    planted(tmp_path / "mlflow_spill.rejected.jsonl", victim)
    with pytest.raises(LinkError):
        spill.reject(path, "{}\n", ValueError("refused"))
    assert victim.read_text() == "# yours\n"


def test_a_file_replaced_by_rename_refuses_a_link_at_its_name(tmp_path, victim):
    link = planted(tmp_path / "report" / "curves.png", victim)
    with pytest.raises(LinkError, match="curves.png is a symbolic link"):
        nofollow.write_replacing(str(link), b"png")
    assert victim.read_text() == "# yours\n" and os.path.islink(link)
    nofollow.write_replacing(str(tmp_path / "report" / "other.png"), b"png")
    assert sorted(os.listdir(tmp_path / "report")) == ["curves.png", "other.png"]  # no temporary file left


def test_a_warm_start_cache_entry_at_a_link_is_a_warning_and_its_target_untouched(tmp_path, victim, caplog):
    from helpers import tiny_model

    from rlrun import warmstart

    model, _ = tiny_model()
    link = planted(tmp_path / "cache" / "entry.pt", victim)
    warmstart._save_cached(link, model)
    assert victim.read_text() == "# yours\n"
    assert "could not write the warm-start cache entry" in caplog.text and "symbolic link" in caplog.text


@pytest.mark.parametrize("override, says", [  # the entry point, refused once Hydra composed its config (<1 s)
    ("hydra.output_subdir={user}", "hydra.output_subdir={user} is outside the run's output folder"),
    ("hydra.output_subdir=..", "hydra.output_subdir=.. is outside the run's output folder"),
    ("hydra.job.name=../../escaped", "hydra.job.name=../../escaped holds a path"),
], ids=["a folder of yours", "the parent", "a job name with a path"])
@pytest.mark.parametrize("multirun", [False, True], ids=["run", "sweep"])
def test_hydra_writes_nothing_outside_the_run_folder(tmp_path, override, says, multirun):
    """hydra.output_subdir=<a folder of yours> replaced your config.yaml, `..` the parent's overrides.yaml, and a
    job name with a path wrote the job's log outside the run folder: refused, exit 2, nothing written."""
    from test_cli import rlrun

    user = tmp_path / "user"
    user.mkdir()
    (user / "config.yaml").write_text("# yours\n")
    run_dir = tmp_path / "a" / "b" / "run"
    r, _ = rlrun(tmp_path, *(["-m", f"hydra.sweep.dir={run_dir}"] if multirun else [f"hydra.run.dir={run_dir}"]),
                 "experiment=smoke", "tracking=none", override.format(user=user))
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"rlrun: error: {says.format(user=user)}" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert (user / "config.yaml").read_text() == "# yours\n" and os.listdir(user) == ["config.yaml"]
    assert sorted(os.listdir(tmp_path)) == ["user"]  # no run folder, no escaped log, nothing in the parents


@pytest.mark.parametrize("subdir", ["../../victim", "{user}"], ids=["climbing out", "a folder of yours"])
def test_a_sweep_subdir_outside_the_sweep_folder_is_refused(tmp_path, subdir):
    """hydra.sweep.subdir=../victim put every job's output (.hydra/, cli.log) outside the sweep folder."""
    from test_cli import rlrun

    user = tmp_path / "user"
    user.mkdir()
    sweep_dir = tmp_path / "a" / "b" / "sweep"
    subdir = subdir.format(user=user)
    r, _ = rlrun(tmp_path, "-m", f"hydra.sweep.dir={sweep_dir}", f"hydra.sweep.subdir={subdir}", "experiment=smoke",
                 "tracking=none")
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"rlrun: error: hydra.sweep.subdir={subdir} is outside the sweep's folder" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and os.listdir(user) == [] and sorted(os.listdir(tmp_path)) == ["user"]


@pytest.mark.slow  # the entry point in a subprocess
@pytest.mark.parametrize("name", [".hydra/config.yaml", "cli.log"])  # cli: the job name of `rlrun`
def test_a_link_in_an_existing_run_folder_is_refused_before_hydra_writes_through_it(tmp_path, victim, name):
    from test_cli import rlrun

    link = planted(tmp_path / "run" / name, victim)
    r, _ = rlrun(tmp_path, f"hydra.run.dir={tmp_path / 'run'}", "experiment=smoke", "tracking=none")
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"rlrun: error: {link} is a symbolic link (to {victim}); rlrun never writes through a link" in r.stderr
    assert victim.read_text() == "# yours\n" and "Traceback" not in r.stderr
