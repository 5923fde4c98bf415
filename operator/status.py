"""Observed children -> DisaggregatedServer status. Pure: no API calls.

:func:`compute_status` takes what the operator sees (each role's StatefulSet
status and the pods' scheduling state) and returns the status to write plus
the condition changes worth an Event. A condition keeps its
``lastTransitionTime`` unless its status flips, and :func:`status_changed`
ignores nothing but that, so an unchanged world writes nothing (no status
flapping under GitOps).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from kvferry_wire.report import TRANSPORT_NONE, TRANSPORT_TCP_FALLBACK, TRANSPORT_UNKNOWN

from . import api, hostpaths, ownership, podtemplate, prerequisites
from .api import Server
from .prerequisites import Finding
from .render import entry_url, owner_boundary_open, selector_labels
from .scaler import scaler_name

# Condition reasons (also Event reasons).
REASON_READY = "AllReplicasReady"
REASON_NO_DECODE = "NoDecodeReplicas"
REASON_UNSCHEDULABLE = "Unschedulable"
REASON_WAITING = "ReplicasNotReady"
REASON_ROLLING = "RollingUpdate"
REASON_CREATING = "Creating"
REASON_COMPLETE = "Complete"
REASON_HEALTHY = "Healthy"
REASON_CRASHING = "ContainersCrashing"
REASON_NO_REPORTS = "NoReports"
REASON_NODE_LOST = "NodeLost"
# A child's name is held by an object the server does not control (ownership.py).
REASON_CHILD_CONFLICT = "ChildConflict"
REASON_CLIENTS_RESTRICTED = "ClientsRestricted"  # OwnerBoundary True
REASON_CLIENTS_NOT_RESTRICTED = "ClientsNotRestricted"  # OwnerBoundary False: a Warning
REASON_APPLY_FAILED = "ApplyFailed"  # the API server refused a child of this generation
# hostpaths.REASON: spec.model.source.hub.cache.hostPath is not under an allowed folder.
# KVTransport reasons are the reported transports (kvferry_wire.report.TRANSPORTS).


# Container waiting reasons that will not clear by themselves.
STUCK_WAITING_REASONS = (
    "CrashLoopBackOff",
    "ImagePullBackOff",
    "ErrImagePull",
    "CreateContainerError",
)


@dataclass(frozen=True)
class PodState:
    name: str
    role: str
    unschedulable_message: str | None = None  # PodScheduled=False, reason Unschedulable
    waiting_reason: str | None = None  # e.g. CrashLoopBackOff, ImagePullBackOff
    node: str | None = None  # spec.nodeName, once scheduled


@dataclass(frozen=True)
class RoleObserved:
    """A StatefulSet as seen; None fields mean the object does not exist yet."""

    exists: bool = False
    observed_generation: int = 0
    generation: int = 0
    replicas: int = 0
    ready_replicas: int = 0
    updated_replicas: int = 0
    current_revision: str | None = None
    update_revision: str | None = None
    spec_replicas: int | None = None  # the StatefulSet's spec.replicas: what we applied


@dataclass(frozen=True)
class Observed:
    roles: dict[str, RoleObserved]
    pods: list[PodState] = field(default_factory=list)
    transport: str = TRANSPORT_UNKNOWN
    transport_reason: str = ""  # the sidecars' evidence (the publisher writes both)
    # Missing prerequisites (prerequisites.check); None = not checked.
    prerequisites: tuple[Finding, ...] | None = None
    # Nodes as the operator sees them: name -> Ready. None: not known (no node
    # has been seen), so no pod is taken for lost.
    nodes: dict[str, bool] | None = None
    # Children not applied because another object holds their name.
    conflicts: tuple[ownership.Conflict, ...] = ()
    # The server's last whole apply; None: not known (not applied since the
    # operator started), so observedGeneration stays what it was.
    last_apply: ownership.ApplyOutcome | None = None
    # Why the spec's hostPath is refused (hostpaths.refusal): no StatefulSets then.
    host_path_refused: str | None = None
    # Why a role's podTemplate is refused (podtemplate.refusal): no StatefulSets then.
    pod_template_refused: str | None = None


@dataclass(frozen=True)
class ConditionChange:
    type: str
    status: str
    reason: str
    message: str
    # (status, reason) before the change; None when the condition is new.
    was: tuple[str, str] | None = None


def role_observed_from(sts: dict[str, Any] | None) -> RoleObserved:
    if not sts:
        return RoleObserved()
    st = sts.get("status") or {}
    return RoleObserved(
        exists=True,
        observed_generation=int(st.get("observedGeneration", 0)),
        generation=int(sts.get("metadata", {}).get("generation", 0)),
        replicas=int(st.get("replicas", 0)),
        ready_replicas=int(st.get("readyReplicas", 0)),
        updated_replicas=int(st.get("updatedReplicas", 0)),
        current_revision=st.get("currentRevision"),
        update_revision=st.get("updateRevision"),
        spec_replicas=(sts.get("spec") or {}).get("replicas"),
    )


def pod_state_from(pod: dict[str, Any]) -> PodState:
    meta = pod.get("metadata", {})
    st = pod.get("status") or {}
    unschedulable = None
    for cond in st.get("conditions") or []:
        if (cond.get("type"), cond.get("status"), cond.get("reason")) == (
            "PodScheduled",
            "False",
            "Unschedulable",
        ):
            unschedulable = cond.get("message") or "no node fits"
    waiting = None
    for cs in (st.get("containerStatuses") or []) + (st.get("initContainerStatuses") or []):
        reason = ((cs.get("state") or {}).get("waiting") or {}).get("reason")
        if reason in STUCK_WAITING_REASONS:
            waiting = f"{cs.get('name')}: {reason}"
    return PodState(
        name=meta.get("name", ""),
        role=(meta.get("labels") or {}).get(api.LABEL_ROLE, ""),
        unschedulable_message=unschedulable,
        waiting_reason=waiting,
        node=(pod.get("spec") or {}).get("nodeName") or None,
    )


# What the scheduler says in a PodScheduled=False condition, e.g.
#   0/2 nodes are available: 2 Insufficient nvidia.com/gpu, 2 Insufficient
#   rdma/hca_shared_devices_b. preemption: 0/2 nodes are available: ...
#   0/2 nodes are available: persistentvolumeclaim "models" not found. not found
# Resource names end in a letter or digit: the sentence's "," or "." is not theirs.
_INSUFFICIENT = re.compile(r"Insufficient ([A-Za-z0-9][\w./-]*[A-Za-z0-9])")
_MISSING_PVC = re.compile(r'persistentvolumeclaim "([^"]+)" not found')
_SELECTOR = "didn't match Pod's node affinity/selector"
_TAINT = "untolerated taint"


def _tidy(message: str) -> str:
    """The scheduler's sentence without its preemption report or a repeated tail."""
    head = message.split(" preemption:")[0].strip().rstrip(".")
    kept: list[str] = []
    for sentence in head.split(". "):
        if sentence and not (kept and sentence in kept[-1]):
            kept.append(sentence)
    return ". ".join(kept)


