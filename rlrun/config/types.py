"""The value types of the schema: bounds (`Check`), required fields (`needs`), and the constrained scalars the
option dataclasses use."""

import re
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

UNIONS = (Union, types.UnionType)  # typing.Optional[X] / Union[X, Y], and X | Y of plain classes


@dataclass(frozen=True)
class Check:
    """A bound on one value: `test(value)` must hold; `text` completes "KEY=VALUE must be ..." (on an optional key
    the message adds "or null" itself)."""

    test: Callable[[Any], bool]
    text: str


@dataclass(frozen=True)
class Registered:
    """The values of a key are the options the registry lists for `group` (an axis keyed by a config key:
    train.precision, rollout.pipeline, rollout.decode), those registered from outside included (registry.register);
    the validator reads the registry when it checks the value, not the schema."""

    group: str


def needs(hint: str) -> dict[str, str]:
    """The metadata of a required field, `key: T = field(metadata=needs(hint))`, whose unset value (???, null or
    '') is reported as "<group>=<option> needs KEY=<hint>". The `field(...)` call is written at the field itself:
    a type checker knows it as a field with no default (behind a helper it would read as a default)."""
    return {"needs": hint}


PosInt = Annotated[int, Check(lambda v: v >= 1, "a positive integer")]
NonNegInt = Annotated[int, Check(lambda v: v >= 0, "an integer >= 0")]
NonNeg = Annotated[float, Check(lambda v: v >= 0, ">= 0")]
Positive = Annotated[float, Check(lambda v: v > 0, "> 0")]
Beta = Annotated[float, Check(lambda v: 0 <= v < 1, "in [0, 1)")]
PathStr = Annotated[str, Check(lambda v: v != "", "a non-empty path")]
Text = Annotated[str, Check(lambda v: v.strip() != "", "a non-empty string")]
Dtype = Literal["float32", "bfloat16", "float16"]  # the torch dtypes rlrun.models builds
ImportPath = Annotated[str, Check(lambda v: re.fullmatch(r"[^:\s]+:[\w.]+", v) is not None,
                                  "module:function or path/to/file.py:function")]
