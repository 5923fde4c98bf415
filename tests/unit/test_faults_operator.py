"""One pod's data can never stop a server's figures; rows of pods that are gone do
not stay in status; the report vocabulary is one list shared by both sides."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import types

import kopf
import pytest
import urllib3

from kvferry_operator import aggregate, api, prerequisites, publisher, reports, status
from kvferry_operator.reports import ReportStore
from kvferry_sidecar import residency
from kvferry_sidecar.types import STORE_FATES
from kvferry_wire import report as wire
from kvferry_wire.protocol import HandleFate, Outcome
from tests.manifests import server
from tests.unit.observed import SETTLED

NOW = 1000.0
SERVER_OBJ = {**server(), "metadata": {"name": "tiny", "namespace": "ns", "uid": "u"}}
SERVER = api.parse_server(SERVER_OBJ)


def rep(pod: str, **kw) -> wire.Report:
    return wire.Report(
        version=1,
        server="tiny",
        namespace="ns",
        pod=pod,
        role="decode",
        started_at=0.0,
        generated_at=NOW,
        **kw,
    )


GOOD = rep("tiny-decode-0", by_turn={"2": wire.TurnBucket(10, 9, 1000, 900)})
# What decode now refuses, built past it (an older operator's store, a future bug).
BAD_KEY = rep("tiny-decode-1", by_turn={"x": wire.TurnBucket(1, 1, 1, 1)})
NOT_FINITE = rep("tiny-decode-2", engine=wire.Engine(kv_usage=math.inf))


@pytest.mark.parametrize("bad", [BAD_KEY, NOT_FINITE], ids=["byTurn-key", "infinity"])
def test_one_pods_unusable_report_leaves_the_others_figures_standing(bad):
    received = [reports.Received(GOOD, NOW), reports.Received(bad, NOW)]
    agg = aggregate.aggregate(SERVER, received, NOW, 480)
    assert agg.status["summary"]["hitRate"] == "90%"  # the good pod's figures
    rows = {row["name"]: row for row in agg.status["pods"]}
    assert "excluded" not in rows["tiny-decode-0"]
    assert rows[bad.pod]["excluded"]
    assert f"left out (report unusable): {bad.pod}" in agg.status["message"]


def test_an_unusable_reports_row_keeps_what_the_pressure_window_saw():
    # The publisher's window counted this report's preemptions too: a new leader seeds
    # its counter from the row (pressure.seed), or it would count them again.
    bad = rep("tiny-decode-1", by_turn={"x": wire.TurnBucket(1, 1, 1, 1)})
    bad.engine.preemptions, bad.started_at = 7, NOW - 60
    agg = aggregate.aggregate(SERVER, [reports.Received(bad, NOW)], NOW, 480)
    (row,) = agg.status["pods"]
    assert row["excluded"]
    assert (row["role"], row["startedAt"], row["preemptions"]) == (
        "decode",
        api.iso_time(NOW - 60),
        7,
    )


class FakeKube:
    def __init__(self, pods: dict[str, str]) -> None:
        self.pods = pods  # name -> uid
        self.patches: list[tuple[str, dict]] = []
        self.pod_gets = 0

    def get(self, api_version, kind, namespace, name):
        if kind == api.SERVER_KIND:
            return SERVER_OBJ
        return {"status": {}}

    def get_pod(self, namespace, name):
        self.pod_gets += 1
        uid = self.pods.get(name)
        return None if uid is None else {"metadata": {"name": name, "uid": uid}}

    def patch_status(self, api_version, kind, namespace, name, status):
        self.patches.append((kind, status))


def make_publisher(kube: FakeKube, store: ReportStore) -> publisher.Publisher:
    return publisher.Publisher(
        kube,
        store,
        stale_after=90,
        min_write_seconds=0,
        emit=lambda *a: None,
        clock=lambda: NOW,
        prune_after=600,
    )


def kvcs_writes(kube: FakeKube) -> list[dict]:
    return [st for kind, st in kube.patches if kind == api.STATUS_KIND]


def test_a_bad_report_in_the_store_does_not_stop_the_status_write():
    store = ReportStore()
    store.put(reports.Received(GOOD, NOW))
    store.put(reports.Received(BAD_KEY, NOW))
    kube = FakeKube({})
    make_publisher(kube, store).publish_all(logging.getLogger("test"))
    (written,) = kvcs_writes(kube)
    assert written["phase"] == "Reporting" and written["summary"]["hitRate"] == "90%"


@pytest.mark.parametrize(
    ("age", "pods", "kept"),
    [
        (10, {}, True),  # fresh: kept without a lookup
        (200, {"tiny-decode-0": "uid-0"}, True),  # stale, pod still there: shown stale
        (200, {}, False),  # stale and the pod is gone
        (200, {"tiny-decode-0": "uid-new"}, False),  # stale and replaced
        (700, {"tiny-decode-0": "uid-0"}, False),  # silent past the prune bound
    ],
    ids=["fresh", "stale-present", "gone", "replaced", "silent-too-long"],
)
def test_rows_of_pods_that_cannot_report_are_pruned(age, pods, kept):
    store = ReportStore()
    store.put(reports.Received(GOOD, NOW - age, "uid-0"))
    kube = FakeKube(pods)
    make_publisher(kube, store).publish_all(logging.getLogger("test"))
    assert bool(store.get("ns", "tiny")) is kept
    if age <= 90:
        assert kube.pod_gets == 0


def test_every_handle_fate_the_sidecar_counts_is_in_the_wire_vocabulary():
    fates = {f.value for f in HandleFate}
    assert {f.value for f in STORE_FATES} <= fates
    counted = {residency.FATE_CONSUMED, residency.FATE_SKIPPED, residency.FATE_TAKEN}
    counted |= {residency._TAKEN_BY_OUTCOME.get(o, residency.FATE_TAKEN) for o in Outcome}
    assert counted <= fates
    assert set(wire.MAP_KEYS["handles"]) == fates
    assert set(wire.MAP_KEYS["outcomes"]) == {o.value for o in Outcome}


# ------------------------------------------------------------------ a node goes away

PODS = [
    status.PodState("tiny-decode-0", "decode", node="gpu-node-1"),
    status.PodState("tiny-prefill-0", "prefill", node="gpu-node-0"),
]


def conditions(nodes: dict[str, bool] | None) -> dict[str, dict]:
    obs = status.Observed(roles={"prefill": SETTLED, "decode": SETTLED}, pods=PODS, nodes=nodes)
    return {c["type"]: c for c in status.compute_conditions(SERVER, obs)}


@pytest.mark.parametrize(
    ("nodes", "says"),
    [
        ({"gpu-node-0": True}, "tiny-decode-0 on node gpu-node-1, which is gone"),
        ({"gpu-node-0": True, "gpu-node-1": False}, "gpu-node-1, which is not Ready"),
    ],
    ids=["deleted", "not-ready"],
)
def test_pods_on_a_lost_node_make_the_server_degraded_and_not_ready(nodes, says):
    # The StatefulSet still counts the pod ready: nobody updates a pod whose node is gone.
    conds = conditions(nodes)
    for ctype, want in ((api.COND_DEGRADED, "True"), (api.COND_READY, "False")):
        assert conds[ctype]["status"] == want
        assert conds[ctype]["reason"] == status.REASON_NODE_LOST
        assert says in conds[ctype]["message"]


@pytest.mark.parametrize("nodes", [None, {"gpu-node-0": True, "gpu-node-1": True}])
def test_pods_on_ready_nodes_or_unknown_nodes_are_not_lost(nodes):
    conds = conditions(nodes)
    assert conds[api.COND_READY]["status"] == "True"
    assert conds[api.COND_DEGRADED]["reason"] == status.REASON_HEALTHY


def test_a_pods_node_is_read_from_its_spec():
    pod = {"metadata": {"name": "p", "labels": {}}, "spec": {"nodeName": "n1"}, "status": {}}
    assert status.pod_state_from(pod).node == "n1"


# ------------------------------------------------------------------ API server away


class UnreachableKube:
    """Lists servers, then cannot reach the API server for anything else."""

    def __init__(self) -> None:
        self.lists = 0
        self.applies = 0
        self.reads = 0

    def list_servers(self, namespaces):
        self.lists += 1
        return [SERVER_OBJ]

    def list_labelled(self, api_version, kind, label_selector, namespaces):
        return []  # no child yet: the pass applies them

    def get(self, api_version, kind, namespace, name):
        self.reads += 1  # is the child's name free or ours (handlers._taken)
        raise urllib3.exceptions.MaxRetryError(None, "/api", "connection refused")

    def apply(self, child):
        self.applies += 1
        raise urllib3.exceptions.MaxRetryError(None, "/apis", "connection refused")

    def create_event(self, body, type, reason, message):
        raise urllib3.exceptions.MaxRetryError(None, "/api", "connection refused")


async def test_the_resync_loop_outlives_an_api_server_that_goes_away_mid_pass(caplog):
    from kvferry_operator import handlers
    from kvferry_operator.settings import Settings

    kube = UnreachableKube()
    settings = Settings(sidecar_image="", resync_seconds=0.01)
    memo = kopf.Memo(kube=kube, namespaces=[], indexes={}, probe=None)
    task = asyncio.ensure_future(
        handlers._resync_forever(memo, settings, logging.getLogger("test"))
    )
    try:
        await asyncio.wait_for(_until(lambda: kube.lists >= 3), 5)
        assert not task.done(), task
    finally:
        task.cancel()
    # Each pass stops at the first unreachable call (the read before the first
    # apply), with one warning line.
    calls = kube.reads + kube.applies
    assert calls == kube.lists or calls == kube.lists - 1
    assert "API server unreachable" in caplog.text and "Traceback" not in caplog.text


async def _until(check) -> None:
    while not check():
        await asyncio.sleep(0.01)


class RecordingKube:
    """What the handlers write: applied children and status patches."""

    def __init__(self) -> None:
        self.applied: list[tuple[str, str]] = []
        self.statuses: list[dict] = []

    def apply(self, child):
        self.applied.append((child["kind"], child["metadata"]["name"]))
        return child

    def get(self, api_version, kind, namespace, name):
        return None  # every child's name is free

    def patch_status(self, api_version, kind, namespace, name, body):
        assert (kind, namespace, name) == (api.SERVER_KIND, "ns", "tiny")
        self.statuses.append(body)


class NoGPUProbe:
    """A cluster without GPU nodes."""

    def facts(self, server):
        return prerequisites.ClusterFacts(nodes=[])


def reasons(written: dict) -> dict[str, str]:
    return {c["type"]: c["reason"] for c in written["conditions"]}


@pytest.mark.parametrize("path", ["statefulset-unchanged", "statefulset-edited", "pod"])
def test_every_event_path_refreshes_status_with_prerequisites_and_nodes(monkeypatch, path):
    """A StatefulSet event that changed none of our fields (the common one: its
    controller's status) once refreshed status without the prerequisite probe and the
    node index, so its status lost Prerequisites and NodeLost until another event put
    them back. Each path, run for real, must write both."""
    from kvferry_operator import handlers, render
    from kvferry_operator.settings import Settings

    events: list[tuple[str, str]] = []
    monkeypatch.setattr(
        kopf, "info", lambda body, reason, message: events.append(("Normal", reason))
    )
    monkeypatch.setattr(
        kopf, "warn", lambda body, reason, message: events.append(("Warning", reason))
    )
    owner = {**server(), "metadata": {"name": "tiny", "namespace": "ns", "generation": 2}}
    settings = Settings(sidecar_image="", resync_seconds=60)
    kube = RecordingKube()
    memo = kopf.Memo(kube=kube, settings=settings, probe=NoGPUProbe())
    not_ready = dataclasses.replace(SETTLED, ready_replicas=0)
    common = dict(
        memo=memo,
        servers={("ns", "tiny"): [owner]},
        statefulsets={("ns", "tiny", "prefill"): [SETTLED], ("ns", "tiny", "decode"): [not_ready]},
        pods={("ns", "tiny"): [status.PodState("tiny-decode-0", "decode", node="gpu-node-1")]},
        nodes={"gpu-node-1": [False]},
    )
    labels = {api.LABEL_INSTANCE: "tiny", api.LABEL_SERVER: "tiny"}
    if path == "pod":
        asyncio.run(handlers.pod_changed(namespace="ns", labels=labels, **common))
    else:
        rendered = next(
            c
            for c in render.render(api.parse_server(owner), settings.render_context())
            if c["kind"] == "StatefulSet" and c["metadata"]["name"] == "tiny-decode"
        )
        body = rendered if path == "statefulset-unchanged" else {}
        child = handlers._on_child_event("StatefulSet")
        asyncio.run(child(type="MODIFIED", name="tiny-decode", namespace="ns", labels=labels,
                          body=body, logger=logging.getLogger("test"), **common))  # fmt: skip
    # An edited StatefulSet is re-applied with its NetworkPolicy (its pods need it).
    edited = [("NetworkPolicy", "tiny"), ("StatefulSet", "tiny-decode")]
    want_applied = edited if path == "statefulset-edited" else []
    assert kube.applied == want_applied
    (written,) = kube.statuses
    got = reasons(written)
    assert got[api.COND_PREREQUISITES] == prerequisites.REASON_NO_GPU_NODES
    assert got[api.COND_READY] == status.REASON_NODE_LOST
    assert got[api.COND_DEGRADED] == status.REASON_NODE_LOST
    assert ("Warning", prerequisites.REASON_NO_GPU_NODES) in events


def test_a_status_refresh_from_a_stale_body_keeps_the_publishers_transport():
    # A child event carries the server as the index last saw it, from before the
    # publisher wrote TCPFallback: status built on it wrote Unknown back (and the
    # KVTransport condition flipped twice, posting its Event twice).
    from kvferry_operator import handlers

    patches: list[dict] = []

    class Kube:
        def patch_status(self, api_version, kind, namespace, name, body):
            patches.append(body)

    stale = {**SERVER_OBJ, "status": {"transport": "Unknown"}}
    handlers.refresh_status(
        stale,
        Kube(),  # type: ignore[arg-type]
        {},
        {},
        post=lambda *a: None,
        transports=lambda key: (
            ("TCPFallback", "tiny-decode-0: TCP") if key == ("ns", "tiny") else None
        ),
    )
    (written,) = patches
    assert (written["transport"], written["transportReason"]) == (
        "TCPFallback",
        "tiny-decode-0: TCP",
    )
    kv = next(c for c in written["conditions"] if c["type"] == api.COND_KV_TRANSPORT)
    assert kv["reason"] == "TCPFallback"


def test_two_refreshes_from_the_same_old_status_post_a_change_once():
    # A server event and a child event at once: both start from the status before
    # either write lands, both see KVTransport change; one Event, not two.
    from kvferry_operator import handlers, ownership

    class Kube:
        def patch_status(self, api_version, kind, namespace, name, body):
            pass

    posted: list[str] = []
    claims = ownership.Claims()
    unknown = {"type": api.COND_KV_TRANSPORT, "status": "Unknown", "reason": "NoReports"}
    stale = {**SERVER_OBJ, "status": {"transport": "Unknown", "conditions": [unknown]}}
    for _ in range(2):
        handlers.refresh_status(
            stale,
            Kube(),  # type: ignore[arg-type]
            {},
            {},
            post=lambda body, kind, reason, message: posted.append(reason),
            claims=claims,
            transports=lambda key: ("TCPFallback", "tiny-decode-0: TCP"),
        )
    assert posted.count("TCPFallback") == 1
    assert len(posted) == len(set(posted))


async def test_a_failed_first_safety_pass_is_tried_again_soon_not_an_interval_later(
    monkeypatch,
):
    """The first pass restores children deleted while no operator ran: one that fails
    (an API hiccup at takeover) is tried again after the first pass's short delay."""
    from kvferry_operator import handlers
    from kvferry_operator.settings import Settings

    delays: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(seconds: float) -> None:
        delays.append(seconds)
        await real_sleep(0)

    outcomes = iter([RuntimeError("API server away"), RuntimeError("still away"), None])

    def safety_pass(memo, settings, logger):
        outcome = next(outcomes, None)
        if outcome is not None:
            raise outcome
        return handlers.PassDone()

    # The loop's own asyncio alone (patching asyncio.sleep would time this test too).
    monkeypatch.setattr(
        handlers, "asyncio", types.SimpleNamespace(sleep=sleep, to_thread=asyncio.to_thread)
    )
    monkeypatch.setattr(handlers, "safety_pass", safety_pass)
    settings = Settings(sidecar_image="", resync_seconds=300)
    memo = kopf.Memo(indexes={})
    task = asyncio.ensure_future(
        handlers._resync_forever(memo, settings, logging.getLogger("test"))
    )
    try:
        await asyncio.wait_for(_until(lambda: len(delays) >= 5), 5)
    finally:
        task.cancel()
    short = handlers.FIRST_PASS_SECONDS * (1 + handlers.FIRST_PASS_SPREAD)
    # Three tries at the short delay (two failed), then the interval (+-20 %).
    assert all(d <= short for d in delays[:3]), delays
    assert all(d >= 300 * 0.8 for d in delays[3:]), delays
