"""Import layering: the contracts in pyproject.toml (``[tool.importlinter]``), checked
by import-linter from the source (no project code is imported).

- ``kvferry_wire`` (the contract) imports neither role; the operator and the sidecar
  import it and never each other; the dev harness may import all three and nothing
  shipped imports it, the benchmarks or the tests; the harness, ``bench/`` and the
  ``hack/`` scripts import no tests.
- No import cycle, between packages (the forbidden edges leave none possible) or
  between the modules of one package.
- The pure cores import no I/O framework, not even through another module: they stay
  testable without a cluster, a socket or an event loop.

Each contract is also shown to break: the import it forbids is added to the real graph
and the contract must report it.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import grimp
import pytest
from importlinter import configuration
from importlinter.application import use_cases
from importlinter.contracts.acyclic_siblings import AcyclicSiblingsContract
from importlinter.contracts.forbidden import ForbiddenContract
from importlinter.domain.contract import Contract

from tests.manifests import ROOT

PYPROJECT = ROOT / "pyproject.toml"
CONTRACT_TYPES: dict[str, type[Contract]] = {
    "forbidden": ForbiddenContract,
    "acyclic_siblings": AcyclicSiblingsContract,
}
# One import each contract forbids (several edges: a cycle), added to the real graph.
Edge = tuple[str, str]
VIOLATIONS: list[tuple[str, list[Edge]]] = [
    ("wire-alone", [("kvferry_wire.report", "kvferry_sidecar.plan")]),
    ("wire-alone", [("kvferry_wire.protocol", "kvferry_operator.api")]),
    ("sidecar-not-operator", [("kvferry_sidecar.relay", "kvferry_operator.render")]),
    ("operator-not-sidecar", [("kvferry_operator.render", "kvferry_sidecar.config")]),
    ("shipped-alone", [("kvferry_operator.handlers", "kvferry_dev.procs")]),
    ("shipped-alone", [("kvferry_sidecar.app", "tests.kube")]),
    ("shipped-alone", [("kvferry_wire.report", "bench.common")]),
    ("tools-not-tests", [("bench.turns", "tests.manifests")]),
    ("tools-not-tests", [("hack.sidecar_load", "tests.kube")]),
    ("tools-not-tests", [("kvferry_dev.demo", "tests.kube")]),
    ("harness-not-bench", [("kvferry_dev.demo", "bench.workload")]),
    ("pure-cores", [("kvferry_sidecar.plan", "aiohttp")]),
    # Through another module: status -> kube -> kubernetes.
    ("pure-cores", [("kvferry_operator.status", "kvferry_operator.kube")]),
    (
        "no-module-cycles",
        [
            ("kvferry_sidecar.plan", "kvferry_sidecar.align"),
            ("kvferry_sidecar.align", "kvferry_sidecar.plan"),
        ],
    ),
    ("no-module-cycles", [("kvferry_wire.protocol", "kvferry_wire.report")]),
]


@pytest.fixture(scope="module")
def options() -> Any:
    configuration.configure()
    return use_cases.read_user_options(str(PYPROJECT))


@pytest.fixture(scope="module")
def graph(options: Any) -> grimp.ImportGraph:
    """The graph lint-imports builds: the repository root is the working directory and
    on sys.path (``hack`` is found there as a namespace package)."""
    assert str(ROOT) in sys.path or str(Path.cwd()) == str(ROOT)
    session = options.session_options
    return grimp.build_graph(
        *session["root_packages"],
        include_external_packages=session.get("include_external_packages", False),
        cache_dir=None,
    )


def contract(options: Any, contract_id: str) -> Contract:
    found = [c for c in options.contracts_options if c["id"] == contract_id]
    assert len(found) == 1, f"no contract {contract_id!r} in pyproject.toml"
    opts = found[0]
    return CONTRACT_TYPES[opts["type"]](
        name=opts["name"], session_options=options.session_options, contract_options=opts
    )


def test_the_import_contracts_hold():
    """What CI runs and a developer can run alone: ``lint-imports``."""
    proc = subprocess.run(
        [
            str(Path(sys.executable).parent / "lint-imports"),
            "--no-cache",
            "--config",
            str(PYPROJECT),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout, proc.stdout


def test_every_contract_has_a_violation_below(options):
    """A new contract comes with an import that breaks it."""
    assert {c["id"] for c in options.contracts_options} == {cid for cid, _ in VIOLATIONS}


@pytest.mark.parametrize(
    ("contract_id", "edges"), VIOLATIONS, ids=[f"{c}:{e[0][0]}" for c, e in VIOLATIONS]
)
def test_each_contract_breaks_on_the_import_it_forbids(options, graph, contract_id, edges):
    checked = contract(options, contract_id)
    assert checked.check(copy.deepcopy(graph), verbose=False).kept
    broken = copy.deepcopy(graph)
    for importer, imported in edges:
        broken.add_import(importer=importer, imported=imported)
    assert not checked.check(broken, verbose=False).kept


def operator_cycle_breakers(graph: grimp.ImportGraph) -> set[tuple[str, str]]:
    """grimp keeps no root module for a namespace portion (operator/ has no
    __init__.py, so that it can never shadow the stdlib ``operator``): add it, then ask
    which imports would have to go for the operator's modules to form no cycle."""
    graph.add_module("kvferry_operator")
    return graph.nominate_cycle_breakers("kvferry_operator")


def test_no_cycle_between_the_operators_modules(graph):
    assert operator_cycle_breakers(copy.deepcopy(graph)) == set()


def test_the_operator_cycle_check_sees_a_cycle(graph):
    broken = copy.deepcopy(graph)
    broken.add_import(importer="kvferry_operator.api", imported="kvferry_operator.status")
    assert operator_cycle_breakers(broken) != set()
