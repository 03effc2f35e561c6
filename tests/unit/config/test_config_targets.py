"""No code from a config file (rlrun/config/targets.py): every `_target_`, logging `class` / `()` and `ext://`
name in a composed config is checked before Hydra instantiates anything."""

import os
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from test_cli import rlrun

from rlrun.config import targets

ROOT = Path(__file__).resolve().parents[3]
SWEEPS = sorted(p.stem for p in (ROOT / "sweeps").glob("*.yaml"))


def composed(config_dir, name, *overrides):
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        return OmegaConf.to_container(compose(name, overrides=list(overrides), return_hydra_config=True),
                                      resolve=False)


@pytest.mark.parametrize("launcher", ["basic", "joblib", "submitit_slurm", "submitit_local", "slurm"])
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
    assert "hydra.job_logging.formatters.simple.(): 'evil.factory' is not a logging.Formatter class" in found


def logging_tree(kind: str, entry: dict) -> dict:
    return {"hydra": {"job_logging": {"version": 1, kind: {"x": entry}}}}


# each spelled under `logging.`, none a logging class: the guard goes by what the name resolves to
@pytest.mark.parametrize("kind, key, name", [
    ("handlers", "()", "logging.io.open"),  # truncates a file of yours (mode: w)
    ("handlers", "()", "logging.os.symlink"),  # plants a link (a .pth into site-packages)
    ("formatters", "()", "logging.os.system"),
    ("handlers", "class", "logging.handlers.os.system"),
    ("filters", "()", "logging.sys.modules.get"),
    ("handlers", "class", "logging.Formatter"),  # a logging class, of the wrong kind
    ("formatters", "class", "logging.StreamHandler"),
    ("handlers", "class", "logging.config.dictConfig"),
    ("handlers", "class", "logging.shutdown"),
])
def test_a_logging_name_is_checked_by_what_it_resolves_to(kind, key, name):
    [found] = targets.problems(logging_tree(kind, {key: name, "file": "/tmp/x", "mode": "w"}))
    assert f"hydra.job_logging.{kind}.x.{key}: {name!r} is not a logging." in found, found


@pytest.mark.parametrize("kind, key, name", [
    ("handlers", "class", "logging.StreamHandler"), ("handlers", "()", "logging.handlers.RotatingFileHandler"),
    ("handlers", "class", "logging.NullHandler"), ("formatters", "()", "colorlog.ColoredFormatter"),
    ("formatters", "class", "logging.Formatter"), ("filters", "()", "logging.Filter"),
])
def test_the_logging_classes_pass(kind, key, name):
    entry = {key: name, "filename": "${hydra.runtime.output_dir}/${hydra.job.name}.log"} if "File" in name else {
        key: name}
    assert targets.problems(logging_tree(kind, entry)) == []


@pytest.mark.parametrize("filename", ["/home/user/.bashrc", "${hydra.runtime.output_dir}/../../.bashrc",
                                      "${oc.env:HOME}/.profile", "notes.txt"])
def test_a_log_file_outside_the_run_folder_is_refused(filename):
    [found] = targets.problems(logging_tree("handlers", {"class": "logging.FileHandler", "filename": filename}))
    assert f"hydra.job_logging.handlers.x.filename: {filename!r} is outside the run's output folder" in found


def test_attributes_set_on_a_logging_object_are_refused():
    """dictConfig's `.` sets attributes on the object it made: a FileHandler's baseFilename, opened later."""
    entry = {"()": "logging.FileHandler", "filename": "${hydra.runtime.output_dir}/x.log", "delay": True,
             ".": {"baseFilename": "/home/user/.bashrc"}}
    [found] = targets.problems(logging_tree("handlers", entry))
    assert "hydra.job_logging.handlers.x..: sets attributes on the logging object" in found


@pytest.mark.parametrize("override, named", [
    ("hydra.launcher._target_=hydra_plugins.hydra_joblib_launcher.joblib_launcher.os.system", "os.system"),
    ("hydra.sweeper._target_=hydra._internal.core_plugins.basic_sweeper.os.system", "os.system"),
    ("+hydra.job.env_set.LD_PRELOAD=/tmp/evil.so", "LD_PRELOAD"),
    ("+hydra.job.env_set.PYTHONSTARTUP=/tmp/evil.py", "PYTHONSTARTUP"),
    # a warnings filter's category is imported (`ignore::evil.Boom` imports the module evil)
    ("+hydra.job.env_set.PYTHONWARNINGS=ignore::evil.Boom", "PYTHONWARNINGS"),
    ("+hydra.job.env_set.PYTHONBREAKPOINT=evil.hook", "PYTHONBREAKPOINT"),
])
def test_a_plugin_or_environment_that_runs_code_is_refused(override, named):
    [found] = targets.problems(composed(ROOT / "conf", "config", override))
    assert named in found and "remove it from the config or sweep file" in found, found


