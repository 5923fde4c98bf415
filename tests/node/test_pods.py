"""Pods on a real kubelet: what kwok's fake pods can never show.

One web pod (a native sidecar beside a tiny HTTP server, read-only root, non-root, a
projected token) behind a Service, applied once for the module; each test checks one
thing the kubelet, containerd, kube-proxy or CoreDNS must really do.
"""

from __future__ import annotations

import json
from typing import Any

from tests.kube import wait_until
from tests.node.cluster import NAMESPACE, NodeCluster
from tests.node.pods import AUDIENCE, UID, in_pod


def test_containers_really_run_and_the_native_sidecar_starts_first(
    nodes: NodeCluster, web: dict[str, Any]
) -> None:
    """containerd ids that containerd itself lists as running, no restarts, and the main
    container found the sidecar's file: the kubelet waited for the sidecar's startup probe."""
    statuses = web["status"]["initContainerStatuses"] + web["status"]["containerStatuses"]
    assert {s["name"] for s in statuses} == {"sidecar", "web"}
    running = json.loads(nodes.crictl("ps", "-o", "json"))["containers"]
    running_ids = {c["id"] for c in running if c["state"] == "CONTAINER_RUNNING"}
    for s in statuses:
        assert s["containerID"].startswith("containerd://"), s
        assert s["containerID"].removeprefix("containerd://") in running_ids, s["name"]
        assert s["restartCount"] == 0, s
        assert "running" in s["state"], s
    by_name = {s["name"]: s for s in statuses}
    assert by_name["sidecar"]["started"] is True
    assert (
        by_name["sidecar"]["state"]["running"]["startedAt"]
        <= by_name["web"]["state"]["running"]["startedAt"]
    )
    log = nodes.kubectl.run("logs", "-n", NAMESPACE, "web", "-c", "web").stdout
    assert "sidecar-seen-at-start True" in log, log


def test_read_only_root_and_non_root_user_hold(nodes: NodeCluster, web: dict[str, Any]) -> None:
    """runc mounted the root read-only and ran the process as the asked-for user."""
    code = "import os\ntry:\n open('/x', 'w')\nexcept OSError as e:\n print(e.strerror)\n"
    code += "print(os.getuid())"
    out = in_pod(nodes, code)
    assert out.split("\n")[:2] == ["Read-only file system", str(UID)], out
    assert (
        in_pod(nodes, "open('/shared/ok','w').write('1'); print('writable')").strip() == "writable"
    )


def test_run_as_non_root_refuses_uid_0(nodes: NodeCluster) -> None:
    """The kubelet refuses a container that would run as root under runAsNonRoot."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "root", "namespace": NAMESPACE},
        "spec": {
            "containers": [
                {
                    "name": "c",
                    "image": nodes.image,
                    "imagePullPolicy": "Never",
                    "command": ["sleep", "60"],
                    "securityContext": {"runAsNonRoot": True, "runAsUser": 0},
                }
            ]
        },
    }
    nodes.kubectl.apply(pod)
    try:

        def refused() -> str:
            s = nodes.kubectl.json("get", "pod", "root", "-n", NAMESPACE)["status"]
            waiting = (s.get("containerStatuses") or [{}])[0].get("state", {}).get("waiting", {})
            return (
                waiting.get("message", "")
                if waiting.get("reason") == "CreateContainerConfigError"
                else ""
            )

        message = wait_until(refused, 60, "the kubelet's refusal of uid 0")
        assert "non-root" in message, message
    finally:
        nodes.kubectl.run("delete", "pod", "root", "-n", NAMESPACE, "--wait=false")


def test_a_pod_resolves_a_service_by_dns_and_reaches_its_cluster_ip(
    nodes: NodeCluster, web: dict[str, Any]
) -> None:
    """CoreDNS answers the Service's name with its ClusterIP, kube-proxy routes it to the
    pod, and a name outside the cluster does not resolve (DNS forwards nowhere)."""
    cluster_ip = nodes.kubectl.json("get", "service", "echo", "-n", NAMESPACE)["spec"]["clusterIP"]
    code = f"""
import socket, urllib.request
print(socket.gethostbyname("echo"), socket.gethostbyname("echo.{NAMESPACE}.svc.cluster.local"))
print(urllib.request.urlopen("http://echo.{NAMESPACE}.svc/", timeout=3).read().decode())
try:
    print(socket.gethostbyname("example.com"))
except OSError:
    print("unresolved")
"""
    # kube-proxy programs the Service within its 1 s minimum sync after the endpoint is ready
    out = wait_until(lambda: in_pod(nodes, code), 30, "the Service through DNS and its ClusterIP")
    assert out.split("\n")[:3] == [f"{cluster_ip} {cluster_ip}", "web", "unresolved"], out


def test_a_pod_reaches_the_api_server_with_its_token(
    nodes: NodeCluster, web: dict[str, Any]
) -> None:
    """Through the `kubernetes` Service by name and TLS with the pod's CA bundle, the
    API server authenticates the pod's service-account token."""
    code = """
import json, ssl, urllib.request
sa = "/var/run/secrets/kubernetes.io/serviceaccount/"
ctx = ssl.create_default_context(cafile=sa + "ca.crt")
url = "https://kubernetes.default.svc/apis/authentication.k8s.io/v1/selfsubjectreviews"
body = {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}
auth = {"Authorization": "Bearer " + open(sa + "token").read()}
req = urllib.request.Request(url, data=json.dumps(body).encode(),
                             headers={**auth, "Content-Type": "application/json"})
review = json.load(urllib.request.urlopen(req, context=ctx, timeout=5))
print(review["status"]["userInfo"]["username"])
"""
    out = wait_until(lambda: in_pod(nodes, code), 30, "the API server from the pod")
    assert out.strip() == f"system:serviceaccount:{NAMESPACE}:default", out


def test_token_review_authenticates_the_projected_token_for_its_audience_only(
    nodes: NodeCluster, web: dict[str, Any]
) -> None:
    """The kubelet's projected token passes TokenReview for its audience, not for another."""
    token = in_pod(nodes, "print(open('/var/run/secrets/tokens/token').read())").strip()

    def review(audience: str) -> dict[str, Any]:
        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenReview",
            "spec": {"token": token, "audiences": [audience]},
        }
        out = nodes.kubectl.run("create", "-f", "-", "-o", "json", input=json.dumps(body)).stdout
        return json.loads(out)["status"]

    ok = review(AUDIENCE)
    assert ok["authenticated"] is True, ok
    assert ok["user"]["username"] == f"system:serviceaccount:{NAMESPACE}:default"
    assert ok["user"]["extra"]["authentication.kubernetes.io/pod-name"] == ["web"]
    wrong = review("https://kubernetes.default.svc")
    assert not wrong.get("authenticated"), wrong
