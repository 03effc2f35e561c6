import os
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parent.parent
CONF = str(ROOT / "conf")
sys.path.insert(0, str(ROOT / "tests"))  # helpers.py: reward functions used through task.reward


def make_cfg(*overrides: str, tmp_path=None):
    """Compose the real config with `overrides`; quiet, and tracking into `tmp_path` when given."""
    extra = ["progress=false"]
    if tmp_path is not None:
        extra.append(f"tracking.uri=sqlite:///{tmp_path}/mlflow.db")
    else:
        extra.append("tracking=none")
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose("config", overrides=[*extra, *overrides])


@pytest.fixture
def cfg_factory():
    return make_cfg


@pytest.fixture(autouse=True)
def _quiet_mlflow(monkeypatch):
    monkeypatch.setenv("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "false")
    monkeypatch.setenv("GIT_PYTHON_REFRESH", "quiet")
    yield


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
