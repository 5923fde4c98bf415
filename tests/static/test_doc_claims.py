"""Claims the docs make that test_docs.py's name checks cannot catch, each checked
against what helm and the operator render: the examples users copy, the ports the
chart's docs name for its monitors and NetworkPolicy, the defaults `kubectl get -o
yaml` does not show, and where the chart and its sources come from (nothing is
published: no chart repository, no public Git repository, no images).

Each test reads the claim out of the text it is made in (a table row, a values
comment, a paragraph) and compares it with the rendered objects, so a doc that drifts
from the code, or code that drifts from its doc, fails here.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml

from kvferry_operator import api, render
from kvferry_operator import settings as operator_settings
from tests.helm import CHART, RELEASE, one, template
from tests.manifests import EXAMPLES, ROOT, load_example

Obj = dict[str, Any]


def rendered(path: Path) -> list[Obj]:
    return render.render(api.parse_server(load_example(path)))


def pod_templates(objs: list[Obj]) -> list[Obj]:
    return [o["spec"]["template"] for o in objs if o["kind"] == "StatefulSet"]


def containers(pod: Obj) -> list[Obj]:
    return pod["spec"]["containers"] + pod["spec"].get("initContainers", [])


_QUANTITY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "G": 10**9, "T": 10**12}


def quantity_bytes(value: str) -> int:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|G|T)?", str(value))
    assert m, f"not a storage quantity this test reads: {value!r}"
    return int(float(m[1]) * _QUANTITY.get(m[2] or "", 1))


# ------------------------------------------------------------------ the examples

# The weights a hub example downloads, in bytes (the repository's safetensors): what
# its ephemeral-storage request must hold. A new hub example adds its model here.
HUB_WEIGHTS = {"Qwen/Qwen3-0.6B": 1.5 * 10**9}
# Room above the weights for what the engine writes into its container (compile
# caches, logs): the request is sized to the model, not a default for any model.
HUB_HEADROOM = 8 * 2**30


def _hub_downloads() -> list[Path]:
    """Examples whose pods download the weights onto the node's disk (an emptyDir)."""
    out = []
    for path in EXAMPLES:
        hub = api.parse_server(load_example(path)).spec.model.hub
        if hub and not (hub.cache.pvc_claim_name or hub.cache.host_path):
            out.append(path)
    return out


def test_the_examples_include_a_hub_download():
    assert _hub_downloads(), "no example downloads from the hub: the test below checks none"


@pytest.mark.parametrize("path", _hub_downloads(), ids=lambda p: p.name)
def test_a_hub_example_requests_the_disk_its_model_needs(path: Path):
    """An example is what users copy: 100Gi (the CRD's default) for a 1.5 GB model
    keeps pods off nodes that have the disk for it many times over."""
    spec = load_example(path)["spec"]
    model = spec["model"]["name"]
    assert model in HUB_WEIGHTS, f"{path.name}: add {model}'s download size to HUB_WEIGHTS"
    cache = spec["model"].get("source", {}).get("hub", {}).get("cache", {})
    assert "ephemeralStorage" in cache, (
        f"{path.name} leaves spec.model.source.hub.cache.ephemeralStorage to the CRD's "
        "default: size it to the model"
    )
    (pod, *_) = pod_templates(rendered(path))
    engine = next(c for c in containers(pod) if c["name"] == "engine")
    request = quantity_bytes(engine["resources"]["requests"]["ephemeral-storage"])
    weights = HUB_WEIGHTS[model]
    assert weights <= request <= weights + HUB_HEADROOM, (
        f"{path.name}: requests {request / 2**30:.1f} GiB for {weights / 10**9:.1f} GB of weights"
    )


_DEBUG = re.compile(r"^(debug|trace)$", re.I)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_no_example_turns_on_debug_logging(path: Path):
    """Debug logs in production write prompts and slow the engine; nobody should copy
    them from an example."""
    for pod in pod_templates(rendered(path)):
        for c in containers(pod):
            for entry in c.get("env", []):
                if "LOG" in entry["name"]:
                    assert not _DEBUG.match(str(entry.get("value", ""))), (path.name, entry)
            args = c.get("args", [])
            for flag, value in itertools.pairwise(args):
                if "log-level" in flag:
                    assert not _DEBUG.match(value), (path.name, flag, value)


# ------------------------------------------------------------------ the chart's monitors

