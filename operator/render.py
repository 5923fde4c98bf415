"""DisaggregatedServer -> the Kubernetes objects that run it. Pure: no API calls.

For a server ``x`` in namespace ``ns``:

- ConfigMap ``x-sidecar``: the sidecars' settings (``sidecar.json``) and the
  peer topology (``topology.json``, which changes on scaling without
  restarting pods);
- StatefulSets ``x-prefill`` and ``x-decode`` (stable pod names give stable
  NIXL side-channel identities and the decode session ring) and their headless
  Services;
- Service ``x``: the sidecar port (8000) of the decode pods, the client entry point;
- PodDisruptionBudgets ``x-prefill`` / ``x-decode``;
- NetworkPolicy ``x``: ingress to the pods from the server's own pods and, on the
  client port only, from ``spec.networkPolicy.clients`` (and on the metrics port only
  from the operator's ``metrics_clients``);
- KVCacheStatus ``x`` (its status is written by the operator, not rendered).

Every object carries the ``app.kubernetes.io/*`` labels and an owner
reference to the server, so deleting the server garbage-collects them. The
engine's own command line (args, KV configs, environment) is ``engine_config``.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from typing import Any

from kvferry_wire import protocol
from kvferry_wire import settings as wire_settings

from . import api, podtemplate, policy
from .api import Role, Server, ServerSpec
from .engine_config import (
    HF_CACHE_MOUNT,
    HF_TOKEN_FILE,
    HF_TOKEN_MOUNT,
    MODELS_MOUNT,
    build_engine_args,
    build_engine_env,
    decode_lease_seconds,
    engine_build_hash,
    engine_command,
    kv_transport,
    stable_hash,
)
from .resources import (
    build_engine_probes,
    build_engine_resources,
    build_sidecar_probes,
    build_sidecar_resources,
)
from .scanskips import build_scanner_skips

DEFAULT_SIDECAR_IMAGE = "ghcr.io/kvferry/kvferry-sidecar:0.1.0"

CONFIG_KEY_SETTINGS = "sidecar.json"
CONFIG_KEY_TOPOLOGY = "topology.json"
CONFIG_KEY_OPERATOR_CA = "operator-ca.crt"
CONFIG_MOUNT = "/etc/kvferry"
TOKEN_MOUNT = "/var/run/secrets/kvferry"
# The decode sidecar's pin journal (kvferry_sidecar.pinjournal): an emptyDir, so it
# outlives a restart of the sidecar, not the pod (nor does D's KV). The journal keeps
# itself under PIN_JOURNAL_MAX_BYTES; the limit leaves room for its rewrite's temp
# file (a pod over an emptyDir's sizeLimit is evicted).
JOURNAL_VOLUME = "kvferry-journal"
JOURNAL_MOUNT = "/var/run/kvferry/journal"
JOURNAL_FILE = f"{JOURNAL_MOUNT}/pins.jsonl"
JOURNAL_SIZE_LIMIT = "128Mi"

# The engine's Hugging Face cache volume (hub downloads), mounted at HF_CACHE_MOUNT.
HF_CACHE_VOLUME = "hf-cache"
# The hub token Secret, mounted at HF_TOKEN_MOUNT.
HF_TOKEN_VOLUME = "hf-token"

# The sidecar runs as this non-root user (distroless "nonroot").
SIDECAR_UID = 65532

# What a stopping pod has beyond its drain: the handles' release requests (5 s at most,
# kvferry_sidecar.runtime) and the engine's own stop after SIGTERM. 60 s was the whole
# grace before pods drained, and vLLM stopped within it.
DRAIN_MARGIN_SECONDS = 60

Obj = dict[str, Any]


@dataclass(frozen=True)
class Context:
    """What the operator adds to every server's objects."""

    sidecar_image: str = DEFAULT_SIDECAR_IMAGE
    # Where sidecars push residency reports, and the CA (PEM) to trust for it.
    report_url: str = ""
    report_ca_pem: str = ""
    # NetworkPolicy peers that may scrape every server's metrics port (Prometheus; the
    # chart's networkPolicy.metricsClients): GET /metrics only, no peer's rights.
    metrics_clients: tuple[Obj, ...] = ()


