"""Disruption budgets on the real API server: what spec.<role>.maxUnavailable takes,
the PodDisruptionBudgets the operator applies from it as the API server stores them,
and what a node drain may then evict. A drain evicts through the Eviction API, which
is called here on one pod at a time (`kubectl drain` would cordon a node the other
tests of the session schedule on). The pods are kwok's: Ready once scheduled, and a
status write makes one not Ready, as a crash-looping engine is.

The decisions behind the defaults are in docs/production.md (Disruption)."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest

from kvferry_operator import api, render
from tests.cluster.conftest import Kubectl, Operator, wait_until
from tests.cluster.test_operator import make, wait_ready
from tests.manifests import INVALID, Invalid, merge, server

REFUSED = [c for c in INVALID if "max-unavailable" in c.id]
BUDGET_TIMEOUT = 60  # the disruption controller's first pass over a new PDB


def dry_run(kubectl: Kubectl, spec: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    manifest = merge(server(spec), {"metadata": {"namespace": "default"}})
    return kubectl.apply(manifest, "--server-side", "--dry-run=server", "-o", "json", check=False)


def wait_budget(kubectl: Kubectl, ns: str, name: str, field: str, value: int) -> None:
    """Until the PDB's status.<field> is ``value`` (kubectl wait watches the object)."""
    kubectl.run(
        "wait",
        f"poddisruptionbudget/{name}",
        "-n",
        ns,
        f"--for=jsonpath={{.status.{field}}}={value}",
        f"--timeout={BUDGET_TIMEOUT}s",
        timeout=BUDGET_TIMEOUT + 10,
    )


def evict(kubectl: Kubectl, ns: str, pod: str) -> subprocess.CompletedProcess[str]:
    """What `kubectl drain` does for each pod of the node."""
    body = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": pod}}
    return kubectl.run(
        "create",
        "--raw",
        f"/api/v1/namespaces/{ns}/pods/{pod}/eviction",
        "-f",
        "-",
        input=json.dumps(body),
        check=False,
    )


def pod_uid(kubectl: Kubectl, ns: str, pod: str) -> str:
    return kubectl.json("get", "pod", pod, "-n", ns)["metadata"]["uid"]


@pytest.mark.parametrize("value", [1, 0, "25%", "100%"], ids=str)
def test_max_unavailable_takes_pods_or_a_percentage_as_a_pdb_does(kubectl: Kubectl, value: Any):
    proc = dry_run(kubectl, {"decode": {"maxUnavailable": value}})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["spec"]["decode"]["maxUnavailable"] == value


@pytest.mark.parametrize("case", REFUSED, ids=lambda c: c.id)
def test_anything_else_is_refused_naming_the_field(kubectl: Kubectl, case: Invalid):
    proc = dry_run(kubectl, case.manifest["spec"])
    out = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode != 0, f"accepted: {out}"
    assert f"{case.path}: Invalid value" in out, out
    assert case.message in out, out


def test_the_stored_pdbs_are_the_rendered_ones_with_the_percentage_and_eviction_policy(
    kubectl: Kubectl, operator: Operator, ns: str
):
    kubectl.apply(
        make(ns, spec={"decode": {"replicas": 2, "maxUnavailable": "25%"}}), "--server-side"
    )
    wait_ready(kubectl, ns)
    stored = kubectl.get("dserver", "tiny", ns)
    rendered = {
        o["metadata"]["name"]: o
        for o in render.render(api.parse_server(stored))
        if o["kind"] == "PodDisruptionBudget"
    }
    for name, want in rendered.items():
        live = kubectl.get("poddisruptionbudget", name, ns)
        # Exactly what was rendered: a field the API server pruned (or an older
        # server without unhealthyPodEvictionPolicy) would be missing here.
        assert live["spec"] == want["spec"], name
        assert live["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    assert rendered["tiny-decode"]["spec"]["maxUnavailable"] == "25%"
    # The controller scales the percentage by the StatefulSet's replicas, rounding up:
    # 25% of 2 decode pods is 1 pod a drain may take.
    wait_budget(kubectl, ns, "tiny-decode", "expectedPods", 2)
    wait_budget(kubectl, ns, "tiny-decode", "disruptionsAllowed", 1)


def test_by_default_a_drain_may_take_a_role_s_only_pod(
    kubectl: Kubectl, operator: Operator, ns: str
):
    # The decision in docs/production.md: with one decode replica the server is down
    # until its pod is back, but a budget that refused would stall every upgrade of
    # the node instead (and force-draining clusters evict anyway, later).
    kubectl.apply(make(ns), "--server-side")
    wait_ready(kubectl, ns)
    wait_budget(kubectl, ns, "tiny-decode", "disruptionsAllowed", 1)
    before = pod_uid(kubectl, ns, "tiny-decode-0")
    proc = evict(kubectl, ns, "tiny-decode-0")
    assert proc.returncode == 0, proc.stderr
    # The StatefulSet brings the pod back (a new one, same name).
    wait_until(
        lambda: (p := kubectl.get("pod", "tiny-decode-0", ns)) and p["metadata"]["uid"] != before,
        30,
        "tiny-decode-0 recreated",
    )


def test_a_pod_that_is_not_ready_may_be_evicted_even_when_the_budget_allows_none(
    kubectl: Kubectl, operator: Operator, ns: str
):
    kubectl.apply(make(ns, spec={"decode": {"maxUnavailable": 0}}), "--server-side")
    wait_ready(kubectl, ns)
    wait_budget(kubectl, ns, "tiny-decode", "currentHealthy", 1)
    # A Ready pod is protected: maxUnavailable 0 refuses its eviction.
    refused = evict(kubectl, ns, "tiny-decode-0")
    assert refused.returncode != 0
    assert "would violate the pod's disruption budget" in refused.stderr, refused.stderr
    # The engine crash-loops: the kubelet would mark the pod not Ready.
    kubectl.run(
        "patch",
        "pod",
        "tiny-decode-0",
        "-n",
        ns,
        "--subresource=status",
        "-p",
        json.dumps(
            {"status": {"conditions": [{"type": "Ready", "status": "False", "reason": "Crash"}]}}
        ),
    )
    # Once the budget counts it unhealthy, IfHealthyBudget (the API's default) would
    # refuse this eviction for as long as the pod crash-loops, and block the drain.
    wait_budget(kubectl, ns, "tiny-decode", "currentHealthy", 0)
    proc = evict(kubectl, ns, "tiny-decode-0")
    assert proc.returncode == 0, proc.stderr
