"""What a server needs from the cluster, checked against what the cluster has. Pure.

The operator can see some missing prerequisites before any pod waits on them:

- no node offers the GPU resource a role asks for (no NVIDIA device plugin or GPU
  Operator), or the RDMA resource (no RDMA device plugin), or every node offers
  fewer than one pod needs;
- ``network.rdma.networks`` names Multus networks, but the
  NetworkAttachmentDefinition CRD (Multus) is not installed, or a named
  NetworkAttachmentDefinition does not exist;
- the namespace's Pod Security label (``pod-security.kubernetes.io/enforce``)
  refuses the pods the operator renders: ``restricted`` refuses the engine (it runs
  as root, as vLLM images do), ``baseline`` refuses ``IPC_LOCK`` (RDMA) and hostPath
  volumes (a hub cache on the node).

:func:`check` turns :class:`ClusterFacts` (gathered by the operator's probe; a
fact it could not read is ``None`` and its check is skipped) into findings, each
naming the spec field or cluster object and the fix; :func:`condition` folds them
into the ``Prerequisites`` condition. The Pod Security rules below are the parts of
the Pod Security Standards that decide for the pods kvferry renders; the cluster
tier checks them against the API server's own admission.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .api import Server

# Condition reasons (also Event reasons).
REASON_MET = "Met"
REASON_NOT_CHECKED = "NotChecked"
REASON_NO_GPU_NODES = "NoGPUNodes"
REASON_NO_RDMA_NODES = "NoRDMANodes"
REASON_TOO_FEW_PER_NODE = "TooFewPerNode"
REASON_NO_MULTUS = "NoMultus"
REASON_NAD_MISSING = "NetworkAttachmentDefinitionMissing"
REASON_POD_SECURITY = "PodSecurityForbids"

NAD_CRD = "network-attachment-definitions.k8s.cni.cncf.io"
PSA_ENFORCE = "pod-security.kubernetes.io/enforce"

# Capabilities the baseline level allows to be added (Pod Security Standards).
BASELINE_CAPABILITIES = frozenset(
    {
        "AUDIT_WRITE",
        "CHOWN",
        "DAC_OVERRIDE",
        "FOWNER",
        "FSETID",
        "KILL",
        "MKNOD",
        "NET_BIND_SERVICE",
        "SETFCAP",
        "SETGID",
        "SETPCAP",
        "SETUID",
        "SYS_CHROOT",
    }
)
RESTRICTED_VOLUMES = frozenset(
    {
        "configMap",
        "csi",
        "downwardAPI",
        "emptyDir",
        "ephemeral",
        "persistentVolumeClaim",
        "projected",
        "secret",
    }
)
LEVELS = ("privileged", "baseline", "restricted")


@dataclass(frozen=True)
class NodeFacts:
    name: str
    # Extended resources the node can give pods (status.allocatable), as integers.
    allocatable: dict[str, int]
    unschedulable: bool = False


@dataclass(frozen=True)
class ClusterFacts:
    """What the probe could read; None = unknown (not readable), so not checked."""

    nodes: list[NodeFacts] | None = None
    namespace_labels: dict[str, str] | None = None
    nad_crd_installed: bool | None = None
    # "namespace/name" -> exists, for the networks the server names.
    nads: dict[str, bool] | None = None


@dataclass(frozen=True)
class Finding:
    reason: str
    message: str


def node_facts_from(node: dict[str, Any]) -> NodeFacts:
    """The part of a Node object the checks need: extended resources as counts."""
    allocatable = {}
    for name, value in ((node.get("status") or {}).get("allocatable") or {}).items():
        if "/" in name:  # extended resources (vendor/name) only
            try:
                allocatable[name] = int(str(value))
            except ValueError:
                allocatable[name] = 0 if str(value) in ("", "0") else 1
    return NodeFacts(
        name=(node.get("metadata") or {}).get("name", ""),
        allocatable=allocatable,
        unschedulable=bool((node.get("spec") or {}).get("unschedulable")),
    )


def network_refs(server: Server) -> list[str]:
    """``namespace/name`` of each NetworkAttachmentDefinition the pods attach
    (Multus also accepts ``name@interface`` and ``namespace/name``)."""
    rdma = server.spec.network.rdma
    if not (rdma.enabled and rdma.networks):
        return []
    out = []
    for entry in rdma.networks:
        ref = entry.split("@", 1)[0].strip()
        if "/" not in ref:
            ref = f"{server.namespace}/{ref}"
        if ref not in out:
            out.append(ref)
    return out


def resource_needs(server: Server) -> list[tuple[str, str, int, str]]:
    """(resource, spec field, count per pod, reason if absent) of each extended
    resource a pod asks for."""
    spec = server.spec
    out = []
    for role in (spec.prefill, spec.decode):
        if server.replicas(role.name) and role.resources.gpus:
            out.append(
                (
                    role.resources.gpu_resource_name,
                    f"spec.{role.name}.resources.gpus",
                    role.resources.gpus,
                    REASON_NO_GPU_NODES,
                )
            )
    rdma = spec.network.rdma
    if rdma.enabled and rdma.resource_name:
        out.append(
            (rdma.resource_name, "spec.network.rdma.count", rdma.count, REASON_NO_RDMA_NODES)
        )
    return out


_INSTALL = {
    REASON_NO_GPU_NODES: (
        "install the NVIDIA device plugin or the GPU Operator on the GPU nodes, or set "
        "gpuResourceName ({where}) to the resource your nodes offer"
    ),
    REASON_NO_RDMA_NODES: (
        "install the RDMA shared device plugin (or the NVIDIA Network Operator) with a "
        "resource of that name, or fix spec.network.rdma.resourceName"
    ),
}


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def check_nodes(server: Server, nodes: list[NodeFacts]) -> list[Finding]:
    """One finding per extended resource that no schedulable node offers, or not
    as many as one pod asks for."""
    needs: dict[str, list[tuple[str, int, str]]] = {}
    for resource, field, count, reason in resource_needs(server):
        needs.setdefault(resource, []).append((field, count, reason))
    usable = [n for n in nodes if not n.unschedulable]
    findings = []
    for resource, asks in needs.items():
        offering = {n.name: n.allocatable.get(resource, 0) for n in usable}
        offering = {name: v for name, v in offering.items() if v > 0}
        fields = [f for f, _, _ in asks]
        if not offering:
            reason = asks[0][2]
            where = ", ".join(f.rsplit(".", 1)[0] for f in fields)
            findings.append(
                Finding(
                    reason,
                    f"no schedulable node offers {resource} ({_and(fields)} "
                    f"{'asks' if len(fields) == 1 else 'ask'} for it): "
                    + _INSTALL[reason].format(where=where),
                )
            )
            continue
        most = max(offering.values())
        for field, count, _ in asks:
            if count > most:
                nodes_with = ", ".join(sorted(n for n, v in offering.items() if v == most)[:3])
                findings.append(
                    Finding(
                        REASON_TOO_FEW_PER_NODE,
                        f"{field} asks for {count} {resource} per pod, but no node has more "
                        f"than {most} ({nodes_with}): lower {field}, or add nodes with {count}",
                    )
                )
    return findings


def check_networks(
    server: Server, crd_installed: bool | None, nads: dict[str, bool] | None
) -> list[Finding]:
    refs = network_refs(server)
    if not refs or crd_installed is None:
        return []
    if not crd_installed:
        return [
            Finding(
                REASON_NO_MULTUS,
                f"spec.network.rdma.networks names {', '.join(refs)}, but the "
                f"NetworkAttachmentDefinition CRD ({NAD_CRD}) is not installed: install "
                "Multus (or the NVIDIA Network Operator), or remove spec.network.rdma.networks",
            )
        ]
    missing = [r for r in refs if nads is not None and nads.get(r) is False]
    if not missing:
        return []
    return [
        Finding(
            REASON_NAD_MISSING,
            f"NetworkAttachmentDefinition {', '.join(missing)} does not exist: create it "
            "(one per server namespace, for your RDMA interface), or fix "
            "spec.network.rdma.networks",
        )
    ]


# ------------------------------------------------------------------ Pod Security


def _containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return list(pod.get("initContainers") or []) + list(pod.get("containers") or [])


def baseline_violations(pod: dict[str, Any]) -> list[str]:
    out = []
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(key):
            out.append(f"{key}: true")
    for v in pod.get("volumes") or []:
        if "hostPath" in v:
            out.append(f"hostPath volume {v['name']}")
    for c in _containers(pod):
        sec = c.get("securityContext") or {}
        if sec.get("privileged"):
            out.append(f"container {c['name']} is privileged")
        extra = sorted(
            set((sec.get("capabilities") or {}).get("add") or []) - BASELINE_CAPABILITIES
        )
        if extra:
            out.append(f"container {c['name']} adds {', '.join(extra)}")
        if any(p.get("hostPort") for p in c.get("ports") or []):
            out.append(f"container {c['name']} uses a hostPort")
    return out


def _effective(pod: dict[str, Any], c: dict[str, Any], key: str) -> Any:
    sec = c.get("securityContext") or {}
    return sec[key] if key in sec else (pod.get("securityContext") or {}).get(key)


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    out = baseline_violations(pod)
    for v in pod.get("volumes") or []:
        kinds = [k for k in v if k != "name"]
        if kinds and kinds[0] not in RESTRICTED_VOLUMES and kinds[0] != "hostPath":
            out.append(f"{kinds[0]} volume {v['name']}")
    for c in _containers(pod):
        name = c["name"]
        sec = c.get("securityContext") or {}
        if sec.get("allowPrivilegeEscalation") is not False:
            out.append(f"container {name} allows privilege escalation")
        if _effective(pod, c, "runAsNonRoot") is not True:
            out.append(f"container {name} may run as root (runAsNonRoot is not true)")
        elif _effective(pod, c, "runAsUser") == 0:
            out.append(f"container {name} runs as uid 0")
        seccomp = (_effective(pod, c, "seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"container {name} sets no RuntimeDefault seccomp profile")
        caps = sec.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"container {name} does not drop ALL capabilities")
        # Restricted allows adding NET_BIND_SERVICE only; baseline named the others.
        extra = sorted((set(caps.get("add") or []) & BASELINE_CAPABILITIES) - {"NET_BIND_SERVICE"})
        if extra:
            out.append(f"container {name} adds {', '.join(extra)}")
    return out


def pod_security_violations(pod: dict[str, Any], level: str) -> list[str]:
    """Why a pod with this spec is refused at ``level`` (privileged: never)."""
    if level == "baseline":
        return baseline_violations(pod)
    if level == "restricted":
        return restricted_violations(pod)
    return []


def level_allowing(pods: list[dict[str, Any]]) -> str:
    """The strictest Pod Security level that admits all ``pods``."""
    for level in reversed(LEVELS):
        if not any(pod_security_violations(p, level) for p in pods):
            return level
    return "privileged"


def check_pod_security(
    server: Server, labels: dict[str, str], pods: list[dict[str, Any]]
) -> list[Finding]:
    level = labels.get(PSA_ENFORCE, "")
    if level not in ("baseline", "restricted"):
        return []  # unlabelled: the cluster's default level, which we cannot read
    why: list[str] = []
    for pod in pods:
        for v in pod_security_violations(pod, level):
            if v not in why:
                why.append(v)
    if not why:
        return []
    needed = level_allowing(pods)
    return [
        Finding(
            REASON_POD_SECURITY,
            f"namespace {server.namespace} enforces Pod Security level {level!r} "
            f"({PSA_ENFORCE}), which refuses these pods: {'; '.join(why[:4])}"
            f"{'; ...' if len(why) > 4 else ''}. Label the namespace "
            f"{PSA_ENFORCE}={needed}, or run the server in a namespace that allows it",
        )
    ]


def check(server: Server, facts: ClusterFacts, pods: list[dict[str, Any]]) -> list[Finding]:
    """Every finding, in the order a person should fix them. ``pods`` are the pod
    specs the operator renders for ``server``."""
    findings: list[Finding] = []
    if facts.namespace_labels is not None:
        findings += check_pod_security(server, facts.namespace_labels, pods)
    if facts.nodes is not None:
        findings += check_nodes(server, facts.nodes)
    findings += check_networks(server, facts.nad_crd_installed, facts.nads)
    return findings


def condition(findings: list[Finding], checked: bool) -> tuple[str, str, str]:
    """(status, reason, message) of the Prerequisites condition."""
    if findings:
        return ("False", findings[0].reason, "; ".join(f.message for f in findings))
    if not checked:
        return ("Unknown", REASON_NOT_CHECKED, "prerequisites not checked yet")
    return ("True", REASON_MET, "no missing prerequisite found")
