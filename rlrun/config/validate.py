"""`validate(cfg)`: the composed DictConfig -> a typed `RunConfig`, or one `ConfigError` listing every problem.

The walk checks every key against schema.py (unknown keys, unset values, types, choices, bounds) and records the
keys that failed; then every rule of rules.py runs unless a key it reads failed, so one bad key is reported once.
"""

from __future__ import annotations

import difflib
from dataclasses import MISSING, fields, is_dataclass
from typing import Annotated, Any, Literal, cast, get_args, get_origin, get_type_hints

from omegaconf import OmegaConf

from .. import ranks, registry
from . import rules
from .schema import RunConfig
from .types import UNIONS, Check, Registered

NoneType = type(None)
SCALARS = {bool: ("true or false", "booleans"), int: ("an integer", "integers"), float: ("a number", "numbers"),
           str: ("a string", "strings"), NoneType: ("null", "nulls"), dict: ("a mapping", "mappings")}


def option_name(cls) -> str | None:
    """The option a dataclass stands for (its `name: Literal[...]`), or None for train/checkpoint/nested nodes."""
    name = getattr(cls, "__dataclass_fields__", {}).get("name")
    return get_args(name.type)[0] if name is not None and get_args(name.type) else None


def group_options(tp) -> dict[str, type] | None:
    """{name: dataclass} when `tp` is a union of group options, else None."""
    arms = get_args(tp) if get_origin(tp) in UNIONS else ()
    named = {a: option_name(a) for a in arms}
    if arms and all(named.values()):
        return {name: a for a, name in named.items() if name is not None}
    return None


OPTIONS: dict[str, dict[str, type]] = {f.name: options for f in fields(RunConfig)
                                       if (options := group_options(f.type)) is not None}


def registered(tp) -> str | None:
    """The axis whose registered options are `tp`'s values (types.Registered), or None."""
    marks = tp.__metadata__ if get_origin(tp) is Annotated else ()
    return next((m.group for m in marks if isinstance(m, Registered)), None)


def allowed(tp) -> tuple | None:
    """The values a choice type allows: a Literal's, or the registry's options of a Registered key, else None."""
    group = registered(tp)
    if group is not None:
        return tuple(registry.REGISTRY[group])
    return get_args(tp) if get_origin(tp) is Literal else None


def choices(key: str) -> list:
    """The values a dotted config key takes (`train.precision` -> ['fp32', 'bf16'] and any precision registered from
    outside); across a group's options, every value one of them allows (`rollout.pipeline`)."""
    group, _, leaf = key.partition(".")
    tp = {f.name: f.type for f in fields(RunConfig)}[group]
    arms: list[Any] = list(OPTIONS[group].values()) if group in OPTIONS else [tp]  # dataclasses
    found: list = []
    for arm in arms:
        field = get_type_hints(arm, include_extras=True).get(leaf)
        found += [v for v in allowed(field) or () if v not in found]
    return found


class ConfigError(ValueError):
    before_start = False  # set where a run is refused before anything was built or logged (cli.run)

    def __init__(self, problems: list[str]):
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{len(problems)} problem(s) in the configuration:\n{lines}")


class Bad:
    """Stands in for a value that failed the schema; keeps the user's value so rules can still quote it."""

    __slots__ = ("raw",)

    def __init__(self, raw):
        self.raw = raw

    def __repr__(self) -> str:
        return repr(self.raw)

    def __str__(self) -> str:
        return str(self.raw)


def validate(cfg) -> RunConfig:
    """The typed config of a composed `cfg` (or of its plain-data form, a dict); raises ConfigError with every
    problem found (schema and rules)."""
    if isinstance(cfg, dict):
        data = dict(cfg)
    else:
        try:
            data = cast("dict[str, Any]", OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False))
        except Exception as e:  # noqa: BLE001 - an interpolation that cannot be resolved (e.g. ${oc.env:...})
            raise ConfigError([f"the configuration cannot be resolved: {e}"]) from None
    data.pop("hydra", None)  # present when composed with return_hydra_config=True
    walk = Walk()
    typed = walk.node(data, RunConfig, "", "the top level")
    world = ranks.world_size()  # set by the launcher (torchrun, deepspeed)
    problems = walk.problems + rules.check(typed, walk.bad, world)
    if problems:
        raise ConfigError(problems)
    return typed


def describe(tp, plural: bool = False) -> str:
    """`tp` in words, for "KEY=VALUE must be <describe>"."""
    origin, args = get_origin(tp), get_args(tp)
    if registered(tp) is not None or origin is Literal:
        values = list(allowed(tp) or ())
        return f"values in {values}" if plural else f"one of {values}"
    if origin is Annotated:
        return describe(args[0], plural)
    if origin in UNIONS:
        return " or ".join(describe(a, plural) for a in args)
    if origin is list:
        return f"a list of {describe(args[0], True)}"
    if origin is tuple:
        return f"a list of {len(args)} {describe(args[0], True)}"
    if is_dataclass(tp):
        return "mappings" if plural else "a mapping"
    return SCALARS[tp][plural]


def scalar(raw, tp):
    """`raw` as `tp`, or Bad. An int is a valid float (converted); a bool is not an int."""
    if tp is float and isinstance(raw, (int, float)) and not isinstance(raw, bool):
        return float(raw)
    if tp is int and isinstance(raw, bool):
        return Bad(raw)
    return raw if isinstance(raw, tp) else Bad(raw)


def join(path: str, key) -> str:
    return f"{path}.{key}" if path else str(key)


