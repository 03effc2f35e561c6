"""Rewards: import them (`module:function` or `path/to/file.py:function`), bind their arguments, call them, check
what they return. The calling rule is documented in rlrun.tasks. A run calls them in a worker process
(rlrun/tasks/worker.py) through `call_one`, the same function `score` uses in this process."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib
import importlib.util
import inspect
import math
import numbers
import os
import re
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .base import TaskError, short

REWARD_KEYS = ("fn", "weight", "name", "kwargs")
_NAME = re.compile(r"[\w\-. /]+")  # what MLflow accepts in a metric name (logged as rewards/<name>/mean)


@dataclass
class Reward:
    fn: Callable[..., Any]
    spec: str  # "module:function" or "path.py:function", as configured
    weight: float = 1.0
    name: str = ""
    kwargs: dict = field(default_factory=dict)
    call: Callable[[str, dict], Any] | None = None  # (completion, row) -> value, from `bind`
    key: str = "task.reward"  # the config key it came from (for messages; the worker re-imports and re-binds)
    fields: tuple = ()  # the row fields it was bound against


def _where(e: BaseException) -> str:
    """' at file:line' of the deepest frame of the traceback outside Python's import machinery and this file."""
    here = os.path.abspath(__file__)
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if not f.filename.startswith("<") and os.path.abspath(f.filename) != here]
    return f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""


def _import_error(key: str, spec: str, what: str, e: BaseException) -> TaskError:
    if isinstance(e, SyntaxError):
        return TaskError(f"{key}={spec!r}: {e.filename}:{e.lineno}: syntax error ({e.msg}); fix the file.")
    return TaskError(f"{key}={spec!r}: importing {what} raised {type(e).__name__}: {e}{_where(e)}; fix it "
                     "or install what it needs.")


def _import_file(key: str, spec: str, file: str):
    path = Path(file).expanduser()
    if not path.is_file():
        raise TaskError(f"{key}={spec!r}: no file {str(path.resolve())!r}; give a path to a .py file (relative to "
                        f"the working directory {os.getcwd()}) or an importable 'module:function'.")
    path = path.resolve()
    # A stable, unique module name: the same file imported twice is one module; registered so pickling works.
    stem = re.sub(r"\W", "_", path.stem)
    name = f"rlrun_reward_{stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name], str(path)
    loader_spec = importlib.util.spec_from_file_location(name, path)
    if loader_spec is None or loader_spec.loader is None:  # a file Python has no loader for
        raise TaskError(f"{key}={spec!r}: {str(path)!r} cannot be imported; give a path to a .py file.")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module
    try:
        loader_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise _import_error(key, spec, str(path), e) from e
    return module, str(path)


def _import_module(key: str, spec: str, module_name: str):
    # The working directory is on sys.path for this import only (as with `python -m`): rewards.py beside the
    # config works without PYTHONPATH=.; installed modules still resolve as usual.
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise TaskError(
                f"{key}={spec!r}: no module named {e.name!r} (looked in the working directory {cwd} and the "
                f"installed packages). Put {e.name.split('.')[0]}.py in the working directory, give a file path "
                "('path/to/file.py:function'), or install the module.") from e
        raise _import_error(key, spec, f"module {module_name!r}", e) from e
    except Exception as e:
        raise _import_error(key, spec, f"module {module_name!r}", e) from e
    finally:
        if added:
            sys.path.remove(cwd)
    return module, getattr(module, "__file__", None) or module_name


class _ExitAtImport(BaseException):
    """os._exit called while a reward module was imported (raised by the stand-in `_no_exit_on_import` sets)."""


@contextlib.contextmanager
def _no_exit_on_import(key: str, spec: str, where: str):
    """A reward module that ends the process while it is imported (`sys.exit`, `os._exit(7)` at module level) is a
    TaskError naming it: `os._exit` ended the run at once, exit 7, no message, its MLflow run left RUNNING. For the
    import only, `os._exit` raises instead of exiting; a crash in C code (a segfault) still ends the process."""
    real = os._exit

    def stand_in(code):
        raise _ExitAtImport(code)

    os._exit = stand_in
    try:
        yield
    except (SystemExit, _ExitAtImport) as e:
        how = "os._exit" if isinstance(e, _ExitAtImport) else "sys.exit"
        raise TaskError(f"{key}={spec!r}: importing {where!r} called {how}({e.args[0] if e.args else ''}), which "
                        "would end the run; a reward module must not end the process when it is imported (move "
                        "that code into a function, or under `if __name__ == '__main__':`).") from None
    finally:
        os._exit = real


