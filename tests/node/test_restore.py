"""`hack/node.sh down` leaves the machine as `up` found it."""

from __future__ import annotations

import os

from tests.node.cluster import NodeCluster, check
from tests.node.machine import snapshot


def test_down_restores_what_up_changed(nodes: NodeCluster) -> None:
    """Sysctls, iptables, routes, links, mounts, cgroups and host paths equal the
    snapshot from before `up`, and every process the scripts started is gone."""
    during = snapshot()
    # the run did change the machine: a comparison that cannot differ proves nothing
    changed = nodes.before.differences(during)
    assert {"iptables", "routes", "links", "cgroups"} <= changed.keys(), changed.keys()
    pids = nodes.process_ids()
    assert pids
    check(nodes.down(), "hack/node.sh down")
    assert nodes.before.differences(snapshot()) == {}
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        alive.append(pid)
    assert alive == []
