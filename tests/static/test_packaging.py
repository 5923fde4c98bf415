"""What each role imports is what its install brings.

Read from the source (no imports executed) and from pyproject.toml: every third-party
module a runtime package imports must come from a distribution that the package's
install declares (the base dependencies plus the role's extra: ``kvferry[operator]``
for the operator, ``kvferry[sidecar]`` for the sidecar, the base alone for the wire
contract). The test tiers install every extra, so a missing declaration would pass
every other test and fail only in the image (issue 10: ``celpy`` lived in ``[test]``).
The artifact tier (tests/artifacts) proves the same with real installs.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import sys
import tomllib

import pytest

from kvferry_wire import extras
from tests.manifests import ROOT

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
FOLDERS = PYPROJECT["tool"]["setuptools"]["package-dir"]
# The extra each runtime package is installed with (None: the base alone).
ROLE_EXTRA = {"kvferry_wire": None, "kvferry_operator": "operator", "kvferry_sidecar": "sidecar"}
OURS = set(FOLDERS)


def dist_name(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", re.split(r"[\s<>=!~\[;@]", requirement, maxsplit=1)[0]).lower()


def declared(extra: str | None) -> set[str]:
    names = {dist_name(r) for r in PROJECT["dependencies"]}
    if extra:
        names |= {dist_name(r) for r in PROJECT["optional-dependencies"].get(extra, [])}
    return names


def third_party_imports(package: str) -> dict[str, set[str]]:
    """Top-level module -> files of ``package`` that import it (absolute imports only)."""
    found: dict[str, set[str]] = {}
    folder = ROOT / FOLDERS[package]
    for path in folder.rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top in OURS or top == "__future__":
                    continue
                found.setdefault(top, set()).add(path.name)
    return found


def providers(module: str) -> set[str]:
    """Distributions that provide ``module`` (the test venv has every extra installed)."""
    return {re.sub(r"[-_.]+", "-", d).lower() for d in md.packages_distributions().get(module, [])}


@pytest.mark.parametrize("package", sorted(ROLE_EXTRA))
def test_every_import_of_a_package_comes_with_its_install(package: str):
    extra = ROLE_EXTRA[package]
    allowed = declared(extra)
    missing = {
        module: sorted(files)
        for module, files in third_party_imports(package).items()
        if not providers(module) & allowed
    }
    install = f"kvferry[{extra}]" if extra else "kvferry"
    assert not missing, f"{package} imports modules that `pip install {install}` lacks: {missing}"


def test_the_sidecar_extra_brings_no_kubernetes_client_and_the_operator_no_zeromq():
    assert not {"kopf", "kubernetes"} & declared("sidecar")
    assert not {"pyzmq", "cbor2"} & declared("operator")


def test_no_runtime_install_declares_a_test_tool():
    tools = {dist_name(r) for r in PROJECT["optional-dependencies"]["test"]}
    for extra in (None, "operator", "sidecar"):
        assert not declared(extra) & tools, extra


@pytest.mark.parametrize("extra", ["operator", "sidecar"])
def test_programs_read_their_extra_from_the_installed_metadata(extra: str):
    # The editable install of this tree: its metadata is pyproject.toml's.
    assert {dist_name(r) for r in extras.requirements(extra)} == {
        dist_name(r) for r in PROJECT["optional-dependencies"][extra]
    }
    assert extras.missing(extra) == []


def test_a_missing_extra_is_named_with_the_command_that_installs_it():
    assert extras.message("operator", ["kopf", "cel-python"]) == (
        "this command needs the 'operator' extra of kvferry (kopf, cel-python not installed): "
        "pip install 'kvferry[operator]'"
    )
    assert extras.requirements("operator", dist="no-such-distribution") == []


def _dockerfile_args(role: str) -> tuple[dict[str, str], list[str]]:
    """A role's Dockerfile: its ARG defaults and its FROM lines."""
    text = (ROOT / "images" / role / "Dockerfile").read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.M))
    return args, re.findall(r"^FROM (.+)$", text, re.M)


def test_the_sidecar_image_is_built_on_the_operators_slim_python_not_on_vllm():
    # The sidecar imports nothing of vLLM (the import test above): an image FROM vLLM's
    # was ~10 GB for an aiohttp proxy, pulled a second time whenever its tag and the
    # engine's differ.
    for role in ("operator", "sidecar"):
        args, froms = _dockerfile_args(role)
        assert froms == ["${BASE}"], (role, froms)
        assert args["BASE"] == "python:3.11-slim", (role, args)
        assert not any("vllm" in v.lower() for v in args.values()), (role, args)
    assert declared("sidecar").isdisjoint({"vllm", "torch"})
