"""Adds rlrun's conf/ and sweeps/ to Hydra's search path: configs in another folder (`rlrun -cd DIR -cn NAME`) can
build on the main config and its groups, and the shipped sweeps run from any working directory by name
(`rlrun -cn logprob_policies`). conf/ comes first, so a sweep never shadows the main config or a group."""

from pathlib import Path

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

ROOT = Path(__file__).resolve().parents[2]
CONF_DIR = ROOT / "conf"
SWEEPS_DIR = ROOT / "sweeps"


class RlrunSearchPathPlugin(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        search_path.append(provider="rlrun", path=f"file://{CONF_DIR}")
        search_path.append(provider="rlrun-sweeps", path=f"file://{SWEEPS_DIR}")