CHART_README = CHART / "README.md"
VALUES = CHART / "values.yaml"
MONITOR_TEMPLATES = sorted((CHART / "templates").glob("*monitor.yaml"))


def prose(path: Path) -> str:
    """A doc's text with YAML comment marks dropped and whitespace folded: a claim
    wrapped over lines reads as one line."""
    text = re.sub(r"^\s*# ?", "", path.read_text(), flags=re.M)
    return re.sub(r"\s+", " ", text)


def scraped_ports() -> dict[str, tuple[str, int]]:
    """What the chart's PodMonitor scrapes on a server pod the operator renders, by
    container: (port name, port number). Only the sidecar's metrics port: it serves
    the engine's series too, so no scraper needs the engine's own port."""
    pm = one(template("podMonitor.enabled=true"), "PodMonitor", f"{RELEASE}-servers")
    (pod, *_) = pod_templates(rendered(EXAMPLES[0]))
    out = {}
    for endpoint in pm["spec"]["podMetricsEndpoints"]:
        for c in containers(pod):
            for port in c["ports"]:
                if port["name"] == endpoint["port"]:
                    out["engine" if c["name"] == "engine" else "sidecar"] = (
                        port["name"],
                        port["containerPort"],
                    )
    assert set(out) == {"sidecar"}, out
    return out


# "sidecar port `internal`", "engine (port engine)", 'sidecar (port "internal"'.
_PORT_NAME = re.compile(r"\b(sidecar|engine) \(?port [`\"]?([a-z][\w-]*)[`\"]?")
# "sidecar (`kvferry_*`, its internal port 8001)", "engine (`vllm:*`, port 8200)".
_PORT_NUMBER = re.compile(r"\b(sidecar|engine) \([^()]*?\bport (\d{4,5})\)")


def _monitor_claims() -> list[Any]:
    out = []
    for path in (CHART_README, VALUES, *MONITOR_TEMPLATES):
        text = prose(path)
        for rx in (_PORT_NAME, _PORT_NUMBER):
            for m in rx.finditer(text):
                doc = str(path.relative_to(ROOT))
                out.append(pytest.param(doc, m[1], m[2], id=f"{doc}:{m[0]}"))
    return out


def test_the_chart_docs_name_the_scraped_ports():
    # The parametrized test below must have claims to check.
    docs = {p.values[0] for p in _monitor_claims()}
    assert {"charts/kvferry/README.md", "charts/kvferry/values.yaml"} <= docs


@pytest.mark.parametrize("doc, container, port", _monitor_claims())
def test_a_port_the_chart_docs_name_for_scraping_is_the_one_the_pod_monitor_scrapes(
    doc: str, container: str, port: str
):
    """The PodMonitor scrapes the sidecar's `metrics` port (not the client port `http`,
    nor the peers' `internal` port), as the operator names it; the engine's series are
    served there too, so a doc naming an engine port for scraping is wrong."""
    scraped = scraped_ports()
    assert container in scraped, (
        f"{doc} names the {container}'s port {port} for scraping; the chart's PodMonitor "
        f"scrapes the engine's series on the sidecar's port {scraped['sidecar']}"
    )
    name, number = scraped[container]
    assert port in (name, str(number)), (
        f"{doc} says the {container}'s metrics are on port {port}; the chart's PodMonitor "
        f"scrapes {name} ({number})"
    )


def test_the_server_ports_to_admit_prometheus_to_are_the_scraped_ones():
    """What the docs say a NetworkPolicy of your own must open for Prometheus."""
    want = {number for _, number in scraped_ports().values()}
    found = 0
    for path in (VALUES, ROOT / "docs" / "cluster-prerequisites.md"):
        for sentence in re.split(r"(?<=[.;])\s", prose(path)):
            if "NetworkPolicy of your own" in sentence and re.search(r"\b\d{4}\b", sentence):
                found += 1
                named = {int(n) for n in re.findall(r"\b(\d{4,5})\b", sentence)}
                assert named == want, f"{path.name}: {sentence!r} names {named}, not {want}"
    assert found == 2


# ------------------------------------------------------------------ metricsClients