def _resource_field(server: Server, role: str, resource: str) -> str | None:
    """The spec field that asks for ``resource`` in a pod of ``role``."""
    spec = server.spec
    if role not in api.ROLES:
        return None
    rdma = spec.network.rdma
    if rdma.enabled and resource == rdma.resource_name:
        return "spec.network.rdma.count"
    resources = spec.role(role).resources
    if resource == resources.gpu_resource_name:
        return f"spec.{role}.resources.gpus"
    # The scheduler counts requests: the requests map's, else resources.cpu / .memory,
    # else the limits map's (a limit set alone is the request: resources.py).
    if resource in resources.requests:
        return f"spec.{role}.resources.requests"
    scalar = {"cpu": resources.cpu, "memory": resources.memory}
    if resource in resources.limits and scalar.get(resource) is None:
        return f"spec.{role}.resources.limits"
    if resource in scalar:
        return f"spec.{role}.resources.{resource}"
    return None


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def unschedulable_summary(server: Server, pods: list[PodState]) -> str | None:
    """One actionable sentence about pods no node can take: what is missing and
    which field of the spec asks for it."""
    stuck = [p for p in pods if p.unschedulable_message]
    if not stuck:
        return None
    # resource -> fields that ask for it (in the order the pods name them)
    short: dict[str, list[str]] = {}
    claims: list[str] = []
    placement: list[str] = []
    other: PodState | None = None
    for pod in stuck:
        msg = pod.unschedulable_message or ""
        found = False
        for resource in _INSUFFICIENT.findall(msg):
            fields = short.setdefault(resource, [])
            field = _resource_field(server, pod.role, resource)
            if field and field not in fields:
                fields.append(field)
            found = True
        for claim in _MISSING_PVC.findall(msg):
            if claim not in claims:
                claims.append(claim)
            found = True
        for text, what in ((_SELECTOR, "nodeSelector/affinity"), (_TAINT, "tolerations")):
            if text in msg and pod.role in api.ROLES:
                field = f"spec.{pod.role}.{what}"
                if field not in placement:
                    placement.append(field)
                found = True
        if not found and other is None:
            other = pod
    reasons = []
    if claims:
        quoted = _and([f'"{c}"' for c in claims])
        reasons.append(
            f"PersistentVolumeClaim {quoted} does not exist in namespace {server.namespace}: "
            "create it, or fix spec.model.source.pvc.claimName"
        )
    if short:
        named = _and([f"{r} ({', '.join(f)})" if f else r for r, f in sorted(short.items())])
        fields = [f for fs in short.values() for f in fs]
        it = "it" if len(short) == 1 else "them"
        lower = (
            f", or lower {'that field' if len(fields) == 1 else 'those fields'}" if fields else ""
        )
        reasons.append(f"no node has enough {named} free: add nodes with {it}{lower}")
    if placement:
        reasons.append(f"no node matches {_and(placement)}: fix them, or label/untaint nodes")
    if other is not None:
        reasons.append(f"{other.name}: {_tidy(other.unschedulable_message or '')}")
    names = ", ".join(sorted(p.name for p in stuck)[:3]) + (", ..." if len(stuck) > 3 else "")
    return f"{len(stuck)} pod(s) cannot be scheduled ({names}): {'; '.join(reasons)}"


