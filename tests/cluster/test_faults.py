"""Faults of the cluster around the operator, on the real control plane: the API
server restarted under it, the operator restarted mid-rollout, a node removed.
Each ends with the operator converged and no traceback in its log."""

from __future__ import annotations

import subprocess
import time

from tests.cluster.conftest import Kubectl, Operator, wait_until
from tests.cluster.test_operator import make, wait_ready
from tests.kube import SCRIPT, condition, cp_env, wait_condition, wait_for_event


def controlplane(command: str) -> None:
    env = cp_env()
    proc = subprocess.run(
        ["bash", str(SCRIPT), command], capture_output=True, text=True, env=env, timeout=180
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def log_since(operator: Operator, offset: int) -> str:
    return operator.log()[offset:]


def statefulset_replicas(kubectl: Kubectl, ns: str, name: str) -> int | None:
    sts = kubectl.get("statefulset", name, ns)
    return sts["spec"]["replicas"] if sts else None


def test_operator_converges_after_the_api_server_restarts(
    kubectl: Kubectl, operator: Operator, ns: str
):
    kubectl.apply(make(ns), "--server-side")
    wait_ready(kubectl, ns)
    offset = len(operator.log())
    controlplane("apiserver-stop")
    try:
        # Longer than a resync period (5 s here) and a publish period (1 s): the
        # operator's loops and watches all meet the missing API server.
        time.sleep(12)
        assert operator.proc is not None and operator.proc.poll() is None, "operator died"
    finally:
        controlplane("apiserver-start")
    # Converges: a spec change lands, a deleted child is restored, status follows.
    kubectl.run("patch", "dserver", "tiny", "-n", ns, "--type=merge", "-p",
                '{"spec":{"decode":{"replicas":2}}}')  # fmt: skip
    wait_until(lambda: statefulset_replicas(kubectl, ns, "tiny-decode") == 2, 90, "decode x2")
    kubectl.run("delete", "configmap", "tiny-sidecar", "-n", ns)
    wait_until(lambda: kubectl.get("configmap", "tiny-sidecar", ns), 60, "ConfigMap restored")
    wait_until(
        lambda: (
            (kubectl.get("dserver", "tiny", ns)["status"].get("decode") or {}).get("readyReplicas")
            == 2
        ),
        90,
        "status shows 2 ready decode replicas",
    )
    wait_ready(kubectl, ns)
    log = log_since(operator, offset)
    assert "Traceback" not in log, log[-4000:]
    assert operator.proc is not None and operator.proc.poll() is None


def test_operator_restarted_during_a_rollout_finishes_it(
    kubectl: Kubectl, operator: Operator, ns: str
):
    kubectl.apply(make(ns, spec={"decode": {"replicas": 2}}), "--server-side")
    wait_ready(kubectl, ns)
    image = "vllm/vllm-openai:v0.33.1"
    kubectl.apply(make(ns, spec={"decode": {"replicas": 2}, "engine": {"image": image}}),
                  "--server-side")  # fmt: skip

    def rolling() -> bool:
        sts = kubectl.get("statefulset", "tiny-decode", ns)
        return sts["spec"]["template"]["spec"]["containers"][0]["image"] == image

    wait_until(rolling, 30, "the rollout started")
    operator.stop(sig=9)  # mid-rollout, no chance to finish anything
    offset = len(operator.log())
    time.sleep(2)
    operator.start()

    def rolled_out() -> bool:
        obj = kubectl.get("dserver", "tiny", ns)
        st = obj["status"]
        return (
            st.get("observedGeneration") == obj["metadata"]["generation"]
            and st["decode"]["updatedReplicas"] == 2
            and st["prefill"]["updatedReplicas"] == 1
            and condition(kubectl, ns, "tiny", "Progressing").get("reason") == "Complete"
            and condition(kubectl, ns, "tiny", "Ready").get("status") == "True"
        )

    wait_until(rolled_out, 120, "the rollout finished and status says so")
    pods = kubectl.json("get", "pods", "-n", ns, "-l", "app.kubernetes.io/instance=tiny")
    images = {p["spec"]["containers"][0]["image"] for p in pods["items"]}
    assert images == {image}
    assert "Traceback" not in log_since(operator, offset)


def test_a_removed_node_shows_in_status_and_events(kubectl: Kubectl, operator: Operator, ns: str):
    kubectl.apply(make(ns), "--server-side")
    wait_ready(kubectl, ns)
    offset = len(operator.log())
    node_name = kubectl.get("pod", "tiny-decode-0", ns)["spec"]["nodeName"]
    node = kubectl.json("get", "node", node_name)
    kubectl.run("delete", "node", node_name)
    try:
        lost = wait_condition(kubectl, ns, "tiny", "Degraded", "NodeLost", timeout=30)
        assert lost["status"] == "True"
        assert f"tiny-decode-0 on node {node_name}, which is gone" in lost["message"]
        assert condition(kubectl, ns, "tiny", "Ready")["status"] == "False"
        wait_for_event(kubectl, ns, "tiny", "NodeLost")
    finally:
        # The node comes back (kwok manages it again): later tests need both nodes.
        meta = node["metadata"]
        kubectl.apply(
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {
                    "name": meta["name"],
                    "labels": meta.get("labels", {}),
                    "annotations": {
                        k: v for k, v in (meta.get("annotations") or {}).items() if "kwok" in k
                    },
                },
                "spec": {k: v for k, v in node.get("spec", {}).items() if k != "podCIDR"},
                "status": {
                    "capacity": node["status"]["capacity"],
                    "allocatable": node["status"]["allocatable"],
                },
            }
        )
        kubectl.run("wait", "--for", "condition=Ready", f"node/{node_name}", "--timeout", "60s")
    # With the node back (or the pod replaced elsewhere), the server recovers.
    wait_ready(kubectl, ns)
    assert condition(kubectl, ns, "tiny", "Degraded")["status"] == "False"
    assert "Traceback" not in log_since(operator, offset)