class Walk:
    """One pass over the plain-container config; `problems` in key order, `bad` the keys that failed."""

    def __init__(self) -> None:
        self.problems: list[str] = []
        self.bad: set[str] = set()

    def fail(self, path: str, raw, message: str) -> Bad:
        self.problems.append(message)
        self.bad.add(path)
        return Bad(raw)

    def node(self, data, cls, path: str, where: str):
        """A mapping against dataclass `cls`: unknown keys, then every field (unset, missing, typed)."""
        if not isinstance(data, dict):
            return self.fail(path, data, f"{path}={data!r} must be a mapping of {[f.name for f in fields(cls)]}.")
        names = [f.name for f in fields(cls)]
        for key in data:
            if key not in names:
                self.unknown(join(path, key), data[key], names, path, where)
        values = {}
        hints = get_type_hints(cls, include_extras=True)  # string annotations too (an option registered from outside)
        for f in fields(cls):
            key, tp = join(path, f.name), hints.get(f.name, f.type)
            raw = data.get(f.name, Bad(None))
            if isinstance(raw, Bad) and f.default is not MISSING:  # optional keys of user-written list items
                values[f.name] = f.default
            elif isinstance(raw, Bad):
                values[f.name] = self.fail(key, None, f"{key} is missing; {where} needs it ({describe(tp)}).")
            elif "needs" in f.metadata and raw in (None, "", "???"):
                values[f.name] = self.fail(key, raw, f"{where} needs {key}={f.metadata['needs']}.")
            elif raw == "???":
                values[f.name] = self.fail(key, raw, f"{key} has no value (???); set {key}=<{describe(tp)}>.")
            else:
                values[f.name] = self.value(raw, tp, key)
        return cls(**values)

    def unknown(self, key: str, raw, names: list[str], path: str, where: str) -> None:
        leaf = key.rsplit(".", 1)[-1]
        close = difflib.get_close_matches(leaf, names, n=1)
        hint = f"; did you mean {join(path, close[0])}?" if close else "."
        self.fail(key, raw, f"{key}={raw!r} is not a key of {where}{hint} Its keys: {sorted(names)}.")

    def value(self, raw, tp, key: str, or_null: str = ""):
        """`raw` checked and converted to `tp`; a problem is recorded and Bad returned when it does not fit."""
        origin, args = get_origin(tp), get_args(tp)
        group = registered(tp)
        if group is not None:  # an axis keyed by this key: the registry's options now, those added from outside too
            return self.choice(raw, tuple(registry.REGISTRY[group]), key)
        if origin is Annotated:
            v = self.value(raw, args[0], key, or_null)
            for check in tp.__metadata__:
                if not isinstance(v, Bad) and isinstance(check, Check) and not check.test(v):
                    v = self.fail(key, raw, f"{key}={raw!r} must be {check.text}{or_null}.")
            return v
        options = group_options(tp)
        if options is not None:  # the schema's options and any registered from outside (registry.register)
            return self.option(raw, {**options, **registry.CONFIGS.get(key, {})}, key)
        if origin in UNIONS:
            return self.union(raw, tp, key)
        if origin is Literal:
            return self.choice(raw, args, key)
        if is_dataclass(tp):
            return self.node(raw, tp, key, key)
        if origin in (list, tuple):
            return self.sequence(raw, tp, key, or_null)
        v = scalar(raw, tp)
        if isinstance(v, Bad):
            self.fail(key, raw, f"{key}={raw!r} must be {describe(tp)}{or_null}.")
        return v

    def option(self, raw, options: dict, group: str):
        """A group's node: the option is picked by its `name`, then checked against that option's dataclass."""
        name = raw.get("name") if isinstance(raw, dict) else None
        if not (isinstance(name, str) and name in options):
            return self.fail(group, raw, f"{group}.name={name!r} is not supported; supported: {sorted(options)}.")
        return self.node(raw, options[name], group, f"{group}={name}")

    def union(self, raw, tp, key: str):
        """Optional[X] (null, or X with "... or null" in its messages), or a choice of scalar types by value."""
        arms = [a for a in get_args(tp) if a is not NoneType]
        or_null = " or null" if len(arms) < len(get_args(tp)) else ""
        if raw is None and or_null:
            return None
        if len(arms) == 1:
            return self.value(raw, arms[0], key, or_null)
        for arm in arms:  # e.g. resume: bool | path; the arm whose base type the value has
            if get_origin(arm) is Literal:  # e.g. head.size: int | "auto"
                if raw in get_args(arm) and isinstance(raw, str):
                    return raw
                continue
            base = get_args(arm)[0] if get_origin(arm) is Annotated else arm
            if not isinstance(scalar(raw, base), Bad):
                return self.value(raw, arm, key, or_null)
        return self.fail(key, raw, f"{key}={raw!r} must be {describe(tp)}.")

    def choice(self, raw, choices: tuple, key: str):
        if any(type(raw) is type(c) and raw == c for c in choices):  # type first: True == 1, 2.0 == 2
            return raw
        close = difflib.get_close_matches(raw, [str(c) for c in choices], n=1) if isinstance(raw, str) else []
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return self.fail(key, raw, f"{key}={raw!r} is not supported{hint}; supported: {list(choices)}.")

    def sequence(self, raw, tp, key: str, or_null: str):
        """list[X] (any length) or tuple[X, ...] (that many items); given as a YAML / command-line list."""
        args = get_args(tp)
        if not isinstance(raw, list) or (get_origin(tp) is tuple and len(raw) != len(args)):
            return self.fail(key, raw, f"{key}={raw!r} must be {describe(tp)}{or_null}.")
        items = [self.value(x, args[min(i, len(args) - 1)], f"{key}[{i}]") for i, x in enumerate(raw)]
        if any(isinstance(x, Bad) for x in items):
            return Bad(raw)
        return tuple(items) if get_origin(tp) is tuple else items