def node_lost_summary(observed: Observed) -> str | None:
    """Pods on a node that is gone or not Ready: the StatefulSet still counts them
    ready (nobody updates a pod whose kubelet is gone) until Kubernetes deletes
    and replaces them, which takes a while (pod GC, node eviction)."""
    if not observed.nodes:
        return None
    lost = []
    for p in sorted(observed.pods, key=lambda p: p.name):
        if p.node is None:
            continue
        if p.node not in observed.nodes:
            lost.append(f"{p.name} on node {p.node}, which is gone")
        elif not observed.nodes[p.node]:
            lost.append(f"{p.name} on node {p.node}, which is not Ready")
    if not lost:
        return None
    return (
        f"{len(lost)} pod(s) lost with their node: {'; '.join(lost)}. "
        "Kubernetes replaces them once it gives up on the node (a new node or free capacity "
        "is needed); sessions on them lose their KV and recompute"
    )


def _role_status(server: Server, role: str, obs: RoleObserved) -> dict[str, Any]:
    desired = server.replicas(role)
    return {
        "replicas": obs.replicas,
        "readyReplicas": obs.ready_replicas,
        "updatedReplicas": obs.updated_replicas,
        "display": f"{obs.ready_replicas}/{desired}",
        "selector": ",".join(f"{k}={v}" for k, v in selector_labels(server, role).items()),
        "desiredReplicas": desired,
        "scaledBy": scaled_by(server, role),
    }


