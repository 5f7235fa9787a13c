"""The import structure, read from the source (AST; nothing is imported):

    ir  <-  costmodel  <-  planner core (errors, plan, strategy_label, tracing)  <-  planner.search
        <-  planner.{scenarios, reports, runtime, profiling}  <-  planner.api (and the package)  <-  planner.cli

A module may import its own group and the groups below it, never above; of the four siblings only
profiling -> runtime is allowed (the framework profile times the runtime's own code paths). Outside `models/`, only
`models.registry` is imported (tests, bench and scripts are free to use the zoo directly). No import cycles between
modules, lazy (function-level) imports included; imports under `if TYPE_CHECKING:` are not dependencies. Tests do
not import `bench/` or `scripts/`: code both need lives in `tests/` helpers.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("ir", "costmodel", "planner", "models")

LAYERS: dict[str, int] = {
    "ir": 0,
    "costmodel": 1,
    "planner.core": 2,
    "planner.search": 3,
    "planner.scenarios": 4,
    "planner.reports": 4,
    "planner.runtime": 4,
    "planner.profiling": 4,
    "planner.api": 5,
    "planner.cli": 6,
}
CORE = frozenset({"planner.errors", "planner.plan", "planner.strategy_label", "planner.tracing"})
SIBLING_EDGES = frozenset({("planner.profiling", "planner.runtime")})
KNOWN_CYCLES: frozenset[frozenset[str]] = frozenset()


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def package_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    hidden: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            hidden.update(id(sub) for sub in ast.walk(node))
    return hidden


def imported_names(path: Path, me: str) -> Iterator[str]:
    """Every dotted name `path` imports (relative imports resolved), TYPE_CHECKING blocks left out."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    hidden = _type_checking_nodes(tree)
    for node in ast.walk(tree):
        if id(node) in hidden:
            continue
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = me if path.name == "__init__.py" else me.rpartition(".")[0]
                for _ in range(node.level - 1):
                    pkg = pkg.rpartition(".")[0]
                base = f"{pkg}.{base}" if base else pkg
            yield from (f"{base}.{a.name}" for a in node.names)


def resolve(name: str) -> str | None:
    """The package module a dotted name lies in (`planner.plan.Plan` -> `planner.plan`), None outside them."""
    modules = package_modules()
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


@cache
def import_graph() -> nx.DiGraph:
    graph = nx.DiGraph()
    for me, path in package_modules().items():
        graph.add_node(me)
        for name in imported_names(path, me):
            target = resolve(name)
            if target is not None and target != me:
                graph.add_edge(me, target)
    return graph


def group(module: str) -> str:
    parts = module.split(".")
    if parts[0] != "planner":
        return parts[0]
    if module in CORE:
        return "planner.core"
    if len(parts) > 1 and f"planner.{parts[1]}" in LAYERS:
        return f"planner.{parts[1]}"
    return "planner.api"  # planner.api and the package itself


def test_every_planner_module_has_a_layer():
    planner_groups = {group(m) for m in package_modules() if m.startswith("planner")}
    assert planner_groups <= set(LAYERS), planner_groups - set(LAYERS)


def test_imports_only_go_down_the_layers():
    wrong = []
    for a, b in import_graph().edges:
        ga, gb = group(a), group(b)
        if "models" in (ga, gb) or ga == gb or (ga, gb) in SIBLING_EDGES:
            continue
        if LAYERS[gb] >= LAYERS[ga]:
            wrong.append(f"{a} -> {b} ({ga} may not import {gb})")
    assert not wrong, "\n".join(sorted(wrong))


def test_models_are_reached_only_through_the_registry():
    wrong = []
    for a, b in import_graph().edges:
        if a.startswith("models") and not b.startswith("models"):
            wrong.append(f"{a} -> {b} (the zoo depends on nothing of the planner)")
        elif b.startswith("models") and not a.startswith("models") and b != "models.registry":
            wrong.append(f"{a} -> {b} (go through models.registry)")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_import_cycles():
    cycles = [sorted(c) for c in nx.strongly_connected_components(import_graph())
              if len(c) > 1 and frozenset(c) not in KNOWN_CYCLES]
    assert not cycles, cycles


def _mentions_bench_or_scripts(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Constant) and isinstance(n.value, str)
               and (n.value in ("bench", "scripts") or n.value.startswith(("bench/", "scripts/")))
               for n in ast.walk(node))


def test_tests_do_not_import_bench_or_scripts():
    loaders = {"spec_from_file_location", "insert", "append", "run_path", "import_module", "SourceFileLoader"}
    wrong = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n.split(".")[0] in ("bench", "scripts") for n in names):
                wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}")
            if isinstance(node, ast.Call) and _mentions_bench_or_scripts(node):
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                if name in loaders:
                    wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not wrong, wrong


def test_the_checks_see_the_imports():
    graph = import_graph()
    assert graph.has_edge("planner.search.branch_and_bound", "costmodel.estimate")
    assert graph.has_edge("planner.profiling.requests", "models.registry")  # a lazy, function-level import
    assert not graph.has_edge("planner.search.explanations", "planner.search.branch_and_bound")  # TYPE_CHECKING
