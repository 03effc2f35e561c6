"""No code runs from a config (the only code a config names is its reward functions, `task.reward(s)`), and an
unknown option is rlrun's error, not Hydra's traceback.

Hydra instantiates whatever a `_target_` names (callbacks, launcher, sweeper) and Python's logging config imports
whatever a handler's `class`, a factory's `()` or an `ext://` value names, before rlrun's own code runs; a sweep
file or an override could so run any module, rlrun's own reward loader included. `guard()` checks every such name
in each config Hydra composes, before Hydra instantiates anything, by what the name resolves to, not by how it is
spelled (`logging.os.system` starts with `logging.` and is a function of the os module):

- a `_target_` is one rlrun ships (hydra.callbacks), or at hydra.launcher / hydra.sweeper an installed Hydra plugin
  of that kind (as Hydra discovered it);
- a logging config's handler, formatter or filter (`class` or `()`) is a subclass of logging.Handler, Formatter or
  Filter found in the standard library's `logging` / `logging.handlers` (looked up, never imported), or
  colorlog's formatter; a `.` (attributes set on the object made) is refused, and a file handler writes only in the
  run's output folder; `ext://` names only the `sys` streams;
- hydra.job.env_set sets no variable that makes a later process load code (LD_*, PYTHONPATH, ...);
- any other `_target_`, `class` or `()` anywhere is refused.
"""

from __future__ import annotations

import difflib
import logging
import logging.handlers  # noqa: F401 (resolves_to looks names up in it)
import re
import sys

from . import ConfigError, typos

TARGETS = {"rlrun.sweep.SweepCallback"}  # the `_target_`s rlrun ships (conf/config.yaml: hydra.callbacks)
PLUGINS = {"hydra.launcher": "Launcher", "hydra.sweeper": "Sweeper"}  # a `_target_` here: an installed plugin's
LOGGING = ("hydra.job_logging", "hydra.hydra_logging")
# what a logging config's handler, formatter or filter must resolve to, found in the standard library's logging
# modules (nothing is imported: both are loaded by `import logging.handlers` here)
KINDS = {"handlers": "Handler", "formatters": "Formatter", "filters": "Filter"}
MODULES = ("logging", "logging.handlers")
ALLOWED = {"formatters": {"colorlog.ColoredFormatter"}}  # hydra_colorlog's formatter (a logging.Formatter)
# a log file may only be in the run's output folder (as Hydra's own file handler's is): elsewhere its lines
# would be appended to (or, mode w, truncate) a file of yours
OUTPUT = re.compile(r"\$\{hydra[.:]runtime\.output_dir\}/(?:[\w.-]|\$\{hydra[.:]job\.(?:name|num|id)\})+")
EXT = ("ext://sys.stdout", "ext://sys.stderr")
# environment variables that make a later process (the reward worker, the generator) load code of their own;
# PYTHONWARNINGS imports the module of a filter's category (`ignore::evil.Warning`), PYTHONBREAKPOINT the hook it names
CODE_ENV = re.compile(r"LD_\w+|DYLD_\w+|BASH_ENV|ENV|"
                      r"PYTHON(?:PATH|STARTUP|HOME|USERBASE|INSPECT|EXECUTABLE|PLATLIBDIR|WARNINGS|BREAKPOINT)")
FIX = "remove it from the config or sweep file"


def problems(node, path: str = "") -> list[str]:
    """Every name of code in the config tree `node` (a plain container) that rlrun does not allow."""
    out = []
    if isinstance(node, dict):
        if path.startswith(LOGGING):
            out += _logging_node(node, path)
        if path == "hydra.job.env_set":
            out += _environment(node, path)
        for key, value in node.items():
            where = f"{path}.{key}" if path else str(key)
            if key in ("_target_", "class", "()"):
                out += _check(path, key, value)
            elif not (key == "." and path.startswith(LOGGING)):  # said by _logging_node
                out += problems(value, where)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            out += problems(value, f"{path}[{i}]")
    elif isinstance(node, str) and node.startswith("ext://") and node not in EXT:
        out.append(f"{path}: {node!r} imports a module; a config may name only {' or '.join(EXT)}")
    return out


