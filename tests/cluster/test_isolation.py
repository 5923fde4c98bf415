"""Network isolation and pod hardening on the real API server (issue 20, items 2 and
10): the NetworkPolicy and the engine's security context the operator renders are what
the API server stores (nothing pruned or defaulted away), pods with them pass a
namespace's Pod Security admission, and a hub cache on a node folder the operator does
not allow gets a condition that names the field and no StatefulSet."""

from __future__ import annotations

import copy
import json
import re
import textwrap
from pathlib import Path
from typing import Any

import yaml

from kvferry_operator import api, hostpaths, render
from kvferry_wire import protocol
from tests.cluster.conftest import Kubectl, Operator, wait_until
from tests.kube import condition, wait_condition, wait_for_event
from tests.manifests import DELETE, server

CLIENTS = [
    {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}},
        "podSelector": {
            "matchExpressions": [{"key": "app", "operator": "In", "values": ["envoy"]}]
        },
    },
    {"ipBlock": {"cidr": "203.0.113.0/24", "except": ["203.0.113.8/29"]}},
]


def rendered(kubectl: Kubectl, ns: str, name: str) -> dict[tuple[str, str], dict[str, Any]]:
    """What the operator renders for the server as the API server stored it."""
    stored = api.parse_server(kubectl.get("dserver", name, ns))
    return {(o["kind"], o["metadata"]["name"]): o for o in render.render(stored)}


def test_network_policy_and_engine_hardening_survive_the_api_server(
    kubectl: Kubectl, operator: Operator, ns: str
):
    # Baseline admits a root engine without capabilities; the pods must still be created.
    kubectl.run("label", "namespace", ns, "pod-security.kubernetes.io/enforce=baseline")
    kubectl.apply(
        server({"networkPolicy": {"clients": CLIENTS}}, name="iso", namespace=ns),
        "--server-side",
    )
    policy = wait_until(lambda: kubectl.get("networkpolicy", "iso", ns), 60, "NetworkPolicy iso")
    want = rendered(kubectl, ns, "iso")
    assert policy["spec"] == want[("NetworkPolicy", "iso")]["spec"]
    assert policy["metadata"]["ownerReferences"][0]["name"] == "iso"

    for role in api.ROLES:
        name = f"iso-{role}"
        sts = wait_until(lambda n=name: kubectl.get("statefulset", n, ns), 60, name)
        template = want[("StatefulSet", name)]["spec"]["template"]["spec"]
        stored = sts["spec"]["template"]["spec"]
        for kind in ("containers", "initContainers"):
            assert [c["securityContext"] for c in stored[kind]] == [
                c["securityContext"] for c in template[kind]
            ]
        # The sidecar's memory limit through the downward API (its in-flight budget
        # follows it): stored as rendered, but for the divisor the server defaults.
        (limit,) = [
            e
            for e in stored["initContainers"][0]["env"]
            if e["name"] == "KVFERRY_MEMORY_LIMIT_BYTES"
        ]
        ref = limit["valueFrom"]["resourceFieldRef"]
        assert (ref["containerName"], ref["resource"]) == ("kvferry-sidecar", "limits.memory")
        svc = kubectl.get("service", name, ns)
        assert [(p["name"], p["port"]) for p in svc["spec"]["ports"]] == [
            (p["name"], p["port"]) for p in want[("Service", name)]["spec"]["ports"]
        ]
        # The pod itself, past Pod Security admission, carries the same fields.
        pod = wait_until(lambda n=name: kubectl.get("pod", f"{n}-0", ns), 60, f"pod {name}-0")
        (engine,) = pod["spec"]["containers"]
        assert engine["securityContext"] == {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        }
        assert pod["metadata"]["labels"][api.LABEL_SERVER] == "iso"


# Prometheus as the chart's networkPolicy.metricsClients names it.
SCRAPERS = [
    {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
    }
]


