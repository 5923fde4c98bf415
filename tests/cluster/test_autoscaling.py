"""Autoscaling each role through its RoleScaler, on a real API server and HPA controller.

The local control plane runs kube-controller-manager (so the HPA controller) but no
metrics-server: an HPA reads and writes /scale, and scales to its minReplicas without
metrics, which is enough to show the loop end to end. The operator must follow every
scale of either role (StatefulSet and the sidecars' topology together) and never undo
it: not on its next safety pass, not when a child drifts.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from tests.cluster.conftest import Kubectl, Operator, wait_until
from tests.cluster.test_operator import make, wait_ready
from tests.manifests import ROOT, load_example

EXTERNAL = {"scaling": {"mode": "External"}}
TIMEOUT = 60


def scaler(kubectl: Kubectl, ns: str, role: str, name: str = "tiny") -> dict[str, Any] | None:
    return kubectl.get("rolescaler", f"{name}-{role}", ns)


def sts_replicas(kubectl: Kubectl, ns: str, role: str) -> int | None:
    sts = kubectl.get("statefulset", f"tiny-{role}", ns)
    return sts["spec"]["replicas"] if sts else None


def topology(kubectl: Kubectl, ns: str) -> dict[str, Any]:
    cm = kubectl.get("configmap", "tiny-sidecar", ns) or {"data": {}}
    return json.loads(cm["data"].get("topology.json", "{}"))


def wait_scaled(kubectl: Kubectl, ns: str, prefill: int, decode: int) -> None:
    """The StatefulSets and the topology the sidecars read show the counts."""
    wait_until(
        lambda: (
            (sts_replicas(kubectl, ns, "prefill"), sts_replicas(kubectl, ns, "decode"))
            == (prefill, decode)
            and len(topology(kubectl, ns)["prefillEngines"]) == prefill
            and len(topology(kubectl, ns)["decodeSidecars"]) == decode
        ),
        TIMEOUT,
        f"StatefulSets and topology at prefill={prefill} decode={decode}",
    )


def safety_passes(op: Operator) -> int:
    return op.log().count("safety pass done")


def replicas_managers(obj: dict[str, Any]) -> set[str]:
    """Field managers that own spec.replicas."""
    return {
        m["manager"]
        for m in obj["metadata"].get("managedFields", [])
        if "f:replicas" in (m.get("fieldsV1") or {}).get("f:spec", {})
    }


def test_kubectl_scale_of_each_role_is_followed_and_never_undone(
    kubectl: Kubectl, operator: Operator, ns: str
):
    kubectl.apply(make(ns, spec={"prefill": EXTERNAL, "decode": EXTERNAL}), "--server-side")
    for role in ("prefill", "decode"):
        created = wait_until(
            lambda role=role: (
                (s := scaler(kubectl, ns, role)) and s.get("status", {}).get("selector") and s
            ),
            TIMEOUT,
            f"RoleScaler tiny-{role} with a status",
        )
        assert created["spec"] == {"serverName": "tiny", "role": role, "replicas": 1}
        assert created["status"]["selector"] == (
            f"app.kubernetes.io/name=kvferry,app.kubernetes.io/instance=tiny,kvferry.io/role={role}"
        )
        ref = created["metadata"]["ownerReferences"][0]
        assert (ref["kind"], ref["name"], ref["controller"]) == (
            "DisaggregatedServer",
            "tiny",
            True,
        )
    wait_ready(kubectl, ns)

    kubectl.run("scale", "rolescaler", "tiny-prefill", "--replicas=3", "-n", ns)
    kubectl.run("scale", "rolescaler", "tiny-decode", "--replicas=2", "-n", ns)
    wait_scaled(kubectl, ns, prefill=3, decode=2)
    assert topology(kubectl, ns)["prefillEngines"][2].startswith(
        f"http://tiny-prefill-2.tiny-prefill.{ns}.svc:"
    )
    wait_ready(kubectl, ns)
    st = wait_until(
        lambda: (
            (s := kubectl.get("dserver", "tiny", ns)["status"])["prefill"]["display"] == "3/3" and s
        ),
        TIMEOUT,
        "server status 3/3 prefill",
    )
    assert st["prefill"]["desiredReplicas"] == 3
    assert st["prefill"]["scaledBy"] == "RoleScaler tiny-prefill"
    assert st["decode"]["desiredReplicas"] == 2 and st["decode"]["display"] == "2/2"
    wait_until(
        lambda: scaler(kubectl, ns, "prefill")["status"].get("readyReplicas") == 3,
        TIMEOUT,
        "RoleScaler tiny-prefill status.readyReplicas 3",
    )
    # The scale through /scale reads back as the scale subresource too (what an HPA sees).
    raw = f"/apis/kvferry.io/v1alpha1/namespaces/{ns}/rolescalers/tiny-prefill/scale"
    scale = json.loads(kubectl.run("get", "--raw", raw).stdout)
    assert scale["spec"]["replicas"] == 3 and scale["status"]["replicas"] == 3

    # Two safety passes later (the fixture's pass runs every 5 s) nothing was undone,
    # and spec.replicas is kubectl's alone: the operator never wrote it after the seed.
    start = safety_passes(operator)
    wait_until(lambda: safety_passes(operator) >= start + 2, TIMEOUT, "two safety passes")
    assert (sts_replicas(kubectl, ns, "prefill"), sts_replicas(kubectl, ns, "decode")) == (3, 2)
    for role, want in (("prefill", 3), ("decode", 2)):
        obj = scaler(kubectl, ns, role)
        assert obj["spec"]["replicas"] == want
        assert "kvferry-operator" not in replicas_managers(obj), obj["metadata"]["managedFields"]

    # A hand edit of the StatefulSet is drift: restored to the RoleScaler's count, not
    # to spec.prefill.replicas (1).
    kubectl.run("scale", "statefulset", "tiny-prefill", "--replicas=1", "-n", ns)
    wait_until(lambda: sts_replicas(kubectl, ns, "prefill") == 3, TIMEOUT, "drift restored to 3")

    # A restarted operator renders from the RoleScalers too (the child watches' first
    # listing, then a safety pass; a landed generation is not applied again): nothing
    # goes back to the spec's 1.
    operator.stop()
    operator.start()
    start = safety_passes(operator)
    wait_until(lambda: safety_passes(operator) > start, TIMEOUT, "a safety pass after restart")
    assert (sts_replicas(kubectl, ns, "prefill"), sts_replicas(kubectl, ns, "decode")) == (3, 2)
    assert len(topology(kubectl, ns)["decodeSidecars"]) == 2

    # Deleted by hand: created again at the count running now, not the spec's.
    kubectl.run("delete", "rolescaler", "tiny-decode", "-n", ns)
    wait_until(
        lambda: (s := scaler(kubectl, ns, "decode")) and s["spec"]["replicas"] == 2,
        TIMEOUT,
        "RoleScaler tiny-decode created again at 2",
    )
    assert sts_replicas(kubectl, ns, "decode") == 2


def test_switching_modes_seeds_at_the_running_count_and_never_scales_down(
    kubectl: Kubectl, operator: Operator, ns: str
):
    kubectl.apply(make(ns, spec={"prefill": {"replicas": 3}}), "--server-side")
    wait_scaled(kubectl, ns, prefill=3, decode=1)
    generation = kubectl.get("statefulset", "tiny-prefill", ns)["metadata"]["generation"]

    # One edit that switches to External and lowers the spec's count: the RoleScaler
    # is seeded at the 3 that run, and the StatefulSet's spec never changes (its
    # generation would move with any write of replicas, even 3 -> 1 -> 3).
    kubectl.run(
        "patch", "dserver", "tiny", "-n", ns, "--type=merge",
        "-p", json.dumps({"spec": {"prefill": {"replicas": 1, **EXTERNAL}}}),
    )  # fmt: skip
    wait_until(
        lambda: (s := scaler(kubectl, ns, "prefill")) and s["spec"]["replicas"] == 3,
        TIMEOUT,
        "RoleScaler tiny-prefill seeded at 3",
    )
    wait_until(
        lambda: (
            (kubectl.get("dserver", "tiny", ns).get("status") or {})
            .get("prefill", {})
            .get("scaledBy")
            == "RoleScaler tiny-prefill"
        ),
        TIMEOUT,
        "status.prefill.scaledBy names the RoleScaler",
    )
    sts = kubectl.get("statefulset", "tiny-prefill", ns)
    assert sts["spec"]["replicas"] == 3
    assert sts["metadata"]["generation"] == generation, "the StatefulSet's count was written"

    # Back to Static: the spec rules again and the RoleScaler goes.
    kubectl.run(
        "patch", "dserver", "tiny", "-n", ns, "--type=merge",
        "-p", json.dumps({"spec": {"prefill": {"scaling": {"mode": "Static"}}}}),
    )  # fmt: skip
    wait_until(lambda: scaler(kubectl, ns, "prefill") is None, TIMEOUT, "RoleScaler deleted")
    wait_scaled(kubectl, ns, prefill=1, decode=1)
    wait_until(
        lambda: (
            kubectl.get("dserver", "tiny", ns)["status"]["prefill"]["scaledBy"]
            == "spec.prefill.replicas"
        ),
        TIMEOUT,
        "status.prefill.scaledBy back to the spec",
    )


def test_an_hpa_scales_a_rolescaler_and_the_role_follows(
    kubectl: Kubectl, operator: Operator, ns: str
):
    kubectl.apply(make(ns, spec={"decode": EXTERNAL}), "--server-side")
    wait_until(
        lambda: (s := scaler(kubectl, ns, "decode")) and s.get("status", {}).get("selector"),
        TIMEOUT,
        "RoleScaler tiny-decode with a selector",
    )
    # No metrics-server here: below minReplicas the HPA controller scales to it without
    # metrics, through the RoleScaler's /scale (what KEDA's HPA does too).
    kubectl.apply(
        {
            "apiVersion": "autoscaling/v2",
            "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": "tiny-decode", "namespace": ns},
            "spec": {
                "scaleTargetRef": {
                    "apiVersion": "kvferry.io/v1alpha1",
                    "kind": "RoleScaler",
                    "name": "tiny-decode",
                },
                "minReplicas": 2,
                "maxReplicas": 4,
                "metrics": [
                    {
                        "type": "Resource",
                        "resource": {
                            "name": "cpu",
                            "target": {"type": "Utilization", "averageUtilization": 70},
                        },
                    }
                ],
            },
        }
    )
    wait_until(
        lambda: scaler(kubectl, ns, "decode")["spec"]["replicas"] == 2,
        120,  # the HPA controller syncs every 15 s
        "the HPA scaled RoleScaler tiny-decode to its minReplicas",
    )
    wait_scaled(kubectl, ns, prefill=1, decode=2)
    hpa = wait_until(
        lambda: (
            (h := kubectl.get("hpa", "tiny-decode", ns))
            and any(c["type"] == "AbleToScale" for c in h.get("status", {}).get("conditions", []))
            and h
        ),
        120,
        "HPA conditions",
    )
    able = next(c for c in hpa["status"]["conditions"] if c["type"] == "AbleToScale")
    assert able["status"] == "True", able
    assert "kvferry-operator" not in replicas_managers(scaler(kubectl, ns, "decode"))


def test_rolescaler_validation(kubectl: Kubectl, operator: Operator, ns: str):
    kubectl.apply(make(ns, spec={"prefill": EXTERNAL}), "--server-side")
    wait_until(lambda: scaler(kubectl, ns, "prefill"), TIMEOUT, "RoleScaler tiny-prefill")
    over = kubectl.run(
        "scale", "rolescaler", "tiny-prefill", "--replicas=1001", "-n", ns, check=False
    )
    assert over.returncode != 0 and "1000" in over.stderr, over.stderr
    moved = kubectl.run(
        "patch", "rolescaler", "tiny-prefill", "-n", ns, "--type=merge",
        "-p", json.dumps({"spec": {"role": "decode"}}), check=False,
    )  # fmt: skip
    assert moved.returncode != 0 and "serverName and role are immutable" in moved.stderr
    columns = kubectl.run("get", "rolescaler", "tiny-prefill", "-n", ns).stdout.split("\n")[0]
    assert columns.split() == ["NAME", "SERVER", "ROLE", "DESIRED", "CURRENT", "READY", "AGE"]


def test_the_example_hpas_reach_the_example_rolescalers(
    kubectl: Kubectl, operator: Operator, ns: str
):
    """examples/autoscaling.yaml with examples/autoscaling/hpa.yaml, as the docs apply
    them: each HPA finds its RoleScaler's /scale (AbleToScale); with no metrics adapter
    here their Pods metrics are missing, which the HPA says too (ScalingActive=False)."""
    server = load_example(ROOT / "examples" / "autoscaling.yaml")
    server["metadata"]["namespace"] = ns
    kubectl.apply(server, "--server-side")
    hpas = list(yaml.safe_load_all((ROOT / "examples" / "autoscaling" / "hpa.yaml").read_text()))
    for hpa in hpas:
        hpa["metadata"]["namespace"] = ns
    kubectl.apply(hpas)
    name = server["metadata"]["name"]
    for role in ("prefill", "decode"):
        wait_until(
            lambda role=role: (s := scaler(kubectl, ns, role, name)) and s["spec"]["replicas"] == 2,
            TIMEOUT,
            f"RoleScaler {name}-{role} seeded at the example's 2",
        )
        conditions = wait_until(
            lambda role=role: (
                {
                    c["type"]: c["status"]
                    for c in (kubectl.get("hpa", f"{name}-{role}", ns) or {})
                    .get("status", {})
                    .get("conditions", [])
                }.get("ScalingActive")
                and {
                    c["type"]: c["status"]
                    for c in kubectl.get("hpa", f"{name}-{role}", ns)["status"]["conditions"]
                }
            ),
            120,  # the HPA controller syncs every 15 s
            f"HPA {name}-{role} conditions",
        )
        assert conditions["AbleToScale"] == "True", conditions
        assert conditions["ScalingActive"] == "False", conditions  # no metrics adapter here


def lookalike(ns: str, uid: str | None) -> dict[str, Any]:
    """A RoleScaler of another name carrying server tiny's decode labels, with a
    controller reference to tiny when ``uid`` is given."""
    meta: dict[str, Any] = {
        "name": "evil-decode",
        "namespace": ns,
        "labels": {
            "app.kubernetes.io/name": "kvferry",
            "app.kubernetes.io/instance": "tiny",
            "app.kubernetes.io/component": "scaler",
            "app.kubernetes.io/managed-by": "kvferry-operator",
            "app.kubernetes.io/part-of": "kvferry",
            "kvferry.io/role": "decode",
        },
    }
    if uid:
        meta["ownerReferences"] = [
            {
                "apiVersion": "kvferry.io/v1alpha1",
                "kind": "DisaggregatedServer",
                "name": "tiny",
                "uid": uid,
                "controller": True,
                "blockOwnerDeletion": False,
            }
        ]
    return {
        "apiVersion": "kvferry.io/v1alpha1",
        "kind": "RoleScaler",
        "metadata": meta,
        "spec": {"serverName": "tiny", "role": "decode", "replicas": 3},
    }


@pytest.mark.parametrize("controlled", [True, False], ids=["controller-ref", "no-ref"])
def test_a_lookalike_rolescaler_changes_nothing_for_the_server(
    kubectl: Kubectl, operator: Operator, ns: str, controlled: bool
):
    # The look-alike is there before the server's own RoleScaler, so the watch's index
    # holds it first under the server's labels.
    kubectl.apply(make(ns), "--server-side")
    wait_scaled(kubectl, ns, prefill=1, decode=1)
    uid = kubectl.get("dserver", "tiny", ns)["metadata"]["uid"]
    kubectl.apply(lookalike(ns, uid if controlled else None), "--server-side")
    kubectl.run(
        "patch", "dserver", "tiny", "-n", ns, "--type=merge",
        "-p", json.dumps({"spec": {"decode": EXTERNAL}}),
    )  # fmt: skip
    wait_until(
        lambda: (s := scaler(kubectl, ns, "decode")) and s["spec"]["replicas"] == 1,
        TIMEOUT,
        "RoleScaler tiny-decode created at the running 1",
    )
    # The StatefulSet keeps being applied, from tiny-decode's count (not evil-decode's 3).
    kubectl.run("scale", "rolescaler", "tiny-decode", "--replicas=2", "-n", ns)
    wait_scaled(kubectl, ns, prefill=1, decode=2)
    wait_until(
        lambda: (
            (kubectl.get("dserver", "tiny", ns).get("status") or {})
            .get("decode", {})
            .get("scaledBy")
            == "RoleScaler tiny-decode"
        ),
        TIMEOUT,
        "status.decode.scaledBy names tiny-decode",
    )
    conditions = {c["type"]: c for c in kubectl.get("dserver", "tiny", ns)["status"]["conditions"]}
    for ctype in ("Ready", "Progressing", "Degraded"):
        assert conditions[ctype]["reason"] != "ChildConflict", conditions[ctype]
        assert "evil-decode" not in conditions[ctype]["message"]
    # The look-alike is left as it was: neither deleted nor written.
    evil = kubectl.get("rolescaler", "evil-decode", ns)
    assert evil is not None and evil["spec"]["replicas"] == 3
    assert "status" not in evil
