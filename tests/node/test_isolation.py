"""No packet leaves the machine: what hack/node.sh set up so, checked where it acts."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest

from tests.node.cluster import NodeCluster
from tests.node.pods import in_pod


def route_to(address: str) -> str:
    """The main table's route the kernel picks for address: the longest prefix, then the
    lowest metric (`ip route get` cannot say: it answers EINVAL for a blackhole)."""
    out = subprocess.run(
        ["ip", "-4", "route", "show", "table", "main", "match", address],
        capture_output=True,
        text=True,
        timeout=10,
        check=True,
    ).stdout

    def rank(line: str) -> tuple[int, int]:
        words = line.split()
        dst = words[1] if words[0] in ("blackhole", "unreachable", "prohibit") else words[0]
        length = 0 if dst == "default" else int(dst.partition("/")[2] or 32)
        metric = int(words[words.index("metric") + 1]) if "metric" in words else 0
        return (length, -metric)

    return max(out.splitlines(), key=rank)


@pytest.mark.parametrize(
    ("address", "means"),
    [
        # a ClusterIP nobody programmed: dropped here, not sent to the default route
        ("10.232.0.99", "blackhole 10.232.0.0/24"),
        # a pod address: the bridge, and the blackhole under it should the bridge go
        ("10.231.200.7", "10.231.0.0/16 dev kvfnode0"),
    ],
)
def test_the_pod_and_service_ranges_never_take_the_default_route(
    nodes: NodeCluster, address: str, means: str
) -> None:
    """The host's route for either range ends on the machine."""
    assert means in route_to(address), route_to(address)


def test_pods_have_no_default_route(nodes: NodeCluster, web: dict[str, Any]) -> None:
    """A pod routes its bridge subnet and the Service range, nothing else."""
    routes = in_pod(nodes, "print(open('/proc/net/route').read())").splitlines()[1:]
    destinations = sorted(line.split()[1] for line in routes if line.strip())
    # /proc/net/route: little-endian hex; 10.231.0.0/16 and 10.232.0.0/24
    assert destinations == ["0000E70A", "0000E80A"], routes


def test_image_pulls_go_nowhere(nodes: NodeCluster) -> None:
    """containerd sends a pull to a dead local address, never to a registry."""
    proc = subprocess.run(
        [
            str(nodes.bin_dir / "crictl"),
            "-r",
            f"unix://{nodes.containerd_socket}",
            "pull",
            "registry.k8s.io/nothing:1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "127.0.0.1:9" in proc.stderr, proc.stderr


def test_both_ranges_have_a_blackhole_route_while_nodes_are_up(nodes: NodeCluster) -> None:
    """Under the bridge's own route too: should the bridge go, pod addresses stay here."""
    routes = subprocess.run(
        ["ip", "-4", "route", "show", "table", "main", "type", "blackhole"],
        capture_output=True,
        text=True,
        timeout=10,
        check=True,
    ).stdout
    prefixes = {w for line in routes.splitlines() for w in line.split() if "/" in w}
    assert {"10.231.0.0/16", "10.232.0.0/24"} <= prefixes, routes
