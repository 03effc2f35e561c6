"""`rlrun plan`: the plan as text, the saved-activation term under each `activations` option, and, for a run that
does not fit the device planned for, the switches that would make it fit, each with its predicted peak."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

from .. import axes, precision, registry
from ..config import OPTIONS, rules
from . import phases as pr
from . import shapes as sh
from . import terms
from .terms import MIB

CONF = Path(__file__).resolve().parent.parent.parent / "conf"  # the options as shipped (their YAML defaults)
GIB = 2**30
HEADROOM = 0.9  # a switch "fits" within 90% of the device: the CUDA context and the allocator's slack need the rest


def table(plan: pr.Plan, device: pr.Plan | None = None, device_gib: float | None = None) -> str:
    """The plan as text: per phase the predicted growth, the peak, and the largest part of the growth; with
    `device` (the same run planned for CUDA) and `device_gib`, whether it fits a device of that size."""
    s = plan.shapes
    lines = [f"model: {s.params / 1e6:.2f}M parameters ({s.trainable / 1e6:.2f}M trainable), vocab {s.vocab}, "
             f"hidden {s.hidden}, {s.layers} layers; planned for {plan.world} rank(s), per rank",
             f"micro-batch: {plan.tokens} response tokens, {plan.seq_len} positions per row"
             + (f"; head tile {plan.head_size} tokens" if plan.head_size else "")]
    head = ["phase", "growth MiB", "peak MiB", "largest part of the growth"]
    rows = [[name, f"{ph.growth / MIB:.0f}", f"{ph.peak / MIB:.0f}", ph.dominant()] for name, ph in
            plan.phases.items()]
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(4)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [head] + rows]
    lines.append("peak = resident (weights, reference copy, optimizer state) + growth")
    if device is not None and device_gib:
        lines.append(fits_line(device, device_gib))
    return "\n".join(lines)


def fits_line(device: pr.Plan, device_gib: float, whence: str = "") -> str:
    """Whether the run's CUDA plan fits a device of `device_gib` GiB."""
    name, peak = highest(device)
    cap = device_gib * GIB
    verdict = "fits" if peak <= cap else f"does not fit: over by {(peak - cap) / GIB:.2f} GiB"
    return (f"on a CUDA device of {device_gib:g} GiB{whence}: predicted peak {peak / GIB:.2f} GiB ({name}), "
            f"{verdict}; add the CUDA context and allocator slack, a few hundred MiB.")


def highest(plan: pr.Plan) -> tuple[str, int]:
    name, ph = max(plan.phases.items(), key=lambda kv: kv[1].peak)
    return name, ph.peak


def detail(plan: pr.Plan) -> str:
    """Every part of every phase, in MiB (the plan artifact and `rlrun plan`)."""
    lines = []
    for name, ph in plan.phases.items():
        lines.append(f"{name}: growth {ph.growth / MIB:.1f} MiB on resident {sum(ph.resident.values()) / MIB:.1f}")
        lines += [f"    {v / MIB:10.1f}  {k}" for k, v in sorted(ph.parts.items(), key=lambda kv: -kv[1])]
        lines += [f"   ({v / MIB:9.1f}) {k}: freed before the peak, not counted" for k, v in ph.apart.items()]
        lines += [f"    {v / MIB:10.1f}  {k} (resident)" for k, v in ph.resident.items()]
    return "\n".join(lines)


# -- the activations term per option ------------------------------------------------------------------------------
def activation_lines(plan: pr.Plan) -> list[str]:
    """The train pass's saved-activation term under every activations option (checkpoint: every layer), on the
    device `plan` is for, with what each costs (the option's `cost`)."""
    s, out = plan.shapes, []
    every_layer = SimpleNamespace(every=1)
    options = {name: registry.get("activations", name)(every_layer) for name in registry.REGISTRY["activations"]}
    base = next(o for o in options.values() if o.exactness == "baseline")
    whole = sum(terms.saved_activations(base, s, plan.layer_tokens, plan.kind, plan.device_type).values())
    for name, o in options.items():
        kept = sum(terms.saved_activations(o, s, plan.layer_tokens, plan.kind, plan.device_type).values())
        cost = o.cost.format(n=s.layers, layers=s.layers, mib=whole / MIB)
        out.append(f"  activations={name:<10} {kept / MIB:12,.0f} MiB  {cost}")
    return out


