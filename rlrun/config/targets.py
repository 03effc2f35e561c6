"""No code runs from a config (the only code a config names is its reward functions, `task.reward(s)`), and an
unknown option is rlrun's error, not Hydra's traceback.

Hydra instantiates whatever a `_target_` names (callbacks, launcher, sweeper) and Python's logging config imports
whatever a handler's `class`, a factory's `()` or an `ext://` value names, before rlrun's own code runs; a sweep
file or an override could so run any module, rlrun's own reward loader included. `guard()` checks every such name
in each config Hydra composes, before Hydra instantiates anything: a `_target_` must be one rlrun ships or a
launcher/sweeper plugin's (Hydra's own or an installed `hydra_plugins` package), logging may name only the
standard library's `logging` classes (and colorlog's, Hydra's colour plugin), and `ext://` only `sys` streams.
"""

from __future__ import annotations

import re
import sys

from . import ConfigError

TARGETS = {"rlrun.sweep.SweepCallback"}  # the `_target_`s rlrun ships (conf/config.yaml: hydra.callbacks)
PLUGIN_KEYS = ("hydra.launcher", "hydra.sweeper")
PLUGIN_PREFIXES = ("hydra._internal.core_plugins.", "hydra_plugins.")
LOGGING_PREFIXES = ("logging.", "colorlog.")
EXT = ("ext://sys.stdout", "ext://sys.stderr")


def problems(node, path: str = "") -> list[str]:
    """Every name of code in the config tree `node` (a plain container) that rlrun does not allow."""
    out = []
    if isinstance(node, dict):
        for key, value in node.items():
            where = f"{path}.{key}" if path else str(key)
            if key in ("_target_", "class", "()"):
                out += _check(path, key, value)
            else:
                out += problems(value, where)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            out += problems(value, f"{path}[{i}]")
    elif isinstance(node, str) and node.startswith("ext://") and node not in EXT:
        out.append(f"{path}: {node!r} imports a module; a config may name only {' or '.join(EXT)}")
    return out


def _check(path: str, key: str, value) -> list[str]:
    name = str(value)
    where = f"{path}.{key}" if path else key
    if "${" in name:
        return [f"{where}: {name!r} is an interpolation; the code a config names must be spelled out"]
    logging = path.startswith(("hydra.job_logging", "hydra.hydra_logging"))
    if key == "_target_" and path in PLUGIN_KEYS:
        ok = name.startswith(PLUGIN_PREFIXES)
    elif key == "_target_":
        ok = name in TARGETS
    else:  # a logging config's handler class or factory
        ok = logging and name.startswith(LOGGING_PREFIXES)
    if ok:
        return []
    return [f"{where}: {name!r} is code that rlrun does not run from a config (only the reward functions under "
            "task.reward / task.rewards are); remove it from the config or sweep file"]


# Names people type for an option rlrun has under another name: what to use instead.
EXPLAINED = {("loss", "grpo"): "GRPO is the recipe that loss=dapo, loss=cispo and loss=gspo train with (generate, "
                               "score, group advantages, update); pick its loss: loss=dapo (the default), loss=cispo "
                               "or loss=gspo (a sequence-level ratio); GRPO's own per-sequence mean is "
                               "loss.agg=seq_mean_token_mean"}


def unknown_option(error: Exception) -> str | None:
    """rlrun's message for a group option Hydra could not find (`head=foo`) or a group set to null (`head=null`):
    the options of that group and the fix; None for other composition errors."""
    from .. import registry

    text = str(error)
    found = re.search(r"Could not find '([\w/]+)/([^']+)'", text)
    if found:
        group, name = found.group(1), found.group(2)
        options = sorted(registry.REGISTRY.get(group, {})) or "see rlrun --help"
        fix = EXPLAINED.get((group, name), f"Choose one of them, e.g. {group}={options[0] if options else '...'}")
        return f"{group}={name} is not an option of {group}; its options: {', '.join(options)}. {fix}."
    if "Config group override must be a string" in text:
        return ("a config group cannot be set to null (e.g. head=null): every group needs one option; "
                "`rlrun --help` lists them.")
    return None


def guard() -> None:
    """Check each config Hydra composes (rlrun's entry point calls this once, before Hydra starts): an unknown
    group option and code named in the config end with one message and exit 2, before anything is instantiated."""
    from hydra._internal.hydra import Hydra
    from omegaconf import OmegaConf

    compose = Hydra.compose_config
    if getattr(compose, "rlrun_guard", False):
        return

    def checked(self, *args, **kwargs):
        try:
            cfg = compose(self, *args, **kwargs)
        except Exception as e:  # noqa: BLE001 - only the errors rlrun can say better are caught; others go on
            message = unknown_option(e) or unknown_option(e.__cause__ or e)
            if message is None:
                raise
            print(f"rlrun: error: {message}", file=sys.stderr)
            sys.exit(2)
        found = problems(OmegaConf.to_container(cfg, resolve=False))
        if found:  # before Hydra instantiates a callback, launcher or sweeper: a message, not its traceback
            print(f"rlrun: error: {ConfigError(found)}", file=sys.stderr)
            sys.exit(2)
        return cfg

    checked.rlrun_guard = True  # type: ignore[attr-defined]  # a marker on the function; mypy has no function attrs
    Hydra.compose_config = checked  # type: ignore[method-assign]  # deliberately patches Hydra's method
