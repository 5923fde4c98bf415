"""spec.<role>.podTemplate and the default decode spread on the real API server (issue 22,
items 3 and 5): an overlay with a ServiceAccount and a volume lands in the stored
StatefulSets and the pods; what the operator's settings refuse gets a condition naming
the field and no StatefulSet; what the API server refuses after the merge shows as
ApplyFailed naming the field. The CRD's own refusals are tests/manifests.py INVALID
(pod-template-*), sent to this API server by tests/cluster/test_operator.py."""

from __future__ import annotations

from kvferry_operator import api, podtemplate, render
from kvferry_operator.status import REASON_APPLY_FAILED
from tests.cluster.conftest import Kubectl, Operator, wait_until
from tests.kube import condition, wait_condition, wait_for_event
from tests.manifests import server

IDENTITY = {
    "metadata": {"labels": {"team": "llm"}},
    "spec": {
        "serviceAccountName": "vllm-irsa",
        "volumes": [{"name": "scratch", "emptyDir": {"sizeLimit": "1Gi"}}],
        "containers": [
            {"name": "engine", "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}]}
        ],
    },
}


def test_an_overlay_with_a_service_account_and_a_volume_applies_and_decode_spreads(
    kubectl: Kubectl, operator: Operator, ns: str
):
    kubectl.apply(
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "vllm-irsa"}},
        "-n",
        ns,
    )
    kubectl.apply(
        server({"decode": {"podTemplate": IDENTITY}}, name="ov", namespace=ns), "--server-side"
    )
    sts = wait_until(lambda: kubectl.get("statefulset", "ov-decode", ns), 60, "ov-decode")
    pod = sts["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "vllm-irsa"
    assert {"name": "scratch", "emptyDir": {"sizeLimit": "1Gi"}} in pod["volumes"]
    (engine,) = pod["containers"]
    assert {"name": "scratch", "mountPath": "/scratch"} in engine["volumeMounts"]
    assert sts["spec"]["template"]["metadata"]["labels"]["team"] == "llm"
    # The default spread, as the API server stored it (nothing pruned or defaulted away).
    want = next(
        o
        for o in render.render(api.parse_server(kubectl.get("dserver", "ov", ns)))
        if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "ov-decode"
    )
    spread = want["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert pod["topologySpreadConstraints"] == spread
    assert spread[0]["topologyKey"] == "kubernetes.io/hostname"
    assert spread[0]["whenUnsatisfiable"] == "ScheduleAnyway"
    # The pod itself, past the ServiceAccount admission, runs as the overlay's account.
    created = wait_until(lambda: kubectl.get("pod", "ov-decode-0", ns), 60, "pod ov-decode-0")
    assert created["spec"]["serviceAccountName"] == "vllm-irsa"
    # The other role is as kvferry renders it: no overlay, no spread.
    prefill = wait_until(lambda: kubectl.get("statefulset", "ov-prefill", ns), 60, "ov-prefill")
    assert "serviceAccountName" not in prefill["spec"]["template"]["spec"]
    assert "topologySpreadConstraints" not in prefill["spec"]["template"]["spec"]
    wait_until(
        lambda: (
            condition(kubectl, ns, "ov", "Progressing").get("reason") != REASON_APPLY_FAILED
            and kubectl.get("dserver", "ov", ns).get("status", {}).get("observedGeneration") == 1
        ),
        60,
        "generation 1 observed",
    )


def test_a_host_namespace_the_operator_does_not_allow_gets_the_condition_and_no_statefulset(
    kubectl: Kubectl, operator: Operator, ns: str
):
    # The tier's operator runs with the default: nothing allowed.
    overlay = {"spec": {"hostNetwork": True}}
    kubectl.apply(
        server({"prefill": {"podTemplate": overlay}}, name="hostnet", namespace=ns),
        "--server-side",
    )
    degraded = wait_condition(kubectl, ns, "hostnet", "Degraded", podtemplate.REASON)
    assert degraded["status"] == "True"
    assert degraded["message"].startswith(
        "spec.prefill.podTemplate.spec.hostNetwork: not allowed by the operator's settings"
    )
    assert "settings.podTemplateAllow: [hostNamespaces]" in degraded["message"]
    ready = condition(kubectl, ns, "hostnet", "Ready")
    assert (ready["status"], ready["reason"]) == ("False", podtemplate.REASON)
    wait_for_event(kubectl, ns, "hostnet", podtemplate.REASON)
    # Everything but the pods landed (policy first); neither StatefulSet ever did.
    assert kubectl.get("networkpolicy", "hostnet", ns)
    assert kubectl.get("statefulset", "hostnet-prefill", ns) is None
    assert kubectl.get("statefulset", "hostnet-decode", ns) is None


def test_what_the_api_server_refuses_after_the_merge_is_apply_failed_naming_the_field(
    kubectl: Kubectl, operator: Operator, ns: str
):
    # The CRD keeps PodSpec fields it does not type; the StatefulSet's validation is
    # the API server's. A StatefulSet's pods must restart Always.
    overlay = {"spec": {"restartPolicy": "Never"}}
    kubectl.apply(
        server({"decode": {"podTemplate": overlay}}, name="never", namespace=ns), "--server-side"
    )
    progressing = wait_condition(kubectl, ns, "never", "Progressing", REASON_APPLY_FAILED)
    assert progressing["status"] == "False"
    assert "StatefulSet never-decode" in progressing["message"]
    assert "spec.template.spec.restartPolicy" in progressing["message"]
    degraded = condition(kubectl, ns, "never", "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", REASON_APPLY_FAILED)
    wait_for_event(kubectl, ns, "never", REASON_APPLY_FAILED)
    # The other role applied: one refused child does not hold the rest.
    assert kubectl.get("statefulset", "never-prefill", ns)


def test_a_patch_delete_survives_the_api_server_and_removes_the_spread(
    kubectl: Kubectl, operator: Operator, ns: str
):
    # `$patch` is no field of the typed items: the CRD must keep it, not prune it.
    gone = {"topologyKey": "kubernetes.io/hostname", "$patch": "delete"}
    overlay = {"spec": {"topologySpreadConstraints": [gone]}}
    kubectl.apply(
        server({"decode": {"podTemplate": overlay}}, name="packed", namespace=ns),
        "--server-side",
    )
    stored = kubectl.get("dserver", "packed", ns)
    assert stored["spec"]["decode"]["podTemplate"] == overlay
    sts = wait_until(lambda: kubectl.get("statefulset", "packed-decode", ns), 60, "packed-decode")
    assert not sts["spec"]["template"]["spec"].get("topologySpreadConstraints")


def test_a_misspelt_field_is_apply_failed_naming_it(kubectl: Kubectl, operator: Operator, ns: str):
    # The CRD keeps unknown PodSpec fields; the operator's server-side apply of the
    # StatefulSet is where a typo is refused (never dropped in silence).
    overlay = {"spec": {"nodeSelecter": {"pool": "h200"}}}
    kubectl.apply(
        server({"decode": {"podTemplate": overlay}}, name="typo", namespace=ns), "--server-side"
    )
    degraded = wait_condition(kubectl, ns, "typo", "Degraded", REASON_APPLY_FAILED)
    assert "StatefulSet typo-decode" in degraded["message"]
    assert ".spec.template.spec.nodeSelecter: field not declared in schema" in degraded["message"]
    assert kubectl.get("statefulset", "typo-decode", ns) is None