# ------------------------------------------------------------ names & labels


def child_name(server: Server, role: str | None = None) -> str:
    return name_for(server.name, role)


def name_for(server_name: str, role: str | None = None) -> str:
    """A child's name from the server's name alone: ``<server>-<role>`` names a role's
    StatefulSet (the report endpoint checks membership against it)."""
    return f"{server_name}-{role}" if role else server_name


def config_map_name(server: Server) -> str:
    return f"{server.name}-sidecar"


def selector_labels(server: Server, role: str | None = None) -> dict[str, str]:
    labels = {api.LABEL_NAME: "kvferry", api.LABEL_INSTANCE: server.name}
    if role:
        labels[api.LABEL_ROLE] = role
    return labels


def common_labels(server: Server, component: str, role: str | None = None) -> dict[str, str]:
    return {
        **selector_labels(server, role),
        api.LABEL_COMPONENT: component,
        api.LABEL_MANAGED_BY: api.FIELD_MANAGER,
        api.LABEL_PART_OF: "kvferry",
    }


def owner_reference(server: Server) -> Obj:
    return {
        "apiVersion": api.API_VERSION,
        "kind": api.SERVER_KIND,
        "name": server.name,
        "uid": server.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(server: Server, name: str, labels: dict[str, str]) -> Obj:
    meta: Obj = {"name": name, "namespace": server.namespace, "labels": labels}
    if server.uid:
        meta["ownerReferences"] = [owner_reference(server)]
    return meta


def drain_seconds(role: Role) -> int:
    """spec.<role>.drainSeconds, or by role: decode waits out the sidecar's decode
    budget (a turn whose decode began as the drain started finishes), prefill nothing
    (its sidecar carries no turns: decode sidecars call the prefill engine directly)."""
    if role.drain_seconds is not None:
        return role.drain_seconds
    if role.name == api.ROLE_DECODE:
        return int(wire_settings.SidecarSettings().decode_timeout_seconds)
    return 0


def build_engine_lifecycle() -> Obj:
    """The engine's preStop: GET the sidecar's drain (the same network namespace: the
    pod IP the kubelet dials reaches the sidecar's internal port). The kubelet runs
    each container's preStop at once and stops a native sidecar only after the main
    containers exited, so this hook is what holds the engine until the turns are done
    (docs/production.md, Drain). Every field the API server defaults is written."""
    return {
        "preStop": {
            "httpGet": {
                "path": protocol.DRAIN_PATH,
                "port": protocol.SIDECAR_INTERNAL_PORT,
                "scheme": "HTTP",
            }
        }
    }


def build_engine_container(server: Server, role: Role) -> Obj:
    spec = server.spec
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}]
    if spec.model.pvc:
        mounts.append({"name": "models", "mountPath": MODELS_MOUNT, "readOnly": True})
    if spec.model.hub:
        mounts.append({"name": HF_CACHE_VOLUME, "mountPath": HF_CACHE_MOUNT})
    if spec.model.hub and spec.model.hub.token_secret_name:
        mounts.append({"name": HF_TOKEN_VOLUME, "mountPath": HF_TOKEN_MOUNT, "readOnly": True})
    return {
        "name": "engine",
        "image": spec.engine.image,
        "imagePullPolicy": spec.engine.image_pull_policy,
        "command": engine_command(spec),
        "args": build_engine_args(server, role),
        "env": build_engine_env(spec, role),
        "ports": [
            {"name": "engine", "containerPort": protocol.ENGINE_PORT},
            {"name": "nixl", "containerPort": protocol.NIXL_SIDE_CHANNEL_PORT},
        ],
        "resources": build_engine_resources(spec, role),
        "securityContext": build_engine_security_context(spec),
        "volumeMounts": mounts,
        "lifecycle": build_engine_lifecycle(),
        # Downloading and loading a large model can take hours: the startup probe's
        # budget comes from the source or spec.<role>.startupSeconds (resources.py).
        **build_engine_probes(spec, role),
    }


