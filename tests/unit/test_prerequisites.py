"""Missing prerequisites, found before any pod waits on them (pure; the cluster tier
checks the Pod Security rules against the API server's own admission)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvferry_operator import api, prerequisites, render
from kvferry_operator.prerequisites import ClusterFacts, NodeFacts
from tests.manifests import EXAMPLES, load_example, server

GPU_NODE = NodeFacts("gpu-0", {"nvidia.com/gpu": 8, "rdma/hca_shared_devices_a": 1})
CPU_NODE = NodeFacts("cpu-0", {})
RDMA = {
    "network": {
        "rdma": {"enabled": True, "resourceName": "rdma/hca_shared_devices_a", "networks": ["n"]}
    }
}


def parsed(spec: dict | None = None, namespace: str = "serving") -> api.Server:
    return api.parse_server(server(spec, namespace=namespace))


def pod_specs(srv: api.Server) -> list[dict]:
    return [o["spec"]["template"]["spec"] for o in render.render(srv) if o["kind"] == "StatefulSet"]


def reasons(srv: api.Server, facts: ClusterFacts) -> list[str]:
    return [f.reason for f in prerequisites.check(srv, facts, pod_specs(srv))]


def test_node_facts_keep_extended_resources_as_counts():
    node = {
        "metadata": {"name": "n1"},
        "spec": {"unschedulable": True},
        "status": {"allocatable": {"cpu": "64", "nvidia.com/gpu": "8", "example.com/x": "1k"}},
    }
    facts = prerequisites.node_facts_from(node)
    assert facts == NodeFacts("n1", {"nvidia.com/gpu": 8, "example.com/x": 1}, unschedulable=True)


class TestNodes:
    def test_no_node_offers_the_gpu_resource(self):
        (finding,) = prerequisites.check(parsed(), ClusterFacts(nodes=[CPU_NODE]), [])
        assert finding.reason == "NoGPUNodes"
        assert finding.message == (
            "no schedulable node offers nvidia.com/gpu (spec.prefill.resources.gpus and "
            "spec.decode.resources.gpus ask for it): install the NVIDIA device plugin or the "
            "GPU Operator on the GPU nodes, or set gpuResourceName (spec.prefill.resources, "
            "spec.decode.resources) to the resource your nodes offer"
        )

    def test_a_cordoned_node_does_not_count(self):
        cordoned = NodeFacts("gpu-0", {"nvidia.com/gpu": 8}, unschedulable=True)
        assert reasons(parsed(), ClusterFacts(nodes=[cordoned])) == ["NoGPUNodes"]

    def test_each_role_names_its_own_resource(self):
        spec = {"decode": {"resources": {"gpuResourceName": "amd.com/gpu"}}}
        found = prerequisites.check_nodes(parsed(spec), [GPU_NODE])
        assert [f.reason for f in found] == ["NoGPUNodes"]
        assert found[0].message.startswith(
            "no schedulable node offers amd.com/gpu (spec.decode.resources.gpus asks for it)"
        )

    def test_a_role_with_no_replicas_or_gpus_needs_none(self):
        srv = parsed({"prefill": {"replicas": 0}, "decode": {"resources": {"gpus": 0}}})
        assert prerequisites.check_nodes(srv, [CPU_NODE]) == []

    def test_a_cpu_server_needs_no_gpu_node(self):
        # Without it, a cluster with no GPUs (kind, minikube) reported NoGPUNodes.
        cpu = parsed({"engine": {"device": "cpu", "image": "kvferry-vllm-cpu:v0.32.0"}})
        assert reasons(cpu, ClusterFacts(nodes=[CPU_NODE])) == []

    def test_no_node_offers_the_rdma_resource(self):
        gpu_only = NodeFacts("gpu-0", {"nvidia.com/gpu": 8})
        found = prerequisites.check_nodes(parsed(RDMA), [gpu_only])
        assert [f.reason for f in found] == ["NoRDMANodes"]
        assert "RDMA shared device plugin" in found[0].message
        assert "spec.network.rdma.resourceName" in found[0].message

    def test_more_gpus_per_pod_than_any_node_has(self):
        spec = {"decode": {"tensorParallelSize": 16}}
        (finding,) = prerequisites.check_nodes(parsed(spec), [GPU_NODE])
        assert finding.reason == "TooFewPerNode"
        assert finding.message == (
            "spec.decode.resources.gpus asks for 16 nvidia.com/gpu per pod, but no node has "
            "more than 8 (gpu-0): lower spec.decode.resources.gpus, or add nodes with 16"
        )

    def test_nodes_with_the_resources_are_enough(self):
        assert prerequisites.check_nodes(parsed(RDMA), [CPU_NODE, GPU_NODE]) == []


class TestNetworks:
    def test_refs_default_to_the_server_namespace_and_drop_the_interface(self):
        spec = {"network": {"rdma": {**RDMA["network"]["rdma"], "networks": ["a@net1", "o/b"]}}}
        assert prerequisites.network_refs(parsed(spec)) == ["serving/a", "o/b"]

    def test_no_networks_without_rdma(self):
        assert prerequisites.network_refs(parsed()) == []

    def test_multus_not_installed(self):
        (finding,) = prerequisites.check_networks(parsed(RDMA), False, None)
        assert finding.reason == "NoMultus"
        assert "network-attachment-definitions.k8s.cni.cncf.io" in finding.message
        assert "install Multus" in finding.message

    def test_missing_network_attachment_definition(self):
        (finding,) = prerequisites.check_networks(parsed(RDMA), True, {"serving/n": False})
        assert finding.reason == "NetworkAttachmentDefinitionMissing"
        assert finding.message.startswith("NetworkAttachmentDefinition serving/n does not exist")

    def test_unknown_facts_are_not_findings(self):
        # A probe that could not read (RBAC, API trouble) must not invent a problem.
        assert prerequisites.check_networks(parsed(RDMA), None, None) == []
        assert prerequisites.check_networks(parsed(RDMA), True, {"serving/n": True}) == []


class TestPodSecurity:
    @pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
    def test_restricted_refuses_every_example_because_the_engine_runs_as_root(self, path: Path):
        srv = api.parse_server(load_example(path))
        violations = [
            v
            for p in pod_specs(srv)
            for v in prerequisites.pod_security_violations(p, "restricted")
        ]
        assert "container engine may run as root (runAsNonRoot is not true)" in violations
        # The sidecar itself meets restricted.
        assert not [v for v in violations if "kvferry-sidecar" in v]

    def test_baseline_admits_a_server_without_rdma(self):
        assert prerequisites.level_allowing(pod_specs(parsed())) == "baseline"

    def test_baseline_refuses_ipc_lock(self):
        srv = parsed(RDMA)
        assert prerequisites.level_allowing(pod_specs(srv)) == "privileged"
        (finding,) = prerequisites.check_pod_security(
            srv, {prerequisites.PSA_ENFORCE: "baseline"}, pod_specs(srv)
        )
        assert finding.reason == "PodSecurityForbids"
        assert finding.message.startswith(
            "namespace serving enforces Pod Security level 'baseline' "
            "(pod-security.kubernetes.io/enforce), which refuses these pods: "
            "container engine adds IPC_LOCK. Label the namespace "
            "pod-security.kubernetes.io/enforce=privileged"
        )

    def test_baseline_refuses_a_host_path_cache(self):
        spec = {"model": {"source": {"hub": {"id": "o/m", "cache": {"hostPath": {"path": "/c"}}}}}}
        manifest = server(spec)
        del manifest["spec"]["model"]["source"]["pvc"]
        srv = api.parse_server(manifest)
        why = [v for p in pod_specs(srv) for v in prerequisites.baseline_violations(p)]
        assert why == ["hostPath volume hf-cache", "hostPath volume hf-cache"]

    def test_restricted_names_the_fix_level(self):
        srv = parsed()
        (finding,) = prerequisites.check_pod_security(
            srv, {prerequisites.PSA_ENFORCE: "restricted"}, pod_specs(srv)
        )
        assert "Label the namespace pod-security.kubernetes.io/enforce=baseline" in finding.message

    @pytest.mark.parametrize("labels", [{}, {prerequisites.PSA_ENFORCE: "privileged"}])
    def test_unlabelled_or_privileged_namespace_refuses_nothing(self, labels):
        srv = parsed(RDMA)
        assert prerequisites.check_pod_security(srv, labels, pod_specs(srv)) == []


def test_pod_security_comes_first_then_nodes_then_networks():
    facts = ClusterFacts(
        nodes=[CPU_NODE],
        namespace_labels={prerequisites.PSA_ENFORCE: "baseline"},
        nad_crd_installed=False,
    )
    assert reasons(parsed(RDMA), facts) == [
        "PodSecurityForbids",
        "NoGPUNodes",
        "NoRDMANodes",
        "NoMultus",
    ]


def test_condition_from_findings():
    finding = prerequisites.Finding("NoMultus", "install Multus")
    assert prerequisites.condition([finding], True) == ("False", "NoMultus", "install Multus")
    assert prerequisites.condition([], True)[:2] == ("True", "Met")
    assert prerequisites.condition([], False)[:2] == ("Unknown", "NotChecked")