def import_reward(spec: str, key: str = "task.reward"):
    """`module:function` or `path/to/file.py:function` -> the function; errors say what failed and the fix."""
    if not isinstance(spec, str) or spec.count(":") < 1 or not spec.rpartition(":")[2].strip():
        raise TaskError(f"{key}={spec!r} must be 'module:function' or 'path/to/file.py:function'.")
    where, _, name = spec.rpartition(":")
    is_file = where.endswith(".py") or "/" in where or os.sep in where
    home = os.getcwd()
    try:
        with _no_exit_on_import(key, spec, where):
            module, origin = _import_file(key, spec, where) if is_file else _import_module(key, spec, where)
    finally:
        _go_home(home)  # a module that changes directory on import does not move where the run writes
    fn = getattr(module, name, None)
    if fn is None:
        found = sorted(n for n, v in vars(module).items()
                       if callable(v) and not inspect.isclass(v) and not n.startswith("_"))[:30]
        raise TaskError(f"{key}={spec!r}: {origin} has no function {name!r}; it defines {found}. Use "
                        "'module:function' with one of these.")
    if not callable(fn):
        raise TaskError(f"{key}={spec!r} is not callable (it is a {type(fn).__name__}).")
    return fn


def load_reward(path: str):
    """`module:function` -> the function (the historic `task.reward` key); see `import_reward`."""
    return import_reward(path, "task.reward")


def parse_rewards(reward, rewards) -> list[dict]:
    """The configured rewards as [{fn, weight, name, kwargs}]: the legacy `reward: module:function` key or the
    `rewards` list (entries are dicts or 'module:function' strings). Checks shapes only, imports nothing."""
    if reward not in (None, "") and rewards not in (None, []):
        raise TaskError(f"set task.reward (one function) or task.rewards (a list), not both (task.reward={reward!r}, "
                        f"task.rewards={rewards!r}): add task.rewards=null to keep task.reward, or task.reward=null "
                        "to keep the list, e.g. task.rewards='[{fn: module:function, weight: 1.0}]'.")
    if reward not in (None, ""):
        return [{"fn": reward, "weight": 1.0, "name": None, "kwargs": {}, "key": "task.reward"}]
    if rewards is None:
        return []  # fine for DPO; `load_rewards` refuses it for GRPO
    if not isinstance(rewards, list):
        raise TaskError(f"task.rewards={rewards!r} must be a list of {{fn: module:function, weight: w}}.")
    out = []
    for i, r in enumerate(rewards):
        key = f"task.rewards[{i}]"
        r = {"fn": r} if isinstance(r, str) else r
        if not isinstance(r, dict) or "fn" not in r:
            raise TaskError(f"{key}={r!r} must be {{fn: module:function, weight: 1.0, name: ..., kwargs: {{...}}}} "
                            "or a 'module:function' string.")
        unknown = sorted(set(r) - set(REWARD_KEYS))
        if unknown:
            raise TaskError(f"{key} has unknown key(s) {unknown}; allowed: {list(REWARD_KEYS)}.")
        weight, name, kwargs = r.get("weight", 1.0), r.get("name"), r.get("kwargs") or {}
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight):
            raise TaskError(f"{key}.weight={weight!r} must be a finite number (0 logs the reward without using it).")
        if name is not None and not (isinstance(name, str) and _NAME.fullmatch(name)):
            raise TaskError(f"{key}.name={name!r} must be letters, digits, '_', '-', '.', ' ' or '/'.")
        if not isinstance(kwargs, dict):
            raise TaskError(f"{key}.kwargs={kwargs!r} must be a mapping of argument name -> value.")
        out.append({"fn": r["fn"], "weight": float(weight), "name": name, "kwargs": kwargs, "key": key})
    return out