def build_engine_security_context(spec: ServerSpec) -> Obj:
    """The engine keeps the image's user (vLLM images run as root) but none of root's
    capabilities: serving, CUDA and NIXL over TCP need none, so a compromised engine
    cannot reach the node through them."""
    capabilities: Obj = {"drop": ["ALL"]}
    if spec.network.rdma.enabled:
        # RDMA registers (pins) memory; without IPC_LOCK registration fails.
        capabilities["add"] = ["IPC_LOCK"]
    return {
        "allowPrivilegeEscalation": False,
        "capabilities": capabilities,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


# The engine's UCX settings the sidecar reports the transport from, and the sidecar
# variables that carry them (kvferry_sidecar.transport).
SIDECAR_UCX_ENV = {
    "UCX_TLS": "KVFERRY_ENGINE_UCX_TLS",
    "UCX_NET_DEVICES": "KVFERRY_ENGINE_UCX_NET_DEVICES",
}


def build_sidecar_ucx_env(spec: ServerSpec, role: Role) -> list[Obj]:
    """The engine container's UCX_TLS / UCX_NET_DEVICES, as the sidecar's
    KVFERRY_ENGINE_* variables: same value or same source (a user's role.env wins
    on the engine, so it does here too)."""
    out = []
    for entry in build_engine_env(spec, role):
        name = SIDECAR_UCX_ENV.get(entry["name"])
        if name is not None:
            out.append({**entry, "name": name})
    return out


def build_sidecar_container(spec: ServerSpec, server: Server, role: Role, ctx: Context) -> Obj:
    def field_env(name: str, path: str) -> Obj:
        return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}

    return {
        "name": "kvferry-sidecar",
        "image": spec.engine.sidecar_image or ctx.sidecar_image,
        "imagePullPolicy": "IfNotPresent",
        # A native sidecar: starts before the engine and lives as long as the pod.
        "restartPolicy": "Always",
        "args": [
            "--role",
            role.name,
            "--config",
            f"{CONFIG_MOUNT}/{CONFIG_KEY_SETTINGS}",
            "--topology",
            f"{CONFIG_MOUNT}/{CONFIG_KEY_TOPOLOGY}",
            # Per role, so a flag, not sidecar.json (one file for both roles): what its
            # own SIGTERM drain waits and what the preStop drain waits.
            "--drain-seconds",
            str(drain_seconds(role)),
        ],
        "env": [
            field_env("POD_NAME", "metadata.name"),
            field_env("POD_NAMESPACE", "metadata.namespace"),
            field_env("POD_IP", "status.podIP"),
            {"name": "KVFERRY_SERVER", "value": server.name},
            {"name": "KVFERRY_TOKEN_FILE", "value": f"{TOKEN_MOUNT}/token"},
            # Its memory limit, as the pod has it: the body bytes it holds in flight
            # follow it (kvferry_sidecar.limits.inflight_capacity).
            {
                "name": "KVFERRY_MEMORY_LIMIT_BYTES",
                "valueFrom": {
                    "resourceFieldRef": {
                        "containerName": "kvferry-sidecar",
                        "resource": "limits.memory",
                    }
                },
            },
            *build_sidecar_ucx_env(spec, role),
        ],
        "ports": [
            {"name": "http", "containerPort": protocol.SIDECAR_PORT},
            # Peers' relayed turns, /metrics and /v1/residency: never behind the entry
            # Service (clients must not read other sessions' figures or pose as peers).
            {"name": "internal", "containerPort": protocol.SIDECAR_INTERNAL_PORT},
            # GET /metrics alone (the sidecar's series and the engine's): the one port
            # scrapers are admitted to (build_network_policy).
            {"name": "metrics", "containerPort": protocol.SIDECAR_METRICS_PORT},
        ],
        "resources": build_sidecar_resources(role),
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": SIDECAR_UID,
            "runAsGroup": SIDECAR_UID,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "volumeMounts": [
            {"name": "sidecar-config", "mountPath": CONFIG_MOUNT, "readOnly": True},
            {"name": "kvferry-token", "mountPath": TOKEN_MOUNT, "readOnly": True},
            *(
                [{"name": JOURNAL_VOLUME, "mountPath": JOURNAL_MOUNT}]
                if role.name == api.ROLE_DECODE
                else []
            ),
        ],
        **build_sidecar_probes(),
    }