def scaled_by(server: Server, role: str) -> str:
    """Where desiredReplicas comes from, as status.<role>.scaledBy shows it."""
    if server.spec.role(role).scaled_externally:
        return f"{api.SCALER_KIND} {scaler_name(server, role)}"
    return f"spec.{role}.replicas"


def _no_decode_message(server: Server) -> str:
    if server.spec.decode.scaled_externally:
        return (
            f"RoleScaler {scaler_name(server, api.ROLE_DECODE)} has spec.replicas 0: nothing "
            "serves requests; give its autoscaler a minimum of 1 or more"
        )
    return "spec.decode.replicas is 0: nothing serves requests; set it to 1 or more"


def _role_settled(server: Server, role: str, obs: RoleObserved) -> bool:
    desired = server.replicas(role)
    return (
        obs.exists
        and obs.observed_generation >= obs.generation
        and obs.replicas == desired
        and obs.updated_replicas == desired
        and obs.ready_replicas == desired
        and (obs.current_revision is None or obs.current_revision == obs.update_revision)
    )


def settled(server: Server, roles: dict[str, RoleObserved]) -> bool:
    """Every role has the desired number of ready, updated pods."""
    return all(_role_settled(server, r, roles.get(r, RoleObserved())) for r in api.ROLES)


def prerequisites_condition(server: Server, observed: Observed) -> tuple[str, str, str]:
    """Prerequisites: False names what the cluster lacks and the fix; True once every
    pod runs (nothing can be missing then) or the checks found nothing."""
    if settled(server, observed.roles):
        return ("True", prerequisites.REASON_MET, "all prefill and decode pods run")
    found = observed.prerequisites
    return prerequisites.condition(list(found or []), checked=found is not None)


def owner_boundary_condition(server: Server) -> tuple[str, str, str] | None:
    """OwnerBoundary, only where spec.owners.header is set (None otherwise): False
    (a Warning Event) while spec.networkPolicy.clients admits every pod, so any pod
    could send another owner's header; True once it names who may reach the port."""
    if not server.spec.owners.header:
        return None
    open_boundary = owner_boundary_open(server)
    if open_boundary:
        return ("False", REASON_CLIENTS_NOT_RESTRICTED, open_boundary)
    return (
        "True",
        REASON_CLIENTS_RESTRICTED,
        "only spec.networkPolicy.clients reach the client port; make them your gateway "
        f"alone, which overwrites {server.spec.owners.header} (enforced by a CNI that "
        "implements NetworkPolicy)",
    )


