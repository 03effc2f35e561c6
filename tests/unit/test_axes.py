"""The axes as objects (rlrun/axes.py): no module but config/ and tools/ compares an option's name; every option says
its exactness, the phases it changes and its memory term once, on itself; and a new option is its module plus its
YAML: a toy head and a toy layout registered from this test module only are validated, planned, grouped by the
sweep's equivalence check and computed like their baselines, with no other file changed."""

from __future__ import annotations

import ast
from collections import Counter

import pytest
import torch
from conftest import CONF, ROOT, make_cfg
from hydra import compose, initialize_config_dir

from rlrun import axes, registry
from rlrun.config import choices, validate
from rlrun.meters import PHASES

# Every module asks an option's object what is true of it (an algorithm's facts: rlrun/algorithms.py), except the
# two places whose work is names: config/ (validation: its rules read the user's choices) and tools/ (benchmarks
# that choose their options by name)
CHECKED = [p for p in sorted((ROOT / "rlrun").rglob("*.py")) if p.relative_to(ROOT / "rlrun").parts[0]
           not in ("config", "tools")]
# Comparisons that only look like option names: how many times each stands in its file, and why it is not one; a
# count that no longer matches fails (a new comparison of the same text must be judged too)
PLAN_KIND = "the plan's arithmetic (fp32 | autocast | bf16 tensors), from the precision path"
NOT_OPTIONS = {
    "rlrun/cluster/__init__.py: 'mlflow' in parts": (1, "a cluster's services (the MLflow server), not tracking="),
    "rlrun/engine/deepspeed.py: e.offload_optimizer != 'none'": (2, "DeepSpeed's offload device, not tracking=none"),
    "rlrun/engine/deepspeed.py: e.offload_param != 'none'": (2, "DeepSpeed's offload device, not tracking=none"),
    "rlrun/losses/bound.py: tis.level == 'sequence'": (1, "loss.tis.level's meaning, said once (old_before_loss)"),
    "rlrun/losses/bound.py: tis.level == 'token'": (1, "loss.tis.level's meaning, said once (Objective)"),
    "rlrun/plan/phases.py: kind == 'fp32'": (2, PLAN_KIND),
    "rlrun/plan/terms.py: kind == 'fp32'": (1, PLAN_KIND),
    "rlrun/plan/terms.py: kind == 'bf16'": (1, PLAN_KIND),
    "rlrun/tracking/spill.py: op == 'dataset'": (1, "a spilled MLflow call (log_input), not task=dataset"),
}


def option_names() -> set[str]:
    """Every value that names an option: the registry's names and the values of the axes keyed by a config key."""
    names = {n for group in registry.REGISTRY.values() for n in group}
    return names | {v for k in registry.KEYED_BY.values() if "." in k for v in choices(k)} | {"sequence", "token"}


def name_comparisons(source: str, where: str) -> list[str]:
    """Each comparison in `source` (==, !=, in, not in) with a string that names an option."""
    names, found = option_names(), []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        texts = [c.value for c in sides if isinstance(c, ast.Constant)]
        texts += [e.value for c in sides if isinstance(c, (ast.Tuple, ast.List, ast.Set)) for e in c.elts
                  if isinstance(e, ast.Constant)]
        if any(isinstance(t, str) and t in names for t in texts):
            found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_but_config_and_tools_compares_an_option_name():
    found = [hit for path in CHECKED for hit in name_comparisons(path.read_text(), str(path.relative_to(ROOT)))]
    said = Counter(f"{hit.split(':')[0]}: {hit.split(': ', 1)[1]}" for hit in found)
    left = [hit for hit in found if f"{hit.split(':')[0]}: {hit.split(': ', 1)[1]}" not in NOT_OPTIONS]
    assert left == [], "branch on the option's object (rlrun/axes.py), not its name:\n" + "\n".join(left)
    assert {k: said[k] for k in NOT_OPTIONS} == {k: n for k, (n, _) in NOT_OPTIONS.items()}, "judge NOT_OPTIONS again"


def test_the_check_finds_a_comparison_of_each_kind():
    code = ('if cfg.batching.name == "padded": pass\nif tis.level != "sequence": pass\n'
            'if cfg.rollout.pipeline in ("async",): pass\nif key == "loss": pass\n')
    assert [line.split(": ", 1)[1] for line in name_comparisons(code, "x")] == [
        "cfg.batching.name == 'padded'", "tis.level != 'sequence'", "cfg.rollout.pipeline in ('async',)"]