def _check(path: str, key: str, value) -> list[str]:
    """A `_target_`, `class` or `()` at `path`: allowed by what the name resolves to, not by how it is spelled."""
    name = str(value)
    where = f"{path}.{key}" if path else key
    if "${" in name:
        return [f"{where}: {name!r} is an interpolation; the code a config names must be spelled out"]
    if key == "_target_" and path in PLUGINS:
        return [] if name in plugin_classes(PLUGINS[path]) else [
            f"{where}: {name!r} is not an installed Hydra {PLUGINS[path].lower()} (those installed: "
            f"{', '.join(sorted(plugin_classes(PLUGINS[path])))}); {FIX}"]
    if key == "_target_" and name in TARGETS:
        return []
    kind = _logging_kind(path)
    if key != "_target_" and kind is not None:
        if name in ALLOWED.get(kind, ()) or resolves_to(name, getattr(logging, KINDS[kind])):
            return []
        return [f"{where}: {name!r} is not a logging.{KINDS[kind]} class of the standard library's logging "
                f"modules; a logging config may name only those; {FIX}"]
    return [f"{where}: {name!r} is code that rlrun does not run from a config (only the reward functions under "
            f"task.reward / task.rewards are); {FIX}"]


def _logging_kind(path: str) -> str | None:
    """`handlers`, `formatters` or `filters` for the path of one such entry of a logging config, else None."""
    parts = path.split(".")
    if path.startswith(LOGGING) and len(parts) == 4 and parts[2] in KINDS:
        return parts[2]
    return None


def resolves_to(name: str, base: type) -> bool:
    """`name` (module.Class) is a subclass of `base` defined in one of the standard library's logging modules,
    looked up in the loaded module, never imported: `logging.io.open` or `logging.os.system` resolve to a function,
    not a class."""
    module, _, attr = name.rpartition(".")
    if module not in MODULES:
        return False
    found = vars(sys.modules[module]).get(attr)
    return isinstance(found, type) and issubclass(found, base)


def _logging_node(node: dict, path: str) -> list[str]:
    """A logging config's entry: no `.` (it sets attributes on the object made, a handler's file included), and a
    file handler writes only in the run's output folder."""
    out = []
    if "." in node:
        out.append(f"{path}..: sets attributes on the logging object it makes (a handler's file among them); {FIX}")
    filename = node.get("filename")
    if _logging_kind(path) == "handlers" and filename is not None and not OUTPUT.fullmatch(str(filename)):
        out.append(f"{path}.filename: {filename!r} is outside the run's output folder; a log file is written "
                   "only there, as ${hydra.runtime.output_dir}/NAME.log (anywhere else it would add to, or "
                   f"truncate, a file of yours); {FIX}")
    return out


def _environment(node: dict, path: str) -> list[str]:
    """hydra.job.env_set's variables that would make the processes rlrun starts load code (env_copy copies your own
    environment's values, and is left alone)."""
    bad = sorted(k for k in map(str, node) if CODE_ENV.fullmatch(k))
    return [f"{path}.{k}: makes the processes rlrun starts load code of its own; {FIX}" for k in bad]


def plugin_classes(kind: str) -> set[str]:
    """The dotted names of the installed Hydra plugins of `kind` (Launcher, Sweeper), as Hydra discovered them."""
    from hydra.core.plugins import Plugins
    from hydra.plugins.launcher import Launcher
    from hydra.plugins.sweeper import Sweeper

    base = {"Launcher": Launcher, "Sweeper": Sweeper}[kind]
    return {f"{c.__module__}.{c.__name__}" for c in Plugins.instance().discover(base)}


# Names people type for an option rlrun has under another name: what to use instead.
EXPLAINED = {("loss", "grpo"): "GRPO is the recipe that loss=dapo, loss=cispo and loss=gspo train with (generate, "
                               "score, group advantages, update); pick its loss: loss=dapo (the default), loss=cispo "
                               "or loss=gspo (a sequence-level ratio); GRPO's own per-sequence mean is "
                               "loss.agg=seq_mean_token_mean"}


def unknown_option(error: BaseException) -> str | None:
    """rlrun's message for a group option Hydra could not find (`head=foo`) or a group set to null (`head=null`):
    the options of that group and the fix; None for other composition errors."""
    from .. import registry

    text = str(error)
    found = re.search(r"Could not find '([\w/]+)/([^']+)'", text)
    if found:
        group, name = found.group(1), found.group(2)
        options = sorted(registry.REGISTRY.get(group, {}))
        if not options:
            return f"{group}={name} is not an option of {group}; `rlrun --help` lists each group's options."
        # the nearest spelling (head=tild -> tiled), not the alphabetically first option
        close = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
        fix = EXPLAINED.get((group, name), f"Did you mean {group}={close[0]}?" if close else
                            f"Choose one of them, e.g. {group}={registry.baseline(group) or options[0]}.")
        end = "" if fix.endswith(("?", ".")) else "."
        return f"{group}={name} is not an option of {group}; its options: {', '.join(options)}. {fix}{end}"
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
            message = unknown_option(e) or unknown_option(e.__cause__ or e) or typos.message(e)
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