def build_hf_cache_volume(spec: ServerSpec) -> Obj:
    """Where hub downloads go: the user's PVC, a node folder, or an emptyDir."""
    assert spec.model.hub
    cache = spec.model.hub.cache
    if cache.pvc_claim_name:
        return {
            "name": HF_CACHE_VOLUME,
            "persistentVolumeClaim": {"claimName": cache.pvc_claim_name},
        }
    if cache.host_path:
        return {
            "name": HF_CACHE_VOLUME,
            "hostPath": {"path": cache.host_path, "type": "DirectoryOrCreate"},
        }
    return {"name": HF_CACHE_VOLUME, "emptyDir": {}}


def build_volumes(server: Server, role: str) -> list[Obj]:
    spec = server.spec
    volumes: list[Obj] = [
        {
            "name": "dshm",
            "emptyDir": {"medium": "Memory", "sizeLimit": spec.network.shared_memory_size},
        },
        {"name": "sidecar-config", "configMap": {"name": config_map_name(server)}},
        {
            # Only the sidecar mounts a token, and only one for our audience: it
            # proves the pod's identity to the operator's report endpoint.
            "name": "kvferry-token",
            "projected": {
                "sources": [
                    {
                        "serviceAccountToken": {
                            "audience": protocol.REPORT_TOKEN_AUDIENCE,
                            "expirationSeconds": 3600,
                            "path": "token",
                        }
                    }
                ]
            },
        },
    ]
    if spec.model.pvc:
        volumes.append(
            {
                "name": "models",
                "persistentVolumeClaim": {"claimName": spec.model.pvc.claim_name, "readOnly": True},
            }
        )
    if spec.model.hub:
        volumes.append(build_hf_cache_volume(spec))
    if spec.model.hub and spec.model.hub.token_secret_name:
        # The Secret's default mode (0644): a non-root engine image must read it too.
        secret = {
            "secretName": spec.model.hub.token_secret_name,
            "items": [{"key": spec.model.hub.token_secret_key, "path": HF_TOKEN_FILE}],
        }
        volumes.append({"name": HF_TOKEN_VOLUME, "secret": secret})
    if role == api.ROLE_DECODE:
        volumes.append({"name": JOURNAL_VOLUME, "emptyDir": {"sizeLimit": JOURNAL_SIZE_LIMIT}})
    return volumes


def build_pod_template(server: Server, role: Role, config_hash: str, ctx: Context) -> Obj:
    spec = server.spec
    annotations = {
        **role.pod_annotations,
        api.ANNOTATION_BUILD_HASH: engine_build_hash(spec),
        api.ANNOTATION_CONFIG_HASH: config_hash,
    }
    if spec.network.rdma.enabled and spec.network.rdma.networks:
        annotations[api.ANNOTATION_MULTUS] = ",".join(spec.network.rdma.networks)
    labels = {
        **role.pod_labels,
        **common_labels(server, role.name, role.name),
        api.LABEL_SERVER: server.name,
    }
    pod: Obj = {
        # Service env vars are off: a Service named like "vllm" would inject
        # VLLM_PORT=tcp://..., which vLLM reads as its own setting and crashes.
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        # The containers set their own contexts; this one covers any other container
        # the pod gets (checkov CKV_K8S_29 wants a pod-level context).
        "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
        # The drain (the engine's preStop) and then the engine's own stop.
        "terminationGracePeriodSeconds": drain_seconds(role) + DRAIN_MARGIN_SECONDS,
        "initContainers": [build_sidecar_container(spec, server, role, ctx)],
        "containers": [build_engine_container(server, role)],
        "volumes": build_volumes(server, role.name),
    }
    if role.node_selector:
        pod["nodeSelector"] = dict(role.node_selector)
    if role.tolerations:
        pod["tolerations"] = [dict(t) for t in role.tolerations]
    if role.affinity:
        pod["affinity"] = role.affinity
    if role.priority_class_name:
        pod["priorityClassName"] = role.priority_class_name
    if spec.engine.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": n} for n in spec.engine.image_pull_secrets]
    spread = build_topology_spread(server, role)
    if spread:
        pod["topologySpreadConstraints"] = spread
    template = {"metadata": {"labels": labels, "annotations": annotations}, "spec": pod}
    # The user's overlay last (spec.<role>.podTemplate; the CRD refuses what it may not
    # change). Our labels and annotations once more after it: the selector, the peers'
    # NetworkPolicy and the rollout hashes depend on them, and an object stored before
    # the CRD's rules is not validated again.
    merged = podtemplate.merge(template, role.pod_template)
    merged.setdefault("metadata", {}).setdefault("labels", {}).update(labels)
    merged["metadata"].setdefault("annotations", {}).update(annotations)
    # What the overlay may not take away without a word: a shorter grace would SIGKILL
    # the engine in the middle of the drain spec.<role>.drainSeconds promises (a
    # longer one is kept), and Service links bring back the VLLM_PORT crash above.
    grace = pod["terminationGracePeriodSeconds"]
    merged_spec = merged.setdefault("spec", {})
    overlay_grace = merged_spec.get("terminationGracePeriodSeconds")
    if not isinstance(overlay_grace, int) or overlay_grace < grace:
        merged_spec["terminationGracePeriodSeconds"] = grace
    merged_spec["enableServiceLinks"] = False
    return merged