AXIS_OPTIONS = [(g, n) for g in registry.AXES for n in registry.REGISTRY[g]]


@pytest.mark.parametrize("group,name", AXIS_OPTIONS, ids=[f"{g}={n}" for g, n in AXIS_OPTIONS])
def test_every_option_says_its_exactness_and_the_phases_it_changes(group, name):
    obj = registry.get(group, name)
    exactness = getattr(obj, "exactness", None) or getattr(obj, "EXACTNESS", None)
    phases = getattr(obj, "phases", None) or getattr(obj, "PHASES", None)
    assert exactness in axes.EXACTNESS
    assert (exactness == "baseline") == (name == registry.baseline(group))  # one baseline: the first listed
    assert phases and set(phases) <= set(PHASES) | {"step"}, phases


def test_resolve_gives_every_axis_its_object(cfg_factory):
    cfg = validate(cfg_factory("head=tiled", "head.size=32", "batching=shared_prompt", "activations=checkpoint",
                               "logprob_policy=window", "train.precision=bf16", "loss=gspo"))
    a = axes.resolve(cfg, temperature=0.7)
    assert a.head.impl is registry.get("head", "tiled") and (a.head.size, a.head.temperature) == (32, 0.7)
    assert a.layout.shares_prompt and a.layout.exchanges and a.layout.max_tokens == cfg.batching.max_tokens
    assert a.activations.checkpointed_layers(8) == 8 and a.logprobs.caches_reference
    assert a.precision.path == "bf16-autocast" and a.pipeline.generates_here
    assert a.objective.sequence_level and not a.objective.old_before_loss


# -- a new option in one place ------------------------------------------------------------------------------------

@pytest.fixture
def toys(tmp_path):
    """head=toy and batching=toy_layout (tests/toys.py) registered, their YAMLs in a config folder of this test on
    Hydra's search path; unregistered after (unless the session registered them: RLRUN_TOY_OPTIONS=1)."""
    import toys as toy_options

    groups = ("head", "batching")
    toy_options.write_yaml(tmp_path, groups)
    mine = [g for g in groups if toy_options.TOYS[g][0] not in registry.REGISTRY[g]]
    toy_options.register(mine)
    yield tmp_path
    toy_options.unregister(mine)


