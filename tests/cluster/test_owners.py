"""spec.owners through the real API server and the real operator: what is accepted is
rendered into the decode sidecars' settings as written, and stored without defaults
(so GitOps tools see no drift). Refusals are in tests/manifests.py INVALID (owner-*),
run here by tests/cluster/test_operator.py::test_invalid_spec_is_rejected_by_the_api_server."""

from __future__ import annotations

import json
from typing import Any

from tests.cluster.conftest import Kubectl, Operator, wait_until
from tests.cluster.test_operator import make
from tests.kube import condition, wait_condition, wait_for_event

OWNERS = {"header": "X-Authenticated-User", "maxHandles": 16}


def sidecar_settings(kubectl: Kubectl, ns: str) -> dict[str, Any] | None:
    cm = kubectl.get("configmap", "tiny-sidecar", ns)
    return json.loads(cm["data"]["sidecar.json"]) if cm else None


def test_owners_reach_the_sidecar_settings_as_written(
    kubectl: Kubectl, operator: Operator, ns: str
):
    kubectl.apply(make(ns, spec={"owners": OWNERS}), "--server-side")
    settings = wait_until(
        lambda: (s := sidecar_settings(kubectl, ns)) and "ownerHeader" in s and s,
        60,
        f"{ns}/tiny-sidecar with ownerHeader",
    )
    assert {k: v for k, v in settings.items() if k.startswith("owner")} == {
        "ownerHeader": "X-Authenticated-User",
        "ownerMaxHandles": 16,
    }
    # Stored as written: no default added for the unset cap (the sidecar derives it).
    assert kubectl.get("dserver", "tiny", ns)["spec"]["owners"] == OWNERS


GATEWAY = [
    {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}},
        "podSelector": {"matchLabels": {"app": "gateway"}},
    }
]


def test_owners_with_every_pod_a_client_say_the_boundary_is_open(
    kubectl: Kubectl, operator: Operator, ns: str
):
    # Issue 38, item 1: spec.networkPolicy.clients at its default admits every pod of
    # every namespace to port 8000, so any pod can send another owner's header.
    kubectl.apply(make(ns, spec={"owners": OWNERS}), "--server-side")
    boundary = wait_condition(kubectl, ns, "tiny", "OwnerBoundary", "ClientsNotRestricted")
    assert boundary["status"] == "False"
    assert "spec.networkPolicy.clients" in boundary["message"]
    assert "namespaceSelector {}" in boundary["message"]
    assert "another owner's header" in boundary["message"]
    events = wait_for_event(kubectl, ns, "tiny", "ClientsNotRestricted")
    assert {e["type"] for e in events} == {"Warning"}
    # The same object stored: the API server kept the condition (declared in status).
    assert condition(kubectl, ns, "tiny", "OwnerBoundary")["reason"] == "ClientsNotRestricted"

    # Clients restricted to the gateway: True, and the policy admits only it.
    kubectl.run(
        "patch", "dserver", "tiny", "-n", ns, "--type=merge",
        "-p", json.dumps({"spec": {"networkPolicy": {"clients": GATEWAY}}}),
    )  # fmt: skip
    boundary = wait_condition(kubectl, ns, "tiny", "OwnerBoundary", "ClientsRestricted")
    assert boundary["status"] == "True"
    policy = wait_until(
        lambda: (
            (p := kubectl.get("networkpolicy", "tiny", ns))
            and any(rule.get("from") == GATEWAY for rule in p["spec"]["ingress"])
            and p
        ),
        60,
        "the NetworkPolicy admitting the gateway alone",
    )
    assert not any(
        peer == {"namespaceSelector": {}}
        for rule in policy["spec"]["ingress"]
        for peer in rule.get("from", [])
    )


def test_without_owners_there_is_no_owner_boundary_condition(
    kubectl: Kubectl, operator: Operator, ns: str
):
    kubectl.apply(make(ns), "--server-side")
    wait_condition(kubectl, ns, "tiny", "Progressing")
    assert condition(kubectl, ns, "tiny", "OwnerBoundary") == {}
