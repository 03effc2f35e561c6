"""Adds rlrun's conf/ to Hydra's search path, so configs in another folder (`rlrun -cd sweeps -cn NAME`) can
build on the main config and its groups."""

from pathlib import Path

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


class RlrunSearchPathPlugin(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        search_path.append(provider="rlrun", path=f"file://{CONF_DIR}")
