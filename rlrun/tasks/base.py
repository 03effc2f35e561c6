"""Shared pieces of the task package: the error type and config access that works for OmegaConf nodes, dicts and
typed dataclasses alike (the `task` node may become a dataclass)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from ..errors import TaskError  # noqa: F401 (re-exported: rlrun.tasks.TaskError)

MISSING = "???"


def opt(cfg, key: str, default=None):
    """`cfg.key`, or `default` when the node has no such key. A mandatory value left unset reads as '???'."""
    try:
        value = cfg[key] if isinstance(cfg, Mapping) else getattr(cfg, key)
    except (AttributeError, KeyError):
        return default
    except Exception as e:  # omegaconf's MissingMandatoryValue, without importing omegaconf
        if type(e).__name__ == "MissingMandatoryValue":
            return MISSING
        raise
    return plain(value)


def plain(value):
    """OmegaConf containers and dataclass instances -> dict / list (recursively): user functions get ordinary
    Python objects, and a typed config node reads like a composed one."""
    if isinstance(value, (str, bytes)):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, Sequence):
        return [plain(v) for v in value]
    return value


def short(value, n: int = 60) -> str:
    """repr(value), cut to about `n` characters for error messages."""
    r = repr(value)
    if len(r) <= n:
        return r
    return r[: n - 4] + "..." + r[0] if r[0] in "'\"" else r[: n - 3] + "..."