def metrics_client_ports() -> set[int]:
    """The ports a networkPolicy.metricsClients peer may reach, in every NetworkPolicy
    the chart renders with one set (named ports resolved on the operator's pod) and in
    the one the operator renders for a server from the variable the chart sets."""
    peer = {"namespaceSelector": {"matchLabels": {"team": "monitoring"}}}
    objs = template(
        "networkPolicy.enabled=true",
        "networkPolicy.metricsClients[0].namespaceSelector.matchLabels.team=monitoring",
    )
    named = {
        p["name"]: p["containerPort"]
        for c in one(objs, "Deployment")["spec"]["template"]["spec"]["containers"]
        for p in c.get("ports", [])
    }
    # The operator renders the chart's metricsClients into every server's policy.
    env = {
        e["name"]: e.get("value", "")
        for c in one(objs, "Deployment")["spec"]["template"]["spec"]["containers"]
        for e in c.get("env", [])
    }
    ctx = render.Context(
        metrics_clients=operator_settings.parse_metrics_clients(
            env[operator_settings.METRICS_CLIENTS_ENV]
        )
    )
    server = render.build_network_policy(api.parse_server(load_example(EXAMPLES[0])), ctx)
    ports = set()
    for policy in [*(o for o in objs if o["kind"] == "NetworkPolicy"), server]:
        for rule in policy["spec"]["ingress"]:
            if rule.get("from") == [peer]:
                ports |= {named.get(p["port"], p["port"]) for p in rule["ports"]}
    return ports


def _metrics_client_claims() -> list[Any]:
    """(doc, ports) for each clause that names metricsClients and port numbers: the
    text after the name up to the clause's end, and in values.yaml the comment above
    the key up to its first ';'."""
    out = []
    for path in (CHART_README, ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))):
        for m in re.finditer(r"metricsClients`?([^|;,]*?(?:[|;,]|\. |$))", prose(path)):
            ports = re.findall(r"\b(\d{4,5})\b", m[1])
            if ports:
                out.append((str(path.relative_to(ROOT)), frozenset(map(int, ports))))
    comment = re.search(r"((?:^ *#.*\n)+) *metricsClients:", VALUES.read_text(), re.M)
    assert comment, "values.yaml: no comment above networkPolicy.metricsClients"
    first = re.sub(r"\s*# ?", " ", comment[1]).split(";")[0]
    out.append(
        ("charts/kvferry/values.yaml", frozenset(map(int, re.findall(r"\b(\d{4,5})\b", first))))
    )
    return [pytest.param(doc, ports, id=f"{doc}:{sorted(ports)}") for doc, ports in out]


@pytest.mark.parametrize("doc, ports", _metrics_client_claims())
def test_the_ports_the_docs_name_for_metrics_clients_are_the_ones_the_policy_opens(
    doc: str, ports: frozenset[int]
):
    opened = metrics_client_ports()
    assert ports == opened, (
        f"{doc} says networkPolicy.metricsClients reaches {sorted(ports)}; the chart's "
        f"NetworkPolicy opens {sorted(opened)}"
    )


# ------------------------------------------------------------------ defaults -o yaml shows


def stored_spec(path: Path) -> Obj:
    """An example's spec as the API server stores it: the CRD's defaults filled in."""
    schema = api.openapi_schema(api.SERVER_KIND)["properties"]["spec"]
    return api.apply_defaults(schema, load_example(path)["spec"])


def _has(spec: Obj, path: str) -> bool:
    node: Any = spec
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def _engine(pod: Obj) -> Obj:
    return next(c for c in containers(pod) if c["name"] == "engine")


def _sidecar(pod: Obj) -> Obj:
    return next(c for c in containers(pod) if c["name"] != "engine")


# Values the stored spec leaves unset and the operator resolves when it renders
# (api.parse_spec, render): the field as the README names it, an example whose stored
# spec lacks it (<role>: both roles), and what of every rendered pod carries the
# resolved value. What a schema default cannot say: it depends on another field or on
# the operator's installation. Not derived from the code: a new value the operator
# fills in joins this table with its README entry.
OPERATOR_FILLED = [
    ("spec.engine.image", "hub.yaml", "engine.image", lambda pod: _engine(pod)["image"]),
    (
        "spec.engine.sidecarImage",
        "hub.yaml",
        "engine.sidecarImage",
        lambda pod: _sidecar(pod)["image"],
    ),
    (
        "resources.gpus",
        "hub.yaml",
        "<role>.resources.gpus",
        lambda pod: _engine(pod)["resources"]["limits"].get("nvidia.com/gpu"),
    ),
    (
        "spec.model.source.hub.id",
        "hub.yaml",
        "model.source.hub.id",
        lambda pod: _engine(pod)["args"][0],
    ),
    (
        "resources.cpu",
        "cpu.yaml",
        "<role>.resources.cpu",
        lambda pod: _engine(pod)["resources"]["requests"].get("cpu"),
    ),
    (
        "resources.memory",
        "cpu.yaml",
        "<role>.resources.memory",
        lambda pod: _engine(pod)["resources"]["requests"].get("memory"),
    ),
]


