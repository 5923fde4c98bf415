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
    # What vLLM's CPU build cannot do (spec.engine.device: cpu).
    Invalid(
        "device-enum",
        _spec({"engine": {"device": "tpu"}}),
        "spec.engine.device",
        'Unsupported value: "tpu"',
    ),
    Invalid(
        "cpu-prefill-gpus",
        _spec({"engine": {"device": "cpu"}, "prefill": {"resources": {"gpus": 1}}}),
        "spec.prefill.resources.gpus",
        "resources.gpus must be unset when spec.engine.device is cpu",
    ),
    Invalid(
        "cpu-decode-gpus",
        _spec({"engine": {"device": "cpu"}, "decode": {"resources": {"gpus": 0}}}),
        "spec.decode.resources.gpus",
        "resources.gpus must be unset when spec.engine.device is cpu",
    ),
    Invalid(
        "cpu-prefill-tp",
        _spec({"engine": {"device": "cpu"}, "prefill": {"tensorParallelSize": 2}}),
        "spec.prefill.tensorParallelSize",
        "tensorParallelSize must be 1 when spec.engine.device is cpu",
    ),
    Invalid(
        "cpu-decode-tp",
        _spec({"engine": {"device": "cpu"}, "decode": {"tensorParallelSize": 4}}),
        "spec.decode.tensorParallelSize",
        "tensorParallelSize must be 1 when spec.engine.device is cpu",
    ),
    Invalid(
        "cpu-transport-rdma",
        _spec(
            {
                "engine": {"device": "cpu"},
                "network": {"transport": "rdma", "rdma": {"enabled": True, "resourceName": "r/x"}},
            }
        ),
        "spec.network.transport",
        "network.transport must be auto or tcp when spec.engine.device is cpu",
    ),
    Invalid(
        "cpu-rdma-enabled",
        _spec(
            {
                "engine": {"device": "cpu"},
                "network": {"rdma": {"enabled": True, "resourceName": "rdma/hca_shared_devices_a"}},
            }
        ),
        "spec.network.rdma.enabled",
        "network.rdma.enabled must be false when spec.engine.device is cpu",
    ),
    Invalid(
        "cpu-kv-cache-space-zero",
        _spec({"engine": {"device": "cpu", "cpu": {"kvCacheSpaceGiB": 0}}}),
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
