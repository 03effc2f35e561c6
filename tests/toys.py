"""A toy option of each axis, added as docs/adding-an-option.md adds one (an object with its facts, its
config dataclass, its YAML), from outside the package: `RLRUN_TOY_OPTIONS=1 python -m pytest ...` registers them for
the whole session (tests/conftest.py), so that every test parametrized from the registry runs them too. Each is a
shipped option's arithmetic under another name, with its own facts (tests/toy_options.py): a test that fails only
with them assumes the shipped options instead of asking what an option declares."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rlrun import registry


@dataclass
class ToyHeadConfig:
    name: Literal["toy"]
    size: int | None


@dataclass
class ToyLayoutConfig:
    name: Literal["toy_layout"]
    max_tokens: int


@dataclass
class ToyActivationsConfig:
    name: Literal["toy_activations"]
    every: int


@dataclass
class ToyPolicyConfig:
    name: Literal["toy_policy"]


@dataclass
class ToyOffloadConfig:
    name: Literal["toy_offload"]
    enabled: bool


# group -> (name, its object as an import string: imported on first use, as the registry's own; its config
# dataclass, its YAML)
TOYS = {
    "head": ("toy", "toy_options:HEAD", ToyHeadConfig, "name: toy\nsize: null\n"),
    "batching": ("toy_layout", "toy_options:ToyLayout", ToyLayoutConfig, "name: toy_layout\nmax_tokens: 4096\n"),
    "activations": ("toy_activations", "toy_options:ToyActivations", ToyActivationsConfig,
                    "name: toy_activations\nevery: 1\n"),
    "logprob_policy": ("toy_policy", "toy_options:ToyPolicy", ToyPolicyConfig, "name: toy_policy\n"),
    "offload": ("toy_offload", "toy_options:ToyOffload", ToyOffloadConfig, "name: toy_offload\nenabled: true\n"),
    # keyed by a config key's value (train.precision=toy_precision): no config dataclass, no YAML
    "precision": ("toy_precision", "toy_options:ToyPrecision", None, None),
    "pipeline": ("toy_pipeline", "toy_options:ToyPipeline", None, None),
    "decode": ("toy_decode", "toy_options:ToyDecode", None, None),
}


def write_yaml(folder: Path, groups=tuple(TOYS)) -> Path:
    """The toys' YAMLs under `folder`/<group>/, a config folder for Hydra's search path."""
    for group in (g for g in groups if TOYS[g][3] is not None):
        name, _, _, text = TOYS[group]
        (folder / group).mkdir(parents=True, exist_ok=True)
        (folder / group / f"{name}.yaml").write_text(text)
    return folder


def register(groups=tuple(TOYS)) -> None:
    for group in groups:
        name, target, config, _ = TOYS[group]
        registry.register(group, name, target, config)


def unregister(groups=tuple(TOYS)) -> None:
    for group in groups:
        registry.unregister(group, TOYS[group][0])


def session_folder() -> Path:
    """A config folder of this process holding every toy's YAML (RLRUN_TOY_OPTIONS=1), removed at its exit."""
    folder = Path(tempfile.mkdtemp(prefix="rlrun-toys-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return write_yaml(folder)
