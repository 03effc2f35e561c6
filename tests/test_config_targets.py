"""No code from a config file (rlrun/config/targets.py): every `_target_`, logging `class` / `()` and `ext://`
name in a composed config is checked before Hydra instantiates anything."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from test_cli import rlrun

from rlrun.config import targets

ROOT = Path(__file__).resolve().parent.parent
SWEEPS = sorted(p.stem for p in (ROOT / "sweeps").glob("*.yaml"))


def composed(config_dir, name, *overrides):
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        return OmegaConf.to_container(compose(name, overrides=list(overrides), return_hydra_config=True),
                                      resolve=False)


@pytest.mark.parametrize("launcher", ["basic", "joblib", "submitit_slurm", "submitit_local"])
def test_what_rlrun_ships_passes(launcher):
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher", reason="the launchers extra is not installed")
    extra = [] if launcher == "basic" else [f"hydra/launcher={launcher}"]
    assert targets.problems(composed(ROOT / "conf", "config", *extra)) == []


@pytest.mark.parametrize("sweep", SWEEPS)
def test_every_shipped_sweep_passes(sweep):
    assert targets.problems(composed(ROOT / "sweeps", sweep)) == []


@pytest.mark.parametrize("override, named", [
    ("+hydra.callbacks.x._target_=rlrun.tasks.scoring.load_reward", "rlrun.tasks.scoring.load_reward"),
    ("hydra.callbacks.sweep._target_=os.system", "os.system"),
    ("hydra.launcher._target_=builtins.exec", "builtins.exec"),
    ("hydra.job_logging.handlers.console.class=evil.Handler", "evil.Handler"),
    ("hydra.job_logging.handlers.console.stream=ext://evil.stream", "ext://evil.stream"),
    ("+task.x._target_=rlrun.tasks.scoring.load_reward", "rlrun.tasks.scoring.load_reward"),
    ("hydra.callbacks.sweep._target_=${oc.env:EVIL}", "${oc.env:EVIL}"),
])
def test_code_named_anywhere_in_a_config_is_refused(override, named):
    found = targets.problems(composed(ROOT / "conf", "config", override))
    assert len(found) == 1 and repr(named) in found[0], found


def test_a_logging_factory_is_code_too():
    """dictConfig calls a formatter's `()` (a sweep file can write the key; an override cannot)."""
    tree = {"hydra": {"job_logging": {"formatters": {"simple": {"()": "evil.factory"}}}}}
    [found] = targets.problems(tree)
    assert "hydra.job_logging.formatters.simple.(): 'evil.factory' is code" in found


@pytest.mark.slow  # the real entry point in a subprocess (~5 s)
def test_a_callback_in_a_sweep_file_runs_nothing(tmp_path):
    (tmp_path / "evil.py").write_text("import pathlib\npathlib.Path('PWNED').write_text('x')\n"
                                      "def fn(completion, answer):\n    return 0.0\n")
    (tmp_path / "sweep.yaml").write_text(
        "defaults:\n  - config\n  - _self_\nhydra:\n  callbacks:\n    x:\n"
        "      _target_: rlrun.tasks.scoring.load_reward\n"
        f"      _args_: ['{tmp_path}/evil.py:fn']\n")
    r, _ = rlrun(tmp_path, "-cd", str(tmp_path), "-cn", "sweep", "experiment=smoke", "tracking=none")
    assert r.returncode == 2, r.stderr[-2000:]
    assert "hydra.callbacks.x._target_: 'rlrun.tasks.scoring.load_reward' is code that rlrun does not run" in r.stderr
    assert not (tmp_path / "PWNED").exists() and "Traceback" not in r.stderr


@pytest.mark.parametrize("override, says", [
    ("loss=grpo", "loss=grpo is not an option of loss; its options: cispo, dapo, dpo, gspo. GRPO is the recipe that "
                  "loss=dapo, loss=cispo and loss=gspo train with"),
    ("batching=foo", "batching=foo is not an option of batching; its options: packed, padded, shared_prompt."),
    ("head=null", "a config group cannot be set to null (e.g. head=null)"),
])
def test_an_unknown_option_is_rlruns_error_with_the_options(tmp_path, override, says):
    r, _ = rlrun(tmp_path, override, "tracking=none")
    assert r.returncode == 2 and f"rlrun: error: {says}" in r.stderr, r.stderr[-1500:]
    assert "Traceback" not in r.stderr and "Config search path" not in r.stderr