def compute_conditions(server: Server, observed: Observed) -> list[dict[str, Any]]:
    """Ready, Progressing, Degraded, KVTransport, Prerequisites and, with owners,
    OwnerBoundary, without transition times. A child conflict makes the server
    Degraded and not Ready."""
    roles = observed.roles
    unschedulable = unschedulable_summary(server, observed.pods)
    crashing = [f"{p.name} ({p.waiting_reason})" for p in observed.pods if p.waiting_reason]
    node_lost = node_lost_summary(observed)
    conflict = ownership.message(observed.conflicts, server.name) if observed.conflicts else None
    refused = apply_failure(server, observed.last_apply)
    settled = all(_role_settled(server, r, roles.get(r, RoleObserved())) for r in api.ROLES)
    prereqs = prerequisites_condition(server, observed)
    # A spec the operator's settings refuse (a hostPath, a pod template): no StatefulSets.
    held: tuple[str, str] | None = (
        (hostpaths.REASON, observed.host_path_refused)
        if observed.host_path_refused
        else (podtemplate.REASON, observed.pod_template_refused)
        if observed.pod_template_refused
        else None
    )
    not_ready = [
        f"{r} {roles.get(r, RoleObserved()).ready_replicas}/{server.replicas(r)} ready"
        for r in api.ROLES
        if roles.get(r, RoleObserved()).ready_replicas < server.replicas(r)
    ]

    if server.replicas(api.ROLE_DECODE) == 0:
        ready = ("False", REASON_NO_DECODE, _no_decode_message(server))
    elif held:
        ready = ("False", *held)
    elif conflict:
        # Pods may run, but some child (the entry Service, say) is someone else's.
        ready = ("False", REASON_CHILD_CONFLICT, conflict)
    elif unschedulable:
        ready = ("False", REASON_UNSCHEDULABLE, unschedulable)
    elif node_lost:
        ready = ("False", REASON_NODE_LOST, node_lost)
    elif prereqs[0] == "False":
        # Pods never created (Pod Security) or never starting (a missing network):
        # the cause says more than "waiting for decode 0/1 ready".
        ready = prereqs
    elif settled:
        ready = ("True", REASON_READY, "all prefill and decode replicas are ready")
    else:
        ready = ("False", REASON_WAITING, "waiting for " + (", ".join(not_ready) or "rollout"))

    # A generation held back (refused, a hostPath not allowed, a child's name taken):
    # the pods may be ready, but on the previous generation, so never "Complete".
    if refused:
        progressing = ("False", REASON_APPLY_FAILED, refused)
    elif held:
        progressing = ("False", *held)
    elif conflict:
        progressing = ("False", REASON_CHILD_CONFLICT, conflict)
    elif settled:
        progressing = ("False", REASON_COMPLETE, "prefill and decode match the spec")
    elif not all(roles.get(r, RoleObserved()).exists for r in api.ROLES):
        progressing = ("True", REASON_CREATING, "creating StatefulSets")
    else:
        rolling = [
            r
            for r in api.ROLES
            if roles[r].updated_replicas < server.replicas(r)
            or roles[r].observed_generation < roles[r].generation
        ]
        what = f"rolling out {', '.join(rolling)}" if rolling else "; ".join(not_ready)
        progressing = ("True", REASON_ROLLING, what or "waiting for StatefulSets")

    if held:
        degraded = ("True", *held)
    elif conflict:
        degraded = ("True", REASON_CHILD_CONFLICT, conflict)
    elif refused:
        degraded = ("True", REASON_APPLY_FAILED, refused)
    elif unschedulable:
        degraded = ("True", REASON_UNSCHEDULABLE, unschedulable)
    elif node_lost:
        degraded = ("True", REASON_NODE_LOST, node_lost)
    elif crashing:
        degraded = ("True", REASON_CRASHING, "containers not running: " + ", ".join(crashing))
    else:
        degraded = ("False", REASON_HEALTHY, "no unschedulable, lost or crashing pods")

    transport = transport_condition(server, observed)
    boundary = owner_boundary_condition(server)
    out = []
    for ctype, (status, reason, message) in (
        (api.COND_READY, ready),
        (api.COND_PROGRESSING, progressing),
        (api.COND_DEGRADED, degraded),
        (api.COND_KV_TRANSPORT, transport),
        (api.COND_PREREQUISITES, prereqs),
        *([(api.COND_OWNER_BOUNDARY, boundary)] if boundary else []),
    ):
        out.append(
            {
                "type": ctype,
                "status": status,
                "reason": reason,
                "message": message,
                "observedGeneration": server.generation,
            }
        )
    return out


def apply_failure(server: Server, last: ownership.ApplyOutcome | None) -> str | None:
    """The message for a generation whose children the API server refused, or None."""
    if last is None or last.generation != server.generation or not last.refusals:
        return None
    return (
        f"generation {last.generation} is not applied, the API server refused: "
        f"{'; '.join(last.refusals)}. Change the field the message names (or what "
        "refused it: an admission policy, a quota); the operator applies again on the "
        "next change of the server and on every resync"
    )


def observed_generation(observed: Observed, old_status: dict[str, Any]) -> int | None:
    """The generation whose children all landed: status must not call a generation
    observed (GitOps tools read that as rolled out) when its apply failed."""
    last = observed.last_apply
    if last is not None and last.applied:
        return last.generation
    old = old_status.get("observedGeneration")
    return old if isinstance(old, int) else None


