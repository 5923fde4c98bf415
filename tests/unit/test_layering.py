"""Import layering, read from the source (no imports executed).

- ``kvferry_wire`` (the contract) imports none of our packages; the operator and the
  sidecar import it and never each other; the dev harness may import all three and
  none of them imports it (it is not shipped).
- No import cycle, between packages or between the modules of one package.
- The pure cores import no I/O framework: they stay testable without a cluster, a
  socket or an event loop.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.manifests import ROOT

# Import name -> folder.
PACKAGES = {
    "kvferry_wire": ROOT / "wire",
    "kvferry_operator": ROOT / "operator",
    "kvferry_sidecar": ROOT / "sidecar",
    "kvferry_dev": ROOT / "kvferry_dev",
}
# Which of our packages each may import (itself aside).
ALLOWED = {
    "kvferry_wire": set(),
    "kvferry_operator": {"kvferry_wire"},
    "kvferry_sidecar": {"kvferry_wire"},
    "kvferry_dev": {"kvferry_wire", "kvferry_operator", "kvferry_sidecar"},
}
IO_PACKAGES = {"kopf", "kubernetes", "aiohttp", "zmq"}
PURE = {
    "kvferry_wire": ["protocol", "report", "extras"],
    "kvferry_operator": [
        "api",
        "engine_config",
        "render",
        "status",
        "tune",
        "aggregate",
        "reports",
        "backoff",
        "pressure",
        "validation",
        "prerequisites",
        "drift",
    ],
    "kvferry_sidecar": [
        "types",
        "plan",
        "session",
        "align",
        "handles",
        "rewrite",
        "config",
        "residency",
        "kvevents",
        "blockindex",
        "promtext",
        "enginemetrics",
        "transport",
    ],
}


def modules(package: str) -> dict[str, Path]:
    folder = PACKAGES[package]
    return {p.stem: p for p in sorted(folder.glob("*.py")) if p.stem != "__init__"}


def imports(path: Path, package: str) -> set[str]:
    """Absolute names imported anywhere in the file (functions too), relative ones
    resolved against ``package``."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module:
                base = node.module
            elif node.level == 1:
                base = f"{package}.{node.module}" if node.module else package
            else:
                continue
            names.add(base)
            if base == package:  # from . import x, y
                names |= {f"{package}.{a.name}" for a in node.names}
    return names


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for package in PACKAGES:
        deps = graph.setdefault(package, set())
        for path in PACKAGES[package].glob("*.py"):
            deps |= {n.split(".")[0] for n in imports(path, package)} & set(PACKAGES)
        deps.discard(package)
    return graph


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_package_imports_only_what_its_layer_allows(package):
    """The operator and the sidecar share the wire contract, never each other's code;
    nothing shipped imports the dev harness."""
    assert package_graph()[package] - ALLOWED[package] == set()


def test_no_cycle_between_packages():
    assert find_cycle(package_graph()) is None


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_cycle_between_modules_of_a_package(package):
    mods = modules(package)
    graph = {
        name: {
            n.split(".")[1]
            for n in imports(path, package)
            if n.startswith(package + ".") and n.split(".")[1] in mods
        }
        - {name}
        for name, path in mods.items()
    }
    assert find_cycle(graph) is None


@pytest.mark.parametrize(
    ("package", "module"), [(p, m) for p, mods in sorted(PURE.items()) for m in mods]
)
def test_pure_module_imports_no_io_framework(package, module):
    path = PACKAGES[package] / f"{module}.py"
    assert {n.split(".")[0] for n in imports(path, package)} & IO_PACKAGES == set()


def test_cycle_finder_finds_a_cycle():
    """The checks above can fail: a two-module loop is reported."""
    assert find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_wire_layer_check_sees_a_forbidden_import(tmp_path, monkeypatch):
    """A wire module importing the sidecar is caught (guards the checker itself)."""
    bad = tmp_path / "wire"
    bad.mkdir()
    (bad / "leak.py").write_text("from kvferry_sidecar import plan\n")
    monkeypatch.setitem(PACKAGES, "kvferry_wire", bad)
    assert package_graph()["kvferry_wire"] == {"kvferry_sidecar"}