def compose_with(folder, *overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose("config", overrides=[f"hydra.searchpath=[file://{folder}]", "tracking=none", *overrides])


def test_a_toy_head_and_layout_are_validated_planned_and_grouped_with_their_baselines(toys):
    from rlrun import plan
    from rlrun.tools import equivalence

    cfg = validate(compose_with(toys, "experiment=smoke", "head=toy", "batching=toy_layout"))
    assert (cfg.head.name, cfg.batching.name) == ("toy", "toy_layout")
    with pytest.raises(Exception, match=r"head.name='toyy' is not supported; supported: \[.*'toy'"):
        validate(compose_with(toys, "experiment=smoke", "head.name=toyy"))
    planned = plan.predict(cfg, *plan.inputs(cfg))
    assert any(k.startswith("toy ") for k in planned.phases["train"].parts)  # its own memory term
    assert any(k.startswith("attention mask") for k in planned.phases["train"].parts)  # packed's layout term
    a = axes.resolve(cfg)
    assert a.head.name == "toy_head" and a.layout.exchanges
    params = [{"head.name": h, "batching.name": b, "seed": "0"} for h, b in
              (("dense", "padded"), ("toy", "padded"), ("dense", "toy_layout"))]
    assert equivalence.baselines(params, ["base", "toy", "toy_layout"]) == ({1: 0, 2: 0}, [])


def test_rlrun_plan_suggests_a_registered_head_it_was_never_told_of(toys, tmp_path, monkeypatch):
    """`rlrun plan`'s switches come from the registry: the toy head is tried where a run does not fit, and the
    combination may take it (it trains the same: fp_tolerance); activations=offload, which says `combined = False`,
    is listed but never combined."""
    import shutil

    from rlrun.plan import text

    shipped = tmp_path / "conf"  # the shipped YAMLs with the toy's, as docs/adding-an-option.md adds it to conf/
    shutil.copytree(CONF, shipped)
    shutil.copy(toys / "head" / "toy.yaml", shipped / "head")
    monkeypatch.setattr(text, "CONF", shipped)
    cfg = validate(compose_with(toys, "experiment=smoke"))
    labels = {label for _, label, _, _ in text.candidates(cfg, 1)}
    assert {"head=toy", "head=chunked", "activations=checkpoint", "activations=offload"} <= labels
    assert not {"head=dense", "activations=keep"} & labels  # this run's options, and baselines, which save nothing
    assert text.combined("head=toy") and text.combined("activations=checkpoint")
    assert text.trains_same("activations=offload") and not text.combined("activations=offload")
    assert not text.trains_same("train.precision=bf16") and not text.combined("model.lora.enabled=true")


def test_a_toy_head_and_layout_compute_their_baselines_numbers(toys):
    """The equivalence checks of tests/unit/heads/test_heads.py and tests/unit/batching/test_batching.py, run on the
    toys."""
    import test_batching
    import test_heads

    hidden, weight, targets, mask, adv, noise = test_heads.inputs(masked_tile=True)
    from rlrun.losses import objective

    def make():
        return objective("dapo", adv, None, clip_low=0.2, clip_high=0.28)

    base = test_heads.run_head("dense", hidden, weight, targets, mask, make, 0.9, 8)
    toy = test_heads.run_head("toy", hidden, weight, targets, mask, make, 0.9, 8)
    for got, want, what in zip(toy, base, ("loss", "grad hidden", "grad weight")):
        test_heads.assert_close(got, want, what)
    model, tok = test_batching.tiny_model()
    micros = test_batching.micros_of(tok)
    padded = test_batching.step(model, micros, "dense", "padded")
    laid = test_batching.step(model, micros, "toy", "toy_layout")
    assert laid[0] == pytest.approx(padded[0], rel=1e-5)
    assert all(torch.allclose(laid[2][n], g, rtol=1e-4, atol=1e-6) for n, g in padded[2].items())


KEYED_TOYS = ("precision", "pipeline", "decode")


def test_registering_over_a_shipped_option_keeps_it_shipped_and_unregister_leaves_it():
    original = registry.REGISTRY["precision"]["bf16"]
    try:
        registry.register("precision", "bf16", "toy_options:ToyPrecision")
        assert registry.shipped("precision") == ["fp32", "bf16"]
        registry.unregister("precision", "bf16")
        assert registry.REGISTRY["precision"]["bf16"] == "toy_options:ToyPrecision"
    finally:
        registry.REGISTRY["precision"]["bf16"] = original


@pytest.fixture
def keyed_toys():
    """train.precision=toy_precision, rollout.pipeline=toy_pipeline, rollout.decode=toy_decode (tests/toys.py)
    registered: an axis keyed by a config key takes an object and no YAML."""
    import toys as toy_options

    mine = [g for g in KEYED_TOYS if toy_options.TOYS[g][0] not in registry.REGISTRY[g]]
    toy_options.register(mine)
    yield [f"{registry.KEYED_BY[g]}={toy_options.TOYS[g][0]}" for g in KEYED_TOYS]
    toy_options.unregister(mine)


def test_an_option_of_a_keyed_axis_added_from_outside_validates_once_registered(keyed_toys, monkeypatch):
    import toys as toy_options

    cfg = validate(make_cfg("experiment=smoke", *keyed_toys))
    assert [registry.option_of(cfg, g) for g in KEYED_TOYS] == ["toy_precision", "toy_pipeline", "toy_decode"]
    a = axes.resolve(cfg)
    assert type(a.precision).__name__ == "ToyPrecision" and a.pipeline.__name__ == "ToyPipeline"
    assert choices("train.precision")[-1] == "toy_precision"
    import importlib.util  # the rules that ask the precision's facts (its dtype): vLLM's copy must compute in it

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a))
    with pytest.raises(Exception, match=r"rollout.dtype=bfloat16 while .* train.precision=toy_precision.* Set "
                                        r"rollout.dtype=float32"):
        validate(make_cfg("experiment=smoke", "rollout=vllm", "rollout.dtype=bfloat16", *keyed_toys[:2]))
    toy_options.unregister(KEYED_TOYS)
    try:  # the same config, the options not registered: one problem each, naming what is supported
        with pytest.raises(Exception) as e:
            validate(make_cfg("experiment=smoke", *keyed_toys))
        assert sorted(p.split(" is not supported")[0] for p in e.value.problems) == [
            "rollout.decode='toy_decode'", "rollout.pipeline='toy_pipeline'", "train.precision='toy_precision'"]
        assert "supported: ['fp32', 'bf16']" in str(e.value)
    finally:
        toy_options.register(KEYED_TOYS)