def observed_render(observed: Observed, old_status: dict[str, Any]) -> str | None:
    """The render.digest of the last whole apply that landed (status.renderHash), with
    observedGeneration: what a process that did not apply the server itself compares
    its own render with (generation_landed)."""
    last = observed.last_apply
    if last is not None and last.applied and last.render:
        return last.render
    old = old_status.get("renderHash")
    return old if isinstance(old, str) else None


def generation_landed(
    server_status: dict[str, Any] | None, generation: int | None, rendered: str | None = None
) -> bool:
    """Whether a server's status, as read, shows ``generation`` landed whole: its
    observedGeneration is that one (written only for a generation whose children all
    landed: observed_generation), and Progressing does not say that an apply of it was
    held back since (refused, held by the settings, a name taken: observedGeneration
    stays where it was then). What a process that has not applied the server itself
    (a standby taking over, a restart) goes by: such a server is not applied again.
    ``rendered``: that process's own render.digest of the server, which must be the
    one that landed (status.renderHash): a new operator version or new settings that
    render the children otherwise apply them again, once. A status without the hash
    (written before it existed) is not landed for this."""
    server_status = server_status or {}
    if rendered is not None and server_status.get("renderHash") != rendered:
        return False
    observed = server_status.get("observedGeneration")
    if not isinstance(observed, int) or isinstance(observed, bool) or observed != generation:
        return False
    progressing = next(
        (
            c
            for c in server_status.get("conditions") or []
            if isinstance(c, dict) and c.get("type") == api.COND_PROGRESSING
        ),
        {},
    )
    held_back = progressing.get("status") == "False" and progressing.get("reason") != (
        REASON_COMPLETE
    )
    return not held_back


def event_type(change: ConditionChange) -> str:
    """Normal or Warning for a condition's Event: Warning only for news of a fault
    (alerting pipelines page on Warnings, so a finished rollout must not be one)."""
    if change.status == "Unknown":
        return "Normal"
    if change.type == api.COND_PROGRESSING:
        # False is "finished" (Complete) or "stopped" (held back: a fault).
        stopped = change.status == "False" and change.reason != REASON_COMPLETE
        return "Warning" if stopped else "Normal"
    bad = "True" if change.type == api.COND_DEGRADED else "False"
    return "Warning" if change.status == bad else "Normal"


# Where a new server's conditions start, for worth_an_event: a condition's first state
# is news only where it differs from this.
INITIAL_CONDITIONS = {
    api.COND_READY: ("False", REASON_WAITING),
    api.COND_PROGRESSING: ("True", REASON_CREATING),
    api.COND_DEGRADED: ("False", REASON_HEALTHY),
    api.COND_KV_TRANSPORT: ("Unknown", REASON_NO_REPORTS),
    api.COND_PREREQUISITES: ("Unknown", prerequisites.REASON_NOT_CHECKED),
    # Restricted is no news; a server that starts open gets its Warning.
    api.COND_OWNER_BOUNDARY: ("True", REASON_CLIENTS_RESTRICTED),
}


def worth_an_event(change: ConditionChange) -> bool:
    """Whether a condition change is news for ``kubectl describe`` and alerting.

    Every change is in status; an Event is posted for a status that flips, and for a
    reason that moves into or out of a fault (a Warning). Not for what every new
    server goes through on its way to Ready: its conditions' first states where they
    are what a new server starts with (``INITIAL_CONDITIONS``), a Normal reason giving
    way to another (``Creating`` to ``RollingUpdate``), or prerequisites not checked
    yet turning out met. A new server's way to Ready posts two Events, ``Ready=True``
    and ``Progressing=False/Complete``, whether status saw the steps between or not."""
    warning = event_type(change) == "Warning"
    was = change.was or INITIAL_CONDITIONS.get(change.type)
    if was is None:
        return True
    was_status, was_reason = was
    if (was_status, was_reason) == (change.status, change.reason):
        return False
    if was_status != change.status:
        return warning or was_reason != prerequisites.REASON_NOT_CHECKED
    before = ConditionChange(change.type, was_status, was_reason, "")
    return warning or event_type(before) == "Warning"


