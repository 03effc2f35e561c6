"""Every registered option of a group with a Protocol satisfies it, checked structurally: each member the
Protocol names exists, methods and functions take the Protocol's parameters (names, order, defaults), and a member
annotated with another Protocol (`Engine: type[Engine]`, `build(...) -> Sampler`) is checked against that one."""

from __future__ import annotations

import ast
import inspect
import textwrap
import types
import typing

import pytest

from rlrun import registry

P = inspect.Parameter
POSITIONAL = (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)


def is_protocol(tp) -> bool:
    return isinstance(tp, type) and getattr(tp, "_is_protocol", False)


def members(proto) -> dict[str, object]:
    """The protocol's own members: name -> the function (methods, properties) or its annotation (data)."""
    out = {}
    for cls in reversed([c for c in proto.__mro__ if is_protocol(c) and c is not typing.Protocol]):
        hints = typing.get_type_hints(cls, vars(inspect.getmodule(cls)))
        out.update({k: hints[k] for k in cls.__dict__.get("__annotations__", {})})
        out.update({k: v for k, v in cls.__dict__.items() if isinstance(v, property)
                    or inspect.isfunction(v) and v.__module__ == cls.__module__})  # not typing's own hooks
    return out


def signature_problems(impl, want, where: str, drop_self: bool) -> list[str]:
    """Why `impl` cannot be called every way the protocol method `want` can ([] when it can)."""
    wanted = list(inspect.signature(want).parameters.values())[1:]  # the protocol's self
    have = list(inspect.signature(impl).parameters.values())[1 if drop_self else 0:]
    by_name, positional = {p.name: p for p in have}, [p for p in have if p.kind in POSITIONAL]
    var_kw = any(p.kind is P.VAR_KEYWORD for p in have)
    out = []
    for i, w in enumerate(wanted):
        h = by_name.get(w.name)
        if w.kind in POSITIONAL and (i >= len(positional) or positional[i].name != w.name):
            out.append(f"{where}: parameter {i} must be {w.name!r}")
        elif h is None and not var_kw:
            out.append(f"{where}: has no parameter {w.name!r}")
        elif h is not None and w.default is not P.empty and h.default is P.empty:
            out.append(f"{where}: {w.name!r} needs a default (callers may leave it out)")
    names = {w.name for w in wanted}
    out += [f"{where}: extra required parameter {p.name!r}" for p in have
            if p.name not in names and p.default is P.empty and p.kind not in (P.VAR_POSITIONAL, P.VAR_KEYWORD)]
    return out


def assigned_in(cls) -> set[str]:
    """Attributes a class (or a base it inherits from) sets on self (`self.x = ...`, also in tuple targets)
    anywhere in its methods."""
    out = set()
    for c in (c for c in cls.__mro__ if c is not object):
        tree = ast.parse(textwrap.dedent(inspect.getsource(c)))
        out |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
                and isinstance(n.value, ast.Name) and n.value.id == "self"}
    return out


def problems(obj, proto, where: str) -> list[str]:
    """Why `obj` (a module, a class or an instance) does not satisfy `proto` ([] when it does)."""
    out, is_class = [], isinstance(obj, type)
    for name, want in members(proto).items():
        at = f"{where}.{name}"
        if isinstance(want, property):
            if not hasattr(obj, name):
                out.append(f"{at} is missing")
        elif inspect.isfunction(want):
            have = obj if name == "__call__" and inspect.isfunction(obj) else getattr(obj, name, None)
            if not callable(have):
                out.append(f"{at} is missing or not callable")
                continue
            static = is_class and isinstance(inspect.getattr_static(obj, name), (staticmethod, classmethod))
            out += signature_problems(have, want, at, drop_self=is_class and not static)
            ret = typing.get_type_hints(want).get("return")
            if is_protocol(ret):
                got = typing.get_type_hints(have).get("return")
                if got is typing.NoReturn:  # an option that never builds one (rollout=replay: no sampler)
                    continue
                out += problems(got, ret, f"{at}()") if got is not None else [f"{at} does not say what it returns"]
        elif typing.get_origin(want) is type and is_protocol(typing.get_args(want)[0]):
            have = getattr(obj, name, None)
            out += problems(have, typing.get_args(want)[0], at) if isinstance(have, type) else [f"{at} is no class"]
        elif not (hasattr(obj, name) or is_class and name in assigned_in(obj)):
            out.append(f"{at} is missing")
    return out


class NoSync:  # a sampler without `sync`
    needs_sync = False

    def generate(self, model, prompts, seeds):
        return None


OPTIONS = [(g, n) for g in registry.PROTOCOLS for n in registry.REGISTRY[g]]


def test_the_groups_with_a_contract_have_a_protocol():
    assert {"head", "engine", "rollout", "task", "tracking"} <= set(registry.PROTOCOLS)
    assert all(is_protocol(registry.protocol(g)) for g in registry.PROTOCOLS)