# -- switches that would make a run fit ---------------------------------------------------------------------------
def yaml_of(group: str, name: str) -> Path | None:
    """The YAML of `group=name`: in conf/, or (an option registered from outside, registry.register) in a folder of
    the run's Hydra search path; None where neither has it."""
    from hydra.core.hydra_config import HydraConfig

    folders = [CONF]
    if HydraConfig.initialized():
        folders += [Path(s.path) for s in HydraConfig.get().runtime.config_sources if s.schema == "file"]
    return next((f / group / f"{name}.yaml" for f in folders if (f / group / f"{name}.yaml").exists()), None)


def option(group: str, name: str, **changes):
    """The option `group=name` as shipped (its YAML), with `changes`."""
    from omegaconf import OmegaConf

    path = yaml_of(group, name)
    if path is None:
        raise FileNotFoundError(f"{group}={name}: no {group}/{name}.yaml in conf/ or on hydra.searchpath")
    shipped = cast("dict[str, Any]", OmegaConf.to_container(OmegaConf.load(path)))  # a mapping
    data = {**shipped, **changes}
    return {**OPTIONS[group], **registry.CONFIGS.get(group, {})}[name](**data)  # registered later too


def nested(obj, key: str, value):
    """dataclasses.replace at a dotted key: nested(cfg, "model.lora.enabled", True)."""
    first, _, rest = key.partition(".")
    return dataclasses.replace(obj, **{first: nested(getattr(obj, first), rest, value) if rest else value})


def candidates(cfg, world: int) -> list[tuple[str, str, object, int]]:
    """(family, label, config, ranks) of each switch that changes this run: one family per line of the list."""
    out = []
    for axis in SWITCHED:  # every registered option but this run's and the axis's baseline (which saves nothing)
        for name in registry.REGISTRY[axis]:
            if (name != getattr(cfg, axis).name and axes.exactness(axis, name) != "baseline"
                    and yaml_of(axis, name) is not None):  # a plugin's option without its YAML here: not offered
                out.append((axis, f"{axis}={name}", nested(cfg, axis, option(axis, name)), world))
    if not cfg.model.lora.enabled and importlib.util.find_spec("peft") is not None:  # planned with peft's adapters
        out.append(("lora", "model.lora.enabled=true", nested(cfg, "model.lora.enabled", True), world))
    if not precision.reduced(cfg) and cfg.model.dtype == "float32":
        for name in (n for n in registry.REGISTRY["precision"] if registry.get("precision", n).reduced):
            out.append(("precision", f"train.precision={name}", nested(cfg, "train.precision", name), world))
    out += sharded(cfg, world)
    packs = registry.get("batching", cfg.batching.name).packs
    for div in (2, 4):  # fewer positions per forward: a smaller micro-batch, or a smaller token budget
        mb, budget = cfg.train.micro_batch // div, cfg.batching.max_tokens // div
        if mb >= 1 and not packs:
            out.append(("micro", f"train.micro_batch={mb}", nested(cfg, "train.micro_batch", mb), world))
        elif packs:
            out.append(("micro", f"batching.max_tokens={budget}", nested(cfg, "batching.max_tokens", budget), world))
    return [c for c in out if not refused(c)]


def refused(candidate) -> str | None:
    """The first rule a switch's config breaks (DeepSpeed or peft missing here does not count): None if none."""
    _, _, variant, ranks = candidate
    return next((m for m in rules.check(variant, set(), ranks) if "is not installed" not in m), None)


def not_applicable(cfg, world: int) -> list[str]:
    """The ZeRO switches the batch sizes rule out here, with the rule (so a missing line is explained)."""
    return [f"  not listed: {c[1]}: {refused(c)}" for c in sharded(cfg, world, every=True) if refused(c)]


