"""The package's shape as the README promises it: short functions, layered modules, an acyclic import graph."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "rlrun"
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 400

# Layers, lowest first: a module may import modules of its own layer or lower, never higher ("no upward imports").
# The config package, errors and the registry must stay importable without torch (the CLI validates in a second).
LAYERS = [
    {"__init__", "errors", "config", "registry", "ranks", "signals", "render", "folders",
     "nofollow", "exportdir", "procs", "pairs", "algorithms"},  # __init__: the version
    {"losses", "heads", "logprobs", "offload", "batching", "activations", "meters", "models", "pretrained", "tasks",
     "checkpoint",
     "tracking", "rollout", "engine", "plan", "pipeline", "precision", "policy", "axes", "faults"},
    {"runner", "export", "evaluate", "warmstart"},
    {"recipes"},
    # bench: the `python -m rlrun.bench` name of tools/bench.py; check: `rlrun check`, it runs the recipes' steps
    {"cli", "sweep", "sweep_jobs", "tools", "bench", "__main__", "check", "cluster"},
]


def modules() -> dict[str, ast.Module]:
    return {str(p.relative_to(PKG)): ast.parse(p.read_text(), str(p)) for p in sorted(PKG.rglob("*.py"))}


def top(rel: str) -> str:
    """rlrun/<top>/... or rlrun/<top>.py -> <top>."""
    return rel.split("/")[0].removesuffix(".py")


def layer(name: str) -> int:
    found = [i for i, names in enumerate(LAYERS) if name in names]
    assert found, f"rlrun.{name} has no layer in LAYERS (or does not exist): place it there"
    return found[0]


def imports(rel: str, tree: ast.Module) -> set[str]:
    """The top-level rlrun modules that `rel` imports (anywhere in the file, lazy imports included)."""
    depth = rel.count("/")  # a relative import with depth + 1 dots starts at the package root
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[1] for a in node.names if a.name.startswith("rlrun."))
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and (node.module or "").split(".")[0] == "rlrun":
                module = node.module.split(".")[1:]
            elif node.level == depth + 1:
                module = node.module.split(".") if node.module else []
            else:
                continue  # inside its own subpackage, or not rlrun
            # `from . import x`: x is a module, or else a name defined in rlrun/__init__.py
            out.update(module[:1] or [a.name if (PKG / f"{a.name}.py").exists() or (PKG / a.name).is_dir()
                                      else "__init__" for a in node.names])
    return out - {top(rel)}


def test_no_function_is_longer_than_60_lines():
    long = [f"{rel}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)"
            for rel, tree in modules().items() for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, long


def test_no_module_is_longer_than_400_lines():
    long = [f"{p.relative_to(PKG)} ({n} lines)" for p in sorted(PKG.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES]
    assert not long, long


def test_every_module_has_a_layer_and_imports_only_its_layer_or_lower():
    upward = []
    for rel, tree in modules().items():
        own = layer(top(rel))
        for dep in imports(rel, tree):
            if layer(dep) > own:
                upward.append(f"{rel} imports {dep} (layer {layer(dep)} > {own})")
    assert not upward, upward


def assert_acyclic(graph: dict[str, set[str]], what: str) -> None:
    """Depth first over `graph`; an AssertionError naming the loop (`what: a -> b -> a`) where there is one."""
    done: set[str] = set()
    stack: list[str] = []

    def visit(node):
        if node in stack:
            raise AssertionError(f"{what}: " + " -> ".join(stack[stack.index(node):] + [node]))
        if node in done:
            return
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            visit(dep)
        stack.pop()
        done.add(node)

    for node in sorted(graph):
        visit(node)


def test_import_graph_is_acyclic():
    graph: dict[str, set[str]] = {}
    for rel, tree in modules().items():
        graph.setdefault(top(rel), set()).update(imports(rel, tree))
    assert_acyclic(graph, "import cycle")


def file_imports(rel: str, tree: ast.Module) -> set[str]:
    """The rlrun module files (paths under rlrun/) that `rel` imports, lazy imports included; a package's
    __init__.py is left out as a target (it hands its modules' names on: importing through it is no circle)."""
    parts = rel.removesuffix(".py").split("/")[:-1]  # the package `rel` is in
    out = set()

    def resolve(dotted: list[str]) -> list[str]:
        path = PKG.joinpath(*dotted)
        return [f"{'/'.join(dotted)}.py"] if path.with_suffix(".py").exists() else []

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("rlrun."):
                    out.update(resolve(a.name.split(".")[1:]))
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and (node.module or "").split(".")[0] == "rlrun":
                base = node.module.split(".")[1:]
            elif node.level:
                base = parts[: len(parts) - (node.level - 1)] + (node.module.split(".") if node.module else [])
            else:
                continue
            for a in node.names:  # `from x import y`: y a module of x, or a name in x
                out.update(resolve(base + [a.name]) or resolve(base))
    return out - {rel}


def test_module_files_import_each_other_in_no_circle():
    """No two files of rlrun import each other, directly or around a loop (farm-studio's circles: the bench's
    bench.py -> bench_gpu.py -> gpu_heads.py -> bench.py and rollout's decoding.py <-> hf.py were two)."""
    graph = {rel: file_imports(rel, tree) for rel, tree in modules().items()}
    assert_acyclic(graph, "a circle of files")
    # the resolver sees each form of import a circle could use
    tree = ast.parse("from . import hf\nfrom .decoding import of\ndef f():\n    from ..tools import bench\n"
                     "import rlrun.models\n")
    assert file_imports("rollout/x.py", tree) == {"rollout/hf.py", "rollout/decoding.py", "tools/bench.py", "models.py"}


def test_the_checks_see_imports():
    """The import parser finds relative, absolute and lazy imports (else the two tests above could not fail)."""
    tree = ast.parse("from . import models, tasks\nfrom .runner import Frame\ndef f():\n    from ..losses import kl\n"
                     "import rlrun.heads\n")
    assert imports("recipes/grpo.py", tree) == {"losses", "heads"}
    assert imports("runner.py", tree) >= {"models", "tasks", "heads"}


# -- the map: docs/development.md's Layout names every module, and nothing that is gone ----------------------------
DOCS = PKG.parent / "docs" / "development.md"


def layout_block() -> str:
    text = DOCS.read_text()
    after = text[text.index("## Layout"):]
    return after[after.index("```\n") + 4:after.index("\n```", after.index("```\n") + 4)]


def entries(block: str) -> set[str]:
    """The top-level names the block lists: on its 2-space lines, the words before the description."""
    out = set()
    for line in block.splitlines():
        if line.startswith("  ") and not line.startswith("   "):
            names = line[2:].split("  ")[0].split()
            out.update(n for n in names if n.endswith((".py", "/")))
    return out


def test_the_layout_page_lists_every_module_and_only_those_that_exist():
    block = layout_block()
    here = {p.name + ("/" if p.is_dir() else "") for p in PKG.iterdir()
            if (p.suffix == ".py" and p.stem not in ("__init__", "__main__")) or (p / "__init__.py").exists()}
    listed = entries(block)
    assert not here - listed, f"docs/development.md#layout does not list {sorted(here - listed)}: add a line"
    assert not listed - here, f"docs/development.md#layout lists {sorted(listed - here)}, which rlrun/ has not"
    tools = {p.name for p in (PKG / "tools").glob("*.py") if p.stem != "__init__"}
    tools_text = block[block.index("  tools/"):]  # the tools/ entry, to the end of the map
    named = set(re.findall(r"(?<![\w/])(\w+\.py)\b", tools_text))
    assert not tools - named, f"docs/development.md#layout's tools/ entry does not name {sorted(tools - named)}"
    assert not named - tools, f"docs/development.md#layout's tools/ entry names {sorted(named - tools)}, gone"


def test_the_layout_check_finds_a_missing_and_a_stale_entry():
    block = "  errors.py ranks.py   what they are\n                        a continuation: config/\n  gone/   was\n"
    assert entries(block) == {"errors.py", "ranks.py", "gone/"}