# The node label a default spread is over: one node's failure, drain or full GPUs
# must not hold every session.
SPREAD_TOPOLOGY_KEY = "kubernetes.io/hostname"


def build_topology_spread(server: Server, role: Role) -> list[Obj]:
    """Decode pods hold the sessions' KV and serve the clients: spread over nodes, so a
    node lost or drained takes a share of the sessions, not all. ``ScheduleAnyway``: a
    preference the scheduler scores, never a reason to leave a pod Pending (one GPU
    node, or fewer nodes than replicas, still schedules). Prefill pods hold nothing
    between turns. spec.decode.podTemplate replaces it (an entry of the same
    topologyKey merges into it; ``$patch: delete`` removes it)."""
    if role.name != api.ROLE_DECODE:
        return []
    return [
        {
            "maxSkew": 1,
            "topologyKey": SPREAD_TOPOLOGY_KEY,
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": selector_labels(server, role.name)},
        }
    ]


# ------------------------------------------------------------ objects


def peer_urls(server: Server, role: str, port: int) -> list[str]:
    """Stable per-ordinal addresses through the role's headless Service."""
    svc = child_name(server, role)
    # The spec's count or, under scaling mode External, the RoleScaler's (api.Server).
    replicas = server.replicas(role)
    return [f"http://{svc}-{i}.{svc}.{server.namespace}.svc:{port}" for i in range(replicas)]


def build_sidecar_settings(server: Server, ctx: Context | None = None) -> Obj:
    """``sidecar.json``: a ``kvferry_wire.settings.SettingsFile`` with what the
    operator decides (the rest keeps the sidecar's defaults), as a JSON object."""
    spec = server.spec
    ctx = ctx or Context()
    live = policy.config_policy(server)
    report: Obj = {}
    # Only what spec.owners sets: unset, the sidecar keeps today's one store (no owners)
    # and derives an owner's caps itself, so servers without owners render as before.
    owned = {
        name: value
        for name, value in (
            ("owner_header", spec.owners.header),
            ("owner_max_handles", spec.owners.max_handles),
            ("owner_max_pinned_tokens", spec.owners.max_pinned_tokens),
        )
        if value is not None
    }
    if ctx.report_url:
        report["operator_url"] = ctx.report_url
        if ctx.report_ca_pem:
            report["operator_ca_file"] = f"{CONFIG_MOUNT}/{CONFIG_KEY_OPERATOR_CA}"
    return wire_settings.encode_file(
        wire_settings.SettingsFile(
            **report,
            **owned,
            version=wire_settings.SETTINGS_VERSION,
            server=server.name,
            model=spec.model.name,
            engine_build=engine_build_hash(spec),
            engine_port=protocol.ENGINE_PORT,
            listen_port=protocol.SIDECAR_PORT,
            internal_port=protocol.SIDECAR_INTERNAL_PORT,
            metrics_port=protocol.SIDECAR_METRICS_PORT,
            bidirectional=spec.kv_transfer.bidirectional,
            # The live policy's values until the operator's first report answer: the
            # spec's (never Auto's: a tuning decision rewrites no child).
            recompute_threshold=live.recompute_threshold,
            retention_seconds=live.retention_seconds,
            retention_ceiling_seconds=policy.retention_ceiling(server),
            local_handle_seconds=decode_lease_seconds(server),
            pin_journal_path=JOURNAL_FILE,
            session_keys=tuple(spec.routing.session_keys),
            skip_prefill_below_tokens=live.skip_prefill_below_tokens,
            prefill_placement=live.prefill_placement,
            diagnostic_headers=spec.routing.diagnostic_headers,
            requested_transport=kv_transport(spec),
            rdma_enabled=spec.network.rdma.enabled,
            kv_events=f"tcp://127.0.0.1:{protocol.KV_EVENTS_PORT}",
            kv_events_replay=f"tcp://127.0.0.1:{protocol.KV_EVENTS_REPLAY_PORT}",
        )
    )