def load_rewards(reward, rewards, fields: set[str]) -> list[Reward]:
    """Import and bind every configured reward. `fields`: the keys of the task's rows (prompt, answer, columns)."""
    specs = parse_rewards(reward, rewards)
    if not specs:
        raise TaskError("no reward is set (task.reward and task.rewards are empty); give at least one, e.g. "
                        "task.rewards='[{fn: rlrun.tasks.rewards:exact_match, weight: 1.0}]'.")
    out: list[Reward] = []
    seen: dict[str, str] = {}  # reward name -> the key that named it
    for s in specs:
        fn = import_reward(s["fn"], s["key"] + (".fn" if s["key"] != "task.reward" else ""))
        name = s["name"] or getattr(fn, "__name__", None)
        if not (isinstance(name, str) and _NAME.fullmatch(name)):
            raise TaskError(f"{s['key']}: {s['fn']!r} has no usable name ({name!r}); set name: in the entry.")
        if name in seen:
            raise TaskError(f"{s['key']} and {seen[name]} are both named {name!r} (logged as rewards/{name}/mean); "
                            "give one a different name:.")
        seen[name] = s["key"]
        bad = sorted(set(s["kwargs"]) & {"completion", "prompt", "answer"})
        if bad:
            raise TaskError(f"{s['key']}.kwargs sets {bad}: those come from each row, not from kwargs.")
        r = Reward(fn, s["fn"], s["weight"], name, dict(s["kwargs"]), key=s["key"], fields=tuple(sorted(fields)))
        r.call = bind(r, fields, s["key"], historic=s["key"] == "task.reward")
        out.append(r)
    return out


def bind(r: Reward, fields: set[str], key: str, historic: bool = False):
    """(completion, row) -> r.fn(...), following the calling rule (rlrun.tasks docstring). Refuses, before
    training, a function that needs an argument nothing provides or kwargs it does not take. `historic`: the
    function comes from the `task.reward` key, whose functions were always called f(completion, answer)."""
    P = inspect.Parameter
    fn, kwargs = r.fn, r.kwargs
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # no signature (some builtins): the historic call
        return lambda c, row: fn(c, row["answer"])
    if not params or params[0].kind not in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD, P.VAR_POSITIONAL):
        raise TaskError(f"{key}: {r.spec} must take the completion as its first positional argument.")
    if params[0].kind is P.VAR_POSITIONAL:
        return lambda c, row: fn(c, row["answer"])
    first, rest = params[0].name, params[1:]
    available = (set(fields) | {"prompt", "answer"} | set(kwargs)) - {first}
    # The historic f(completion, answer) under any parameter name (task.reward only: under task.rewards a typo'd
    # or forgotten kwarg must not silently receive the answer); a positional-only one can only be the answer.
    second = rest[0] if rest else None
    legacy = second is not None and second.default is P.empty and (second.kind is P.POSITIONAL_ONLY or (
        historic and second.kind is P.POSITIONAL_OR_KEYWORD and second.name not in available))
    rest = rest[1:] if legacy else rest
    var_kw = any(p.kind is P.VAR_KEYWORD for p in rest)
    named = {p.name for p in rest if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY) and p.name in available}
    missing = [p.name for p in rest if p.kind is not P.VAR_KEYWORD and p.kind is not P.VAR_POSITIONAL
               and p.default is P.empty and p.name not in named]
    if missing:
        raise TaskError(f"{key}: {r.spec} needs argument(s) {missing}, which neither the rows (fields "
                        f"{sorted(available - set(kwargs))}) nor kwargs ({sorted(kwargs)}) provide; add the column "
                        "or set kwargs: {NAME: value} in the reward entry.")
    stray = [] if var_kw else sorted(set(kwargs) - named)
    if stray:
        raise TaskError(f"{key}.kwargs {stray} are not parameters of {r.spec}; it takes {[p.name for p in params]}.")

    def call(completion, row):
        values = {k: v for k, v in row.items() if k != first}
        values.update(kwargs)  # configured kwargs win over a column of the same name
        if not var_kw:
            values = {k: v for k, v in values.items() if k in named}
        return fn(completion, row["answer"], **values) if legacy else fn(completion, **values)

    return call


def _context(r: Reward, i: int, n: int, completion: str, row: dict) -> str:
    return (f"reward {r.name!r} ({r.spec}) on completion {i} of {n} (prompt {short(row.get('prompt'))}, answer "
            f"{short(row.get('answer'))}, completion {short(completion)})")


