"""Status from observed children: one test per contract rule."""

from __future__ import annotations

from typing import Any

import pytest

from kvferry_operator import api, hostpaths, ownership, podtemplate, prerequisites, status
from kvferry_operator.status import Observed, PodState, RoleObserved
from tests.manifests import server
from tests.unit.observed import SETTLED

NOW = "2026-11-29T10:00:00Z"
EARLIER = "2026-11-29T09:00:00Z"
SERVER = api.parse_server(
    {**server(), "metadata": {"name": "tiny", "namespace": "ns", "generation": 3}}
)
GPU_MESSAGE = "0/2 nodes are available: 2 Insufficient nvidia.com/gpu."


def observed(
    prefill: RoleObserved = SETTLED,
    decode: RoleObserved = SETTLED,
    pods: list[PodState] | None = None,
    **kw: Any,
) -> Observed:
    return Observed(roles={"prefill": prefill, "decode": decode}, pods=pods or [], **kw)


def cond(conditions: list[dict], ctype: str) -> dict:
    return next(c for c in conditions if c["type"] == ctype)


@pytest.mark.parametrize(
    ("name", "obs", "ready", "reason"),
    [
        ("all settled", observed(), "True", status.REASON_READY),
        (
            "nothing exists yet",
            observed(RoleObserved(), RoleObserved()),
            "False",
            status.REASON_WAITING,
        ),
        (
            "decode not ready",
            observed(
                decode=RoleObserved(exists=True, replicas=1, updated_replicas=1, ready_replicas=0)
            ),
            "False",
            status.REASON_WAITING,
        ),
        (
            "stale statefulset generation",
            observed(
                prefill=RoleObserved(
                    exists=True,
                    observed_generation=1,
                    generation=2,
                    replicas=1,
                    ready_replicas=1,
                    updated_replicas=1,
                )
            ),
            "False",
            status.REASON_WAITING,
        ),
        (
            "rollout in progress",
            observed(
                decode=RoleObserved(
                    exists=True,
                    observed_generation=2,
                    generation=2,
                    replicas=1,
                    ready_replicas=1,
                    updated_replicas=1,
                    current_revision="r1",
                    update_revision="r2",
                )
            ),
            "False",
            status.REASON_WAITING,
        ),
        (
            "unschedulable wins over waiting",
            observed(pods=[PodState("tiny-decode-0", "decode", unschedulable_message=GPU_MESSAGE)]),
            "False",
            status.REASON_UNSCHEDULABLE,
        ),
        (
            "a child conflict wins over settled pods",
            observed(conflicts=(ownership.Conflict("Service", "tiny", ""),)),
            "False",
            status.REASON_CHILD_CONFLICT,
        ),
        (
            # Pods of an earlier spec may still run: the refusal says why no update lands.
            "a refused host path wins over settled pods",
            observed(host_path_refused="spec.model.source.hub.cache.hostPath.path ..."),
            "False",
            hostpaths.REASON,
        ),
    ],
    ids=lambda v: v if isinstance(v, str) and " " in v else None,
)
def test_ready_condition(name, obs, ready, reason):
    c = cond(status.compute_conditions(SERVER, obs), api.COND_READY)
    assert (c["status"], c["reason"]) == (ready, reason)


def test_unschedulable_message_names_the_resource_and_the_field():
    # A user must learn which resource is short and which field to change.
    pods = [PodState("tiny-decode-0", "decode", unschedulable_message=GPU_MESSAGE)]
    c = cond(status.compute_conditions(SERVER, observed(pods=pods)), api.COND_READY)
    assert c["message"] == (
        "1 pod(s) cannot be scheduled (tiny-decode-0): no node has enough nvidia.com/gpu "
        "(spec.decode.resources.gpus) free: add nodes with it, or lower that field"
    )


