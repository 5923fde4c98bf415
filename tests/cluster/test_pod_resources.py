"""The engine's and the sidecar's resources and probes on the real API server.

The CRD accepts the resource maps and startupSeconds; the StatefulSets the operator
applies read back with the pod template's resources and probes exactly as rendered
from the stored server (the API server keeps every field, drops none); and the pods the
StatefulSet controller creates from the default template are Guaranteed by the API
server's own QoS computation (status.qosClass), not only by the unit tier's copy of it.
"""

from __future__ import annotations

from typing import Any

from kvferry_operator import api, render
from tests.cluster.conftest import Kubectl, Operator, wait_until
from tests.manifests import server

PROBES = ("startupProbe", "readinessProbe", "livenessProbe")

# Every new field: requests below limits, resources beyond cpu and memory (the fake
# nodes have no hugepages: the pods stay Pending, the objects are what is checked), a
# startup budget of its own, and a sidecar allowed to burst.
CUSTOM = {
    "prefill": {
        "startupSeconds": 5400,
        "resources": {
            "memory": "200Gi",
            "requests": {"memory": "150Gi", "cpu": "4"},
            "limits": {"cpu": "16", "hugepages-2Mi": "2Gi", "example.com/npu": 1},
        },
    },
    "decode": {
        "startupSeconds": 600,
        "sidecarResources": {"requests": {"cpu": "1"}, "limits": {"cpu": "2", "memory": "2Gi"}},
    },
}


def shape(container: dict[str, Any]) -> dict[str, Any]:
    """What is compared; quantities as strings, as the API server writes every Quantity
    (render writes GPU and RDMA counts as integers)."""
    out = {k: container.get(k) for k in ("name", *PROBES)}
    out["resources"] = {
        kind: {k: str(v) for k, v in amounts.items()}
        for kind, amounts in container.get("resources", {}).items()
    }
    return out


def pod_shapes(template: dict[str, Any]) -> list[dict[str, Any]]:
    spec = template["spec"]
    return [shape(c) for c in spec["initContainers"] + spec["containers"]]


def test_resources_and_probes_round_trip_through_the_api_server(
    kubectl: Kubectl, operator: Operator, ns: str
):
    kubectl.apply(server(CUSTOM, name="tiny", namespace=ns), "--server-side")
    stored = kubectl.get("dserver", "tiny", ns)
    assert stored["spec"]["prefill"]["resources"]["limits"]["hugepages-2Mi"] == "2Gi"
    assert stored["spec"]["decode"]["startupSeconds"] == 600
    expected = {
        o["metadata"]["name"]: pod_shapes(o["spec"]["template"])
        for o in render.render(api.parse_server(stored))
        if o["kind"] == "StatefulSet"
    }
    for name, shapes in expected.items():
        sts = wait_until(lambda n=name: kubectl.get("statefulset", n, ns), 30, f"{name} applied")
        assert pod_shapes(sts["spec"]["template"]) == shapes, name
    prefill = expected["tiny-prefill"][1]
    assert prefill["resources"]["requests"] == {"cpu": "4", "memory": "150Gi"}
    assert prefill["startupProbe"]["failureThreshold"] == 540
    assert expected["tiny-decode"][0]["startupProbe"]["httpGet"]["path"] == "/healthz"


def test_the_default_pods_are_guaranteed_by_the_api_servers_count(
    kubectl: Kubectl, operator: Operator, ns: str
):
    kubectl.apply(server(name="tiny", namespace=ns), "--server-side")
    pods = wait_until(
        lambda: (
            (got := kubectl.json("get", "pods", "-n", ns, "-l", "app.kubernetes.io/instance=tiny"))
            and len(got["items"]) == 2
            and got["items"]
        ),
        60,
        "both pods created",
    )
    assert {p["metadata"]["name"]: p["status"]["qosClass"] for p in pods} == {
        "tiny-prefill-0": "Guaranteed",
        "tiny-decode-0": "Guaranteed",
    }
