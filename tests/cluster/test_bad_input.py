"""Bad input at volume on the real control plane: generated DisaggregatedServers
through the API server (server-side dry run), a sample of the accepted ones applied
and reconciled, and generated reports pushed to the operator's report endpoint.

Nothing may be a 5xx caused by the input, hang, or leave anything behind; a
rejection names the field. The examples are derandomized, so a CI failure
reproduces, and counted (>= 1,000 each)."""

from __future__ import annotations

import contextlib
import copy
import http.client
import json
import resource
import ssl
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kubernetes import client, config

from kvferry_operator import api, hostpaths, podtemplate, render, validation
from kvferry_operator.kube import Kube, api_error_message
from kvferry_wire import report as wire
from tests.cluster.conftest import Kubectl, Operator, wait_until
from tests.cluster.test_operator import make, wait_ready
from tests.cluster.test_reports import bound_token, decode_report
from tests.hostile_reports import report_corpus
from tests.manifests import MINIMAL, ROOT

EXAMPLES = 1000
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)

# ------------------------------------------------------------------ servers


def schema_leaves() -> list[tuple[str, dict[str, Any]]]:
    """Every field of the spec with its schema, from the CRD (so new fields are fuzzed)."""
    crd = yaml.safe_load((ROOT / "crds" / "kvferry.io_disaggregatedservers.yaml").read_text())
    root = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    out: list[tuple[str, dict[str, Any]]] = []

    def walk(schema: dict[str, Any], path: str) -> None:
        out.append((path, schema))
        for key, sub in (schema.get("properties") or {}).items():
            walk(sub, f"{path}.{key}")

    walk(root, "spec")
    return out


LEAVES = schema_leaves()
ANY_JUNK = st.sampled_from([None, "", "x" * 300, -1, 2**63, 1.5, True, [], {}, {"unknown": 1}])


def values_for(schema: dict[str, Any]) -> st.SearchStrategy[Any]:
    kind = schema.get("type")
    lo, hi = schema.get("minimum"), schema.get("maximum")
    if "enum" in schema:
        good = st.sampled_from(schema["enum"])
        return st.one_of(good, good, st.sampled_from(["Off", "on", "", "RDMA", 0]))
    if kind == "integer":
        edges = [v for v in (lo, hi) if v is not None]
        edges += [e - 1 for e in edges if e == lo] + [e + 1 for e in edges if e == hi]
        return st.one_of(
            st.sampled_from(edges or [0]),
            st.integers(-3, 20),
            st.sampled_from([2**31, 2**53, "7", 2.5]),
        )
    if kind == "number":
        return st.one_of(st.floats(-0.5, 1.5, allow_nan=False), st.sampled_from(["0.9", 2]))
    if kind == "boolean":
        return st.sampled_from([True, False, "yes", 1])
    if kind == "string":
        return st.one_of(
            st.text(max_size=12),
            st.sampled_from(["", "x" * 300, "UPPER_case", "vllm/vllm-openai:v0.33.1", 5]),
        )
    if kind == "array":
        item = st.one_of(st.text(max_size=10), st.dictionaries(st.text(max_size=5), st.integers()))
        return st.one_of(st.lists(item, max_size=4), st.just("not-a-list"))
    if kind == "object":
        return st.one_of(
            st.just({}),
            st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3),
            st.just("not-an-object"),
        )
    # int-or-string quantities (cpu, memory, sharedMemorySize).
    return st.one_of(st.sampled_from(["1Gi", "500m", "lots", "", "-1", 4, -4]), st.text(max_size=6))


def set_path(obj: dict[str, Any], path: str, value: Any) -> None:
    parts = path.split(".")
    node = obj
    for part in parts[:-1]:
        nxt = node.setdefault(part, {})
        if not isinstance(nxt, dict):
            return  # an earlier mutation replaced the parent
        node = nxt
    node[parts[-1]] = value


@st.composite
def servers(draw: st.DrawFn) -> dict[str, Any]:
    obj = copy.deepcopy(MINIMAL)
    obj["metadata"] = {"name": "gen"}
    for _ in range(draw(st.integers(1, 4))):
        path, schema = draw(st.sampled_from(LEAVES))
        if draw(st.integers(0, 9)) == 0:
            set_path(obj, f"{path}.unknownField", draw(ANY_JUNK))
        else:
            set_path(obj, path, draw(values_for(schema)))
    return obj