# As kube-scheduler 1.37 words them (seen on the local control plane).
PREEMPTION = " preemption: 0/2 nodes are available: 2 Preemption is not helpful for scheduling."
SHORT_SERVER = api.parse_server(
    {
        **server(
            {
                "prefill": {"resources": {"gpus": 16, "requests": {"cpu": "4"}}},
                "decode": {"resources": {"limits": {"hugepages-2Mi": "1Gi"}}},
                "network": {"rdma": {"enabled": True, "resourceName": "rdma/hca_shared_devices_b"}},
            }
        ),
        "metadata": {"name": "big", "namespace": "ns"},
    }
)


@pytest.mark.parametrize(
    ("name", "pods", "message"),
    [
        (
            # Once garbled into "Not enough nvidia.com/gpu., rdma/... or lower
            # spec.prefill.resources" when the RDMA count was as short as the GPUs.
            "gpus and rdma short, each named with its field",
            [
                PodState(
                    "big-prefill-0",
                    "prefill",
                    "0/2 nodes are available: 2 Insufficient nvidia.com/gpu, "
                    "2 Insufficient rdma/hca_shared_devices_b." + PREEMPTION,
                ),
                PodState(
                    "big-decode-0",
                    "decode",
                    "0/2 nodes are available: 2 Insufficient rdma/hca_shared_devices_b."
                    + PREEMPTION,
                ),
            ],
            "2 pod(s) cannot be scheduled (big-decode-0, big-prefill-0): no node has enough "
            "nvidia.com/gpu (spec.prefill.resources.gpus) and rdma/hca_shared_devices_b "
            "(spec.network.rdma.count) free: add nodes with them, or lower those fields",
        ),
        (
            "only the rdma count short: not the role's resources",
            [
                PodState(
                    "big-decode-0",
                    "decode",
                    "0/2 nodes are available: 2 Insufficient rdma/hca_shared_devices_b."
                    + PREEMPTION,
                )
            ],
            "1 pod(s) cannot be scheduled (big-decode-0): no node has enough "
            "rdma/hca_shared_devices_b (spec.network.rdma.count) free: add nodes with it, "
            "or lower that field",
        ),
        (
            "cpu short",
            [PodState("big-decode-0", "decode", "0/2 nodes are available: 2 Insufficient cpu.")],
            "1 pod(s) cannot be scheduled (big-decode-0): no node has enough cpu "
            "(spec.decode.resources.cpu) free: add nodes with it, or lower that field",
        ),
        (
            # A resource only spec.<role>.resources.limits asks for was named bare, with
            # no field to change.
            "hugepages from the limits map, named with that field",
            [
                PodState(
                    "big-decode-0",
                    "decode",
                    "0/2 nodes are available: 2 Insufficient hugepages-2Mi." + PREEMPTION,
                )
            ],
            "1 pod(s) cannot be scheduled (big-decode-0): no node has enough hugepages-2Mi "
            "(spec.decode.resources.limits) free: add nodes with it, or lower that field",
        ),
        (
            "a cpu request from the requests map, named with that field",
            [PodState("big-prefill-0", "prefill", "0/2 nodes are available: 2 Insufficient cpu.")],
            "1 pod(s) cannot be scheduled (big-prefill-0): no node has enough cpu "
            "(spec.prefill.resources.requests) free: add nodes with it, or lower that field",
        ),
        (
            # The scheduler says "... not found. not found"; once repeated as it was.
            "missing pvc, said once",
            [
                PodState(
                    "big-decode-0",
                    "decode",
                    '0/2 nodes are available: persistentvolumeclaim "models" not found. not found',
                ),
                PodState(
                    "big-prefill-0",
                    "prefill",
                    '0/2 nodes are available: persistentvolumeclaim "models" not found. not found',
                ),
            ],
            "2 pod(s) cannot be scheduled (big-decode-0, big-prefill-0): PersistentVolumeClaim "
            '"models" does not exist in namespace ns: create it, or fix '
            "spec.model.source.pvc.claimName",
        ),
        (
            "taint",
            [
                PodState(
                    "big-decode-0",
                    "decode",
                    "0/2 nodes are available: 2 node(s) had untolerated taint "
                    "{nvidia.com/gpu: present}." + PREEMPTION,
                )
            ],
            "1 pod(s) cannot be scheduled (big-decode-0): no node matches "
            "spec.decode.tolerations: fix them, or label/untaint nodes",
        ),
        (
            "anything else: the scheduler's sentence, without the preemption report",
            [
                PodState(
                    "big-decode-0",
                    "decode",
                    "0/2 nodes are available: 2 node(s) had volume node affinity conflict."
                    + PREEMPTION,
                )
            ],
            "1 pod(s) cannot be scheduled (big-decode-0): big-decode-0: 0/2 nodes are "
            "available: 2 node(s) had volume node affinity conflict",
        ),
    ],
    ids=lambda v: v if isinstance(v, str) and len(v) < 80 and "pod(s)" not in v else None,
)
def test_unschedulable_summary(name: str, pods: list[PodState], message: str):
    assert status.unschedulable_summary(SHORT_SERVER, pods) == message


