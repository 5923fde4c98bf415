"""The docs say only what is true of the code: every file, make target, chart value,
environment variable, port, metric name and spec field a doc mentions exists, and every
CRD field has a description (`kubectl explain` shows it).

What a doc "mentions" is read from its code: inline `code` spans, fenced blocks and
link targets. Prose is not parsed; a claim that needs more than a name to check has a
test of its own elsewhere (test_doc_claims.py reads the chart docs' ports, the README's
list of defaults the operator fills in, the examples and where things come from; the
cluster tier runs the documented CRD upgrade and the README's walk-through).
"""

from __future__ import annotations

import functools
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvferry_operator import api
from kvferry_wire import protocol
from tests.manifests import ROOT

DOCS = sorted(
    {
        ROOT / "README.md",
        *(ROOT / "docs").glob("*.md"),
        ROOT / "charts" / "kvferry" / "README.md",
        ROOT / "images" / "README.md",
        ROOT / "e2e" / "README.md",
        ROOT / "deploy" / "README.md",
        ROOT / "operator" / "README.md",
        ROOT / "sidecar" / "README.md",
        ROOT / "tests" / "engine" / "README.md",
    }
)
ARCHITECTURE = ROOT / "docs" / "architecture.md"
# Texts a user reads that are not Markdown but make the same kind of claims.
NOTES = ROOT / "charts" / "kvferry" / "templates" / "NOTES.txt"
VALUES = ROOT / "charts" / "kvferry" / "values.yaml"


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


@functools.cache
def tracked() -> tuple[str, ...]:
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return tuple(p for p in out.splitlines() if (ROOT / p).is_file())


@functools.cache
def top_level() -> frozenset[str]:
    return frozenset(p.split("/", 1)[0] for p in tracked())


_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
_SPAN = re.compile(r"`([^`\n]+)`")
_LINK = re.compile(r"\]\(([^)\s]+)\)")


@functools.cache
def code_of(path: Path) -> tuple[str, ...]:
    """Fenced blocks and inline spans of a Markdown file, in order."""
    text = path.read_text()
    blocks = _FENCE.findall(text)
    prose = _FENCE.sub("", text)
    return tuple(blocks) + tuple(_SPAN.findall(prose))


def mentions(pattern: str, docs: list[Path] = DOCS) -> list[tuple[str, str]]:
    """(doc, match) for every match of ``pattern`` in the docs' code."""
    rx = re.compile(pattern)
    return [(rel(d), m) for d in docs for code in code_of(d) for m in rx.findall(code)]


def doc_params(items: list[tuple[str, str]]) -> list[Any]:
    return [pytest.param(doc, name, id=f"{doc}:{name}") for doc, name in sorted(set(items))]


# ------------------------------------------------------------------ files and links


def _repo_path_tokens() -> list[tuple[str, str]]:
    out = []
    for doc in DOCS:
        for code in code_of(doc):
            for token in re.findall(r"[\w./*-]+", code):
                token = token.split("::")[0].rstrip(".,:")
                first = token.split("/", 1)[0]
                if "/" in token and first in top_level() and not token.startswith("//"):
                    out.append((rel(doc), token))
    return out


def _exists(token: str) -> bool:
    if "*" in token:
        return any(Path(p).match(token) or p.startswith(token.split("*")[0]) for p in tracked())
    path = ROOT / token
    return path.exists() or any(p.startswith(token.rstrip("/") + "/") for p in tracked())


@pytest.mark.parametrize("doc, path", doc_params(_repo_path_tokens()))
def test_every_repository_path_a_doc_names_exists(doc: str, path: str):
    assert _exists(path), f"{doc} names {path}, which is not in the repository"


def _links() -> list[tuple[str, str]]:
    out = []
    for doc in DOCS:
        for target in _LINK.findall(doc.read_text()):
            if not re.match(r"[a-z]+:", target) and not target.startswith("#"):
                out.append((rel(doc), target))
    return out


@pytest.mark.parametrize("doc, target", doc_params(_links()))
def test_every_relative_link_points_inside_the_repository_at_a_file(doc: str, target: str):
    path = ((ROOT / doc).parent / target.split("#")[0]).resolve()
    assert path.is_relative_to(ROOT), f"{doc} links outside the repository: {target}"
    assert path.exists(), f"{doc} links to {target}, which does not exist"


