"""The node tier: real kubelet nodes from hack/node.sh (containerd, runc, bridge CNI,
kube-proxy, CoreDNS) on the local control plane, and pods that really run.

One node for the session (``hack/node.sh up 1``) on its own port (27443, or
KVFERRY_TEST_NODE_PORT) and state folder, so it never meets the cluster tier's planes
on 26443+. The pods run the kvferry image base (hack/images.sh base: Debian's python3),
loaded onto the node with ``hack/node.sh load``. What the machine looked like before
``up`` is kept, and ``test_restore.py`` checks ``down`` put it back. Without root or a
cgroup file system the tier skips, saying why (``-ra`` lists it); anything else that
stops ``up`` fails the tier with the scripts' output.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.manifests import ROOT
from tests.node.cluster import NAMESPACE, PORT, NodeCluster, cannot_run, check, node_sh
from tests.node.machine import snapshot
from tests.node.pods import SERVICE, web_pod
from tests.progress import step


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/node/" in str(item.fspath):
            item.add_marker(pytest.mark.node)


@pytest.fixture(scope="session")
def nodes() -> Iterator[NodeCluster]:
    reason = cannot_run()
    if reason:
        pytest.skip(reason)
    with step("node tier: building (or reusing) kubelet, kube-proxy, crictl, CoreDNS, pause image"):
        bin_dir = Path(check(node_sh("build", timeout=3600), "hack/node.sh build").split()[-1])
    with step("node tier: the pods' image (hack/images.sh base)"):
        base = subprocess.run(
            ["bash", str(ROOT / "hack" / "images.sh"), "base"],
            capture_output=True,
            text=True,
            timeout=1800,
        )
        image = check(base, "hack/images.sh base").split()[-1]
    before = snapshot()
    with step(f"node tier: hack/node.sh up 1 (port {PORT})"):
        try:
            up = node_sh("up", "1", timeout=600)
        except subprocess.TimeoutExpired:
            # What up started runs on in the background: tear it down, then fail.
            node_sh("down", timeout=300)
            raise
        if up.returncode != 0:
            node_sh("down", timeout=300)
            check(up, "hack/node.sh up 1")
    cluster = NodeCluster(Path(up.stdout.split()[-1]), before, bin_dir, image)
    try:
        with step(f"node tier: hack/node.sh load {image}"):
            cluster.load(image)
        cluster.kubectl.run("create", "namespace", NAMESPACE)
        yield cluster
    finally:
        if not cluster.is_down:
            check(cluster.down(), "hack/node.sh down")


@pytest.fixture(scope="session")
def web(nodes: NodeCluster) -> Iterator[dict[str, Any]]:
    nodes.kubectl.apply([web_pod(nodes.image), SERVICE])
    nodes.kubectl.run(
        "wait",
        "-n",
        NAMESPACE,
        "--for",
        "condition=Ready",
        "pod/web",
        "--timeout",
        "120s",
        timeout=130,
    )
    yield nodes.kubectl.json("get", "pod", "web", "-n", NAMESPACE)