def test_zero_decode_replicas_is_never_ready():
    zero = api.parse_server(
        {**server({"decode": {"replicas": 0}}), "metadata": {"name": "tiny", "namespace": "ns"}}
    )
    decode = RoleObserved(exists=True, replicas=0)
    c = cond(status.compute_conditions(zero, observed(decode=decode)), api.COND_READY)
    assert (c["status"], c["reason"]) == ("False", status.REASON_NO_DECODE)


def test_a_child_conflict_degrades_naming_the_object_and_the_fix():
    obs = observed(
        pods=[PodState("tiny-decode-0", "decode", waiting_reason="engine: CrashLoopBackOff")],
        conflicts=(ownership.Conflict("Service", "tiny", "Deployment db"),),
    )
    c = cond(status.compute_conditions(SERVER, obs), api.COND_DEGRADED)
    assert (c["status"], c["reason"]) == ("True", status.REASON_CHILD_CONFLICT)
    assert "Service tiny (controlled by Deployment db)" in c["message"]
    assert "rename this server" in c["message"]


def test_a_refused_host_path_degrades_with_its_message():
    why = "spec.model.source.hub.cache.hostPath.path '/etc' is a node folder, ..."
    c = cond(status.compute_conditions(SERVER, observed(host_path_refused=why)), api.COND_DEGRADED)
    assert (c["status"], c["reason"], c["message"]) == ("True", hostpaths.REASON, why)


@pytest.mark.parametrize("ctype", [api.COND_READY, api.COND_PROGRESSING, api.COND_DEGRADED])
def test_a_refused_pod_template_holds_the_generation_with_its_message(ctype):
    why = "spec.decode.podTemplate.spec.hostNetwork: not allowed by the operator's settings"
    c = cond(status.compute_conditions(SERVER, observed(pod_template_refused=why)), ctype)
    assert (c["reason"], c["message"]) == (podtemplate.REASON, why)
    assert c["status"] == ("True" if ctype == api.COND_DEGRADED else "False")


def test_crashing_containers_degrade():
    pods = [PodState("tiny-prefill-0", "prefill", waiting_reason="engine: CrashLoopBackOff")]
    c = cond(status.compute_conditions(SERVER, observed(pods=pods)), api.COND_DEGRADED)
    assert (c["status"], c["reason"]) == ("True", status.REASON_CRASHING)
    assert "tiny-prefill-0" in c["message"]


def test_transport_is_unknown_until_reported():
    c = cond(status.compute_conditions(SERVER, observed()), api.COND_KV_TRANSPORT)
    assert (c["status"], c["reason"]) == ("Unknown", status.REASON_NO_REPORTS)


RDMA_SERVER = api.parse_server(
    server({"network": {"transport": "rdma", "rdma": {"enabled": True, "resourceName": "r/x"}}})
)
TCP_EVIDENCE = "tiny-decode-0: TCP: no RDMA device in the pod; UCX_TLS=tcp,self"


def test_tcp_when_rdma_was_asked_for_is_a_false_condition_naming_the_fix():
    # The silent fallback: RDMA requested, KV over TCP. False -> a Warning Event.
    obs = observed(transport="TCPFallback", transport_reason=TCP_EVIDENCE)
    c = cond(status.compute_conditions(RDMA_SERVER, obs), api.COND_KV_TRANSPORT)
    assert (c["status"], c["reason"]) == ("False", "TCPFallback")
    assert "network.transport: rdma asks for RDMA" in c["message"]
    assert TCP_EVIDENCE in c["message"] and "resourceName" in c["message"]