# ------------------------------------------------------------------ make targets


@functools.cache
def make_targets() -> frozenset[str]:
    text = (ROOT / "Makefile").read_text()
    return frozenset(re.findall(r"^([a-z][\w-]*):", text, re.M))


@pytest.mark.parametrize("doc, target", doc_params(mentions(r"\bmake ([a-z][\w-]*)")))
def test_every_make_target_a_doc_names_exists(doc: str, target: str):
    assert target in make_targets(), f"{doc}: `make {target}` is not a Makefile target"


# ------------------------------------------------------------------ chart values


@functools.cache
def values() -> dict[str, Any]:
    return yaml.safe_load(VALUES.read_text())


def _value_exists(path: str) -> bool:
    node: Any = values()
    for part in path.split("."):
        if part == "*":
            return isinstance(node, dict) and bool(node)
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


# First segments the CRD shares with the chart (resources, nodeSelector, ...): checked
# only in the chart's own README and in --set flags.
_SHARED = {"resources", "nodeSelector", "tolerations", "affinity", "image", "metrics"}


_FILE_SUFFIXES = {"crt", "key", "py", "yaml", "json", "md", "sh", "txt"}


def _value_tokens() -> list[tuple[str, str]]:
    out = [(d, m) for d, m in mentions(r"--set ([\w.\[\]]+)=") if "[" not in m]
    chart_readme = ROOT / "charts" / "kvferry" / "README.md"
    for doc in DOCS:
        for code in code_of(doc):
            if "\n" in code or " " in code.strip():
                continue  # a block or a phrase, not a value's name
            token = code.strip()
            first = token.split(".", 1)[0]
            if "." not in token or first not in values() or "/" in token:
                continue
            if token.rsplit(".", 1)[1] in _FILE_SUFFIXES:
                continue  # tls.crt, settings.py: file names
            if first in _SHARED and doc != chart_readme:
                continue
            out.append((rel(doc), token))
    return out


@pytest.mark.parametrize("doc, value", doc_params(_value_tokens()))
def test_every_chart_value_a_doc_names_exists(doc: str, value: str):
    assert _value_exists(value), f"{doc} names chart value {value}, not in values.yaml"


# ------------------------------------------------------------------ environment


@functools.cache
def code_text() -> str:
    """Everything but the docs: where a variable must be read or set to exist."""
    skip = (".md", ".png", ".json")
    return "\n".join(
        (ROOT / p).read_text(errors="replace") for p in tracked() if not p.endswith(skip)
    )


def _sidecar_env_twins() -> set[str]:
    from kvferry_sidecar import config

    return {f"KVFERRY_{f.upper()}" for f in config.FIELDS}


_ENV = r"\b((?:KVFERRY|E2E|UCX|VLLM|HF|HELM)_[A-Z0-9_]*[A-Z0-9])\b"


@pytest.mark.parametrize("doc, var", doc_params(mentions(_ENV)))
def test_every_environment_variable_a_doc_names_is_used(doc: str, var: str):
    if var in _sidecar_env_twins():
        return  # kvferry-sidecar reads KVFERRY_<FIELD> for every setting (config.py)
    assert re.search(rf"\b{var}\b", code_text()), f"{doc} names {var}; no code reads or sets it"


# ------------------------------------------------------------------ ports

# Every port of the wire contract (SIDECAR_PORT, ENGINE_PORT, ...) and the chart's.
KNOWN_PORTS = {
    **{v: k for k, v in vars(protocol).items() if k.endswith("_PORT") and isinstance(v, int)},
    values()["reportEndpoint"]["containerPort"]: "report endpoint (chart)",
    values()["metrics"]["containerPort"]: "operator metrics (chart)",
}


def _port_tokens() -> list[tuple[str, str]]:
    rx = r"(?:\bports? |:)(\d{4,5})\b"
    found = mentions(rx)
    for doc in DOCS:
        prose = _FENCE.sub("", doc.read_text())
        found += [(rel(doc), m) for m in re.findall(r"\bports? \(?`?(\d{4,5})\b", prose)]
    return found


