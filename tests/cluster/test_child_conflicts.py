"""Child names taken by other objects, on the real API server (issue 20, item 11): a
server never takes over an object it does not control, and the CRD refuses the names
whose children would collide with another server's."""

from __future__ import annotations

from typing import Any

from tests.cluster.conftest import Kubectl, Operator, wait_until
from tests.kube import condition, wait_condition, wait_for_event
from tests.manifests import server


def users_service(ns: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "postgres", "namespace": ns, "labels": {"app": "postgres"}},
        "spec": {"selector": {"app": "postgres"}, "ports": [{"name": "pg", "port": 5432}]},
    }


def test_a_server_named_like_an_existing_service_leaves_it_alone_and_says_so(
    kubectl: Kubectl, operator: Operator, ns: str
):
    kubectl.apply(users_service(ns), "--server-side", "--field-manager=db-team")
    before = kubectl.get("service", "postgres", ns)
    assert before is not None
    kubectl.apply(server(name="postgres", namespace=ns), "--server-side")

    degraded = wait_condition(kubectl, ns, "postgres", "Degraded", "ChildConflict")
    assert degraded["status"] == "True"
    assert "Service postgres (controlled by nothing)" in degraded["message"]
    assert "rename this server" in degraded["message"]
    assert condition(kubectl, ns, "postgres", "Ready")["reason"] == "ChildConflict"
    wait_for_event(kubectl, ns, "postgres", "ChildConflict")
    # The server's other children landed.
    assert kubectl.get("statefulset", "postgres-decode", ns)
    assert kubectl.get("service", "postgres-decode", ns)

    after = kubectl.get("service", "postgres", ns)
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
    assert "ownerReferences" not in after["metadata"]
    managers = {m["manager"] for m in after["metadata"].get("managedFields", [])}
    assert "kvferry-operator" not in managers

    # Deleting the server must not garbage-collect the user's Service.
    kubectl.run("delete", "dserver", "postgres", "-n", ns, "--wait=true", timeout=60)
    wait_until(
        lambda: kubectl.get("statefulset", "postgres-decode", ns) is None,
        60,
        "the server's own children garbage-collected",
    )
    kept = kubectl.get("service", "postgres", ns)
    assert kept is not None and kept["metadata"]["uid"] == before["metadata"]["uid"]


def test_a_server_named_like_another_servers_child_is_refused_naming_the_rule(
    kubectl: Kubectl, ns: str
):
    for name in ("chat-decode", "chat-prefill"):
        proc = kubectl.apply(server(name=name, namespace=ns), "--server-side", check=False)
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0, f"accepted: {out}"
        assert "metadata.name must not end in -prefill or -decode" in out, out
        assert kubectl.get("dserver", name, ns) is None
    # A name that only contains a suffix is fine.
    kubectl.apply(server(name="chat-decoder", namespace=ns), "--server-side")


def test_a_burst_of_new_servers_still_leaves_a_users_object_alone(
    kubectl: Kubectl, operator: Operator, ns: str
):
    # Servers applied at once are looked up from one list per kind in the namespace
    # (ownership.NameLookup): what that list shows must hold a name as a read would.
    kubectl.apply(users_service(ns))
    before = kubectl.get("service", "postgres", ns)
    names = ["alpha", "postgres", "beta", "gamma"]
    kubectl.apply([server(name=n, namespace=ns) for n in names], "--server-side")
    wait_condition(kubectl, ns, "postgres", "Degraded", "ChildConflict")
    for name in ("alpha", "beta", "gamma"):
        wait_condition(kubectl, ns, name, "Ready", status="True", timeout=120)
        assert kubectl.get("service", name, ns)
    after = kubectl.get("service", "postgres", ns)
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
    assert "ownerReferences" not in after["metadata"]