def test_tcp_fallback_without_an_rdma_request_is_true_with_the_evidence():
    obs = observed(transport="TCPFallback", transport_reason=TCP_EVIDENCE)
    c = cond(status.compute_conditions(SERVER, obs), api.COND_KV_TRANSPORT)
    assert (c["status"], c["reason"], c["message"]) == ("True", "TCPFallback", TCP_EVIDENCE)


@pytest.mark.parametrize("value", ["RDMA", "TCP"])
def test_the_transport_asked_for_is_true(value: str):
    obs = observed(transport=value, transport_reason="evidence")
    c = cond(status.compute_conditions(RDMA_SERVER, obs), api.COND_KV_TRANSPORT)
    assert (c["status"], c["reason"]) == ("True", value)


@pytest.mark.parametrize("spec", [SERVER, RDMA_SERVER], ids=["auto", "rdma"])
def test_no_transport_is_a_false_condition_and_a_warning(spec):
    """Every turn would quietly end pull-failed: the condition says so, whatever was
    asked for (it was Unknown with a Normal Event)."""
    evidence = "UCX_TLS=ib allows neither a usable RDMA transport (no RDMA device) nor tcp"
    obs = observed(transport="NoTransport", transport_reason=evidence)
    c = cond(status.compute_conditions(spec, obs), api.COND_KV_TRANSPORT)
    assert (c["status"], c["reason"]) == ("False", "NoTransport")
    assert evidence in c["message"] and "UCX_TLS" in c["message"]
    change = status.ConditionChange(api.COND_KV_TRANSPORT, c["status"], c["reason"], "m")
    assert status.event_type(change) == "Warning"


def test_unknown_with_evidence_says_why():
    obs = observed(transport="Unknown", transport_reason="cannot read /sys/class/infiniband")
    c = cond(status.compute_conditions(SERVER, obs), api.COND_KV_TRANSPORT)
    assert (c["status"], c["reason"], c["message"]) == (
        "Unknown",
        "Unknown",
        "cannot read /sys/class/infiniband",
    )


def test_transport_reason_is_kept_in_status():
    obs = observed(transport="TCP", transport_reason="evidence")
    st, _ = status.compute_status(SERVER, obs, None, NOW)
    assert (st["transport"], st["transportReason"]) == ("TCP", "evidence")


def test_transition_time_is_kept_while_status_holds():
    # Rewriting lastTransitionTime on every pass would make status flap under GitOps.
    first, _ = status.compute_status(SERVER, observed(), None, EARLIER)
    second, changes = status.compute_status(SERVER, observed(), first, NOW)
    assert second == first
    assert changes == []
    assert not status.status_changed(first, second)


def test_transition_time_moves_when_status_flips():
    first, _ = status.compute_status(SERVER, observed(), None, EARLIER)
    waiting = observed(
        decode=RoleObserved(exists=True, replicas=1, updated_replicas=1), prerequisites=()
    )
    second, changes = status.compute_status(SERVER, waiting, first, NOW)
    assert cond(second["conditions"], api.COND_READY)["lastTransitionTime"] == NOW
    assert cond(second["conditions"], api.COND_DEGRADED)["lastTransitionTime"] == EARLIER
    assert [(c.type, c.status) for c in changes] == [
        (api.COND_READY, "False"),
        (api.COND_PROGRESSING, "True"),
    ]


def test_role_counts_and_display():
    decode = RoleObserved(exists=True, replicas=2, ready_replicas=1, updated_replicas=2)
    obs = observed(decode=decode, last_apply=ownership.ApplyOutcome(3, applied=True))
    st, _ = status.compute_status(SERVER, obs, None, NOW)
    assert st["decode"] == {
        "replicas": 2,
        "readyReplicas": 1,
        "updatedReplicas": 2,
        "display": "1/1",
        # For the CRD's scale subresource (HPA, KEDA, kubectl scale).
        "selector": "app.kubernetes.io/name=kvferry,app.kubernetes.io/instance=tiny,"
        "kvferry.io/role=decode",
        # What the operator renders the role at, and where that comes from.
        "desiredReplicas": 1,
        "scaledBy": "spec.decode.replicas",
    }
    assert st["observedGeneration"] == 3
    assert st["endpoint"] == "http://tiny.ns.svc:8000"