def _control_plane_ports() -> set[int]:
    text = (ROOT / "hack" / "controlplane.sh").read_text()
    return {int(p) for p in re.findall(r"KVFERRY_CP_PORT:-(\d+)", text)}


@pytest.mark.parametrize("doc, port", doc_params(_port_tokens()))
def test_every_port_a_doc_names_is_one_the_code_uses(doc: str, port: str):
    known = set(KNOWN_PORTS) | _control_plane_ports()
    assert int(port) in known, f"{doc} names port {port}; kvferry uses {sorted(known)}"


# ------------------------------------------------------------------ metrics


def _expand(name: str) -> list[str]:
    m = re.search(r"\{([^}]*,[^}]*)\}", name)
    if not m:
        return [name]
    return [
        n
        for alt in m.group(1).split(",")
        for n in _expand(name[: m.start()] + alt + name[m.end() :])
    ]


@functools.cache
def exported_metrics() -> frozenset[str]:
    """Series names kvferry's code defines (sidecar and operator registries)."""
    text = "\n".join(
        (ROOT / p).read_text()
        for p in tracked()
        if p.endswith(".py") and not p.startswith("tests/")
    )
    return frozenset(re.findall(r"[\"'](kvferry_[a-z0-9_]+)[\"']", text))


@functools.cache
def vllm_metrics_read() -> frozenset[str]:
    text = "\n".join((ROOT / p).read_text() for p in tracked() if p.endswith(".py"))
    return frozenset(re.findall(r"vllm:[a-z0-9_]+", text))


_PACKAGES = {"kvferry_dev", "kvferry_wire", "kvferry_operator", "kvferry_sidecar"}
_SERIES_SUFFIX = re.compile(r"_(total|sum|count|bucket|created)$")
UPGRADING = ROOT / "docs" / "upgrading.md"
# The first column of the upgrade note's removed-series table: | `name{labels}` | ...
_REMOVED_ROW = re.compile(r"^\| `(kvferry_[a-z0-9_]+)", re.M)


@functools.cache
def removed_metrics() -> frozenset[str]:
    """Series the upgrade note lists as removed, without their sample suffixes."""
    return frozenset(_SERIES_SUFFIX.sub("", n) for n in _REMOVED_ROW.findall(UPGRADING.read_text()))


def _metric_tokens() -> list[tuple[str, str]]:
    out = []
    for doc, raw in mentions(r"\b((?:kvferry_|vllm:)[a-z0-9_{},:]*[a-z0-9_}])"):
        name = re.sub(r"\{[^,}]*\}?$", "", raw)  # labels: {reuse}, {source="p2p"}
        for n in _expand(name):
            if n not in _PACKAGES and not n.endswith("_"):
                out.append((doc, n))
    return out


@pytest.mark.parametrize("doc, metric", doc_params(_metric_tokens()))
def test_every_metric_a_doc_names_is_exported_or_read(doc: str, metric: str):
    if metric.startswith("vllm:"):
        base = re.sub(r"_(total|sum|count|bucket)$", "", metric)
        # The engine tier checks the series kvferry reads against a real vLLM.
        assert {metric, base} & vllm_metrics_read(), f"{doc}: {metric} is read by no code"
        return
    base = _SERIES_SUFFIX.sub("", metric)
    if base in removed_metrics():
        # Only the upgrade note names a removed series, and only while no code exports it.
        assert doc == rel(UPGRADING), f"{doc}: {metric} is removed (see {rel(UPGRADING)})"
        assert not {metric, base} & exported_metrics(), f"{doc}: {metric} is still exported"
        return
    assert {metric, base} & exported_metrics(), f"{doc}: {metric} is exported by no code"


# ------------------------------------------------------------------ spec and status fields


def _schema_has(schema: dict[str, Any], path: list[str]) -> bool:
    node = schema
    for part in path:
        part = re.sub(r"\[.*\]$", "", part)
        if node.get("type") == "array":
            node = node.get("items") or {}
        props = node.get("properties") or {}
        if part not in props:
            return node.get("x-kubernetes-preserve-unknown-fields", False)
        node = props[part]
    return True


