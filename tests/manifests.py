"""Manifest builders and the invalid-spec table shared by the unit and cluster tiers."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))

MINIMAL: dict[str, Any] = {
    "apiVersion": "kvferry.io/v1alpha1",
    "kind": "DisaggregatedServer",
    "metadata": {"name": "tiny", "namespace": "default"},
    "spec": {
        "model": {"name": "tiny-llama", "source": {"pvc": {"claimName": "models", "path": "tiny"}}}
    },
}


def load_example(path: Path) -> dict[str, Any]:
    with open(path) as f:
        return yaml.safe_load(f)


def merge(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """Deep merge; a value of DELETE removes the key."""
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if value is DELETE:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


DELETE = object()


def server(spec: dict[str, Any] | None = None, **metadata: Any) -> dict[str, Any]:
    """A DisaggregatedServer manifest: MINIMAL with ``spec`` merged in."""
    obj = merge(MINIMAL, {"spec": spec or {}})
    obj["metadata"].update(metadata)
    return obj


@dataclass(frozen=True)
class Invalid:
    id: str
    manifest: dict[str, Any]
    path: str  # the field the error names ("" for rules on the whole object)
    message: str  # a fragment of the message, as local validation and the API server word it


def _spec(patch: dict[str, Any]) -> dict[str, Any]:
    return merge(MINIMAL, {"spec": patch})


CPU_ENGINE = {"device": "cpu", "image": "kvferry-vllm-cpu:v0.32.0"}


def _cpu_spec(patch: dict[str, Any]) -> dict[str, Any]:
    """A CPU server (spec.engine.device cpu, with the image it needs) with ``patch``."""
    return _spec(merge({"engine": CPU_ENGINE}, patch))


NODE_REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"
HUB_BOTH = {"pvc": {"claimName": "hf"}, "hostPath": {"path": "/var/cache/hf"}}

# Every CEL rule and every required field of the CRD appears here at least once
# (tests/unit/test_validation.py checks that), each with the message that
# tells the user what to do.
INVALID: list[Invalid] = [
    Invalid("spec-required", merge(MINIMAL, {"spec": DELETE}), "spec", "Required value"),
    Invalid("model-required", _spec({"model": DELETE}), "spec.model", "Required value"),
    Invalid(
        "model-name-required",
        _spec({"model": {"name": DELETE}}),
        "spec.model.name",
        "Required value",
    ),
    Invalid(
        "source-none",
        _spec({"model": {"source": {"pvc": DELETE}}}),
        "spec.model.source",
        "must set exactly one of pvc (a PersistentVolumeClaim), hub (a Hugging Face hub "
        "repository) or image (a folder in the engine image)",
    ),
    Invalid(
        # Not pruned as an unknown field: the message names the choices.
        "source-unknown",
        _spec({"model": {"source": {"pvc": DELETE, "s3": {"bucket": "models"}}}}),
        "spec.model.source",
        "must set exactly one of pvc (a PersistentVolumeClaim), hub (a Hugging Face hub "
        "repository) or image (a folder in the engine image)",
    ),
    Invalid(
        "source-two",
        _spec({"model": {"source": {"hub": {"id": "org/m"}}}}),
        "spec.model.source",
        "Too many: 2: must have at most 1 item",
    ),
    Invalid(
        "source-known-and-unknown",
        _spec({"model": {"source": {"s3": {"bucket": "models"}}}}),
        "spec.model.source",
        "Too many: 2: must have at most 1 item",
    ),
    Invalid(
        "pvc-claim-required",
        _spec({"model": {"source": {"pvc": {"claimName": DELETE}}}}),
        "spec.model.source.pvc.claimName",
        "Required value",
    ),
    Invalid(
        "pvc-path-absolute",
        _spec({"model": {"source": {"pvc": {"path": "/etc"}}}}),
        "spec.model.source.pvc.path",
        "must be relative to the volume root",
    ),
    Invalid(
        "pvc-path-dotdot",
        _spec({"model": {"source": {"pvc": {"path": "a/../../b"}}}}),
        "spec.model.source.pvc.path",
        "must not contain '..'",
    ),
    Invalid(
        "hub-id-empty",
        _spec({"model": {"source": {"pvc": DELETE, "hub": {"id": ""}}}}),
        "spec.model.source.hub.id",
        "should be at least 1 chars long",
    ),
    Invalid(
        "hub-secret-name-required",
        _spec(
            {
                "model": {
                    "source": {"pvc": DELETE, "hub": {"id": "org/m", "tokenSecret": {"key": "t"}}}
                }
            }
        ),
        "spec.model.source.hub.tokenSecret.name",
        "Required value",
    ),
    Invalid(
        "hub-cache-pvc-and-host-path",
        _spec({"model": {"source": {"pvc": DELETE, "hub": {"id": "org/m", "cache": HUB_BOTH}}}}),
        "spec.model.source.hub.cache",
        "sets pvc or hostPath, not both",
    ),
    Invalid(
        "hub-cache-pvc-claim-required",
        _spec({"model": {"source": {"pvc": DELETE, "hub": {"id": "org/m", "cache": {"pvc": {}}}}}}),
        "spec.model.source.hub.cache.pvc.claimName",
        "Required value",
    ),
    Invalid(
        "hub-cache-host-path-required",
        _spec(
            {
                "model": {
                    "source": {"pvc": DELETE, "hub": {"id": "org/m", "cache": {"hostPath": {}}}}
                }
            }
        ),
        "spec.model.source.hub.cache.hostPath.path",
        "Required value",
    ),
    Invalid(
        "hub-cache-host-path-relative",
        _spec(
            {
                "model": {
                    "source": {
                        "pvc": DELETE,
                        "hub": {"id": "org/m", "cache": {"hostPath": {"path": "var/cache"}}},
                    }
                }
            }
        ),
        "spec.model.source.hub.cache.hostPath.path",
        "must be an absolute path on the node",
    ),
    Invalid(
        "image-pull-secret-name-required",
        _spec({"engine": {"imagePullSecrets": [{}]}}),
        "spec.engine.imagePullSecrets[0].name",
        "Required value",
    ),
    Invalid(
        "image-path-required",
        _spec({"model": {"source": {"pvc": DELETE, "image": {}}}}),
        "spec.model.source.image.path",
        "Required value",
    ),
    Invalid(
        "image-path-relative",
        _spec({"model": {"source": {"pvc": DELETE, "image": {"path": "models/x"}}}}),
        "spec.model.source.image.path",
        "must be an absolute path in the engine image",
    ),
    Invalid(
        "dtype-enum",
        _spec({"model": {"dtype": "fp8"}}),
        "spec.model.dtype",
        'Unsupported value: "fp8"',
    ),
    Invalid(
        "max-model-len-positive",
        _spec({"model": {"maxModelLen": 0}}),
        "spec.model.maxModelLen",
        "should be greater than or equal to 1",
    ),
    Invalid(
        "prefill-replicas-negative",
        _spec({"prefill": {"replicas": -1}}),
        "spec.prefill.replicas",
        "should be greater than or equal to 0",
    ),
    Invalid(
        "decode-replicas-negative",
        _spec({"decode": {"replicas": -2}}),
        "spec.decode.replicas",
        "should be greater than or equal to 0",
    ),
    Invalid(
        # Found by the generated specs: render ranges over the replicas (peer list).
        "decode-replicas-too-many",
        _spec({"decode": {"replicas": 2**31}}),
        "spec.decode.replicas",
        "should be less than or equal to 1000",
    ),
    # A PodDisruptionBudget's maxUnavailable: pods or a percentage
    # (tests/cluster/test_disruption.py runs these through the API server).
    Invalid(
        "decode-max-unavailable-word",
        _spec({"decode": {"maxUnavailable": "lots"}}),
        "spec.decode.maxUnavailable",
        "maxUnavailable must be a whole number of pods (0 or more) or a percentage of the "
        'role\'s replicas from 0% to 100%, e.g. 1 or "25%"',
    ),
    Invalid(
        "prefill-max-unavailable-negative",
        _spec({"prefill": {"maxUnavailable": -1}}),
        "spec.prefill.maxUnavailable",
        "maxUnavailable must be a whole number of pods (0 or more)",
    ),
    Invalid(
        "decode-max-unavailable-over-all",
        _spec({"decode": {"maxUnavailable": "150%"}}),
        "spec.decode.maxUnavailable",
        "a percentage of the role's replicas from 0% to 100%",
    ),
    # How long a stopping pod drains (tests/cluster/test_drain.py).
    Invalid(
        "decode-drain-negative",
        _spec({"decode": {"drainSeconds": -1}}),
        "spec.decode.drainSeconds",
        "should be greater than or equal to 0",
    ),
    Invalid(
        "prefill-drain-over-an-hour",
        _spec({"prefill": {"drainSeconds": 3601}}),
        "spec.prefill.drainSeconds",
        "should be less than or equal to 3600",
    ),
    Invalid(
        "decode-drain-word",
        _spec({"decode": {"drainSeconds": "30m"}}),
        "spec.decode.drainSeconds",
        "must be of type integer",
    ),
    Invalid(
        "decode-tp-zero",
        _spec({"decode": {"tensorParallelSize": 0}}),
        "spec.decode.tensorParallelSize",
        "should be greater than or equal to 1",
    ),
    Invalid(
        "prefill-gpus-below-tp",
        _spec({"prefill": {"tensorParallelSize": 8, "resources": {"gpus": 4}}}),
        "spec.prefill.resources.gpus",
        "resources.gpus must be at least tensorParallelSize",
    ),
    Invalid(
        "decode-gpus-below-tp",
        _spec({"decode": {"tensorParallelSize": 2, "resources": {"gpus": 1}}}),
        "spec.decode.resources.gpus",
        "resources.gpus must be at least tensorParallelSize",
    ),
    # The engine's extra resources: hugepages and devices are limited (Kubernetes
    # requests the same), GPUs come from resources.gpus (checked against the TP size).
    Invalid(
        "decode-requests-beyond-cpu-memory-storage",
        _spec({"decode": {"resources": {"requests": {"hugepages-2Mi": "1Gi"}}}}),
        "spec.decode.resources.requests",
        "resources.requests may name cpu, memory and ephemeral-storage only",
    ),
    Invalid(
        "prefill-requests-beyond-cpu-memory-storage",
        _spec({"prefill": {"resources": {"requests": {"rdma/hca": 1}}}}),
        "spec.prefill.resources.requests",
        "put hugepages-*, RDMA and device resources in resources.limits",
    ),
    Invalid(
        "decode-limits-name-the-gpu-resource",
        _spec(
            {
                "decode": {
                    "resources": {"gpuResourceName": "amd.com/gpu", "limits": {"amd.com/gpu": 1}}
                }
            }
        ),
        "spec.decode.resources.limits",
        "set the GPUs with resources.gpus",
    ),
    # Each value of the limits map is a quantity: the API server runs the rule on every
    # entry, offline validation too (found by tests/cluster/test_bad_input.py).
    Invalid(
        "decode-limits-value-no-quantity",
        _spec({"decode": {"resources": {"limits": {"hugepages-2Mi": ""}}}}),
        "spec.decode.resources.limits[hugepages-2Mi]",
        "must be a Kubernetes quantity",
    ),
    Invalid(
        "prefill-limits-name-the-gpu-resource",
        _spec({"prefill": {"resources": {"limits": {"nvidia.com/gpu": 2}}}}),
        "spec.prefill.resources.limits",
        "resources.limits must not name the GPU resource",
    ),
    Invalid(
        "startup-seconds-above-six-hours",
        _spec({"decode": {"startupSeconds": 30000}}),
        "spec.decode.startupSeconds",
        "should be less than or equal to 21600",
    ),
    Invalid(
        "startup-seconds-below-a-minute",
        _spec({"prefill": {"startupSeconds": 10}}),
        "spec.prefill.startupSeconds",
        "should be greater than or equal to 60",
    ),
    Invalid(
        # The HPA's word is External; "Auto" would be the tuner's (cacheTuning.mode).
        "scaling-mode-enum",
        _spec({"decode": {"scaling": {"mode": "Auto"}}}),
        "spec.decode.scaling.mode",
        'Unsupported value: "Auto"',
    ),
    # What vLLM's CPU build cannot do (spec.engine.device: cpu).
    Invalid(
        "device-enum",
        _spec({"engine": {"device": "tpu"}}),
        "spec.engine.device",
        'Unsupported value: "tpu"',
    ),
    Invalid(
        "cpu-prefill-gpus",
        _cpu_spec({"prefill": {"resources": {"gpus": 1}}}),
        "spec.prefill.resources.gpus",
        "resources.gpus must be 0 or unset when spec.engine.device is cpu",
    ),
    Invalid(
        "cpu-decode-gpus",
        _cpu_spec({"decode": {"resources": {"gpus": 2}}}),
        "spec.decode.resources.gpus",
        "resources.gpus must be 0 or unset when spec.engine.device is cpu",
    ),
    # gpus 0 is the CPU server's (where it is allowed); a GPU engine needs its GPUs.
    Invalid(
        "gpu-prefill-gpus-zero",
        _spec({"prefill": {"resources": {"gpus": 0}}}),
        "spec.prefill.resources.gpus",
        "resources.gpus 0 needs spec.engine.device: cpu",
    ),
    Invalid(
        "gpu-decode-gpus-zero",
        _spec({"decode": {"resources": {"gpus": 0}}}),
        "spec.decode.resources.gpus",
        "resources.gpus 0 needs spec.engine.device: cpu",
    ),
    Invalid(
        "tp-above-one-node",
        _spec({"decode": {"tensorParallelSize": 64}}),
        "spec.decode.tensorParallelSize",
        "should be less than or equal to 16",
    ),
    # Quantities: what the CRD accepts, the StatefulSet must accept too.
    Invalid(
        "memory-not-a-quantity",
        _spec({"prefill": {"resources": {"memory": "lots"}}}),
        "spec.prefill.resources.memory",
        "must be a Kubernetes quantity",
    ),
    Invalid(
        "memory-negative",
        _spec({"decode": {"resources": {"memory": -4}}}),
        "spec.decode.resources.memory",
        "should be greater than or equal to 0",
    ),
    Invalid(
        "sidecar-cpu-not-a-quantity",
        _spec({"decode": {"sidecarResources": {"limits": {"cpu": "1 core"}}}}),
        "spec.decode.sidecarResources.limits.cpu",
        "must be a Kubernetes quantity",
    ),
    Invalid(
        "shared-memory-not-a-quantity",
        _spec({"network": {"sharedMemorySize": "16 GB"}}),
        "spec.network.sharedMemorySize",
        "must be a Kubernetes quantity",
    ),
    Invalid(
        "hub-ephemeral-storage-not-a-quantity",
        _spec(
            {
                "model": {
                    "source": {
                        "pvc": DELETE,
                        "hub": {"id": "org/m", "cache": {"ephemeralStorage": "-1Gi"}},
                    }
                }
            }
        ),
        "spec.model.source.hub.cache.ephemeralStorage",
        "must be a Kubernetes quantity",
    ),
    *[
        Invalid(
            f"{field.replace('.', '-')}-not-a-quantity",
            _spec({role: merge({}, patch)}),
            f"spec.{role}.{field}",
            "must be a Kubernetes quantity",
        )
        for role, field, patch in [
            ("prefill", "resources.cpu", {"resources": {"cpu": "4 cores"}}),
            (
                "decode",
                "sidecarResources.requests.cpu",
                {"sidecarResources": {"requests": {"cpu": "1/4"}}},
            ),
            (
                "prefill",
                "sidecarResources.requests.memory",
                {"sidecarResources": {"requests": {"memory": "256 Mi"}}},
            ),
            (
                "decode",
                "sidecarResources.limits.memory",
                {"sidecarResources": {"limits": {"memory": "1GB!"}}},
            ),
        ]
    ],
    Invalid(
        "env-divisor-not-a-quantity",
        _spec(
            {
                "decode": {
                    "env": [
                        {
                            "name": "MEM",
                            "valueFrom": {
                                "resourceFieldRef": {"resource": "limits.memory", "divisor": "a Mi"}
                            },
                        }
                    ]
                }
            }
        ),
        "spec.decode.env[0].valueFrom.resourceFieldRef.divisor",
        "must be a Kubernetes quantity",
    ),
    # Flags the operator sets (engine_config.OWNED_FLAGS): the sidecar still targets 8200.
    Invalid(
        "extra-args-port",
        _spec({"decode": {"extraArgs": ["--port", "9000"]}}),
        "spec.decode.extraArgs[0]",
        "extraArgs must not set a flag the operator sets",
    ),
    Invalid(
        "extra-args-kv-transfer-config",
        _spec({"prefill": {"extraArgs": ["--kv_transfer_config={}"]}}),
        "spec.prefill.extraArgs[0]",
        "extraArgs must not set a flag the operator sets",
    ),
    Invalid(
        "model-extra-args-abbreviated-tp",
        _spec({"model": {"extraArgs": ["--enforce-eager", "--tensor-parallel", "4"]}}),
        "spec.model.extraArgs[1]",
        "extraArgs must not set a flag the operator sets",
    ),
    # core/v1 types with their fields and the pod validation's rules.
    Invalid(
        "toleration-misspelt-field",
        _spec({"prefill": {"tolerations": [{"keys": "nvidia.com/gpu", "operator": "Exists"}]}}),
        "spec.prefill.tolerations[0].keys",
        'unknown field "spec.prefill.tolerations[0].keys"',
    ),
    Invalid(
        "toleration-operator-enum",
        _spec({"prefill": {"tolerations": [{"key": "nvidia.com/gpu", "operator": "exists"}]}}),
        "spec.prefill.tolerations[0].operator",
        'Unsupported value: "exists"',
    ),
    Invalid(
        "toleration-key-not-a-label-key",
        _spec({"decode": {"tolerations": [{"key": "nvidia gpu", "operator": "Exists"}]}}),
        "spec.decode.tolerations[0].key",
        "should match",
    ),
    Invalid(
        "toleration-no-key-needs-exists",
        _spec({"decode": {"tolerations": [{"value": "x", "effect": "NoSchedule"}]}}),
        "spec.decode.tolerations[0]",
        "a toleration without a key tolerates every taint and needs operator: Exists",
    ),
    Invalid(
        "toleration-exists-with-value",
        _spec({"decode": {"tolerations": [{"key": "k", "operator": "Exists", "value": "v"}]}}),
        "spec.decode.tolerations[0].value",
        "a toleration with operator: Exists matches every value of its key",
    ),
    Invalid(
        "toleration-seconds-without-no-execute",
        _spec({"decode": {"tolerations": [{"key": "k", "tolerationSeconds": 60}]}}),
        "spec.decode.tolerations[0].tolerationSeconds",
        "tolerationSeconds applies to effect NoExecute only",
    ),
    Invalid(
        "affinity-misspelt-field",
        _spec({"decode": {"affinity": {"podAntiAfinity": {}}}}),
        "spec.decode.affinity.podAntiAfinity",
        'unknown field "spec.decode.affinity.podAntiAfinity"',
    ),
    Invalid(
        "node-requirement-in-without-values",
        _spec(
            {
                "prefill": {
                    "affinity": {
                        "nodeAffinity": {
                            NODE_REQUIRED: {
                                "nodeSelectorTerms": [
                                    {"matchExpressions": [{"key": "gpu", "operator": "In"}]}
                                ]
                            }
                        }
                    }
                }
            }
        ),
        f"spec.prefill.affinity.nodeAffinity.{NODE_REQUIRED}.nodeSelectorTerms[0]"
        ".matchExpressions[0].values",
        "a node selector requirement with operator In or NotIn needs values",
    ),
    Invalid(
        "pod-requirement-exists-with-values",
        _spec(
            {
                "decode": {
                    "affinity": {
                        "podAntiAffinity": {
                            NODE_REQUIRED: [
                                {
                                    "topologyKey": "kubernetes.io/hostname",
                                    "labelSelector": {
                                        "matchExpressions": [
                                            {"key": "app", "operator": "Exists", "values": ["x"]}
                                        ]
                                    },
                                }
                            ]
                        }
                    }
                }
            }
        ),
        f"spec.decode.affinity.podAntiAffinity.{NODE_REQUIRED}[0].labelSelector"
        ".matchExpressions[0].values",
        "a label selector requirement with operator In or NotIn needs values",
    ),
    Invalid(
        "env-misspelt-field",
        _spec({"prefill": {"env": [{"name": "A", "valeu": "1"}]}}),
        "spec.prefill.env[0].valeu",
        'unknown field "spec.prefill.env[0].valeu"',
    ),
    Invalid(
        "env-duplicate-name",
        _spec({"prefill": {"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}}),
        "spec.prefill.env",
        "env names each variable once",
    ),
    Invalid(
        "env-duplicate-name-list-map",
        _spec({"decode": {"env": [{"name": "B", "value": "1"}, {"name": "B"}]}}),
        "spec.decode.env[1]",
        'Duplicate value: {"name":"B"}',
    ),
    Invalid(
        "env-name-with-equals",
        _spec({"decode": {"env": [{"name": "A=B", "value": "1"}]}}),
        "spec.decode.env[0].name",
        "should match",
    ),
    Invalid(
        "env-value-and-value-from",
        _spec(
            {
                "decode": {
                    "env": [
                        {
                            "name": "A",
                            "value": "1",
                            "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
                        }
                    ]
                }
            }
        ),
        "spec.decode.env[0]",
        "an env entry sets value or valueFrom, not both",
    ),
    Invalid(
        "env-value-from-two-sources",
        _spec(
            {
                "decode": {
                    "env": [
                        {
                            "name": "A",
                            "valueFrom": {
                                "fieldRef": {"fieldPath": "status.podIP"},
                                "secretKeyRef": {"name": "s", "key": "k"},
                            },
                        }
                    ]
                }
            }
        ),
        "spec.decode.env[0].valueFrom",
        "Too many: 2: must have at most 1 item",
    ),
    Invalid(
        "cpu-prefill-tp",
        _cpu_spec({"prefill": {"tensorParallelSize": 2}}),
        "spec.prefill.tensorParallelSize",
        "tensorParallelSize must be 1 when spec.engine.device is cpu",
    ),
    Invalid(
        "cpu-decode-tp",
        _cpu_spec({"decode": {"tensorParallelSize": 4}}),
        "spec.decode.tensorParallelSize",
        "tensorParallelSize must be 1 when spec.engine.device is cpu",
    ),
    # Names the pod validation checks: refused by the CRD, not by the StatefulSet apply.
    Invalid(
        "priority-class-not-a-name",
        _spec({"decode": {"priorityClassName": "High Priority"}}),
        "spec.decode.priorityClassName",
        "should match",
    ),
    Invalid(
        "gpu-resource-without-a-domain",
        _spec({"prefill": {"resources": {"gpuResourceName": "gpu"}}}),
        "spec.prefill.resources.gpuResourceName",
        "should match",
    ),
    Invalid(
        "pvc-claim-not-a-name",
        _spec({"model": {"source": {"pvc": {"claimName": "My_Models"}}}}),
        "spec.model.source.pvc.claimName",
        "should match",
    ),
    Invalid(
        "cpu-without-image",
        _spec({"engine": {"device": "cpu"}}),
        "spec.engine.image",
        "spec.engine.image is required when spec.engine.device is cpu",
    ),
    Invalid(
        "cpu-transport-rdma",
        _cpu_spec(
            {"network": {"transport": "rdma", "rdma": {"enabled": True, "resourceName": "r/x"}}}
        ),
        "spec.network.transport",
        "network.transport must be auto or tcp when spec.engine.device is cpu",
    ),
    Invalid(
        "cpu-rdma-enabled",
        _cpu_spec(
            {"network": {"rdma": {"enabled": True, "resourceName": "rdma/hca_shared_devices_a"}}}
        ),
        "spec.network.rdma.enabled",
        "network.rdma.enabled must be false when spec.engine.device is cpu",
    ),
    Invalid(
        "cpu-kv-cache-space-zero",
        _cpu_spec({"engine": {"cpu": {"kvCacheSpaceGiB": 0}}}),
        "spec.engine.cpu.kvCacheSpaceGiB",
        "should be greater than or equal to 1",
    ),
    Invalid(
        "prefill-env-name-required",
        _spec({"prefill": {"env": [{"value": "1"}]}}),
        "spec.prefill.env[0].name",
        "Required value",
    ),
    Invalid(
        "decode-env-name-required",
        _spec({"decode": {"env": [{"value": "1"}]}}),
        "spec.decode.env[0].name",
        "Required value",
    ),
    Invalid(
        "unknown-field",
        _spec({"prefill": {"replica": 2}}),
        "spec.prefill.replica",
        'unknown field "spec.prefill.replica"',
    ),
    Invalid(
        "backends-enum",
        _spec({"kvTransfer": {"backends": ["TCP"]}}),
        "spec.kvTransfer.backends[0]",
        'Unsupported value: "TCP"',
    ),
    Invalid(
        "backends-empty",
        _spec({"kvTransfer": {"backends": []}}),
        "spec.kvTransfer.backends",
        "should have at least 1 items",
    ),
    Invalid(
        "retention-below-vllm-margin",
        _spec({"kvTransfer": {"decodeRetentionSeconds": 5}}),
        "spec.kvTransfer.decodeRetentionSeconds",
        "should be greater than or equal to 10",
    ),
    Invalid(
        "rdma-needs-resource",
        _spec({"network": {"rdma": {"enabled": True}}}),
        "spec.network.rdma",
        "network.rdma.enabled needs network.rdma.resourceName",
    ),
    Invalid(
        "transport-rdma-needs-rdma",
        _spec({"network": {"transport": "rdma"}}),
        "spec.network.transport",
        "network.transport: rdma needs network.rdma.enabled",
    ),
    Invalid(
        "transport-enum",
        _spec({"network": {"transport": "infiniband"}}),
        "spec.network.transport",
        'Unsupported value: "infiniband"',
    ),
    Invalid(
        "session-key-pattern",
        _spec({"routing": {"sessionKeys": ["cookie:sid"]}}),
        "spec.routing.sessionKeys[0]",
        "should match",
    ),
    Invalid(
        "clients-ipblock-and-selector",
        _spec(
            {"networkPolicy": {"clients": [{"ipBlock": {"cidr": "10.0.0.0/8"}, "podSelector": {}}]}}
        ),
        "spec.networkPolicy.clients[0]",
        "each spec.networkPolicy.clients entry sets ipBlock alone, or podSelector",
    ),
    Invalid(
        "clients-empty-peer",
        _spec({"networkPolicy": {"clients": [{}]}}),
        "spec.networkPolicy.clients[0]",
        "each spec.networkPolicy.clients entry sets ipBlock alone, or podSelector",
    ),
    Invalid(
        "clients-cidr-required",
        _spec({"networkPolicy": {"clients": [{"ipBlock": {"except": ["10.0.0.0/24"]}}]}}),
        "spec.networkPolicy.clients[0].ipBlock.cidr",
        "Required value",
    ),
    Invalid(
        "clients-pod-expression-key-required",
        _spec(
            {
                "networkPolicy": {
                    "clients": [{"podSelector": {"matchExpressions": [{"operator": "Exists"}]}}]
                }
            }
        ),
        "spec.networkPolicy.clients[0].podSelector.matchExpressions[0].key",
        "Required value",
    ),
    Invalid(
        "clients-pod-expression-operator-required",
        _spec(
            {
                "networkPolicy": {
                    "clients": [{"podSelector": {"matchExpressions": [{"key": "app"}]}}]
                }
            }
        ),
        "spec.networkPolicy.clients[0].podSelector.matchExpressions[0].operator",
        "Required value",
    ),
    Invalid(
        "clients-namespace-expression-key-required",
        _spec(
            {
                "networkPolicy": {
                    "clients": [
                        {"namespaceSelector": {"matchExpressions": [{"operator": "Exists"}]}}
                    ]
                }
            }
        ),
        "spec.networkPolicy.clients[0].namespaceSelector.matchExpressions[0].key",
        "Required value",
    ),
    Invalid(
        "clients-namespace-expression-operator-required",
        _spec(
            {
                "networkPolicy": {
                    "clients": [{"namespaceSelector": {"matchExpressions": [{"key": "team"}]}}]
                }
            }
        ),
        "spec.networkPolicy.clients[0].namespaceSelector.matchExpressions[0].operator",
        "Required value",
    ),
    Invalid(
        "tuning-mode-off",
        _spec({"cacheTuning": {"mode": "Off"}}),
        "spec.cacheTuning.mode",
        'Unsupported value: "Off"',
    ),
    Invalid(
        "tuning-mode-yaml-bool",
        _spec({"cacheTuning": {"mode": False}}),
        "spec.cacheTuning.mode",
        "must be of type string",
    ),
    Invalid(
        "coverage-zero",
        _spec({"cacheTuning": {"coverage": 0}}),
        "spec.cacheTuning.coverage",
        "should be greater than 0",
    ),
    Invalid(
        "coverage-above-one",
        _spec({"cacheTuning": {"coverage": 1.5}}),
        "spec.cacheTuning.coverage",
        "should be less than or equal to 1",
    ),
    Invalid(
        "retention-min-above-max",
        _spec({"cacheTuning": {"minRetentionSeconds": 600, "maxRetentionSeconds": 60}}),
        "spec.cacheTuning.minRetentionSeconds",
        "cacheTuning.minRetentionSeconds must be at most maxRetentionSeconds",
    ),
    Invalid(
        "name-too-long",
        merge(MINIMAL, {"metadata": {"name": "x" * 45}}),
        "",
        "metadata.name must be at most 44 characters",
    ),
    # Server chat renders Service chat-decode; a server chat-decode would render it too.
    Invalid(
        "name-ends-in-decode",
        merge(MINIMAL, {"metadata": {"name": "chat-decode"}}),
        "",
        "metadata.name must not end in -prefill or -decode",
    ),
    Invalid(
        "name-ends-in-prefill",
        merge(MINIMAL, {"metadata": {"name": "chat-prefill"}}),
        "",
        "metadata.name must not end in -prefill or -decode",
    ),
    # Per-owner caps mean nothing without an owner identity: every client is one owner.
    Invalid(
        "owner-caps-without-header",
        _spec({"owners": {"maxHandles": 8}}),
        "spec.owners",
        "spec.owners.maxHandles and maxPinnedTokens need spec.owners.header",
    ),
    Invalid(
        "owner-header-ours",
        _spec({"owners": {"header": "X-Kvferry-Owner"}}),
        "spec.owners.header",
        "spec.owners.header must not be one of the sidecar's own headers",
    ),
    Invalid(
        "owner-header-pattern",
        _spec({"owners": {"header": "X User"}}),
        "spec.owners.header",
        "should match",
    ),
    Invalid(
        "owner-max-handles-positive",
        _spec({"owners": {"header": "X-User", "maxHandles": 0}}),
        "spec.owners.maxHandles",
        "should be greater than or equal to 1",
    ),
    Invalid(
        "owner-max-pinned-tokens-positive",
        _spec({"owners": {"header": "X-User", "maxPinnedTokens": 0}}),
        "spec.owners.maxPinnedTokens",
        "should be greater than or equal to 1",
    ),
]


# spec.<role>.podTemplate: what the overlay may not change (podtemplate.py).
def _overlay(role: str, template: dict[str, Any]) -> dict[str, Any]:
    return _spec({role: {"podTemplate": template}})


INVALID += [
    Invalid(
        "pod-template-operator-label",
        _overlay("decode", {"metadata": {"labels": {"kvferry.io/server": "other"}}}),
        "spec.decode.podTemplate.metadata.labels",
        "podTemplate labels may not be app.kubernetes.io/* or kvferry.io/*",
    ),
    Invalid(
        "pod-template-operator-annotation",
        _overlay("prefill", {"metadata": {"annotations": {"kvferry.io/config-hash": "x"}}}),
        "spec.prefill.podTemplate.metadata.annotations",
        "pod annotations may not be kvferry.io/*",
    ),
    # podAnnotations land on the same pods: one rule for both (podtemplate.ANNOTATIONS_RULE).
    Invalid(
        "pod-annotations-operator-annotation",
        _spec({"decode": {"podAnnotations": {"kvferry.io/config-hash": "x"}}}),
        "spec.decode.podAnnotations",
        "pod annotations may not be kvferry.io/*",
    ),
    Invalid(
        "pod-annotations-networks",
        _spec({"prefill": {"podAnnotations": {"k8s.v1.cni.cncf.io/networks": "other-tenant/net"}}}),
        "spec.prefill.podAnnotations",
        "or k8s.v1.cni.cncf.io/networks (set spec.network.rdma.networks)",
    ),
    Invalid(
        "pod-template-sidecar",
        _overlay("decode", {"spec": {"containers": [{"name": "kvferry-sidecar", "image": "x"}]}}),
        "spec.decode.podTemplate.spec.containers",
        "the kvferry-sidecar container is kvferry's",
    ),
    Invalid(
        "pod-template-sidecar-init",
        _overlay("prefill", {"spec": {"initContainers": [{"name": "kvferry-sidecar"}]}}),
        "spec.prefill.podTemplate.spec.initContainers",
        "the kvferry-sidecar container is kvferry's",
    ),
    Invalid(
        "pod-template-engine-ports",
        _overlay("decode", {"spec": {"containers": [{"name": "engine", "ports": []}]}}),
        "spec.decode.podTemplate.spec.containers",
        "the engine's ports, command, args, env, image and resources are kvferry's",
    ),
    Invalid(
        "pod-template-engine-args",
        _overlay("prefill", {"spec": {"containers": [{"name": "engine", "args": ["--port"]}]}}),
        "spec.prefill.podTemplate.spec.containers",
        "the engine's ports, command, args, env, image and resources are kvferry's",
    ),
    Invalid(
        "pod-template-engine-lifecycle",
        _overlay(
            "decode",
            {
                "spec": {
                    "containers": [
                        {
                            "name": "engine",
                            "lifecycle": {
                                "preStop": {"httpGet": {"path": "/healthz", "port": 8001}}
                            },
                        }
                    ]
                }
            },
        ),
        "spec.decode.podTemplate.spec.containers",
        "the engine's lifecycle hooks are kvferry's",
    ),
    Invalid(
        "pod-template-kvferry-volume",
        _overlay("decode", {"spec": {"volumes": [{"name": "dshm", "hostPath": {"path": "/"}}]}}),
        "spec.decode.podTemplate.spec.volumes",
        "are kvferry's volumes",
    ),
    Invalid(
        "pod-template-spread-when",
        _overlay(
            "decode",
            {
                "spec": {
                    "topologySpreadConstraints": [{"topologyKey": "x", "whenUnsatisfiable": "No"}]
                }
            },
        ),
        "spec.decode.podTemplate.spec.topologySpreadConstraints[0].whenUnsatisfiable",
        "Unsupported value",
    ),
    Invalid(
        "pod-template-service-account",
        _overlay("decode", {"spec": {"serviceAccountName": "Not_A_Name"}}),
        "spec.decode.podTemplate.spec.serviceAccountName",
        "should match",
    ),
]


# Every keyed list of a pod template requires its merge key (podtemplate.POD_LISTS),
# so what the API server stores the operator can merge: (case, overlay spec, path).
_MERGE_KEYS: list[tuple[str, dict[str, Any], str]] = [
    ("container-name", {"containers": [{"image": "x"}]}, "containers[0].name"),
    (
        "env-name",
        {"containers": [{"name": "logs", "env": [{"value": "1"}]}]},
        "containers[0].env[0].name",
    ),
    (
        "port-container-port",
        {"containers": [{"name": "logs", "ports": [{"name": "p"}]}]},
        "containers[0].ports[0].containerPort",
    ),
    (
        "mount-path",
        {"initContainers": [{"name": "setup", "volumeMounts": [{"name": "v"}]}]},
        "initContainers[0].volumeMounts[0].mountPath",
    ),
    (
        "device-path",
        {"containers": [{"name": "logs", "volumeDevices": [{"name": "v"}]}]},
        "containers[0].volumeDevices[0].devicePath",
    ),
    ("volume-name", {"volumes": [{"emptyDir": {}}]}, "volumes[0].name"),
    ("pull-secret-name", {"imagePullSecrets": [{}]}, "imagePullSecrets[0].name"),
    ("host-alias-ip", {"hostAliases": [{"hostnames": ["a"]}]}, "hostAliases[0].ip"),
    (
        "spread-topology-key",
        {"topologySpreadConstraints": [{"maxSkew": 1}]},
        "topologySpreadConstraints[0].topologyKey",
    ),
]
INVALID += [
    Invalid(
        f"pod-template-{case}-required",
        _overlay(role, {"spec": patch}),
        f"spec.{role}.podTemplate.spec.{path}",
        "Required value",
    )
    for i, (case, patch, path) in enumerate(_MERGE_KEYS)
    for role in ["prefill" if i % 2 else "decode"]
]


# A required field of the core/v1 types in a role, left out: (case, role patch, path).
_NODE_PREFERRED = "preferredDuringSchedulingIgnoredDuringExecution"
_TERM = {"topologyKey": "kubernetes.io/hostname"}
_CORE_REQUIRED: list[tuple[str, dict[str, Any], str]] = [
    (
        "node-affinity-terms",
        {"affinity": {"nodeAffinity": {NODE_REQUIRED: {}}}},
        f"affinity.nodeAffinity.{NODE_REQUIRED}.nodeSelectorTerms",
    ),
    (
        "node-requirement-key",
        {
            "affinity": {
                "nodeAffinity": {
                    NODE_REQUIRED: {
                        "nodeSelectorTerms": [{"matchExpressions": [{"operator": "Exists"}]}]
                    }
                }
            }
        },
        f"affinity.nodeAffinity.{NODE_REQUIRED}.nodeSelectorTerms[0].matchExpressions[0].key",
    ),
    (
        "node-requirement-operator",
        {
            "affinity": {
                "nodeAffinity": {
                    NODE_REQUIRED: {"nodeSelectorTerms": [{"matchExpressions": [{"key": "gpu"}]}]}
                }
            }
        },
        f"affinity.nodeAffinity.{NODE_REQUIRED}.nodeSelectorTerms[0].matchExpressions[0].operator",
    ),
    (
        "node-preferred-weight",
        {"affinity": {"nodeAffinity": {_NODE_PREFERRED: [{"preference": {}}]}}},
        f"affinity.nodeAffinity.{_NODE_PREFERRED}[0].weight",
    ),
    (
        "node-preferred-preference",
        {"affinity": {"nodeAffinity": {_NODE_PREFERRED: [{"weight": 1}]}}},
        f"affinity.nodeAffinity.{_NODE_PREFERRED}[0].preference",
    ),
    (
        "pod-term-topology-key",
        {"affinity": {"podAffinity": {NODE_REQUIRED: [{}]}}},
        f"affinity.podAffinity.{NODE_REQUIRED}[0].topologyKey",
    ),
    (
        "pod-requirement-key",
        {
            "affinity": {
                "podAffinity": {
                    NODE_REQUIRED: [
                        {**_TERM, "labelSelector": {"matchExpressions": [{"operator": "Exists"}]}}
                    ]
                }
            }
        },
        f"affinity.podAffinity.{NODE_REQUIRED}[0].labelSelector.matchExpressions[0].key",
    ),
    (
        "pod-requirement-operator",
        {
            "affinity": {
                "podAffinity": {
                    NODE_REQUIRED: [
                        {**_TERM, "labelSelector": {"matchExpressions": [{"key": "app"}]}}
                    ]
                }
            }
        },
        f"affinity.podAffinity.{NODE_REQUIRED}[0].labelSelector.matchExpressions[0].operator",
    ),
    (
        "pod-preferred-weight",
        {"affinity": {"podAntiAffinity": {_NODE_PREFERRED: [{"podAffinityTerm": _TERM}]}}},
        f"affinity.podAntiAffinity.{_NODE_PREFERRED}[0].weight",
    ),
    (
        "pod-preferred-term",
        {"affinity": {"podAntiAffinity": {_NODE_PREFERRED: [{"weight": 1}]}}},
        f"affinity.podAntiAffinity.{_NODE_PREFERRED}[0].podAffinityTerm",
    ),
    (
        "env-field-path",
        {"env": [{"name": "A", "valueFrom": {"fieldRef": {}}}]},
        "env[0].valueFrom.fieldRef.fieldPath",
    ),
    (
        "env-resource",
        {"env": [{"name": "A", "valueFrom": {"resourceFieldRef": {}}}]},
        "env[0].valueFrom.resourceFieldRef.resource",
    ),
    (
        "env-config-map-name",
        {"env": [{"name": "A", "valueFrom": {"configMapKeyRef": {"key": "k"}}}]},
        "env[0].valueFrom.configMapKeyRef.name",
    ),
    (
        "env-config-map-key",
        {"env": [{"name": "A", "valueFrom": {"configMapKeyRef": {"name": "c"}}}]},
        "env[0].valueFrom.configMapKeyRef.key",
    ),
    (
        "env-secret-name",
        {"env": [{"name": "A", "valueFrom": {"secretKeyRef": {"key": "k"}}}]},
        "env[0].valueFrom.secretKeyRef.name",
    ),
    (
        "env-secret-key",
        {"env": [{"name": "A", "valueFrom": {"secretKeyRef": {"name": "s"}}}]},
        "env[0].valueFrom.secretKeyRef.key",
    ),
]
INVALID += [
    Invalid(f"{case}-required", _spec({role: patch}), f"spec.{role}.{path}", "Required value")
    for i, (case, patch, path) in enumerate(_CORE_REQUIRED)
    for role in ["prefill" if i % 2 else "decode"]
]