def test_the_keyed_toys_train_their_baselines_numbers(keyed_toys, tmp_path):
    """Each keyed toy says `bitwise`: a run with all three logs the baseline run's losses and rewards exactly."""
    from helpers import history
    from test_runs import run_in

    got = {}
    for what, overrides in (("base", []), ("toys", keyed_toys)):
        _, client, r = run_in(tmp_path / what, "experiment=smoke", "eval.every=0", "export.enabled=false", *overrides)
        assert r.data.params["train.precision"] == ("toy_precision" if overrides else "fp32")
        got[what] = [history(client, r.info.run_id, k) for k in ("loss", "reward_mean", "grad_norm")]
    assert got["toys"] == got["base"] and len(got["base"][0]) > 1


def test_one_reader_gives_each_axis_option_from_a_config_or_a_dictconfig():
    """registry.option_of: what rlrun check, the run's header and the sweep's verdict read each axis from."""
    raw = compose_with(CONF, "head=tiled", "train.precision=bf16", "rollout.pipeline=async")
    cfg = validate(raw)
    for c in (raw, cfg):
        chosen = {g: registry.option_of(c, g) for g in registry.AXES}
        assert chosen["head"] == "tiled" and chosen["precision"] == "bf16" and chosen["pipeline"] == "async"
        assert (chosen["logprob_policy"], chosen["batching"], chosen["activations"]) == ("window", "padded", "keep")
    assert registry.key_of("precision") == "train.precision" and registry.key_of("head") == "head.name"
    assert registry.option_of(object(), "head") is None


def test_each_algorithm_says_what_is_true_of_it_once():
    """The `recipe` group's objects: what the description, the views, the planner and the layouts ask of a loss."""
    from rlrun import algorithms

    for loss in registry.REGISTRY["recipe"]:
        a = algorithms.of(loss)
        cfg = validate(compose_with(CONF, "experiment=smoke", f"loss={loss}"))
        assert algorithms.of(cfg) is a and a.samples != a.pairs  # GRPO samples groups; DPO reads pairs
        assert a.prompt_rows(cfg) == (2 if a.pairs else cfg.train.group_size)
        assert callable(a.train) and a.loop.startswith("rlrun.recipes.")
    assert algorithms.title("cispo") == "GRPO-family RL (cispo loss)" and algorithms.title("dpo") == "DPO"
    assert (algorithms.of("dapo").curve, algorithms.of("dpo").curve) == ("reward_mean", "rewards/accuracy")


def test_the_planner_precision_and_the_check_ask_the_engine_not_its_name():
    """What is true of an engine (its ZeRO stage, bf16 path, master copy, ...) is said on its module
    (rlrun/engine/protocol.py EngineModule): the planner, rlrun.precision and the check compare no engine's name."""
    engines = {repr(name) for name in registry.REGISTRY["engine"]}
    files = [*sorted((ROOT / "rlrun" / "plan").glob("*.py")), *sorted((ROOT / "rlrun" / "check").glob("*.py")),
             ROOT / "rlrun" / "precision.py"]
    found = [hit for path in files for hit in name_comparisons(path.read_text(), str(path.relative_to(ROOT)))
             if any(e in hit for e in engines)]
    assert found == [], "ask registry.get('engine', cfg.engine.name) what is true of it:\n" + "\n".join(found)
    assert name_comparisons('if cfg.engine.name == "single": pass', "x")  # the check sees such a comparison


def test_the_planner_the_check_and_the_rollouts_ask_the_algorithm_not_the_loss_name():
    """What is true of an algorithm (it samples, trains on pairs, always reads the reference, has probes of its own)
    is said on rlrun/algorithms.py's objects: the planner, the check and the rollout package compare no loss name."""
    losses = {repr(name) for name in registry.REGISTRY["recipe"]}
    rlrun = ROOT / "rlrun"
    files = [p for folder in ("plan", "check", "rollout") for p in sorted((rlrun / folder).glob("*.py"))]
    found = [hit for path in files for hit in name_comparisons(path.read_text(), str(path.relative_to(ROOT)))
             if any(x in hit for x in losses)]
    assert found == [], "ask rlrun.algorithms.of(cfg) what is true of it:\n" + "\n".join(found)
    assert name_comparisons('if cfg.loss.name == "dpo": pass', "x")  # the check sees such a comparison