def test_pod_state_reads_scheduler_and_container_waits():
    pod = {
        "metadata": {"name": "p", "labels": {api.LABEL_ROLE: "decode"}},
        "status": {
            "conditions": [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": GPU_MESSAGE,
                }
            ],
            "initContainerStatuses": [
                {"name": "kvferry-sidecar", "state": {"waiting": {"reason": "ImagePullBackOff"}}}
            ],
        },
    }
    st = status.pod_state_from(pod)
    assert st == PodState("p", "decode", GPU_MESSAGE, "kvferry-sidecar: ImagePullBackOff")


def test_statefulset_status_is_read():
    sts = {
        "metadata": {"generation": 4},
        "status": {
            "observedGeneration": 4,
            "replicas": 2,
            "readyReplicas": 1,
            "updatedReplicas": 2,
            "currentRevision": "a",
            "updateRevision": "b",
        },
    }
    assert status.role_observed_from(sts) == RoleObserved(True, 4, 4, 2, 1, 2, "a", "b")
    assert status.role_observed_from(None) == RoleObserved()


NOT_READY = RoleObserved(exists=True, replicas=1, updated_replicas=1)
NO_GPU = prerequisites.Finding(prerequisites.REASON_NO_GPU_NODES, "no node offers nvidia.com/gpu")


def test_missing_prerequisite_is_a_false_condition_and_the_ready_reason():
    # The cause, not its symptom: "waiting for decode 0/1 ready" says nothing to fix
    # (pods a Pod Security level refuses are never created).
    obs = observed(decode=NOT_READY, prerequisites=(NO_GPU,))
    conditions = status.compute_conditions(SERVER, obs)
    pre = cond(conditions, api.COND_PREREQUISITES)
    assert (pre["status"], pre["reason"], pre["message"]) == (
        "False",
        "NoGPUNodes",
        "no node offers nvidia.com/gpu",
    )
    ready = cond(conditions, api.COND_READY)
    assert (ready["status"], ready["reason"]) == ("False", "NoGPUNodes")


def test_prerequisites_met_while_rolling_keeps_the_ready_reason():
    obs = observed(decode=NOT_READY, prerequisites=())
    conditions = status.compute_conditions(SERVER, obs)
    assert cond(conditions, api.COND_PREREQUISITES)["status"] == "True"
    assert cond(conditions, api.COND_READY)["reason"] == status.REASON_WAITING


def test_settled_server_meets_its_prerequisites_without_a_check():
    c = cond(status.compute_conditions(SERVER, observed()), api.COND_PREREQUISITES)
    assert (c["status"], c["reason"]) == ("True", "Met")


def test_unchecked_prerequisites_are_unknown():
    c = cond(status.compute_conditions(SERVER, observed(decode=NOT_READY)), api.COND_PREREQUISITES)
    assert (c["status"], c["reason"]) == ("Unknown", "NotChecked")


def test_unschedulable_pods_keep_the_ready_reason_and_prerequisites_say_why():
    pods = [PodState("tiny-decode-0", "decode", unschedulable_message=GPU_MESSAGE)]
    obs = observed(decode=NOT_READY, pods=pods, prerequisites=(NO_GPU,))
    conditions = status.compute_conditions(SERVER, obs)
    assert cond(conditions, api.COND_READY)["reason"] == status.REASON_UNSCHEDULABLE
    assert cond(conditions, api.COND_PREREQUISITES)["reason"] == "NoGPUNodes"


# ---------------------------------------------------------- observedGeneration (GitOps)

REFUSED = "StatefulSet tiny-decode: admission webhook denied the request: replicas over 3"