def test_an_ordinary_environment_variable_passes():
    assert targets.problems(composed(ROOT / "conf", "config", "+hydra.job.env_set.OMP_NUM_THREADS=1")) == []


SWEEP_LOGGING = """defaults:
  - config
  - _self_
hydra:
  job_logging:
    handlers:
      evil:
        (): {name}
{args}
    root:
      handlers: [console, evil]
"""


@pytest.mark.slow  # the real entry point in a subprocess (~5 s each)
@pytest.mark.parametrize("name", ["logging.io.open", "logging.os.symlink"])
def test_a_logging_config_in_a_sweep_file_touches_nothing(tmp_path, name):
    victim, link = tmp_path / "victim.txt", tmp_path / "site" / "evil.pth"
    victim.write_text("yours")
    link.parent.mkdir()
    args = {"logging.io.open": f"        file: {victim}\n        mode: w",
            "logging.os.symlink": f"        src: {victim}\n        dst: {link}"}[name]
    (tmp_path / "sweep.yaml").write_text(SWEEP_LOGGING.format(name=name, args=args))
    r, _ = rlrun(tmp_path, "-cd", str(tmp_path), "-cn", "sweep", "experiment=smoke", "tracking=none")
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"hydra.job_logging.handlers.evil.(): {name!r} is not a logging.Handler class" in r.stderr
    assert victim.read_text() == "yours" and not os.path.lexists(link) and "Traceback" not in r.stderr


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
    ("batching=foo", "batching=foo is not an option of batching; its options: packed, padded, shared_prompt. "
                     "Choose one of them, e.g. batching=padded."),
    # the nearest spelling, not the alphabetically first option (it said "e.g. head=chunked")
    ("head=tild", "head=tild is not an option of head; its options: chunked, dense, tiled. Did you mean head=tiled?"),
    ("head=null", "a config group cannot be set to null (e.g. head=null)"),
])
def test_an_unknown_option_is_rlruns_error_with_the_options(tmp_path, override, says):
    r, _ = rlrun(tmp_path, override, "tracking=none")
    assert r.returncode == 2 and f"rlrun: error: {says}" in r.stderr, r.stderr[-1500:]
    assert "Traceback" not in r.stderr and "Config search path" not in r.stderr


@pytest.mark.parametrize("args, says", [
    (["train.lrr=0.1"], "train.lrr: 'lrr' is not a key of train. Did you mean train.lr? Its keys: batch_size,"),
    (["trian.lr=0.1"], "trian.lr: 'trian' is not a key of the configuration. Did you mean train.lr=0.1?"),
    (["model.lora.rnak=4"], "model.lora.rnak: 'rnak' is not a key of model.lora. Did you mean model.lora.rank?"),
    (["-cn", "heads_equivalnce"], "there is no config named 'heads_equivalnce'; did you mean heads_equivalence? "
                                  "`-cn NAME` runs one of: activations, batching, config,"),
    (["pipeline_run=async_k1"], "pipeline_run is a config group of the sweep pipeline (sweeps/pipeline_run/), not of "
                                "a single run. Run the sweep (rlrun -cn pipeline), or add the group to this run: "
                                "+pipeline_run=async_k1."),
])
def test_a_typo_hydra_refuses_is_rlruns_error_with_the_nearest_name(tmp_path, args, says):
    """Names Hydra refuses while composing (before rlrun's validation): one line with the nearest valid name,
    exit 2, no traceback, no Hydra search path, and no output folder written."""
    r, _ = rlrun(tmp_path, *args, "tracking=none")
    assert r.returncode == 2 and f"rlrun: error: {says}" in r.stderr, r.stderr[-1500:]
    assert "Traceback" not in r.stderr and "Config search path" not in r.stderr and "HYDRA_FULL_ERROR" not in r.stderr
    assert not (tmp_path / "outputs").exists()


def test_the_plus_form_a_typo_message_offers_runs():
    """What the message for a sweep's group offers (+pipeline_run=async_k1) composes: the job's settings."""
    from hydra import compose, initialize_config_dir

    from rlrun.config import typos

    with initialize_config_dir(str(typos.CONF), version_base="1.3"):
        cfg = compose("config", ["+pipeline_run=async_k1", "hydra.searchpath=[file://" + str(typos.SWEEPS) + "]"])
    assert cfg.rollout.pipeline == "async" and cfg.rollout.max_staleness == 1


def test_a_keys_typo_hint_never_offers_the_value_to_another_key():
    """issue #53: `rollout.top_k=5` (before top_k existed) was answered "Did you mean rollout.top_p=5?", a value
    that key refuses and a different sampler filter; the hint names the nearest key alone. A node's typo keeps the
    value: it is for the key the user named."""
    from rlrun.config import typos

    hint = typos.unknown_key("rollout.top_a", "5")
    assert "Did you mean rollout.top_" in hint and "=5" not in hint, hint
    assert "Did you mean train.lr=0.1?" in typos.unknown_key("trian.lr", "0.1")