def _number(r: Reward, value, i: int, n: int, completion: str, row: dict) -> float:
    """`value` as a float, or a TaskError naming the reward, the row and the value. bool counts (True -> 1.0)."""
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:
        value = value.item()  # numpy scalars, numpy.bool_ included
    if isinstance(value, numbers.Real):
        try:
            out = float(value)
        except OverflowError:  # an int past float's range (10**400): said here, not a crash of the reward worker
            what = f"an int of {value.bit_length()} bits" if isinstance(value, int) else f"a {type(value).__name__}"
            raise TaskError(f"{_context(r, i, n, completion, row)} returned {what}, "
                            "too large for a float (at most about 1.8e308); a reward must be finite.") from None
        if math.isfinite(out):
            return out
        raise TaskError(f"{_context(r, i, n, completion, row)} returned {value!r}; a reward must be finite.")
    hint = ""
    if isinstance(value, (list, tuple)):
        hint = " rlrun calls a reward once per completion (not with a batch, as TRL does): return one number."
    elif hasattr(value, "item"):
        hint = " Return a Python float (e.g. tensor.item())."
    raise TaskError(f"{_context(r, i, n, completion, row)} returned {short(value)} ({type(value).__name__}); a "
                    f"reward must return a finite number (float, int or bool).{hint}")


_IMMUTABLE = (str, bytes, int, float, bool, complex, type(None))


def _own(row: dict) -> dict:
    """The row as a reward receives it: a new dict whose mutable values (lists, dicts, arrays) are copies, so a
    reward that changes them changes nothing that the next completion of the group, or the task, sees."""
    return {k: v if isinstance(v, _IMMUTABLE) else copy.deepcopy(v) for k, v in row.items()}


def _go_home(home: str) -> None:
    """Back to the run's working directory if a reward (or its import) changed it: checkpoints, exports and
    relative paths must not move."""
    try:
        here = os.getcwd()
    except OSError:  # the directory it moved to was removed
        here = None
    if here != home:
        os.chdir(home)


def call_one(r: Reward, i: int, n: int, completion: str, row: dict, home: str, isolated: bool = False) -> float:
    """Reward `r` of completion `i` of `n` as a float; any failure is a TaskError naming the reward and the row.
    `isolated` (in the worker process, where a signal never raises): KeyboardInterrupt is the reward's own too."""
    caught = BaseException if isolated else (Exception, SystemExit)
    if r.call is None:
        raise RuntimeError(f"{r.key}: {r.spec} is called before it is bound (scoring.bind)")
    try:
        value = r.call(completion, _own(row))
    except caught as e:
        exits = isinstance(e, (SystemExit, KeyboardInterrupt))
        what = type(e).__name__ + ((f"({e.args[0]!r})" if e.args else "") if exits else f": {e}")
        tail = "; a reward must return a number, not stop the process" if exits else ""
        raise TaskError(f"{_context(r, i, n, completion, row)} raised {what}{_where(e)}{tail}") from None
    finally:
        _go_home(home)
    return _number(r, value, i, n, completion, row)


def weigh(rewards: list[Reward], per: dict[str, list[float]], completions: list[str], rows: list[dict]):
    """The weighted totals; the first weighted term is the start of the sum, so a single reward of weight 1.0
    gives its values bit for bit. A total that is not finite (finite values times weights that overflow) is a
    TaskError naming the reward whose term is largest, and the row."""
    totals: list[float] | None = None
    for r in rewards:
        terms = [r.weight * v for v in per[r.name]]
        totals = terms if totals is None else [t + x for t, x in zip(totals, terms)]
    for i, total in enumerate(totals or []):
        if not math.isfinite(total):
            worst = max(rewards, key=lambda r: abs(r.weight * per[r.name][i]))
            v = per[worst.name][i]
            each = ", ".join(f"{r.name}={per[r.name][i]!r} x {r.weight!r}" for r in rewards)
            raise TaskError(f"{_context(worst, i, len(rows), completions[i], rows[i])} returned {v!r} with weight "
                            f"{worst.weight!r}: the weighted total is {total!r} ({each}); keep values times weights "
                            "well inside the float range: scale the reward or lower its weight.")
    return totals


def score(rewards: list[Reward], completions: list[str], rows: list[dict]):
    """(weighted totals, {name: values}), every reward called in this process (a run calls them in its reward
    worker: rlrun/tasks/worker.py)."""
    if len(completions) != len(rows):
        raise ValueError(f"score: {len(completions)} completions for {len(rows)} rows")
    n, home = len(rows), os.getcwd()
    per = {r.name: [call_one(r, i, n, c, row, home) for i, (c, row) in enumerate(zip(completions, rows))]
           for r in rewards}
    return weigh(rewards, per, completions, rows), per