def test_a_refused_generation_is_not_observed_and_says_what_was_refused():
    # Generation 3 refused, generation 2 was running: Argo CD / Flux must not read
    # generation 3 as rolled out (observedGeneration 3 + Complete looked Healthy).
    obs = observed(last_apply=ownership.ApplyOutcome(3, applied=False, refusals=(REFUSED,)))
    st, changes = status.compute_status(SERVER, obs, {"observedGeneration": 2}, NOW)
    assert st["observedGeneration"] == 2
    progressing = cond(st["conditions"], api.COND_PROGRESSING)
    degraded = cond(st["conditions"], api.COND_DEGRADED)
    for c in (progressing, degraded):
        assert c["reason"] == status.REASON_APPLY_FAILED
        assert REFUSED in c["message"] and "generation 3 is not applied" in c["message"]
    assert (progressing["status"], degraded["status"]) == ("False", "True")
    kinds = {c.type: status.event_type(c) for c in changes}
    assert kinds[api.COND_PROGRESSING] == kinds[api.COND_DEGRADED] == "Warning"


def test_the_generation_observed_is_the_one_whose_children_all_landed():
    landed = observed(last_apply=ownership.ApplyOutcome(3, applied=True))
    st, _ = status.compute_status(SERVER, landed, {"observedGeneration": 2}, NOW)
    assert st["observedGeneration"] == 3
    assert cond(st["conditions"], api.COND_PROGRESSING)["reason"] == status.REASON_COMPLETE
    # A child conflict (nothing refused, something not applied) does not advance it either.
    held = observed(last_apply=ownership.ApplyOutcome(3, applied=False))
    st, _ = status.compute_status(SERVER, held, {"observedGeneration": 2}, NOW)
    assert st["observedGeneration"] == 2


def test_an_apply_not_known_keeps_the_observed_generation_and_never_invents_one():
    st, _ = status.compute_status(SERVER, observed(), {"observedGeneration": 2}, NOW)
    assert st["observedGeneration"] == 2
    st, _ = status.compute_status(SERVER, observed(), None, NOW)
    assert "observedGeneration" not in st


def test_an_older_generations_refusal_does_not_mark_the_current_one():
    obs = observed(last_apply=ownership.ApplyOutcome(2, applied=False, refusals=(REFUSED,)))
    c = cond(status.compute_conditions(SERVER, obs), api.COND_PROGRESSING)
    assert c["reason"] == status.REASON_COMPLETE


@pytest.mark.parametrize(
    ("ctype", "value", "reason", "kind"),
    [
        # A rollout that finished is good news: a Warning here paged on every rollout.
        (api.COND_PROGRESSING, "False", status.REASON_COMPLETE, "Normal"),
        (api.COND_PROGRESSING, "True", status.REASON_ROLLING, "Normal"),
        (api.COND_PROGRESSING, "False", status.REASON_APPLY_FAILED, "Warning"),
        (api.COND_READY, "True", status.REASON_READY, "Normal"),
        (api.COND_READY, "False", status.REASON_UNSCHEDULABLE, "Warning"),
        (api.COND_DEGRADED, "False", status.REASON_HEALTHY, "Normal"),
        (api.COND_DEGRADED, "True", status.REASON_CRASHING, "Warning"),
        (api.COND_KV_TRANSPORT, "False", "TCPFallback", "Warning"),
        (api.COND_KV_TRANSPORT, "Unknown", status.REASON_NO_REPORTS, "Normal"),
        (api.COND_PREREQUISITES, "False", "NoGPUNodes", "Warning"),
        (api.COND_PREREQUISITES, "True", "Met", "Normal"),
    ],
)
def test_event_type_is_warning_only_for_a_fault(ctype, value, reason, kind):
    assert status.event_type(status.ConditionChange(ctype, value, reason, "m")) == kind