def sharded(cfg, world: int, every: bool = False) -> list[tuple[str, str, object, int]]:
    """The switches to an engine that shards the run's state over ranks (each ZeRO stage it names, 8 and 16
    ranks), but the run's own; `every`: the run's own too."""
    own = registry.get("engine", cfg.engine.name).zero_stage(cfg.engine), world
    return [("zero", f"WORLD_SIZE={ranks} engine={name} engine.zero_stage={stage}",
             nested(cfg, "engine", option("engine", name, zero_stage=stage)), ranks)
            for name in registry.REGISTRY["engine"] for stage in registry.get("engine", name).ZERO_STAGES
            for ranks in (8, 16) if every or name != cfg.engine.name or (stage, ranks) != own]


@dataclasses.dataclass
class Base:
    """What the original config's plan was made of: its shapes and micro-batch sizes, and what they depend on."""

    shapes: sh.Shapes
    rows: int
    seq_len: int
    tokens: int
    micro_batch: int
    lora: bool
    dtype: str


def planned(cfg, world: int, gib: float, base: Base) -> pr.Plan:
    """The CUDA plan of a variant of the base config on `world` ranks: shapes from a meta model again only when
    LoRA or the weights' dtype changed; rows and tokens scaled with the micro-batch."""
    shapes = base.shapes
    if cfg.model.lora.enabled != base.lora or sh.weight_dtype(cfg) != base.dtype:
        shapes = sh.shapes_of(sh.meta_model(cfg.model, cfg.seed)[0], sh.weight_dtype(cfg))
    rows, tokens = (n * cfg.train.micro_batch // base.micro_batch for n in (base.rows, base.tokens))
    size = pr.resolve_size(cfg, shapes, tokens, "cuda", world, device_bytes=int(gib * GIB))
    return pr.predict(cfg, shapes, rows, base.seq_len, tokens, world=world, device_type="cuda", head_size=size,
                      device_gib=gib)


SWITCHED = ("activations", "head")  # the axes whose registered options rlrun plan tries
# besides those options, what `combine` may add: data parallel ranks and smaller forwards, which train the same
RESHAPES = ("WORLD_SIZE=", "train.micro_batch=", "batching.max_tokens=")


def trains_same(label: str) -> bool:
    """Whether a switch keeps what trains (LoRA and bf16 change it): a registered option by its exactness."""
    axis, _, name = label.partition("=")
    if axis in SWITCHED:
        return axes.trains_same(axis, name)
    return label.startswith(RESHAPES)


def combined(label: str) -> bool:
    """What `combine` may add: switches that train the same and cost compute or devices; an option that says
    `combined = False` (activations=offload: a copy of every activation over PCIe per micro-batch) is listed alone."""
    axis, _, name = label.partition("=")
    return trains_same(label) and (axis not in SWITCHED or getattr(registry.get(axis, name), "combined", True))


def combine(cfg, base: Base, world: int, gib: float):
    """Switches that keep the result (`combined`), added one family at a time, the one that lowers the peak most
    first, until the run fits (or none lowers it): (labels, config, ranks, peak)."""
    chosen, current, ranks, used = [], cfg, world, set()
    peak = highest(planned(current, ranks, gib, base))[1]
    while peak > HEADROOM * gib * GIB:
        options = [(highest(planned(v, r, gib, base))[1], family, label, v, r)
                   for family, label, v, r in candidates(current, ranks)
                   if family not in used and combined(label)]
        best = min(options, key=lambda o: o[0], default=None)
        if best is None or best[0] >= peak:
            break
        peak, family, label, current, ranks = best
        chosen.append(label)
        used.add(family)
    return chosen, current, ranks, peak


def fit_lines(cfg, base: Base, world: int, gib: float) -> list[str]:
    """Each switch alone with its predicted peak, then a combination that fits, with its parts."""
    cap = HEADROOM * gib * GIB
    lines = [f"switches that change the peak (predicted peak per rank, its phase; fits: within {HEADROOM:.0%} of "
             f"{gib:g} GiB, the rest for the CUDA context and allocator slack):"]
    for _, label, variant, ranks in candidates(cfg, world):
        name, peak = highest(planned(variant, ranks, gib, base))
        note = "" if trains_same(label) else "  (changes what trains)"
        lines.append(f"  {label:<52} {peak / GIB:8.2f} GiB ({name}){'  fits' if peak <= cap else ''}{note}")
    lines += not_applicable(cfg, world)
    chosen, current, ranks, peak = combine(cfg, base, world, gib)
    if peak > cap:
        return lines + [f"no combination of these switches fits (best: {' '.join(chosen) or '-'}, "
                        f"{peak / GIB:.2f} GiB)"]
    plan = planned(current, ranks, gib, base)
    lines.append(f"together (switches that train the same, the largest cut first): {' '.join(chosen)}: predicted "
                 f"peak {peak / GIB:.2f} GiB per rank, fits; its parts (MiB, CUDA, per rank):")
    return lines + ["  " + x for x in detail(plan).splitlines()]


def head_lines(cfg, base: Base, cpu: pr.Plan, world: int) -> list[str]:
    """The other heads in the registry that would cut this run's largest phase by a quarter or more (its growth, on
    this machine's plan): where the head's own term (a dense head's logits) is what the run's memory is made of."""
    name, _ = highest(cpu)
    now = cpu.phases[name].growth
    found = []
    for head in registry.REGISTRY["head"]:
        if head == cfg.head.name or yaml_of("head", head) is None:
            continue
        candidate = ("head", f"head={head}", nested(cfg, "head", option("head", head)), world)
        if refused(candidate):
            continue
        variant = candidate[2]
        size = pr.resolve_size(variant, base.shapes, base.tokens, "cpu", world)
        after = pr.predict(variant, base.shapes, base.rows, base.seq_len, base.tokens, world=world,
                           head_size=size).phases[name].growth
        if after <= 0.75 * now:
            exact = axes.exactness("head", head)
            found.append(f"  head={head:<10} {name} growth {after / MIB:,.0f} MiB ({exact}: "
                         f"{'trains the same' if exact in axes.SAME else 'changes the numbers'})")
    if not found:
        return []
    return [f"\nanother head would cut {name}, the largest phase ({now / MIB:,.0f} MiB; its largest part: "
            f"{cpu.phases[name].dominant()}):", *found]


def report(cfg) -> str:
    """`rlrun plan`: the plan of a validated config without building its weights (a meta-device model), as on
    this machine's CPU, plus whether it fits a CUDA device of plan.device_gib (and if not, what would make it);
    the activations term under each option; then every part."""
    s, n_rows, seq_len, tokens = sh.inputs(cfg)
    world, gib = pr.world_size(cfg), cfg.plan.device_gib
    # head.size=auto with no budget: a tenth of the device planned for (plan.device_gib), as a run on it would take
    size = pr.resolve_size(cfg, s, tokens, "cpu", world, device_bytes=int(gib * GIB) if gib else None)
    cpu = pr.predict(cfg, s, n_rows, seq_len, tokens, world=world, head_size=size)
    cuda = pr.predict(cfg, s, n_rows, seq_len, tokens, world=world, device_type="cuda", head_size=size,
                      device_gib=gib) if gib else None
    note = ""
    if cfg.head.size == "auto":
        within = (f"head.memory_budget_mib={cfg.head.memory_budget_mib}" if cfg.head.memory_budget_mib else
                  f"a tenth of plan.device_gib={gib:g} GiB; a run chooses from its own device's free memory" if gib
                  else "a tenth of this machine's free memory; a run chooses from its own device's free memory")
        note = f"head.size=auto: {size} tokens per tile, within {within}\n"
    base = Base(s, n_rows, seq_len, tokens, cfg.train.micro_batch, cfg.model.lora.enabled, sh.weight_dtype(cfg))
    text = ["on this machine (CPU):", note + table(cpu), *head_lines(cfg, base, cpu, world)]
    device = cuda or cpu
    if cuda is not None:  # the CUDA verdict apart from this machine's plan: another device, other terms
        text.append("\n" + fits_line(cuda, gib, " (plan.device_gib)"))
    text.append(f"\nactivations saved for backward by the train pass, per option ({device.device_type}, "
                f"{device.layer_tokens} positions per forward):\n" + "\n".join(activation_lines(device)))
    if cuda is not None and highest(cuda)[1] > gib * GIB:
        text.append("\n" + "\n".join(fit_lines(cfg, base, world, gib)))
    return "\n".join(text) + "\n\nparts (MiB, CPU):\n" + detail(cpu)