# Settings the live policy changes without a restart (policy.py): in the file as what
# a sidecar starts with, in no pod's hash (either role), so changing them rolls nothing.
LIVE_SETTINGS = tuple(
    wire_settings.file_key(name)
    for name in (
        "retention_seconds",
        "skip_prefill_below_tokens",
        "recompute_threshold",
        "prefill_placement",
    )
)
# Settings only the decode sidecar reads: changing them must not restart prefill.
DECODE_ONLY_SETTINGS = tuple(
    wire_settings.file_key(name)
    for name in (
        "retention_ceiling_seconds",
        "local_handle_seconds",
        "pin_journal_path",
        "session_keys",
        "diagnostic_headers",
        "owner_header",
        "owner_max_handles",
        "owner_max_pinned_tokens",
    )
)


def sidecar_config_hash(server: Server, role: str, ctx: Context) -> str:
    """What restarts a role's pods when settings change. Topology (replica
    counts) is not in it: sidecars re-read topology.json live."""
    settings = {
        k: v for k, v in build_sidecar_settings(server, ctx).items() if k not in LIVE_SETTINGS
    }
    if role == api.ROLE_PREFILL:
        settings = {k: v for k, v in settings.items() if k not in DECODE_ONLY_SETTINGS}
    return stable_hash(settings)


def build_topology(server: Server) -> Obj:
    return {
        "version": 1,
        "prefillEngines": peer_urls(server, api.ROLE_PREFILL, protocol.ENGINE_PORT),
        # Peers relay turns to the owner's internal port (a client cannot reach it).
        "decodeSidecars": peer_urls(server, api.ROLE_DECODE, protocol.SIDECAR_INTERNAL_PORT),
    }


def _json(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True) + "\n"


def build_config_map(server: Server, ctx: Context) -> Obj:
    data = {
        CONFIG_KEY_SETTINGS: _json(build_sidecar_settings(server, ctx)),
        CONFIG_KEY_TOPOLOGY: _json(build_topology(server)),
    }
    if ctx.report_ca_pem:
        data[CONFIG_KEY_OPERATOR_CA] = ctx.report_ca_pem
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(server, config_map_name(server), common_labels(server, "sidecar")),
        "data": data,
    }


def build_statefulset(server: Server, role: Role, ctx: Context) -> Obj:
    config_hash = sidecar_config_hash(server, role.name, ctx)
    name = child_name(server, role.name)
    template = build_pod_template(server, role, config_hash, ctx)
    meta = _metadata(server, name, common_labels(server, role.name, role.name))
    # Why the pods fail the scanner checks they do (scanskips.py): on the StatefulSet,
    # where checkov reads them, so they restart no pod.
    skips = build_scanner_skips(
        template["spec"], server.spec.engine.on_cpu, server.spec.network.rdma.enabled, role.name
    )
    if skips:
        meta["annotations"] = skips
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": meta,
        "spec": {
            "serviceName": name,
            "replicas": server.replicas(role.name),
            # Engines do not depend on each other's start order.
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "RollingUpdate"},
            "selector": {"matchLabels": selector_labels(server, role.name)},
            "template": template,
        },
    }