def test_metrics_clients_reach_the_metrics_port_only_on_the_api_server(
    kubectl: Kubectl, operator: Operator, ns: str
):
    """The operator's KVFERRY_METRICS_CLIENTS (the chart's metricsClients) become a rule
    on the sidecars' scrape-only port in every server's policy, stored as rendered;
    the peers' ports (8001, 8200) stay the server's own."""
    before = dict(operator.extra_env)
    operator.stop()
    operator.extra_env = {**before, "KVFERRY_METRICS_CLIENTS": json.dumps(SCRAPERS)}
    operator.start()
    try:
        kubectl.apply(server({}, name="scraped", namespace=ns), "--server-side")
        policy = wait_until(
            lambda: kubectl.get("networkpolicy", "scraped", ns), 60, "NetworkPolicy scraped"
        )
        stored = api.parse_server(kubectl.get("dserver", "scraped", ns))
        ctx = render.Context(metrics_clients=tuple(SCRAPERS))
        assert policy["spec"] == render.build_network_policy(stored, ctx)["spec"]
        own, _clients, scrapers = policy["spec"]["ingress"]
        assert own == {"from": [{"podSelector": {"matchLabels": {api.LABEL_SERVER: "scraped"}}}]}
        assert scrapers == {
            "from": SCRAPERS,
            "ports": [{"protocol": "TCP", "port": protocol.SIDECAR_METRICS_PORT}],
        }
        # The port scrapers reach is the one the sidecars listen on, by name.
        sts = wait_until(
            lambda: kubectl.get("statefulset", "scraped-decode", ns), 60, "scraped-decode"
        )
        (sidecar,) = sts["spec"]["template"]["spec"]["initContainers"]
        assert {"name": "metrics", "containerPort": protocol.SIDECAR_METRICS_PORT} in [
            {k: p[k] for k in ("name", "containerPort")} for p in sidecar["ports"]
        ]
    finally:
        operator.stop()
        operator.extra_env = before
        operator.start()


def hub_cache_on_the_node(ns: str, path: str) -> dict[str, Any]:
    cache = {"hostPath": {"path": path}}
    spec = {"model": {"source": {"pvc": DELETE, "hub": {"id": "org/m", "cache": cache}}}}
    return server(spec, name="nodecache", namespace=ns)


def test_a_host_path_the_operator_does_not_allow_gets_the_condition_and_no_statefulset(
    kubectl: Kubectl, operator: Operator, ns: str
):
    # The tier's operator runs with the default: no folder allowed.
    kubectl.apply(hub_cache_on_the_node(ns, "/var/lib/kubelet/../../../etc"), "--server-side")
    ready = wait_condition(kubectl, ns, "nodecache", "Ready", hostpaths.REASON)
    assert ready["status"] == "False"
    assert ready["message"].startswith(
        "spec.model.source.hub.cache.hostPath.path '/var/lib/kubelet/../../../etc' has a '..'"
    )
    degraded = condition(kubectl, ns, "nodecache", "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", hostpaths.REASON)
    wait_for_event(kubectl, ns, "nodecache", hostpaths.REASON)
    # Everything but the pods landed: the policy and the entry Service are there, and
    # neither StatefulSet ever was (the children land in one pass, policy first).
    assert kubectl.get("networkpolicy", "nodecache", ns)
    assert kubectl.get("service", "nodecache", ns)
    assert kubectl.get("statefulset", "nodecache-decode", ns) is None
    assert kubectl.get("statefulset", "nodecache-prefill", ns) is None

    # A plain path is refused the same way, and naming the fix.
    kubectl.apply(hub_cache_on_the_node(ns, "/var/cache/kvferry"), "--server-side")
    wait_until(
        lambda: "operator allows none" in condition(kubectl, ns, "nodecache", "Ready")["message"],
        60,
        "the refusal of /var/cache/kvferry",
    )
    message = condition(kubectl, ns, "nodecache", "Ready")["message"]
    assert "settings.hostPathPrefixes" in message and "KVFERRY_HOST_PATH_PREFIXES" in message
    assert kubectl.get("statefulset", "nodecache-decode", ns) is None


SECURITY_DOC = Path(__file__).resolve().parents[2] / "docs" / "security.md"
# The identities the documented policy names: the chart's operator, and the StatefulSet
# controller's in its two forms.
DOC_USERS = (
    "system:serviceaccount:kvferry-system:kvferry",
    "system:serviceaccount:kube-system:statefulset-controller",
    "system:kube-controller-manager",
)


def documented_policy(name: str, user: str) -> dict[str, Any]:
    """The ValidatingAdmissionPolicy docs/security.md gives, as a reader would copy it,
    with this cluster's identities in place of the documented ones: here the test's
    operator and the controller-manager both run as the admin user."""
    text = SECURITY_DOC.read_text()
    for block in re.findall(r"```yaml\n(.*?)```", text, re.S):
        doc = yaml.safe_load(textwrap.dedent(block))
        if doc.get("kind") == "ValidatingAdmissionPolicy":
            raw = json.dumps(doc)
            for documented in DOC_USERS:
                assert documented in raw, documented
                raw = raw.replace(documented, user)
            doc = json.loads(raw)
            doc["metadata"]["name"] = name
            return doc
    raise AssertionError("docs/security.md has no ValidatingAdmissionPolicy")