@pytest.mark.parametrize("held", ["host path", "conflict"])
def test_a_generation_held_back_is_never_complete(held):
    # Settled StatefulSets of the previous generation, the new one held back.
    if held == "host path":
        obs = observed(host_path_refused="spec.model.source.hub.cache.hostPath.path ...")
    else:
        obs = observed(conflicts=(ownership.Conflict("Service", "tiny"),))
    st, changes = status.compute_status(SERVER, obs, {"observedGeneration": 2}, NOW)
    progressing = cond(st["conditions"], api.COND_PROGRESSING)
    assert progressing["status"] == "False" and progressing["reason"] != status.REASON_COMPLETE
    assert {c.type: status.event_type(c) for c in changes}[api.COND_PROGRESSING] == "Warning"


def change(ctype, value, reason, was=None):
    return status.ConditionChange(ctype, value, reason, "m", was)


@pytest.mark.parametrize(
    ("c", "posted"),
    [
        # A new server's way to Ready: two Events, Ready=True and Complete.
        (change(api.COND_READY, "False", status.REASON_WAITING), False),
        (change(api.COND_PROGRESSING, "True", status.REASON_CREATING), False),
        (change(api.COND_DEGRADED, "False", status.REASON_HEALTHY), False),
        (change(api.COND_KV_TRANSPORT, "Unknown", status.REASON_NO_REPORTS), False),
        (change(api.COND_PREREQUISITES, "Unknown", prerequisites.REASON_NOT_CHECKED), False),
        (
            change(
                api.COND_PROGRESSING,
                "True",
                status.REASON_ROLLING,
                ("True", status.REASON_CREATING),
            ),
            False,
        ),
        (
            change(
                api.COND_PREREQUISITES,
                "True",
                prerequisites.REASON_MET,
                ("Unknown", prerequisites.REASON_NOT_CHECKED),
            ),
            False,
        ),
        (
            change(api.COND_READY, "True", status.REASON_READY, ("False", status.REASON_WAITING)),
            True,
        ),
        (
            change(
                api.COND_PROGRESSING,
                "False",
                status.REASON_COMPLETE,
                ("True", status.REASON_ROLLING),
            ),
            True,
        ),
        # A server whose first status is already Ready says so.
        (change(api.COND_READY, "True", status.REASON_READY), True),
        (change(api.COND_PROGRESSING, "False", status.REASON_COMPLETE), True),
        (change(api.COND_PROGRESSING, "True", status.REASON_ROLLING), False),
        (change(api.COND_PREREQUISITES, "True", prerequisites.REASON_MET), False),
        # Faults, new or moved into, and the way out of one.
        (change(api.COND_READY, "False", status.REASON_UNSCHEDULABLE), True),
        (change(api.COND_DEGRADED, "True", status.REASON_CRASHING), True),
        (
            change(
                api.COND_READY,
                "False",
                status.REASON_UNSCHEDULABLE,
                ("False", status.REASON_WAITING),
            ),
            True,
        ),
        (
            change(
                api.COND_PROGRESSING,
                "False",
                status.REASON_COMPLETE,
                ("False", status.REASON_APPLY_FAILED),
            ),
            True,
        ),
        (
            change(api.COND_READY, "False", status.REASON_WAITING, ("True", status.REASON_READY)),
            True,
        ),
        (
            change(api.COND_KV_TRANSPORT, "True", "TCP", ("Unknown", status.REASON_NO_REPORTS)),
            True,
        ),
    ],
)
def test_an_event_is_posted_for_news_not_for_every_step_to_ready(c, posted):
    assert status.worth_an_event(c) is posted


def test_the_status_patch_holds_only_what_changed_and_never_retention():
    old = {"endpoint": "a", "retention": {"applied": 1}, "conditions": [{"type": "Ready"}]}
    new = {"endpoint": "a", "retention": {"applied": 2}, "conditions": [{"type": "Degraded"}]}
    assert status.status_patch(old, new) == {"conditions": [{"type": "Degraded"}]}
    assert status.status_patch(old, {**old, "retention": {"applied": 9}}) == {}
    assert status.status_patch(None, {"endpoint": "a"}) == {"endpoint": "a"}


# Issue 38, item 1: with spec.owners.header, the owner boundary holds only if no one
# but the gateway reaches the client port.
OWNER_HEADER = {"owners": {"header": "X-Authenticated-User"}}
GATEWAY_NS = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gw"}}}


