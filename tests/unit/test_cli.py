"""The CLI answers before any heavy import: `--help`, `--cfg job` and every refused config exit without importing
torch, transformers, deepspeed, vllm or mlflow (checked with `python -X importtime`), with exit code 2 for a
config problem. Each test runs `python -m rlrun` in a fresh process from an empty folder."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from rlrun import registry
from rlrun.config import OPTIONS

ROOT = Path(__file__).resolve().parents[2]
HEAVY = {"torch", "transformers", "deepspeed", "vllm", "mlflow"}


def rlrun(tmp_path, *args, importtime=False, env=None):
    """`python [-X importtime] -m rlrun ARGS` -> (completed process, top-level packages it imported)."""
    cmd = [sys.executable, *(["-X", "importtime"] if importtime else []), "-m", "rlrun", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    imported = {line.split("|")[-1].strip().split(".")[0] for line in r.stderr.splitlines()
                if line.startswith("import time:")}
    return r, imported


def test_refused_config_exits_2_with_the_rule_and_imports_nothing_heavy(tmp_path):
    r, imported = rlrun(tmp_path, "logprob_policy=skip", "loss.kl_coef=0.1", importtime=True)
    assert "rlrun" in imported and "hydra" in imported  # the measurement saw the imports
    assert not imported & HEAVY, sorted(imported & HEAVY)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "rlrun: error: 1 problem(s) in the configuration:" in r.stderr
    assert "logprob_policy=skip skips the reference pass, which needs loss.kl_coef=0 (got loss.kl_coef=0.1)" in r.stderr
    assert not list(tmp_path.glob("*.db"))  # no MLflow store touched
    assert not list(tmp_path.iterdir())  # no output folder left behind (Hydra made one before rlrun refused)


def test_a_refused_config_in_a_folder_of_yours_removes_nothing(tmp_path):
    """hydra.run.dir names a folder of yours: its log may hold earlier runs' lines (Hydra appends), so nothing in
    it is removed, your files least of all."""
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "cli.log").write_text("an earlier run's log\n")
    r, _ = rlrun(tmp_path, "logprob_policy=skip", "loss.kl_coef=0.1", "hydra.run.dir=.")
    assert r.returncode == 2, r.stderr[-2000:]
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert (tmp_path / "cli.log").read_text().startswith("an earlier run's log\n")


def test_help_lists_groups_options_sweeps_and_imports_nothing_heavy(tmp_path):
    r, imported = rlrun(tmp_path, "--help", importtime=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert not imported & HEAVY, sorted(imported & HEAVY)
    out = r.stdout
    for group, options in OPTIONS.items():
        assert f"{group}: {', '.join(sorted(options))}" in out, group
    assert "experiment: smoke" in out
    listed = out[out.index("Sweeps:"):out.index("Results:")]  # the help's list of sweeps, not the groups above it
    for sweep in (ROOT / "sweeps").glob("*.yaml"):  # the help names every shipped sweep
        assert sweep.stem in listed.replace("\n", " ").replace(",", " ").split(), sweep.stem
    for needle in ("rlrun -cn NAME", "rlrun-report", "sqlite:///mlflow.db", "mlflow ui"):
        assert needle in out, needle


def test_cfg_job_prints_the_config_and_imports_nothing_heavy(tmp_path):
    r, imported = rlrun(tmp_path, "--cfg", "job", "head=tiled", importtime=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert not imported & HEAVY, sorted(imported & HEAVY)
    assert "head:\n  name: tiled\n  size: 128" in r.stdout


def test_misspelled_value_exits_2_naming_the_allowed_values(tmp_path):
    r, _ = rlrun(tmp_path, "train.lr_schedule=cosin", "+head.sizee=3")
    assert r.returncode == 2, r.stderr[-2000:]
    assert ("train.lr_schedule='cosin' is not supported (did you mean 'cosine'?); supported: ['constant', 'cosine', "
            "'linear']") in r.stderr
    assert "head.sizee=3 is not a key of head=dense; did you mean head.size?" in r.stderr
    assert "2 problem(s)" in r.stderr


def test_error_names_the_rank_under_a_launcher(tmp_path):
    import os

    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "1"}
    r, _ = rlrun(tmp_path, "experiment=smoke", env=env)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "rlrun: rank 1: error:" in r.stderr and "engine=single runs one process" in r.stderr


def test_registry_names_are_the_options():
    from rlrun.config import choices

    keyed = {g: registry.KEYED_BY.get(g, g) for g in registry.REGISTRY}  # recipe: by the loss group's options
    groups = {k for k in keyed.values() if "." not in k}  # precision, pipeline: by a config key's values
    assert groups == set(OPTIONS) and set(keyed) - set(OPTIONS) == set(registry.KEYED_BY)
    assert {g: set(registry.REGISTRY[g]) for g in registry.REGISTRY} == {  # those registered from outside too
        g: set(choices(k) if "." in k else {**OPTIONS[k], **registry.CONFIGS.get(k, {})}) for g, k in keyed.items()}
    with pytest.raises(KeyError, match=re.escape(f"head='fancy' is not supported; supported: "
                                                 f"{sorted(registry.REGISTRY['head'])}")):
        registry.get("head", "fancy")


@pytest.mark.slow  # imports torch, transformers and DeepSpeed's torch.distributed: ~10 s
def test_registry_resolves_every_option():
    # in a fresh process: importing the components loads torch, which this file otherwise never does
    code = ("from rlrun import registry, logprobs, tracking, models\n"
            "from rlrun.losses import dapo, cispo, dpo\n"
            "from rlrun.heads import dense\n"
            "got = {(g, n): registry.get(g, n) for g in registry.REGISTRY for n in registry.REGISTRY[g]}\n"
            "assert got['loss', 'dapo'] is dapo.token_loss and got['loss', 'cispo'] is cispo.token_loss, 'grpo'\n"
            "assert got['loss', 'dpo'] is dpo.dpo_loss and got['head', 'dense'] is dense, 'dpo, head'\n"
            "assert got['logprob_policy', 'window'] is logprobs.Window, 'policies'\n"
            "assert got['tracking', 'none'] is tracking.Null and got['model', 'tiny'] is models.tiny\n"
            "assert all(callable(got['task', n]) for n in registry.REGISTRY['task']), 'tasks'\n"
            "assert all(callable(got['recipe', n].train) for n in registry.REGISTRY['recipe']), 'recipes'\n"
            "assert hasattr(got['engine', 'single'], 'Engine') and hasattr(got['rollout', 'hf'], 'build')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


def test_a_sweep_only_key_in_a_single_run_is_warned_not_ignored_silently():
    from conftest import make_cfg

    from rlrun.cli import sweep_only

    assert sweep_only(make_cfg("experiment=smoke")) == []
    said = sweep_only(make_cfg("experiment=smoke", "report.replay=true", "report.repeats=3"))
    assert said == ["report.replay=True is read by a sweep only (rlrun -m ...: docs/sweeps.md); this single run "
                    "ignores it", "report.repeats=3 is read by a sweep only (rlrun -m ...: docs/sweeps.md); this "
                    "single run ignores it"]