def _top_fields() -> set[str]:
    out = {"<role>"}
    for kind in (api.SERVER_KIND, api.STATUS_KIND):
        for part in ("spec", "status"):
            out |= set(api.openapi_schema(kind)["properties"][part].get("properties") or {})
    return out


def _field_tokens() -> list[tuple[str, str]]:
    # spec.x.y where x is a kvferry field: `spec.replicas` of a StatefulSet is not ours.
    rx = r"\b((?:spec|status)\.[A-Za-z<>]+(?:\.[A-Za-z<>\[\]]+)*)"
    out = []
    for doc, m in mentions(rx):
        parts = m.rstrip(".").split(".")
        if parts[1] in _top_fields() and parts[-1] not in _FILE_SUFFIXES:
            out.append((doc, ".".join(parts)))
    return out


@pytest.mark.parametrize("doc, field", doc_params(_field_tokens()))
def test_every_spec_or_status_field_a_doc_names_is_in_a_crd(doc: str, field: str):
    path = field.replace("<role>", "prefill").split(".")
    schemas = [api.openapi_schema(api.SERVER_KIND), api.openapi_schema(api.STATUS_KIND)]
    assert any(_schema_has(s, path) for s in schemas), f"{doc} names {field}, in no CRD"


def _undescribed(node: dict[str, Any], path: str) -> list[str]:
    out = [] if "description" in node or path.endswith(".metadata") else [path]
    for name, sub in (node.get("properties") or {}).items():
        out += _undescribed(sub, f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        sub = node.get(key)
        if isinstance(sub, dict) and sub.get("properties"):
            # The container's description covers the element; its fields need theirs.
            out += [p for p in _undescribed(sub, f"{path}[]") if p != f"{path}[]"]
    return out


@pytest.mark.parametrize("kind", [api.SERVER_KIND, api.STATUS_KIND])
def test_every_crd_field_has_a_description(kind: str):
    # kubectl explain shows these; README promises it documents every field.
    assert _undescribed(api.openapi_schema(kind), kind) == []


# ------------------------------------------------------------------ claims with one answer


def _texts() -> list[tuple[str, str]]:
    return [(rel(d), d.read_text()) for d in [*DOCS, NOTES, VALUES]]


def test_crd_upgrades_are_documented_with_force_conflicts():
    # Over CRDs that Helm created, a plain server-side apply conflicts with "helm"
    # (tests/cluster/test_crd_upgrade.py runs this command).
    for doc, text in _texts():
        for line in text.splitlines():
            if re.search(r"kubectl apply --server-side\b.*\bcrds/", line):
                assert "--force-conflicts" in line, f"{doc}: {line.strip()}"


# Spelled in two parts so that this file does not contain what it looks for.
WRONG_HOST = "kvferry-operator" + ".kvferry-system.svc"


def test_the_report_endpoint_is_named_as_the_chart_names_its_service():
    # The chart's Service for release "kvferry" in kvferry-system is kvferry, not
    # kvferry-operator (templates/_helpers.tpl shortens <release>-kvferry).
    for doc, text in [
        *_texts(),
        *((p, (ROOT / p).read_text()) for p in tracked() if p.endswith(".py")),
    ]:
        assert WRONG_HOST not in text, doc


def test_field_manager_named_in_docs_is_the_operators():
    for doc, text in _texts():
        for name in re.findall(r"field manager `([\w-]+)`", text):
            assert name in (api.FIELD_MANAGER, "argocd", "helm", "kubectl"), f"{doc}: {name}"


def test_dockerfiles_named_in_values_exist():
    for path in re.findall(r"\b(images/[\w/]+Dockerfile)\b", VALUES.read_text()):
        assert (ROOT / path).exists(), path
    assert not re.search(r"Dockerfile\.(operator|sidecar)", VALUES.read_text())


# ------------------------------------------------------------------ failure modes


def named_tests(text: str) -> list[tuple[str, str]]:
    """`tests/x.py::test_name` and the `::test_other` that follow it in one cell."""
    found = []
    for cell in text.split("|"):
        current = None
        for m in re.finditer(r"`(tests/[\w/]+\.py)?(?:::(\w+))?`", cell):
            current = m.group(1) or current
            if m.group(2) and current:
                found.append((current, m.group(2)))
    return found


def test_every_test_the_failure_modes_page_names_exists():
    text = (ROOT / "docs" / "failure-modes.md").read_text()
    named = named_tests(text)
    assert len(named) > 40, "the page's test names were not found: did the format change?"
    missing = [
        f"{path}::{name}"
        for path, name in named
        if not (ROOT / path).is_file()
        or not re.search(rf"^(async )?def {name}\(", (ROOT / path).read_text(), re.M)
    ]
    assert not missing, f"docs/failure-modes.md names tests that do not exist: {missing}"


# ------------------------------------------------------------------ the architecture page

# A repository path anywhere on the page: prose, tables and the diagrams too.
_ARCH_PATH = re.compile(
    r"(?<![\w./-])((?:operator|sidecar|wire|kvferry_dev|tests|bench|hack|e2e|crds|docs)"
    r"/[\w./-]*\w)"
)
# module.symbol in the page's inline code, e.g. relay.serve_turn, kvferry_wire.report.decode.
_ARCH_SYMBOL = re.compile(
    r"\b(?:kvferry_(operator|sidecar|wire|dev)\.)?([a-z_]+)\.([A-Za-z_]\w*)\b(?![./-])"
)
_FOLDERS = {"operator": "operator", "sidecar": "sidecar", "wire": "wire", "dev": "kvferry_dev"}


def _architecture_paths() -> list[str]:
    return sorted(set(_ARCH_PATH.findall(ARCHITECTURE.read_text())))


def _module_file(module: str, package: str) -> bool:
    folders = [_FOLDERS[package]] if package else list(_FOLDERS.values())
    return any((ROOT / f / f"{module}.py").is_file() for f in folders)


def _architecture_symbols() -> list[str]:
    out = set()
    # Inline spans only: the diagrams also name status fields (status.retention).
    for code in _SPAN.findall(_FENCE.sub("", ARCHITECTURE.read_text())):
        for package, module, symbol in _ARCH_SYMBOL.findall(code):
            name = f"{'kvferry_' + package + '.' if package else ''}{module}.{symbol}"
            if symbol in _FILE_SUFFIXES:
                continue  # render.py, sidecar.json: file names
            if _module_file(module, package):
                out.add(name)  # kvTransfer.leaseSeconds and the like name no module
    return sorted(out)


def _defines(module: str, symbol: str, package: str) -> bool:
    folders = [_FOLDERS[package]] if package else list(_FOLDERS.values())
    rx = re.compile(rf"^\s*(?:async def|def|class) {symbol}\b|^{symbol}\b[^=]*=", re.M)
    return any(
        (ROOT / f / f"{module}.py").is_file() and rx.search((ROOT / f / f"{module}.py").read_text())
        for f in folders
    )


def _package_maps() -> list[Path]:
    return [ROOT / "operator" / "README.md", ROOT / "sidecar" / "README.md"]


def test_the_architecture_page_exists_and_both_package_maps_link_to_it():
    # The package maps once named a design document the repository does not hold.
    assert ARCHITECTURE.is_file()
    for readme in _package_maps():
        targets = {
            (readme.parent / t.split("#")[0]).resolve() for t in _LINK.findall(readme.read_text())
        }
        assert ARCHITECTURE.resolve() in targets, f"{rel(readme)} does not link {rel(ARCHITECTURE)}"
        assert "DESIGN.md" not in readme.read_text(), f"{rel(readme)} names DESIGN.md"


def test_the_architecture_page_names_paths():
    # Guards the two parametrized tests below against a regex that finds nothing.
    assert len(_architecture_paths()) > 20
    assert len(_architecture_symbols()) > 3


@pytest.mark.parametrize("path", _architecture_paths())
def test_every_path_the_architecture_page_names_exists(path: str):
    assert _exists(path), f"docs/architecture.md names {path}, which is not in the repository"


@pytest.mark.parametrize("name", _architecture_symbols())
def test_every_module_symbol_the_architecture_page_names_is_defined(name: str):
    *prefix, module, symbol = name.split(".")
    package = prefix[0].removeprefix("kvferry_") if prefix else ""
    assert _defines(module, symbol, package), f"docs/architecture.md names {name}, defined nowhere"
