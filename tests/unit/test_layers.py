"""The package's layers: every import points down, and no module imports itself back.

``shardckpt/`` is one package per layer (docs/architecture.md). A module may import
modules of its own layer and of the layers below it, never one above, not even inside
a function: what two layers share lives in the lower one. Among all modules, the
imports form no circle. Both rules are read from the source (every ``import`` statement,
wherever it stands), so a lazy import cannot hide an upward edge.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "shardckpt"

# Lowest first. The package itself (its version) sits below them all and imports nothing;
# the console entry point (``__main__``) sits above them all.
LAYERS = ("core", "state", "codecs", "formats", "plan", "engine", "api", "cli")
TOP = len(LAYERS)
ROOT = -1


def module_name(path: Path) -> str:
    """Return the dotted name of the module in ``path``."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules() -> dict[str, Path]:
    """Return every module of the package by dotted name."""
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Return the package's modules that module ``name`` imports anywhere in its source."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[: len(name.split(".")) - node.level + is_package]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            # `from pkg import mod` imports the module pkg.mod; `from mod import name`, mod.
            targets = [
                f"{module}.{a.name}" if f"{module}.{a.name}" in known else module
                for a in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def layer(name: str) -> int:
    """Return the rank of the layer module ``name`` belongs to (0 is the lowest)."""
    parts = name.split(".")
    if len(parts) == 1:
        return ROOT
    if parts[1] in LAYERS:
        return LAYERS.index(parts[1])
    return TOP


def _layer_name(name: str) -> str:
    rank = layer(name)
    return "package root" if rank == ROOT else "entry point" if rank == TOP else LAYERS[rank]


def graph() -> dict[str, set[str]]:
    """Return the package's import graph: module -> the package's modules it imports."""
    known = modules()
    return {name: imported(name, path, known) for name, path in known.items()}


def test_every_module_lives_in_a_layer():
    loose = [n for n in modules() if layer(n) in (ROOT, TOP)]
    assert sorted(loose) == ["shardckpt", "shardckpt.__main__"]


def test_no_module_imports_a_layer_above_its_own():
    upward = [
        f"{name} ({_layer_name(name)}) imports {dep} ({_layer_name(dep)})"
        for name, deps in graph().items()
        for dep in sorted(deps)
        if layer(dep) > layer(name)
    ]
    assert upward == []


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Return the circles of ``edges``: its strongly connected parts of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            part = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                part.append(top)
                if top == node:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_no_import_circle():
    assert cycles(graph()) == []


@pytest.mark.parametrize(
    "edges, expected",
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, [["a", "b", "c"]]),
        ({"a": {"b"}, "b": {"a"}, "c": {"a"}}, [["a", "b"]]),
    ],
)
def test_the_circle_finder_finds_circles(edges, expected):
    assert cycles(edges) == expected


def test_the_import_reader_sees_imports_inside_functions(tmp_path):
    source = tmp_path / "shardckpt" / "core" / "x.py"
    source.parent.mkdir(parents=True)
    source.write_text("def f():\n    from shardckpt.cli import app\n    from ..api import y\n")
    known = {"shardckpt.cli.app": source, "shardckpt.api.y": source, "shardckpt.core.x": source}
    assert imported("shardckpt.core.x", source, known) == {"shardckpt.cli.app", "shardckpt.api.y"}
