"""Missing prerequisites on a real API server: the operator's Pod Security rules
against the API server's own admission, and the Prerequisites condition with its
Event when Pod Security, the RDMA device plugin or Multus is missing."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from kvferry_operator import api, prerequisites, render
from tests.cluster.conftest import Kubectl, Operator, wait_until
from tests.cluster.test_operator import make
from tests.kube import condition, wait_condition, wait_for_event
from tests.manifests import EXAMPLES, load_example, server

RDMA = {"enabled": True, "resourceName": "rdma/hca_shared_devices_a"}
# Keeps prefill Pending on the fake nodes: a server whose pods all run lacks nothing,
# so the operator looks for missing prerequisites only while some pod is not ready.
NOWHERE = {"nodeSelector": {"kvferry.io/test": "no-such-node"}}
NAD_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": prerequisites.NAD_CRD},
    "spec": {
        "group": "k8s.cni.cncf.io",
        "scope": "Namespaced",
        "names": {
            "plural": "network-attachment-definitions",
            "singular": "network-attachment-definition",
            "kind": "NetworkAttachmentDefinition",
            "shortNames": ["net-attach-def"],
        },
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "x-kubernetes-preserve-unknown-fields": True,
                    }
                },
            }
        ],
    },
}


def variants() -> dict[str, dict[str, Any]]:
    """Servers whose pods differ in what Pod Security looks at."""
    hub_host_path = server({"model": {"source": {"hub": {"id": "o/m"}}}})
    del hub_host_path["spec"]["model"]["source"]["pvc"]
    hub_host_path["spec"]["model"]["source"]["hub"]["cache"] = {"hostPath": {"path": "/var/c"}}
    out = {p.stem: load_example(p) for p in EXAMPLES}
    out["hub-host-path"] = hub_host_path
    out["rdma-no-networks"] = server({"network": {"rdma": RDMA}})
    return out


@pytest.fixture(scope="module")
def psa_namespaces(kubectl: Kubectl) -> Iterator[dict[str, str]]:
    names = {level: f"psa-{level}-{uuid.uuid4().hex[:6]}" for level in ("baseline", "restricted")}
    for level, name in names.items():
        kubectl.run("create", "namespace", name)
        kubectl.run("label", "namespace", name, f"{prerequisites.PSA_ENFORCE}={level}")
    for name in names.values():
        wait_until(
            lambda n=name: kubectl.get("serviceaccount", "default", n), 60, f"{name}/default SA"
        )
    yield names
    for name in names.values():
        kubectl.run("delete", "namespace", name, "--wait=false", check=False)


@pytest.mark.parametrize("level", ["baseline", "restricted"])
@pytest.mark.parametrize("variant", sorted(variants()))
def test_pod_security_rules_agree_with_the_api_server(
    kubectl: Kubectl, psa_namespaces: dict[str, str], level: str, variant: str
):
    # If these disagree, the operator would warn about pods the cluster admits, or
    # stay silent about pods it refuses.
    srv = api.parse_server(variants()[variant])
    for sts in (o for o in render.render(srv) if o["kind"] == "StatefulSet"):
        spec = sts["spec"]["template"]["spec"]
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"{sts['metadata']['name']}-0"},
            "spec": spec,
        }
        proc = kubectl.run(
            "create",
            "--dry-run=server",
            "-n",
            psa_namespaces[level],
            "-f",
            "-",
            input=json.dumps(pod),
            check=False,
        )
        ours = prerequisites.pod_security_violations(spec, level)
        admitted = proc.returncode == 0
        assert admitted == (ours == []), (
            f"{variant}/{sts['metadata']['name']} at {level}: API server "
            f"{'admits' if admitted else 'refuses: ' + proc.stderr.strip()}; ours: {ours}"
        )


def prerequisites_condition(kubectl: Kubectl, ns: str) -> dict[str, Any]:
    return condition(kubectl, ns, "tiny", api.COND_PREREQUISITES)


def wait_reason(kubectl: Kubectl, ns: str, reason: str, timeout: float = 60) -> dict[str, Any]:
    return wait_condition(kubectl, ns, "tiny", api.COND_PREREQUISITES, reason, timeout=timeout)


def test_a_namespace_refusing_the_pods_is_a_condition_an_event_and_the_ready_reason(
    kubectl: Kubectl, operator: Operator, ns: str
):
    kubectl.run("label", "namespace", ns, f"{prerequisites.PSA_ENFORCE}=baseline")
    kubectl.apply(make(ns, spec={"network": {"rdma": RDMA}}), "--server-side")
    cond = wait_reason(kubectl, ns, "PodSecurityForbids")
    assert cond["status"] == "False"
    assert "container engine adds IPC_LOCK" in cond["message"]
    assert f"{prerequisites.PSA_ENFORCE}=privileged" in cond["message"]
    # The StatefulSet controller really cannot create the pods.
    assert kubectl.json("get", "pods", "-n", ns)["items"] == []
    ready = condition(kubectl, ns, "tiny", "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "PodSecurityForbids")
    (event, *_) = wait_for_event(kubectl, ns, "tiny", "PodSecurityForbids")
    assert event["type"] == "Warning"
    assert "IPC_LOCK" in event["message"]


def test_no_node_offering_the_rdma_resource_is_named_with_the_fix(
    kubectl: Kubectl, operator: Operator, ns: str
):
    rdma = {**RDMA, "resourceName": "rdma/hca_shared_devices_b"}
    kubectl.apply(make(ns, spec={"network": {"rdma": rdma}}), "--server-side")
    cond = wait_reason(kubectl, ns, "NoRDMANodes")
    assert cond["message"] == (
        "no schedulable node offers rdma/hca_shared_devices_b (spec.network.rdma.count asks "
        "for it): install the RDMA shared device plugin (or the NVIDIA Network Operator) with "
        "a resource of that name, or fix spec.network.rdma.resourceName"
    )
    (event, *_) = wait_for_event(kubectl, ns, "tiny", "NoRDMANodes")
    assert event["type"] == "Warning"


def test_multus_and_its_networks_are_checked(kubectl: Kubectl, operator: Operator, ns: str):
    spec = {"prefill": NOWHERE, "network": {"rdma": {**RDMA, "networks": ["rdma-net-a"]}}}
    installed = kubectl.get("crd", prerequisites.NAD_CRD, "") is not None
    assert not installed, "another test left the NetworkAttachmentDefinition CRD behind"
    kubectl.apply(make(ns, spec=spec), "--server-side")
    cond = wait_reason(kubectl, ns, "NoMultus")
    assert prerequisites.NAD_CRD in cond["message"] and "install Multus" in cond["message"]
    wait_for_event(kubectl, ns, "tiny", "NoMultus")
    try:
        kubectl.apply(NAD_CRD)
        kubectl.run("wait", "--for=condition=Established", f"crd/{prerequisites.NAD_CRD}")
        cond = wait_reason(kubectl, ns, "NetworkAttachmentDefinitionMissing")
        assert cond["message"].startswith(
            f"NetworkAttachmentDefinition {ns}/rdma-net-a does not exist: create it"
        )
        kubectl.apply(
            {
                "apiVersion": "k8s.cni.cncf.io/v1",
                "kind": "NetworkAttachmentDefinition",
                "metadata": {"name": "rdma-net-a", "namespace": ns},
                "spec": {"config": "{}"},
            }
        )
        cond = wait_reason(kubectl, ns, "Met")
        assert cond["status"] == "True"
    finally:
        kubectl.run("delete", "crd", prerequisites.NAD_CRD, "--wait=false", check=False)


def test_a_server_with_everything_it_needs_meets_its_prerequisites(
    kubectl: Kubectl, operator: Operator, ns: str
):
    kubectl.apply(make(ns, spec={"prefill": NOWHERE}), "--server-side")
    cond = wait_reason(kubectl, ns, "Met")
    assert (cond["status"], cond["message"]) == ("True", "no missing prerequisite found")
