"""The pure cores import no I/O framework: they stay testable without a cluster."""

from __future__ import annotations

import ast

import pytest

from tests.manifests import ROOT

PURE = ["api", "render", "status", "tune", "reports", "validation"]
IO_PACKAGES = {"kopf", "kubernetes", "aiohttp", "zmq"}


def imported_top_levels(path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("module", PURE)
def test_pure_module_imports_no_io_framework(module):
    assert imported_top_levels(ROOT / "operator" / f"{module}.py") & IO_PACKAGES == set()
