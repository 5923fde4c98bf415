"""The operator on a real API server: create, drift, GitOps, scheduling, deletion, restart."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import yaml

from kvferry_operator import api, render
from tests.cluster.conftest import Kubectl, Operator, wait_until
from tests.kube import condition, wait_condition, wait_for_event
from tests.manifests import EXAMPLES, INVALID, Invalid, load_example, merge, server

CHILDREN = [
    ("statefulset", "{n}-prefill"),
    ("statefulset", "{n}-decode"),
    ("service", "{n}-prefill"),
    ("service", "{n}-decode"),
    ("service", "{n}"),
    ("configmap", "{n}-sidecar"),
    ("poddisruptionbudget", "{n}-prefill"),
    ("poddisruptionbudget", "{n}-decode"),
    ("kvcachestatus", "{n}"),
]
READY_TIMEOUT = 90


def make(ns: str, name: str = "tiny", spec: dict[str, Any] | None = None) -> dict[str, Any]:
    return server(spec, name=name, namespace=ns)


def wait_ready(kubectl: Kubectl, ns: str, name: str = "tiny") -> dict[str, Any]:
    return wait_condition(kubectl, ns, name, "Ready", status="True", timeout=READY_TIMEOUT)


def uid(kubectl: Kubectl, kind: str, name: str, ns: str) -> str | None:
    obj = kubectl.get(kind, name, ns)
    return obj["metadata"]["uid"] if obj else None


def test_sample_creates_children_and_becomes_ready(kubectl: Kubectl, operator: Operator, ns: str):
    sample = load_example(
        next(
            p for p in __import__("tests.manifests").manifests.EXAMPLES if p.name == "minimal.yaml"
        )
    )
    sample["metadata"]["namespace"] = ns
    kubectl.apply(sample, "--server-side")
    name = sample["metadata"]["name"]
    ready = wait_ready(kubectl, ns, name)
    assert ready["reason"] == "AllReplicasReady"
    for kind, pattern in CHILDREN:
        assert kubectl.get(kind, pattern.format(n=name), ns), f"{kind} {pattern} missing"
    pods = kubectl.json("get", "pods", "-n", ns, "-l", f"app.kubernetes.io/instance={name}")
    assert sorted((p["metadata"]["name"], p["status"]["phase"]) for p in pods["items"]) == [
        (f"{name}-decode-0", "Running"),
        (f"{name}-prefill-0", "Running"),
    ]
    assert all(p["spec"]["nodeName"].startswith("gpu-node-") for p in pods["items"])
    status = kubectl.get("dserver", name, ns)["status"]
    assert status["prefill"]["display"] == "1/1" and status["decode"]["display"] == "1/1"
    assert status["observedGeneration"] == 1
    kvcs = kubectl.get("kvcachestatus", name, ns)
    assert kvcs["status"]["phase"] == "NoReports"
    assert "no residency reports yet" in kvcs["status"]["message"]


def test_the_api_server_keeps_every_examples_pods_as_rendered(kubectl: Kubectl, ns: str):
    # The scanner skips on each StatefulSet, the pod-level seccomp profile and the hub
    # token's Secret volume (tuned.yaml) must survive validation and pruning.
    for example in EXAMPLES:
        manifest = load_example(example)
        manifest["metadata"]["namespace"] = ns
        rendered = render.render(api.parse_server(manifest))
        sets = [o for o in rendered if o["kind"] == "StatefulSet"]
        proc = kubectl.apply(sets, "--server-side", "--dry-run=server", "-o", "json")
        stored = {o["metadata"]["name"]: o for o in json.loads(proc.stdout)["items"]}
        for sts in sets:
            kept = stored[sts["metadata"]["name"]]
            assert kept["metadata"]["annotations"] == sts["metadata"]["annotations"], example
            pod, kept_pod = sts["spec"]["template"]["spec"], kept["spec"]["template"]["spec"]
            assert kept_pod["securityContext"] == pod["securityContext"], example
            assert [v["name"] for v in kept_pod["volumes"]] == [v["name"] for v in pod["volumes"]]
            if example.name == "tuned.yaml":
                (token,) = [v for v in kept_pod["volumes"] if v["name"] == "hf-token"]
                assert token["secret"]["items"] == [{"key": "token", "path": "token"}]


def test_a_server_with_only_a_model_name_loads_it_from_the_hub_and_becomes_ready(
    kubectl: Kubectl, operator: Operator, ns: str
):
    sample = load_example(next(p for p in EXAMPLES if p.name == "hub.yaml"))
    # The example names the model and sizes the download's disk; without the latter
    # it is a model name alone, which must serve too.
    assert set(sample["spec"]) == {"model"} and set(sample["spec"]["model"]) == {"name", "source"}
    assert sample["spec"]["model"]["source"] == {"hub": {"cache": {"ephemeralStorage": "5Gi"}}}
    del sample["spec"]["model"]["source"]
    sample["metadata"]["namespace"] = ns
    name, model = sample["metadata"]["name"], sample["spec"]["model"]["name"]
    kubectl.apply(sample, "--server-side")
    wait_ready(kubectl, ns, name)
    # What `kubectl get -o yaml` shows, and GitOps tools compare: the defaulted source,
    # with the hub's own default (the download goes to the node's disk).
    shown = yaml.safe_load(kubectl.run("get", "dserver", name, "-n", ns, "-o", "yaml").stdout)
    assert shown["spec"]["model"]["source"] == {"hub": {"cache": {"ephemeralStorage": "100Gi"}}}
    for role in ("prefill", "decode"):
        sts = kubectl.get("statefulset", f"{name}-{role}", ns)
        engine = sts["spec"]["template"]["spec"]["containers"][0]
        assert engine["command"] == ["vllm", "serve"] and engine["args"][0] == model


@pytest.mark.parametrize("case", INVALID, ids=lambda c: c.id)
def test_invalid_spec_is_rejected_by_the_api_server(kubectl: Kubectl, case: Invalid):
    manifest = merge(case.manifest, {"metadata": {"namespace": "default"}})
    proc = kubectl.apply(manifest, "--dry-run=server", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, f"accepted: {out}"
    assert case.message in out, out
    assert case.path in out, out


def test_deleted_children_are_restored(kubectl: Kubectl, operator: Operator, ns: str):
    kubectl.apply(make(ns), "--server-side")
    wait_ready(kubectl, ns)
    for kind, name in [
        ("statefulset", "tiny-decode"),
        ("service", "tiny"),
        ("configmap", "tiny-sidecar"),
        ("poddisruptionbudget", "tiny-prefill"),
    ]:
        before = uid(kubectl, kind, name, ns)
        kubectl.run("delete", kind, name, "-n", ns, "--wait=true")
        wait_until(
            lambda k=kind, n=name, b=before: uid(kubectl, k, n, ns) not in (None, b),
            30,
            f"{kind} {name} restored",
        )
    wait_ready(kubectl, ns)


def test_edited_child_is_restored_and_foreign_fields_are_kept(
    kubectl: Kubectl, operator: Operator, ns: str
):
    kubectl.apply(make(ns), "--server-side")
    wait_ready(kubectl, ns)
    kubectl.run(
        "patch",
        "service",
        "tiny",
        "-n",
        ns,
        "--type=json",
        "-p",
        json.dumps([{"op": "replace", "path": "/spec/ports/0/targetPort", "value": 9999}]),
    )
    kubectl.run("label", "service", "tiny", "-n", ns, "team=platform")
    kubectl.run("scale", "statefulset", "tiny-decode", "-n", ns, "--replicas=3")

    def restored() -> bool:
        svc = kubectl.get("service", "tiny", ns)
        sts = kubectl.get("statefulset", "tiny-decode", ns)
        ports = [(p["port"], p["targetPort"]) for p in svc["spec"]["ports"]]
        return ports == [(8000, "http")] and sts["spec"]["replicas"] == 1

    wait_until(restored, 30, "service port and decode replicas restored")
    # A label we never set belongs to whoever set it: it stays.
    assert kubectl.get("service", "tiny", ns)["metadata"]["labels"]["team"] == "platform"


def test_gitops_reapply_changes_nothing(kubectl: Kubectl, operator: Operator, ns: str, tmp_path):
    manifest = make(ns)
    kubectl.apply(manifest, "--server-side", "--field-manager=argocd")
    wait_ready(kubectl, ns)
    time.sleep(3)  # let the last status write land
    before = kubectl.get("dserver", "tiny", ns)
    out = kubectl.apply(manifest, "--server-side", "--field-manager=argocd").stdout
    assert "serverside-applied" in out
    time.sleep(5)  # longer than the test operator's resync period
    after = kubectl.get("dserver", "tiny", ns)
    assert after["metadata"]["generation"] == before["metadata"]["generation"] == 1
    # No status flapping: nothing wrote the object in between.
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
    path = tmp_path / "server.json"
    path.write_text(json.dumps(manifest))
    diff = kubectl.run(
        "diff", "--server-side", "--field-manager=argocd", "-f", str(path), check=False
    )
    assert diff.returncode == 0, diff.stdout + diff.stderr
    assert diff.stdout == ""
    # The operator never touched the spec: argocd is its only manager.
    fields = kubectl.json("get", "dserver", "tiny", "-n", ns, "--show-managed-fields")
    managers = {
        (f["manager"], f.get("subresource", ""))
        for f in fields["metadata"]["managedFields"]
        if "f:spec" in f.get("fieldsV1", {})
    }
    assert managers == {("argocd", "")}
    # ... and owns the status it writes, under its own name (docs/gitops.md).
    status_managers = {
        (f["manager"], f.get("subresource", ""))
        for f in fields["metadata"]["managedFields"]
        if "f:status" in f.get("fieldsV1", {})
    }
    assert status_managers == {("kvferry-operator", "status")}


def test_not_enough_gpus_is_reported_naming_the_resource(
    kubectl: Kubectl, operator: Operator, ns: str
):
    # The fake nodes have 8 GPUs each; 16 per pod fits nowhere. The CPUs are set, so
    # that the GPUs alone do not fit.
    spec = {"decode": {"resources": {"gpus": 16, "cpu": "8"}}}
    kubectl.apply(make(ns, spec=spec), "--server-side")
    ready = wait_condition(kubectl, ns, "tiny", "Ready", "Unschedulable")
    assert ready["status"] == "False"
    assert ready["message"] == (
        "1 pod(s) cannot be scheduled (tiny-decode-0): no node has enough nvidia.com/gpu "
        "(spec.decode.resources.gpus) free: add nodes with it, or lower that field"
    )
    assert condition(kubectl, ns, "tiny", "Degraded")["status"] == "True"
    wait_for_event(kubectl, ns, "tiny", "Unschedulable")


def test_short_gpus_and_rdma_are_each_reported_with_their_field(
    kubectl: Kubectl, operator: Operator, ns: str
):
    # The fake nodes have rdma/hca_shared_devices_a only, and 8 GPUs.
    rdma = {"enabled": True, "resourceName": "rdma/hca_shared_devices_b"}
    spec = {"prefill": {"resources": {"gpus": 16, "cpu": "8"}}, "network": {"rdma": rdma}}
    kubectl.apply(make(ns, spec=spec), "--server-side")
    expected = (
        "2 pod(s) cannot be scheduled (tiny-decode-0, tiny-prefill-0): no node has enough "
        "nvidia.com/gpu (spec.prefill.resources.gpus) and rdma/hca_shared_devices_b "
        "(spec.network.rdma.count) free: add nodes with them, or lower those fields"
    )
    wait_until(
        lambda: condition(kubectl, ns, "tiny", "Ready").get("message") == expected,
        60,
        "Ready=False naming both resources and their fields",
    )


def test_a_missing_pvc_is_reported_once_naming_the_claim_field(
    kubectl: Kubectl, operator: Operator, ns: str
):
    spec = {"model": {"source": {"pvc": {"claimName": "no-such-claim"}}}}
    kubectl.apply(make(ns, spec=spec), "--server-side")
    expected = (
        "2 pod(s) cannot be scheduled (tiny-decode-0, tiny-prefill-0): PersistentVolumeClaim "
        f'"no-such-claim" does not exist in namespace {ns}: create it, or fix '
        "spec.model.source.pvc.claimName"
    )
    wait_until(
        lambda: condition(kubectl, ns, "tiny", "Ready").get("message") == expected,
        60,
        "Ready=False naming the missing claim",
    )


def test_deleting_the_server_garbage_collects_children(
    kubectl: Kubectl, operator: Operator, ns: str
):
    kubectl.apply(make(ns), "--server-side")
    wait_ready(kubectl, ns)
    kubectl.run("delete", "dserver", "tiny", "-n", ns, "--wait=true", timeout=60)

    def all_gone() -> bool:
        return all(kubectl.get(k, p.format(n="tiny"), ns) is None for k, p in CHILDREN)

    wait_until(all_gone, 60, "children garbage-collected")


def test_scaling_a_role_touches_only_its_statefulset(kubectl: Kubectl, operator: Operator, ns: str):
    kubectl.apply(make(ns), "--server-side")
    wait_ready(kubectl, ns)
    prefill_before = kubectl.get("statefulset", "tiny-prefill", ns)["metadata"]["generation"]
    kubectl.apply(make(ns, spec={"decode": {"replicas": 2}}), "--server-side")
    wait_until(
        lambda: kubectl.get("dserver", "tiny", ns)["status"]["decode"]["display"] == "2/2",
        READY_TIMEOUT,
        "decode 2/2",
    )
    assert (
        kubectl.get("statefulset", "tiny-prefill", ns)["metadata"]["generation"] == prefill_before
    )
    wait_ready(kubectl, ns)


def test_engine_image_change_rolls_both_roles(kubectl: Kubectl, operator: Operator, ns: str):
    kubectl.apply(make(ns), "--server-side")
    wait_ready(kubectl, ns)
    image = "vllm/vllm-openai:v0.33.1"
    kubectl.apply(make(ns, spec={"engine": {"image": image}}), "--server-side")

    def both_rolled() -> bool:
        for role in ("prefill", "decode"):
            sts = kubectl.get("statefulset", f"tiny-{role}", ns)
            if sts["spec"]["template"]["spec"]["containers"][0]["image"] != image:
                return False
        return True

    wait_until(both_rolled, 30, "both StatefulSets on the new image")
    wait_ready(kubectl, ns)


def test_printer_columns(kubectl: Kubectl, operator: Operator, ns: str):
    kubectl.apply(make(ns), "--server-side")
    wait_ready(kubectl, ns)
    out = kubectl.run("get", "dserver", "-n", ns).stdout
    assert out.split("\n")[0].split() == [
        "NAME",
        "MODEL",
        "PREFILL",
        "DECODE",
        "TRANSPORT",
        "READY",
        "AGE",
    ]
    assert out.split("\n")[1].split()[:6] == ["tiny", "tiny-llama", "1/1", "1/1", "Unknown", "True"]
    for alias in ("kv-cache-status", "kvcs", "kvcachestatus"):
        out = kubectl.run("get", alias, "-n", ns).stdout
        assert out.split("\n")[0].split() == [
            "NAME",
            "HIT-RATE",
            "REUSED",
            "GAP-P95",
            "RETENTION",
            "RECOMMENDED",
            "TTFT-P95",
            "TRANSPORT",
            "AGE",
        ], alias
    out = kubectl.run("get", "kvferry", "-n", ns).stdout
    assert "disaggregatedserver.kvferry.io/tiny" in out
    assert "kvcachestatus.kvferry.io/tiny" in out


def test_operator_restart_mid_reconcile_converges(kubectl: Kubectl, operator: Operator, ns: str):
    operator.stop()
    kubectl.apply(make(ns, "restart"), "--server-side")
    operator.start()
    # Let it get partway through, then kill it hard and start again.
    wait_until(lambda: kubectl.get("configmap", "restart-sidecar", ns), 30, "first child")
    operator.stop(sig=9)
    operator.start()
    wait_ready(kubectl, ns, "restart")
    for kind in ("statefulsets", "services", "configmaps", "poddisruptionbudgets"):
        items = kubectl.json("get", kind, "-n", ns, "-l", "app.kubernetes.io/instance=restart")
        assert (
            len(items["items"])
            == {"statefulsets": 2, "services": 3, "configmaps": 1, "poddisruptionbudgets": 2}[kind]
        ), kind
    assert "Traceback" not in operator.log()


def test_scale_subresource_scales_decode(kubectl: Kubectl, operator: Operator, ns: str):
    # What an HPA or KEDA ScaledObject targeting the DisaggregatedServer does.
    kubectl.apply(make(ns), "--server-side")
    wait_ready(kubectl, ns)
    path = f"/apis/kvferry.io/v1alpha1/namespaces/{ns}/disaggregatedservers/tiny/scale"
    scale = json.loads(kubectl.run("get", "--raw", path).stdout)
    assert scale["spec"]["replicas"] == 1
    assert scale["status"]["selector"] == (
        "app.kubernetes.io/name=kvferry,app.kubernetes.io/instance=tiny,kvferry.io/role=decode"
    )
    kubectl.run("scale", "dserver", "tiny", "-n", ns, "--replicas=3")
    wait_until(
        lambda: kubectl.get("dserver", "tiny", ns)["status"]["decode"]["display"] == "3/3",
        READY_TIMEOUT,
        "decode 3/3",
    )
    assert kubectl.get("statefulset", "tiny-decode", ns)["spec"]["replicas"] == 3
    assert kubectl.get("statefulset", "tiny-prefill", ns)["spec"]["replicas"] == 1
    wait_ready(kubectl, ns)