def with_clients(clients: list[dict] | None, owners: bool = True) -> api.Server:
    spec: dict[str, Any] = dict(OWNER_HEADER) if owners else {}
    if clients is not None:
        spec["networkPolicy"] = {"clients": clients}
    body = server(spec, name="tiny", namespace="ns", generation=3)
    if clients is None:  # the CRD's default, as the API server stores it
        body["spec"].setdefault("networkPolicy", {})["clients"] = [{"namespaceSelector": {}}]
    return api.parse_server(body)


@pytest.mark.parametrize(
    ("clients", "wide"),
    [
        (None, "entry 0: namespaceSelector {}"),
        ([{"namespaceSelector": {}, "podSelector": {}}], "entry 0: namespaceSelector {}"),
        ([GATEWAY_NS, {"ipBlock": {"cidr": "0.0.0.0/0"}}], "entry 1: ipBlock 0.0.0.0/0"),
        ([{"ipBlock": {"cidr": "::/0"}}], "entry 0: ipBlock ::/0"),
    ],
    ids=["default", "empty-selectors", "ipv4-any", "ipv6-any"],
)
def test_owners_with_unrestricted_clients_say_the_boundary_is_open(clients, wide):
    srv = with_clients(clients)
    got = cond(status.compute_conditions(srv, observed()), api.COND_OWNER_BOUNDARY)
    assert (got["status"], got["reason"]) == ("False", status.REASON_CLIENTS_NOT_RESTRICTED)
    assert wide in got["message"]
    assert "spec.networkPolicy.clients" in got["message"]
    assert "another owner's header" in got["message"]
    # A Warning Event, also when it is the new server's first state.
    c = status.ConditionChange(got["type"], got["status"], got["reason"], got["message"])
    assert status.event_type(c) == "Warning" and status.worth_an_event(c)


@pytest.mark.parametrize(
    "clients",
    [
        [GATEWAY_NS],
        [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"app": "gateway"}}}],
        [{"podSelector": {}}],
        [{"ipBlock": {"cidr": "10.0.0.0/8"}}],
        [{"ipBlock": {"cidr": "0.0.0.0/0", "except": ["10.0.0.0/8"]}}],
        [],
    ],
    ids=["gateway-ns", "gateway-pods", "this-namespace", "ipblock", "ipblock-except", "none"],
)
def test_owners_with_restricted_clients_hold_the_boundary(clients):
    got = cond(status.compute_conditions(with_clients(clients), observed()), "OwnerBoundary")
    assert (got["status"], got["reason"]) == ("True", status.REASON_CLIENTS_RESTRICTED)
    # Restricted from the start is no news: no Event.
    c = status.ConditionChange(got["type"], got["status"], got["reason"], got["message"])
    assert not status.worth_an_event(c)


def test_without_owners_there_is_no_owner_boundary_condition():
    conditions = status.compute_conditions(with_clients(None, owners=False), observed())
    assert api.COND_OWNER_BOUNDARY not in {c["type"] for c in conditions}


CLI = "import sys; from kvferry_operator.cli import main; sys.exit(main(sys.argv[1:]))"


def test_render_offline_warns_of_an_open_boundary_on_stderr(tmp_path):
    # kvferry-operator render: a warning on stderr, the children on stdout, exit 0 (a
    # refusal, exit 2, is for what the API server or the operator would refuse).
    import subprocess
    import sys

    import yaml

    body = server(OWNER_HEADER, name="tiny", namespace="ns")
    body["spec"]["networkPolicy"] = {"clients": [{"namespaceSelector": {}}]}
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(body))
    run = subprocess.run(
        [sys.executable, "-c", CLI, "render", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert "warning: DisaggregatedServer tiny: spec.owners.header" in run.stderr
    assert "ClientsNotRestricted" not in run.stdout and "kind: NetworkPolicy" in run.stdout
    body["spec"]["networkPolicy"] = {"clients": [GATEWAY_NS]}
    path.write_text(yaml.safe_dump(body))
    run = subprocess.run(
        [sys.executable, "-c", CLI, "render", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0 and "warning" not in run.stderr