# Anyone else, with every RBAC right: only the policy can refuse them.
MALLORY = ("--as=mallory", "--as-group=system:masters")


def labelled_pod(ns: str, name: str, server_name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "labels": {api.LABEL_SERVER: server_name}},
        "spec": {"containers": [{"name": "c", "image": "busybox"}]},
    }


def test_the_documented_admission_policy_keeps_the_peer_label_to_kvferry(
    kubectl: Kubectl, operator: Operator, ns: str
):
    """Within a namespace anyone who may create pods may set labels: the policy in
    docs/security.md admits kvferry.io/server only from the operator (StatefulSets) and
    the StatefulSet controller (pods)."""
    me = kubectl.json("auth", "whoami")["status"]["userInfo"]["username"]
    name = f"kvferry-server-label-{ns}"
    binding = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": name},
        "spec": {
            "policyName": name,
            "validationActions": ["Deny"],
            "matchResources": {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}}
            },
        },
    }
    kubectl.apply([documented_policy(name, me), binding])
    try:
        # The API server loads a new policy asynchronously; once refused, it stays so.
        refused = wait_until(
            lambda: (
                (
                    p := kubectl.apply(
                        labelled_pod(ns, "intruder", "iso"),
                        *MALLORY,
                        "--dry-run=server",
                        check=False,
                    )
                ).returncode
                != 0
                and p
            ),
            60,
            "the policy in force",
        )
        assert "kvferry.io/server is set by the kvferry operator" in refused.stderr
        assert "not by mallory" in refused.stderr

        kubectl.apply(server(name="iso", namespace=ns), "--server-side")
        pod = wait_until(lambda: kubectl.get("pod", "iso-decode-0", ns), 60, "pod iso-decode-0")
        assert pod["metadata"]["labels"][api.LABEL_SERVER] == "iso"
        # Relabelling a pod, theirs or ours, is refused; other label edits pass.
        proc = kubectl.run(
            "label", "pod", "iso-decode-0", "-n", ns, f"{api.LABEL_SERVER}=other",
            "--overwrite", *MALLORY, check=False,
        )  # fmt: skip
        assert proc.returncode != 0 and "not by mallory" in proc.stderr
        kubectl.run("label", "pod", "iso-decode-0", "-n", ns, "team=a", *MALLORY)
        # Someone else's StatefulSet with the label in its template (full RBAC rights).
        sts = copy.deepcopy(kubectl.get("statefulset", "iso-decode", ns))
        sts["metadata"] = {"name": "impostor", "namespace": ns}
        sts.pop("status", None)
        proc = kubectl.apply(sts, *MALLORY, "--dry-run=server", check=False)
        assert proc.returncode != 0 and "not by mallory" in proc.stderr
        # Other workload kinds, even from the controllers' shared identity (here the
        # test's own user): their pods would be created by that identity and pass.
        template = {"metadata": {"labels": {api.LABEL_SERVER: "iso"}}, "spec": pod["spec"]}
        selector = {"matchLabels": {api.LABEL_SERVER: "iso"}}
        for kind, api_version, spec in (
            ("Deployment", "apps/v1", {"selector": selector, "template": template}),
            ("DaemonSet", "apps/v1", {"selector": selector, "template": template}),
            (
                "Job",
                "batch/v1",
                {"template": {**template, "spec": {**pod["spec"], "restartPolicy": "Never"}}},
            ),
            (
                "CronJob",
                "batch/v1",
                {
                    "schedule": "@daily",
                    "jobTemplate": {
                        "spec": {
                            "template": {
                                **template,
                                "spec": {**pod["spec"], "restartPolicy": "Never"},
                            }
                        }
                    },
                },
            ),
        ):
            obj = {
                "apiVersion": api_version,
                "kind": kind,
                "metadata": {"name": "impostor", "namespace": ns},
                "spec": spec,
            }
            proc = kubectl.apply(obj, "--dry-run=server", check=False)
            assert proc.returncode != 0 and "kvferry.io/server is set by" in proc.stderr, (
                kind,
                proc.stderr,
            )
    finally:
        kubectl.run("delete", "validatingadmissionpolicybinding", name, check=False)
        kubectl.run("delete", "validatingadmissionpolicy", name, check=False)
