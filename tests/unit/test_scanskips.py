"""scanskips: the checkov skip annotations on each StatefulSet are there exactly while
the pod fails the check for the reason given (tests/static/test_checkov.py runs
checkov itself over the examples)."""

from __future__ import annotations

import copy

from kvferry_operator import api, render, scanskips
from tests.manifests import server

GPU = server()
CPU = server({"engine": {"device": "cpu", "image": "example.com/vllm-cpu-nixl:1"}})
RDMA = server({"network": {"rdma": {"enabled": True, "resourceName": "rdma/hca"}}})
DIGEST = "example.com/vllm@sha256:" + "0" * 64


def statefulsets(manifest: dict, ctx: render.Context | None = None) -> list[dict]:
    objs = render.render(api.parse_server(manifest), ctx)
    return [o for o in objs if o["kind"] == "StatefulSet"]


def skipped(sts: dict) -> list[str]:
    values = sts["metadata"].get("annotations", {}).values()
    return [v.split("=", 1)[0] for v in values]


def test_a_gpu_engine_skips_the_root_user_writable_root_tag_and_pull_policy_checks():
    for sts in statefulsets(GPU):
        assert skipped(sts) == [
            "CKV_K8S_43",
            "CKV_K8S_15",
            "CKV_K8S_22",
            "CKV_K8S_23",
            "CKV_K8S_40",
        ]


def test_annotations_are_numbered_skips_whose_reason_has_no_equals_sign():
    # checkov splits the value on "=": a second one makes it drop the annotation.
    for manifest in (GPU, CPU, RDMA):
        for sts in statefulsets(manifest):
            notes = sts["metadata"]["annotations"]
            assert list(notes) == [f"checkov.io/skip{i}" for i in range(1, len(notes) + 1)]
            assert all(v.count("=") == 1 and len(v.split("=")[1]) > 40 for v in notes.values())


def test_only_rdma_skips_the_added_capability_check():
    assert all("CKV_K8S_25" in skipped(s) for s in statefulsets(RDMA))
    assert not any("CKV_K8S_25" in skipped(s) for s in statefulsets(GPU))


def reasons(sts: dict) -> dict[str, str]:
    values = sts["metadata"].get("annotations", {}).values()
    return dict(v.split("=", 1) for v in values)


def test_ipc_lock_from_an_overlay_without_rdma_says_so_not_rdma():
    # The reason named RDMA on a server without it: the overlay added IPC_LOCK.
    overlay = {
        "podTemplate": {
            "spec": {
                "containers": [
                    {"name": "engine", "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}}}
                ]
            }
        }
    }
    for sts in statefulsets(server({"decode": overlay})):
        why = reasons(sts).get("CKV_K8S_25")
        if sts["metadata"]["name"].endswith("-prefill"):
            assert why is None
            continue
        assert why is not None and "with RDMA" not in why
        assert "spec.decode.podTemplate" in why
    for sts in statefulsets(RDMA):
        assert "with RDMA (spec.network.rdma)" in reasons(sts)["CKV_K8S_25"]


def test_only_a_cpu_engine_skips_the_limit_checks():
    for sts in statefulsets(CPU):
        assert {"CKV_K8S_11", "CKV_K8S_13"} <= set(skipped(sts))
    for sts in statefulsets(GPU):
        assert not {"CKV_K8S_11", "CKV_K8S_13"} & set(skipped(sts))


def test_images_by_digest_drop_the_digest_skip():
    manifest = server({"engine": {"image": DIGEST, "sidecarImage": DIGEST.replace("vllm", "sc")}})
    for sts in statefulsets(manifest):
        assert "CKV_K8S_43" not in skipped(sts)


def test_the_sidecar_keeps_the_pull_policy_skip_when_the_engine_pulls_always():
    always = server({"engine": {"imagePullPolicy": "Always"}})
    assert all("CKV_K8S_15" in skipped(s) for s in statefulsets(always))


def test_another_root_container_gets_no_skip():
    # The reasons are the engine's: a second container as root must fail the scan.
    pod = statefulsets(GPU)[0]["spec"]["template"]["spec"]
    pod = copy.deepcopy(pod)
    pod["containers"].append({"name": "debug", "image": DIGEST, "imagePullPolicy": "Always"})
    notes = scanskips.build_scanner_skips(pod, on_cpu=False)
    assert not {"CKV_K8S_22", "CKV_K8S_23", "CKV_K8S_40"} & {
        v.split("=")[0] for v in notes.values()
    }


def test_an_overlay_container_by_tag_gets_no_tag_or_pull_policy_skip():
    # The reasons name kvferry's images: a container of the podTemplate's by tag and
    # IfNotPresent must fail the scan.
    pod = copy.deepcopy(statefulsets(GPU)[0]["spec"]["template"]["spec"])
    pod["containers"].append({"name": "logs", "image": "busybox:1"})
    notes = scanskips.build_scanner_skips(pod, on_cpu=False)
    assert not {"CKV_K8S_43", "CKV_K8S_15"} & {v.split("=")[0] for v in notes.values()}


def test_an_engine_that_keeps_capabilities_gets_no_root_skip():
    # The reason says the root engine has no capabilities and cannot escalate.
    pod = copy.deepcopy(statefulsets(GPU)[0]["spec"]["template"]["spec"])
    pod["containers"][0]["securityContext"]["capabilities"] = {"drop": []}
    notes = scanskips.build_scanner_skips(pod, on_cpu=False)
    assert not {"CKV_K8S_23", "CKV_K8S_40"} & {v.split("=")[0] for v in notes.values()}


def test_a_non_root_engine_drops_the_root_skips():
    pod = copy.deepcopy(statefulsets(GPU)[0]["spec"]["template"]["spec"])
    pod["containers"][0]["securityContext"] |= {"runAsNonRoot": True, "runAsUser": 10001}
    notes = scanskips.build_scanner_skips(pod, on_cpu=False)
    assert not {"CKV_K8S_23", "CKV_K8S_40"} & {v.split("=")[0] for v in notes.values()}


def test_skips_are_on_the_statefulset_not_the_pod_template():
    # A new or changed reason must restart no pod.
    for sts in statefulsets(RDMA):
        template_notes = sts["spec"]["template"]["metadata"]["annotations"]
        assert not any(k.startswith("checkov.io/") for k in template_notes)


def test_every_pod_gets_a_pod_level_seccomp_profile():
    for sts in statefulsets(GPU):
        pod = sts["spec"]["template"]["spec"]
        assert pod["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}