def o_yaml_paragraph() -> str:
    """The README's paragraph on what `kubectl get -o yaml` shows."""
    text = (ROOT / "README.md").read_text()
    (para,) = [p for p in text.split("\n\n") if "kubectl get -o yaml" in p]
    return re.sub(r"\s+", " ", para)


@pytest.mark.parametrize(
    "named, example, path, value",
    OPERATOR_FILLED,
    ids=[f"{n}@{e}" for n, e, *_ in OPERATOR_FILLED],
)
def test_the_readme_names_every_default_kubectl_get_does_not_show(
    named: str, example: str, path: str, value: Any
):
    """The README says the CRD's defaults make the stored spec show every default;
    what the operator fills in instead must be named there as an exception."""
    stored = stored_spec(ROOT / "examples" / example)
    for role in api.ROLES:
        assert not _has(stored, path.replace("<role>", role)), (
            f"{example}: the stored spec has {path} (a schema default): drop it from "
            "OPERATOR_FILLED"
        )
    pods = pod_templates(rendered(ROOT / "examples" / example))
    assert len(pods) == len(api.ROLES)
    assert all(value(pod) for pod in pods), f"{example}: a rendered pod has no value for {path}"
    assert named in o_yaml_paragraph(), (
        f"README: {named} has no schema default (the operator fills it in, so "
        "`kubectl get -o yaml` does not show it), but the paragraph does not name it"
    )


# ------------------------------------------------------------------ nothing is published

USER_TEXTS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    CHART_README,
    VALUES,
    CHART / "templates" / "NOTES.txt",
    ROOT / "deploy" / "README.md",
    ROOT / "images" / "README.md",
    ROOT / "e2e" / "README.md",
]

# Commands that fetch a chart from a repository; kvferry publishes none (no chart
# repository index, no OCI artifact), so each would fail.
_FETCH_CHART = re.compile(r"helm (?:pull|repo add|search repo)\b|oci://")


@pytest.mark.parametrize("path", USER_TEXTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_text_fetches_a_chart_from_a_repository(path: Path):
    found = _FETCH_CHART.findall(path.read_text())
    assert not found, f"{path.name} tells users to run {found}: no kvferry chart is published"


def test_the_upgrade_notes_apply_the_crds_from_the_charts_own_folder():
    """NOTES.txt tells an upgrader how to apply the CRDs `helm upgrade` skipped: from the
    crds/ folder of the chart they upgraded with (a folder, or a .tgz untarred), the
    only kind of chart there is. (Not `helm show crds CHART | kubectl apply -f -`: helm
    3.22 joins the CRD files without a `---`, and the two CRDs read as one document.)"""
    notes = (CHART / "templates" / "NOTES.txt").read_text()
    upgrade = notes.split("{{- if .Release.IsUpgrade }}")[1].split("{{- end }}")[0]
    (folder,) = re.findall(r"kubectl apply --server-side --force-conflicts -f CHART/(\S+)", upgrade)
    shown = sorted(
        yaml.safe_load(p.read_text())["metadata"]["name"] for p in (CHART / folder).glob("*.yaml")
    )
    assert shown == sorted(api.load_crd(kind)["metadata"]["name"] for kind in api.CRD_FILES)


def _repo_urls() -> list[Any]:
    out = []
    for path in USER_TEXTS:
        for url in re.findall(r"repoURL:\s*([^\s,}]+)", path.read_text()):
            out.append(pytest.param(url, id=f"{path.relative_to(ROOT)}:{url}"))
    return out


def test_the_docs_show_an_argo_cd_source():
    assert _repo_urls(), "no repoURL in the docs: the test below checks none"


@pytest.mark.parametrize("url", _repo_urls())
def test_an_argo_cd_source_is_a_placeholder_for_the_users_own_copy(url: str):
    """Nothing is published: an Application must point at the copy the user keeps
    (its host a placeholder under example.com), not a repository that is not there."""
    host = urlparse(url).hostname or ""
    assert host == "example.com" or host.endswith(".example.com"), (
        f"repoURL {url}: kvferry is not published there; show a placeholder for the "
        "user's own copy (e.g. https://git.example.com/platform/kvferry.git)"
    )
