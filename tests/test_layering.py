"""The package's structure stays as the docs draw it: no import cycle, configs as leaves, one description per knob."""

from __future__ import annotations

import ast
import typing
from pathlib import Path

import pytest

from titan_strategy.config import TitanConfig, knob_fields, knob_names
from titan_strategy.knob_reference import field_docstrings, knob_reference
from titan_strategy.knobs import KNOB

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("titan_strategy", "llama_module")
# What a config module may import of ours: pure rules and types, no runtime.
CONFIG_MAY_IMPORT = {"titan_strategy", "titan_strategy.knobs", "titan_strategy.plan", "titan_strategy.gpu",
                     "titan_strategy.pipeline", "titan_strategy.pipeline.layout"}


def _modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


MODULES = _modules()


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    skipped = set()
    for node in ast.walk(tree):
        test = getattr(node, "test", None) if isinstance(node, ast.If) else None
        if isinstance(test, ast.Name | ast.Attribute) and getattr(test, "id", getattr(test, "attr", "")) == \
                "TYPE_CHECKING":
            skipped |= {id(inner) for statement in node.body for inner in ast.walk(statement)}
    return skipped


def _imported_names(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: from the module's package up
        package = module.split(".") if MODULES[module].name == "__init__.py" else module.split(".")[:-1]
        base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
    return [base, *(f"{base}.{alias.name}" for alias in node.names)]


def _and_packages(name: str) -> list[str]:
    """``a.b.c`` and the packages importing it runs first (``a``, ``a.b``), those that are ours."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in MODULES]


def imports_of(module: str) -> set[str]:
    """Our modules that importing ``module`` runs, function-level imports included and ``TYPE_CHECKING`` blocks
    excluded. Importing ``a.b.c`` also runs ``a/b/__init__.py``, so a package's ``__init__`` counts, except for its
    own submodules (Python runs it before them, whatever they import)."""
    tree = ast.parse(MODULES[module].read_text())
    skipped, own_packages = _type_checking_nodes(tree), set(_and_packages(module))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom) and id(node) not in skipped:
            for name in _imported_names(module, node):
                found |= {dep for dep in _and_packages(name) if dep not in own_packages or dep == name}
    return found - {module}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while (member := stack.pop()) != node:
                component.append(member)
            if component:
                components.append(sorted([node, *component]))

    for node in graph:
        if node not in index:
            visit(node)
    return components


def test_no_module_imports_itself_through_others() -> None:
    graph = {module: imports_of(module) for module in MODULES}
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_configs_import_no_runtime_code() -> None:
    seen, todo = set(), [m for m in MODULES if m.startswith("titan_strategy.config")]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += imports_of(module)
    assert {m for m in seen if not m.startswith("titan_strategy.config")} <= CONFIG_MAY_IMPORT


def test_every_knob_is_described_once_in_its_field_and_the_reference_is_current() -> None:
    for feature in typing.get_type_hints(TitanConfig).values():
        docs = field_docstrings(feature)
        undescribed = [f.metadata[KNOB] for f in knob_fields(feature) if f.name not in docs]
        assert undescribed == [], f"{feature.__name__}: give these knobs a docstring under their field"
    reference = (ROOT / "docs" / "knobs.md").read_text()
    assert reference == knob_reference(), "stale: python -m titan_strategy.knob_reference > docs/knobs.md"
    assert all(f"| `{name}` |" in reference for name in knob_names())