def build_headless_service(server: Server, role: Role) -> Obj:
    name = child_name(server, role.name)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(server, name, common_labels(server, role.name, role.name)),
        "spec": {
            "clusterIP": "None",
            # Peers must resolve a starting pod to finish the NIXL handshake.
            "publishNotReadyAddresses": True,
            "selector": selector_labels(server, role.name),
            # Peers call a prefill pod's engine and a decode pod's internal port; the
            # chart's ServiceMonitor scrapes the sidecars' metrics port through these
            # Services. Nothing reaches a pod's 8000 through them (clients use Service
            # x) nor NIXL's side channel (peers learn the pod IP from the KV handle).
            # What may connect at all is the NetworkPolicy's to say, not these ports.
            "ports": [
                {
                    "name": "internal",
                    "port": protocol.SIDECAR_INTERNAL_PORT,
                    "targetPort": "internal",
                },
                {"name": "engine", "port": protocol.ENGINE_PORT, "targetPort": "engine"},
                {
                    "name": "metrics",
                    "port": protocol.SIDECAR_METRICS_PORT,
                    "targetPort": "metrics",
                },
            ],
        },
    }


def build_entry_service(server: Server) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(server, child_name(server), common_labels(server, "router")),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(server, api.ROLE_DECODE),
            "ports": [{"name": "http", "port": protocol.SIDECAR_PORT, "targetPort": "http"}],
        },
    }