def rdma_asked(server: Server) -> str | None:
    """The spec field that asks for RDMA, or None."""
    net = server.spec.network
    if net.transport == "rdma":
        return "network.transport: rdma"
    if net.rdma.enabled:
        return "network.rdma.enabled: true"
    return None


def transport_condition(server: Server, observed: Observed) -> tuple[str, str, str]:
    """KVTransport: True when the sidecars see the transport the spec allows for;
    False (a Warning Event) when RDMA was asked for and TCP carries the KV."""
    value, evidence = observed.transport, observed.transport_reason
    if value == TRANSPORT_UNKNOWN:
        if not evidence:
            return ("Unknown", REASON_NO_REPORTS, "no sidecar has reported a transport yet")
        return ("Unknown", TRANSPORT_UNKNOWN, evidence)
    if value == TRANSPORT_NONE:
        return (
            "False",
            value,
            f"KV cannot move between the pods: {evidence}. Turns are served by recomputing "
            "their prompts on decode. Check the engine's UCX_TLS (network.transport, env), "
            "the RDMA resource (network.rdma.resourceName) and that the pods reach each other",
        )
    asked = rdma_asked(server)
    if value == TRANSPORT_TCP_FALLBACK and asked:
        return (
            "False",
            value,
            f"{asked} asks for RDMA, but KV moves over TCP: {evidence}. Check that the pods "
            "get the RDMA resource (network.rdma.resourceName), the Multus networks and a UCX "
            "build with verbs",
        )
    return ("True", value, evidence or f"sidecars see {value}")


def merge_conditions(
    old: list[dict[str, Any]], new: list[dict[str, Any]], now: str
) -> tuple[list[dict[str, Any]], list[ConditionChange]]:
    """Carry lastTransitionTime over unless the status flips; report what changed."""
    previous = {c.get("type"): c for c in old or []}
    merged, changes = [], []
    for cond in new:
        before = previous.get(cond["type"])
        flipped = before is None or before.get("status") != cond["status"]
        since = (
            now if flipped or not before.get("lastTransitionTime") else before["lastTransitionTime"]
        )
        merged.append({**cond, "lastTransitionTime": since})
        if before is None or flipped or before.get("reason") != cond["reason"]:
            was = None if before is None else (before.get("status"), before.get("reason"))
            changes.append(
                ConditionChange(cond["type"], cond["status"], cond["reason"], cond["message"], was)
            )
    return merged, changes


def compute_status(
    server: Server, observed: Observed, old_status: dict[str, Any] | None, now: str
) -> tuple[dict[str, Any], list[ConditionChange]]:
    old_status = old_status or {}
    conditions, changes = merge_conditions(
        old_status.get("conditions") or [], compute_conditions(server, observed), now
    )
    generation = observed_generation(observed, old_status)
    rendered = observed_render(observed, old_status)
    status = {
        **{k: v for k, v in old_status.items() if k == "retention"},
        **({"observedGeneration": generation} if generation is not None else {}),
        **({"renderHash": rendered} if rendered is not None else {}),
        "endpoint": entry_url(server),
        "transport": observed.transport,
        **({"transportReason": observed.transport_reason} if observed.transport_reason else {}),
        "prefill": _role_status(
            server, api.ROLE_PREFILL, observed.roles.get(api.ROLE_PREFILL, RoleObserved())
        ),
        "decode": _role_status(
            server, api.ROLE_DECODE, observed.roles.get(api.ROLE_DECODE, RoleObserved())
        ),
        "conditions": conditions,
    }
    return status, changes


def status_changed(old: dict[str, Any] | None, new: dict[str, Any]) -> bool:
    return (old or {}) != new


def status_patch(old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """The merge patch from ``old`` to ``new``: the top-level fields that differ, and
    never ``retention`` (the publisher's; ``new`` carries it over from a status that
    may be older than the publisher's last write). Empty: nothing to write."""
    old = old or {}
    return {k: v for k, v in new.items() if k != "retention" and old.get(k) != v}