@contextlib.contextmanager
def memory_cap(extra: int) -> Iterator[None]:
    """Cap this process's address space while rendering generated specs: a spec whose
    rendering explodes (it happened: replicas 2**31) fails with MemoryError instead of
    taking the machine's memory."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    used = int(Path("/proc/self/statm").read_text().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (used + extra, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def names_a_field(body: dict[str, Any]) -> bool:
    causes = (body.get("details") or {}).get("causes") or []
    message = body.get("message", "")
    return all(c.get("field") for c in causes) and ("spec" in message or "metadata" in message)


def test_generated_servers_are_rejected_naming_a_field_or_reconciled(
    kubectl: Kubectl, operator: Operator, ns: str, kubeconfig: Path
):
    config.load_kube_config(str(kubeconfig))
    objects = client.CustomObjectsApi()
    verdicts = {"accepted": 0, "rejected": 0}
    accepted: list[dict[str, Any]] = []

    @SETTINGS
    @given(servers())
    def check(obj: dict[str, Any]) -> None:
        # Offline `kvferry-operator render` checks with validation.validate: it must
        # refuse exactly what the API server refuses.
        offline = validation.validate(obj)
        try:
            out = objects.create_namespaced_custom_object(
                api.GROUP,
                api.VERSION,
                ns,
                api.SERVER_PLURAL,
                obj,
                dry_run="All",
                field_validation="Strict",
                _request_timeout=(5, 30),
            )
        except client.ApiException as exc:
            assert exc.status in (400, 422), (exc.status, exc.body, obj)
            body = json.loads(exc.body)
            assert names_a_field(body), (body, obj)
            assert offline, ("refused by the API server, not offline", body["message"], obj)
            verdicts["rejected"] += 1
            return
        assert offline == [], ("refused offline, not by the API server", offline, obj)
        verdicts["accepted"] += 1
        # What the API server accepts (with its defaults) parses and renders.
        render.render(api.parse_server({**out, "metadata": {**out["metadata"], "uid": "u"}}))
        spec = out["spec"]
        if spec["prefill"]["replicas"] + spec["decode"]["replicas"] <= 3 and len(accepted) < 8:
            accepted.append({"apiVersion": out["apiVersion"], "kind": out["kind"], "spec": spec})

    started = time.monotonic()
    with memory_cap(2 * 1024**3):
        check()
    print(f"\n{EXAMPLES} servers: {verdicts} in {time.monotonic() - started:.1f}s")
    assert sum(verdicts.values()) >= EXAMPLES
    assert verdicts["accepted"] >= 50 and verdicts["rejected"] >= 50, verdicts  # both sides

    # A sample of the accepted ones for real: the operator reconciles each, no traceback.
    offset = len(operator.log())
    for i, obj in enumerate(accepted):
        # Created as JSON (an apply patch is YAML to the API server, which refuses
        # control characters that JSON strings may hold).
        obj = {**obj, "metadata": {"name": f"gen-{i}", "namespace": ns}}
        objects.create_namespaced_custom_object(
            api.GROUP, api.VERSION, ns, api.SERVER_PLURAL, obj, _request_timeout=(5, 30)
        )

    refusals: dict[int, str] = {}

    held: dict[int, str] = {}

    def reconciled(i: int) -> str | None:
        """'observed'; 'held' when the operator's own settings refuse what the CRD
        admits (a hostPath, a podTemplate's host namespace: the reason names the field
        and the setting); 'refused' when status names what the API server refused (a
        control character in a value: the operator's apply patch is YAML to it)."""
        st = kubectl.get("dserver", f"gen-{i}", ns).get("status") or {}
        if st.get("observedGeneration"):
            return "observed"
        progressing = [c for c in st.get("conditions", []) if c["type"] == "Progressing"]
        if progressing and progressing[0]["reason"] == "ApplyFailed":
            refusals[i] = progressing[0]["message"]
            return "refused"
        if progressing and progressing[0]["reason"] in (hostpaths.REASON, podtemplate.REASON):
            held[i] = progressing[0]["message"]
            return "held"
        return None

    seen = Counter(
        wait_until(lambda i=i: reconciled(i), 60, f"gen-{i} reconciled")
        for i in range(len(accepted))
    )
    # What the CRD accepts, the API server accepts in the children too (typed core
    # fields and quantities in the CRD): no accepted server ends ApplyFailed.
    print(f"accepted servers reconciled: {dict(seen)}")
    assert set(seen) <= {"observed", "held"}, (seen, refusals)
    # A held server's reason names the spec field at fault and the setting to change.
    assert all(m.startswith("spec.") and "settings." in m for m in held.values()), held
    assert accepted
    assert "Traceback" not in operator.log()[offset:]


# ------------------------------------------------------------------ reports


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


class Endpoint:
    """One kept-alive HTTPS connection to the operator's report endpoint."""

    def __init__(self, operator: Operator) -> None:
        self.port = operator.report_port
        self.ctx = ssl.create_default_context(cafile=str(operator.cert))
        self.conn = self._connect()

    def _connect(self) -> http.client.HTTPSConnection:
        return http.client.HTTPSConnection("127.0.0.1", self.port, context=self.ctx, timeout=10)

    def post(self, body: bytes, token: str) -> tuple[int, Any]:
        headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        for attempt in (1, 2):
            try:
                self.conn.request("POST", "/v1/reports", body=body, headers=headers)
                resp = self.conn.getresponse()
                return resp.status, resp.read()
            except (http.client.HTTPException, OSError):
                self.conn.close()
                self.conn = self._connect()
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")


def test_generated_reports_never_get_a_5xx_hang_or_leak(
    kubectl: Kubectl, operator: Operator, ns: str
):
    kubectl.apply(make(ns), "--server-side")
    wait_ready(kubectl, ns)
    token = bound_token(kubectl, ns, "tiny-decode-0")
    base = json.loads(decode_report(ns, "tiny", "tiny-decode-0"))
    endpoint = Endpoint(operator)
    assert operator.proc is not None
    rss_before = rss_kib(operator.proc.pid)
    statuses: dict[int, int] = {}
    slowest = 0.0

    started = time.monotonic()
    # A fixed corpus of exactly EXAMPLES bodies (hypothesis could end a run early).
    for body in report_corpus(base, EXAMPLES):
        sent = time.monotonic()
        status, _ = endpoint.post(body, token)
        slowest = max(slowest, time.monotonic() - sent)
        statuses[status] = statuses.get(status, 0) + 1
        # 403: a mutated pod or namespace that is not the token's.
        assert status in (202, 400, 403, 413, 429), (status, body[:300])
    took = time.monotonic() - started
    rss_after = rss_kib(operator.proc.pid)
    print(
        f"\n{EXAMPLES} reports: {statuses} in {took:.1f}s, slowest {slowest:.2f}s, "
        f"operator RSS {rss_before // 1024} -> {rss_after // 1024} MiB"
    )
    assert sum(statuses.values()) == EXAMPLES and statuses.get(400, 0) >= 100
    assert slowest < 5
    assert rss_after - rss_before < 64 * 1024, "operator memory grew"
    # Nothing left behind: one pod row, and a good report still lands and publishes.
    time.sleep(1.5)  # the per-pod bucket refills
    good = wire.decode(decode_report(ns, "tiny", "tiny-decode-0"))
    assert endpoint.post(wire.encode(good), token)[0] == 202
    rows = wait_until(
        lambda: (kubectl.get("kvcachestatus", "tiny", ns).get("status") or {}).get("pods"),
        30,
        "pod rows",
    )
    assert [row["name"] for row in rows] == ["tiny-decode-0"]
    assert "excluded" not in rows[0]
    assert "Traceback" not in operator.log()


# ------------------------------------------------------------------ the operator's applies


@pytest.mark.parametrize("kind", ["ConfigMap", api.STATUS_KIND])
def test_the_operators_apply_refuses_a_field_the_api_server_does_not_know(
    kubeconfig: Path, ns: str, kind: str
):
    # Why kube.apply asks for no fieldValidation=Strict: server-side apply refuses an
    # unknown field whatever fieldValidation says (the API server cannot build the typed
    # patch), for built-in kinds and custom resources alike; Strict would add only the
    # refusal of duplicate keys, which json.dumps never writes. So a child field the
    # cluster does not know is an ApplyFailed naming it, never dropped.
    k = Kube(config.new_client_from_config(str(kubeconfig)))
    obj: dict[str, Any] = {
        "apiVersion": "v1" if kind == "ConfigMap" else api.API_VERSION,
        "kind": kind,
        "metadata": {"name": "strict", "namespace": ns},
        "notAField": {"a": 1},
    }
    if kind == api.STATUS_KIND:
        obj["spec"] = {"serverName": "x"}
    try:
        with pytest.raises(client.ApiException) as refused:
            k.apply(obj)
    finally:
        k.close()
    assert ".notAField: field not declared in schema" in api_error_message(refused.value)
