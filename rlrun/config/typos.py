"""rlrun's message, with the nearest valid name, for the typos Hydra refuses while composing (before rlrun's own
validation sees the config): a key that does not exist (`train.lrr=0.1`), a name that is neither a key nor a group
of this config (`pipeline_run=async_k1` outside its sweep), and a config name that does not exist
(`-cn heads_equivalnce`). `config.targets.guard` calls `message` on Hydra's composition errors."""

from __future__ import annotations

import dataclasses
import difflib
import re
from pathlib import Path
from typing import Annotated, Any, get_args, get_origin, get_type_hints

from .schema import RunConfig
from .types import UNIONS

ROOT = Path(__file__).resolve().parent.parent.parent
CONF, SWEEPS = ROOT / "conf", ROOT / "sweeps"


def classes(tp) -> list[Any]:
    """The dataclasses a field's type can hold (Annotated, Optional and a group's union of options unwrapped)."""
    if get_origin(tp) is Annotated:
        return classes(get_args(tp)[0])
    if get_origin(tp) in UNIONS:
        return [c for arm in get_args(tp) for c in classes(arm)]
    return [tp] if dataclasses.is_dataclass(tp) else []


def keys_at(path: str) -> list[str] | None:
    """The keys rlrun reads under `path` ("" for the top, "train", "loss.tis"), over every option of a group;
    None when `path` itself is not a node of the config."""
    found: list[Any] = [RunConfig]
    for part in path.split(".") if path else []:
        found = [c for cls in found for f in dataclasses.fields(cls) if f.name == part
                 for c in classes(get_type_hints(cls, include_extras=True).get(f.name, f.type))]
        if not found:
            return None
    return sorted({f.name for cls in found for f in dataclasses.fields(cls)})


def groups(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith(("_", ".")))


def configs() -> list[str]:
    """The names `-cn` finds: conf/'s primary config and the named sweeps."""
    return sorted({p.stem for p in CONF.glob("*.yaml")} | {p.stem for p in SWEEPS.glob("*.yaml")})


def nearest(name: str, names: list[str]) -> str:
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else "."


def unknown_key(key: str, value: str) -> str:
    """`key` is not in the config: name its first part that is not, the nearest key there, and that node's keys."""
    parts = key.split(".")
    for i in range(len(parts)):
        parent, leaf = ".".join(parts[:i]), parts[i]
        names = keys_at(parent)
        if names is None or leaf in names:
            continue
        where = parent or "the configuration"
        near = difflib.get_close_matches(leaf, names, n=1, cutoff=0.6)
        # a node's typo (trian.lr=0.1): the value is for the key the user named, under its right node; a key's own
        # typo names the nearest key without the value, which may be another key's (rollout.top_a=5 is not top_p=5)
        suggested = ".".join([*parts[:i], near[0], *parts[i + 1:]]) if near else ""
        shown = f"{suggested}={value}" if near and i < len(parts) - 1 and value else suggested
        hint = f" Did you mean {shown}?" if near else ""
        return f"{key}: {leaf!r} is not a key of {where}.{hint} Its keys: {', '.join(names)}."
    return f"{key} is not a key of the configuration."


def message(error: Exception) -> str | None:
    """rlrun's one-line message for a Hydra composition error about a name, or None for any other error (its
    cause's text read too: Hydra wraps OmegaConf's "not in struct")."""
    text = f"{error}\n{error.__cause__ or ''}"
    missing = re.search(r"Cannot find primary config '([^']+)'", text)
    if missing:
        name, names = missing.group(1), configs()
        return (f"there is no config named {name!r}{nearest(name, names)} `-cn NAME` runs one of: "
                f"{', '.join(names)} (sweeps/; `rlrun --help` describes them).")
    override = re.search(r"Could not override '([^']+)'", text)
    if not override:
        return None
    key = override.group(1)
    given = re.search(r"use \+\+?" + re.escape(key) + r"=(\S+)", text)  # Hydra's "To append ... use +key=value"
    value = given.group(1) if given else ""
    if "not in struct" in text:
        return unknown_key(key, value)
    if "No match in the defaults list" in text:
        if key in groups(SWEEPS):
            sweep = [p.stem for p in SWEEPS.glob("*.yaml") if re.search(rf"^\s*-\s*{key}\s*:", p.read_text(), re.M)]
            return (f"{key} is a config group of the sweep {', '.join(sweep) or '(none)'} (sweeps/{key}/), not of a "
                    f"single run. Run the sweep (rlrun -cn {sweep[0] if sweep else 'NAME'}), or add the group to "
                    f"this run: +{key}={value or 'OPTION'}.")
        names = keys_at("") or []
        return (f"{key} is neither a key nor a config group of the configuration{nearest(key, names)} "
                f"`rlrun --help` lists the groups; conf/config.yaml has the keys.")
    return None