@pytest.mark.parametrize("group,name", OPTIONS, ids=[f"{g}={n}" for g, n in OPTIONS])
def test_every_registered_option_satisfies_its_protocol(group, name):
    try:
        impl = registry.get(group, name)
    except ImportError as e:  # an optional extra (deepspeed) that is not installed
        pytest.skip(f"{group}={name} needs {e.name}")
    assert problems(impl, registry.protocol(group), f"{group}={name}") == []


def test_a_loaded_task_is_a_task(cfg_factory):
    from rlrun import tasks
    from rlrun.tasks.protocol import Task

    task = tasks.load(cfg_factory("task.size=5", "task.eval_size=0").task, 0, None)
    assert isinstance(task, Task) and problems(task, Task, "task") == []


def test_a_broken_implementation_is_caught():
    from rlrun.engine.protocol import EngineModule
    from rlrun.heads import dense
    from rlrun.heads.protocol import Head
    from rlrun.rollout.protocol import RolloutModule
    from rlrun.tasks.protocol import TaskReader

    # mask and objective swapped
    def loss(hidden, weight, targets, objective, mask, num_tokens, temperature, size, top_p=1.0, top_k=0):
        return None

    facts = {k: getattr(dense, k) for k in ("EXACTNESS", "PHASES", "TILED", "SWEEPS_SEQUENCE_LEVEL", "memory",
                                            "freed_before_weight_grad")}
    head = types.SimpleNamespace(logprobs=dense.logprobs, loss=loss, **facts)
    assert problems(head, Head, "head") == ["head.loss: parameter 3 must be 'mask'",
                                            "head.loss: parameter 4 must be 'objective'"]
    assert problems(types.SimpleNamespace(loss=dense.loss, **facts), Head, "h") == [
        "h.logprobs is missing or not callable"]
    no_facts = problems(types.SimpleNamespace(logprobs=dense.logprobs, loss=dense.loss), Head, "h")
    assert "h.EXACTNESS is missing" in no_facts and "h.memory is missing or not callable" in no_facts

    # with_entropy without a default: callers omit it
    def logprobs(hidden, weight, targets, temperature, size, with_entropy, top_p=1.0, top_k=0):
        return None

    assert problems(types.SimpleNamespace(logprobs=logprobs, loss=dense.loss, **facts), Head, "h") == [
        "h.logprobs: 'with_entropy' needs a default (callers may leave it out)"]

    class Engine:  # no step, a gather with another parameter, no rank
        world, main = 1, True

        def __init__(self, cfg, policy, reference, grad_accum):
            self.device = self.model = self.reference = None

        def gather(self, obj, group) -> list:
            return [obj]

    found = problems(types.SimpleNamespace(Engine=Engine), EngineModule, "engine")
    assert "engine.Engine.rank is missing" in found and "engine.Engine.step is missing or not callable" in found
    assert "engine.Engine.gather: extra required parameter 'group'" in found

    def build(cfg, model, tokenizer, device) -> NoSync:
        return NoSync()

    found = problems(types.SimpleNamespace(build=build, reserved=lambda cfg, device_gib: {}), RolloutModule, "r")
    assert found == ["r.build().sync is missing or not callable"]

    def read(cfg, seed, pairs):
        return [], None

    assert problems(read, TaskReader, "t") == ["t.__call__: parameter 2 must be 'fmt'",
                                               "t.__call__: parameter 3 must be 'pairs'"]


LOSSES = list(registry.REGISTRY["loss"])


@pytest.mark.parametrize("name", LOSSES)
def test_every_loss_satisfies_its_algorithms_loss_protocol(name):
    # the loss group holds two kinds of loss: the algorithm that trains with it names its contract
    from rlrun import algorithms
    from rlrun.losses.protocol import SequenceTokenLoss

    loss = registry.get("loss", name)
    proto = SequenceTokenLoss if getattr(loss, "sequence_level", False) else registry.load(
        algorithms.of(name).loss_protocol)
    assert is_protocol(proto) and problems(loss, proto, f"loss={name}") == []


def test_a_loss_with_the_wrong_arguments_is_caught():
    from rlrun.losses.protocol import PairLoss, TokenLoss

    def swapped(old_logprobs, logprobs, advantages, *, clip_low, clip_high, **_):
        return None

    assert problems(swapped, TokenLoss, "l") == ["l.__call__: parameter 0 must be 'logprobs'",
                                                 "l.__call__: parameter 1 must be 'old_logprobs'"]

    def no_defaults(policy_chosen, policy_rejected, ref_chosen, ref_rejected, *, beta, label_smoothing=0.0,
                    chosen_nll=None, sft_coef=0.0, num_pairs=None):
        return None

    assert problems(no_defaults, PairLoss, "d") == ["d.__call__: 'beta' needs a default (callers may leave it out)"]