def build_pdb(server: Server, role: Role) -> Obj:
    """How many of a role's pods voluntary evictions (drains) may take at once:
    ``maxUnavailable`` as the spec has it, pods or a percentage of the replicas.

    ``unhealthyPodEvictionPolicy: AlwaysAllow``: a pod that is not Ready serves no
    turns, so evicting it takes nothing from the role. Under the API's default
    (IfHealthyBudget) a not-Ready pod may be evicted only while the role's Ready pods
    meet the budget, so when all of a role's pods crash-loop (a bad engine flag, a
    model that does not fit) or one does under maxUnavailable 0, every drain of their
    nodes blocks until someone deletes the pods by hand. Ready pods stay under the
    budget either way. Kubernetes' docs recommend AlwaysAllow for this reason."""
    name = child_name(server, role.name)
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(server, name, common_labels(server, role.name, role.name)),
        "spec": {
            "maxUnavailable": role.max_unavailable,
            "selector": {"matchLabels": selector_labels(server, role.name)},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def network_policy_name(server: Server) -> str:
    return server.name


def _selects_all(selector: Any) -> bool:
    """A label selector with no requirement: every object."""
    return isinstance(selector, dict) and not (
        selector.get("matchLabels") or selector.get("matchExpressions")
    )


def unrestricted_clients(server: Server) -> list[str]:
    """The ``spec.networkPolicy.clients`` entries that admit any pod of any namespace
    to the client port: a ``namespaceSelector`` with no requirement and no
    ``podSelector`` requirement (the CRD's default, ``[{namespaceSelector: {}}]``), or
    an ``ipBlock`` of every address (``/0``, no ``except``). Each as ``entry i: ...``."""
    out = []
    for i, peer in enumerate(server.spec.network_policy.clients):
        block = peer.get("ipBlock")
        if isinstance(block, dict):
            cidr = str(block.get("cidr", ""))
            if cidr.endswith("/0") and not block.get("except"):
                out.append(f"entry {i}: ipBlock {cidr}")
        elif _selects_all(peer.get("namespaceSelector")) and (
            "podSelector" not in peer or _selects_all(peer.get("podSelector"))
        ):
            out.append(f"entry {i}: namespaceSelector {{}}")
    return out


def owner_boundary_open(server: Server) -> str | None:
    """Why the owner boundary is not enforced, or None (no ``spec.owners.header``, or
    clients restricted). With owners, a handle is its owner's only if no one but the
    gateway, which overwrites the header, reaches the client port: a pod that does can
    send another owner's header and session id."""
    if not server.spec.owners.header:
        return None
    wide = unrestricted_clients(server)
    if not wide:
        return None
    return (
        f"spec.owners.header is {server.spec.owners.header} but spec.networkPolicy.clients "
        f"admits every pod of every namespace to port {protocol.SIDECAR_PORT} "
        f"({'; '.join(wide)}): any pod can send another owner's header and session id "
        "and take its handles. Set spec.networkPolicy.clients to your gateway alone, "
        "e.g. [{namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: "
        "<gateway namespace>}}, podSelector: {matchLabels: {<gateway labels>}}}]"
    )


def build_network_policy(server: Server, ctx: Context | None = None) -> Obj:
    """Ingress to the server's pods: everything from the server's own pods (engine
    HTTP, the sidecars' internal port, NIXL's side channel and UCX's data
    connections, whose TCP ports UCX picks at random: no port list can name them),
    the client port from ``spec.networkPolicy.clients``, the sidecars' metrics port
    (GET /metrics alone) from the operator's ``metrics_clients``, nothing else. Peers are
    told by ``kvferry.io/server``, which only the operator puts on pods. The kubelet's
    probes come from the node, which NetworkPolicy always admits. Egress stays open:
    the sidecars push reports to the operator and engines may download from the hub.
    The KV-event sockets listen on 127.0.0.1 (engine_config), beyond any policy."""
    own = {"podSelector": {"matchLabels": {api.LABEL_SERVER: server.name}}}
    ingress: list[Obj] = [{"from": [own]}]
    clients = [dict(peer) for peer in server.spec.network_policy.clients]
    if clients:
        ingress.append(
            {
                "from": clients,
                "ports": [{"protocol": "TCP", "port": protocol.SIDECAR_PORT}],
            }
        )
    scrapers = [dict(peer) for peer in (ctx or Context()).metrics_clients]
    if scrapers:
        ingress.append(
            {
                "from": scrapers,
                "ports": [{"protocol": "TCP", "port": protocol.SIDECAR_METRICS_PORT}],
            }
        )
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(
            server, network_policy_name(server), common_labels(server, "network")
        ),
        "spec": {
            "podSelector": {"matchLabels": {api.LABEL_SERVER: server.name}},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def build_kv_cache_status(server: Server) -> Obj:
    return {
        "apiVersion": api.API_VERSION,
        "kind": api.STATUS_KIND,
        "metadata": _metadata(server, server.name, common_labels(server, "status")),
        "spec": {"serverName": server.name},
    }


def entry_url(server: Server) -> str:
    """The in-cluster URL clients call: Service ``x`` on the sidecar port."""
    return f"http://{child_name(server)}.{server.namespace}.svc:{protocol.SIDECAR_PORT}"


def render(server: Server, ctx: Context | None = None) -> list[Obj]:
    """All children of ``server``, in the order they should be applied.

    ``ctx`` carries what the operator adds (its sidecar image, its report endpoint).
    Without it (``kvferry-operator render``, offline) an owner boundary the
    NetworkPolicy leaves open is a warning on stderr; the operator says it in the
    server's OwnerBoundary condition and a Warning Event instead.
    """
    if ctx is None:
        open_boundary = owner_boundary_open(server)
        if open_boundary:
            # Unconfigured logging (the CLI) prints a warning on stderr by itself.
            logging.getLogger(__name__).warning(
                "warning: %s %s: %s", api.SERVER_KIND, server.name, open_boundary
            )
    ctx = ctx or Context()
    roles = [server.spec.prefill, server.spec.decode]
    return [
        # The policy first: pods never start unisolated, even for a moment.
        build_network_policy(server, ctx),
        build_config_map(server, ctx),
        *(build_headless_service(server, r) for r in roles),
        build_entry_service(server),
        *(build_statefulset(server, r, ctx) for r in roles),
        *(build_pdb(server, r) for r in roles),
        build_kv_cache_status(server),
    ]


def digest(children: list[Obj]) -> str:
    """A short hash of a whole render, kept in the server's status as
    ``status.renderHash`` once every child of it landed. A process that has not
    applied the server itself (a standby taking over, a restart, an upgrade) applies
    it again only when its own render differs: a field the new version renders or no
    longer renders, a changed setting (the sidecar image), a RoleScaler's count."""
    canonical = json.dumps(children, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]
