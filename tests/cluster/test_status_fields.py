"""Every status field the operator writes survives the real API server unchanged.

The API server silently prunes what the CRD schema does not declare, and a JSON merge
patch deletes a key whose value is null. Either way the operator reads back something
other than what it wrote: it then "changes" the status on every pass, and whatever it
keeps there (``status.retention``: the policy in force, its ceiling and revision) is
lost. These tests write the statuses the operator's own code computes (the reconcile
status, the KVCacheStatus and the retention status of the residency publisher in Auto
mode), through the operator's own client, and read them back.

Auto applying recommendations live (no restart) is tests/cluster/test_live_policy.py;
the gap patterns and the expected recommendation it uses are here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import config as kube_config

from kvferry_operator import (
    aggregate,
    api,
    handlers,
    ownership,
    publisher,
    reports,
    settings,
    status,
)
from kvferry_operator.kube import Kube
from kvferry_operator.reports import ReportStore
from kvferry_wire import costfit
from kvferry_wire import report as wire
from tests.cluster.conftest import Kubectl, Operator
from tests.cluster.test_operator import make

NOW = 1_800_000_000.0  # a fixed clock: nothing changes between two passes but the inputs
LOG = logging.getLogger("test")


@pytest.fixture
def kube(kubeconfig: Path) -> Iterator[Kube]:
    k = Kube(kube_config.new_client_from_config(str(kubeconfig)))
    yield k
    k.close()


def differences(expected: Any, actual: Any, path: str = "status") -> list[str]:
    """Where ``actual`` differs from ``expected``, as readable lines."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        out = []
        for key in sorted(set(expected) | set(actual)):
            where = f"{path}.{key}"
            if key not in actual:
                out.append(f"{where}: written {expected[key]!r}, read back nothing")
            elif key not in expected:
                out.append(f"{where}: not written, read back {actual[key]!r}")
            else:
                out += differences(expected[key], actual[key], where)
        return out
    if isinstance(expected, list) and isinstance(actual, list) and len(expected) == len(actual):
        return [
            line
            for i, (e, a) in enumerate(zip(expected, actual, strict=True))
            for line in differences(e, a, f"{path}[{i}]")
        ]
    return [] if expected == actual else [f"{path}: written {expected!r}, read back {actual!r}"]


def assert_same(written: Any, back: Any, what: str = "") -> None:
    lines = differences(written, back)
    assert not lines, f"{what} status changed by the API server:\n" + "\n".join(lines)


def full_report(ns: str, server: str, pod: str, role: str) -> wire.Report:
    """A report with every figure measured, so every optional status field is set."""
    rep = wire.Report(
        version=1,
        server=server,
        namespace=ns,
        pod=pod,
        role=role,
        engine_build="abc",
        started_at=NOW - 600,
        generated_at=NOW,
        transport="RDMA",
    )
    rep.by_turn = {"1": wire.TurnBucket(10, 0, 5000, 0), "2": wire.TurnBucket(10, 9, 6000, 5100)}
    rep.outcomes = {"no-handle": 10, "reused": 9, "expired": 1}
    rep.handles = {"consumed": 9, "expired": 1}
    for gap in [30.0] * 40 + [50.0] * 10:
        rep.gaps.observe(gap)
    for _ in range(9):
        rep.ttft_reused.observe(0.3)
    for _ in range(11):
        rep.ttft_recomputed.observe(2.0)
    rep.pinned = wire.Pinned(
        handles=3,
        blocks=30,
        bytes=3_000_000,
        oldest_age_seconds=12.5,
        unused_handles=2,
        unused_blocks=20,
        orphaned_handles=1,
        orphaned_blocks=10,
        unreleasable_handles=1,
    )
    rep.orphans = wire.Orphans(found=2, found_blocks=20, released=1, void=1)
    rep.evictions = wire.Evictions(
        store_cap=1,
        owner_handles=2,
        owner_tokens=3,
        pressure=4,
        preemption=5,
        usefulness=6,
        retention=7,
        lease=8,
    )
    rep.transfer = wire.Transfer(
        pulls=9,
        bytes=9_000_000,
        seconds=0.09,
        recompute_tokens=10_000,
        recompute_seconds=2.5,
        bytes_per_token=1024.0,
    )
    for _ in range(9):
        rep.transfer.pull_latency.observe(0.02)
    rep.engine = wire.Engine(kv_usage=0.42, preemptions=0, healthy=True)
    rep.kv_events = wire.KVEvents(blocks_held=100, sessions_held=4, batches=50)
    # Legs of both kinds and both ways, so every cost figure is fitted (and Auto applies
    # a measured recompute threshold: the server's status.recomputeThreshold). A pull's
    # fixed cost below 0 (as a fit may give within its noise) must read back too.
    for n in (16, 64, 256, 1024, 2048) * 4:  # 20 pulls: what Auto needs to apply
        for pulled in (0, n):
            x = {costfit.PULL: 1.0 if pulled else 0.0, costfit.PULLED_TOKENS: pulled}
            x[costfit.COMPUTED_TOKENS] = n + 16 - pulled
            seconds = 0.05 - (0.004 if pulled else 0) + 0.0001 * pulled + 0.0013 * (n + 16 - pulled)
            costfit.observe(rep.costs.prefill_leg, costfit.PREFILL_LEG, x, seconds, n + 16)
        alone = {costfit.ALONE: 1.0, costfit.ALONE_COMPUTED_TOKENS: n, costfit.OUTPUT_TOKENS: 1}
        fetched = {costfit.FETCHED_TOKENS: n, costfit.OUTPUT_TOKENS: 1 + n // 64}
        costfit.observe(rep.costs.decode_leg, costfit.DECODE_LEG, alone, 0.02 + 0.0012 * n, n)
        seconds = 0.03 + 0.0001 * n + 0.01 * (1 + n // 64)
        costfit.observe(rep.costs.decode_leg, costfit.DECODE_LEG, fetched, seconds, n)
    rep.placements = wire.Placements(1, 2, 3, 4, 5, 6)
    return rep


def empty_report(ns: str, server: str, pod: str, role: str) -> wire.Report:
    """A sidecar's first report: nothing measured, so every optional figure is unknown."""
    return wire.Report(
        version=1,
        server=server,
        namespace=ns,
        pod=pod,
        role=role,
        started_at=NOW - 5,
        generated_at=NOW,
    )


class Spy:
    """The operator's Kube with its status writes recorded."""

    def __init__(self, kube: Kube) -> None:
        self.kube = kube
        self.patches: list[tuple[str, str, dict[str, Any]]] = []

    def get(self, *args: Any) -> Any:
        return self.kube.get(*args)

    def patch_status(self, api_version: str, kind: str, ns: str, name: str, body: Any) -> None:
        self.patches.append((kind, name, body))
        self.kube.patch_status(api_version, kind, ns, name, body)


def server_status(
    server: api.Server, last_apply: ownership.ApplyOutcome | None = None
) -> dict[str, Any]:
    """What the reconcile writes for a settled server (conditions of every kind; with
    ``last_apply`` landed, observedGeneration and renderHash too)."""
    roles = {
        r: status.RoleObserved(
            exists=True,
            observed_generation=1,
            generation=1,
            replicas=1,
            ready_replicas=1,
            updated_replicas=1,
            current_revision="a",
            update_revision="a",
        )
        for r in api.ROLES
    }
    observed = status.Observed(roles=roles, transport="RDMA", last_apply=last_apply)
    new, _ = status.compute_status(server, observed, {}, api.iso_time(NOW))
    return new


@pytest.mark.parametrize("report", [full_report, empty_report], ids=["measured", "unmeasured"])
def test_every_status_field_the_operator_writes_reads_back_unchanged(
    kubectl: Kubectl, operator: Operator, kube: Kube, ns: str, report: Any
):
    # The tier's operator would write this server's status concurrently: stop it; this
    # test runs the operator's own code in-process instead.
    operator.stop()
    try:
        # owners with every pod a client: OwnerBoundary (False) is written too.
        spec = {"cacheTuning": {"mode": "Auto"}, "owners": {"header": "X-Authenticated-User"}}
        kubectl.apply(make(ns, spec=spec), "--server-side")
        body = kube.get(api.API_VERSION, api.SERVER_KIND, ns, "tiny")
        server = api.parse_server(body)
        ours = settings.from_env()

        # 1. The reconcile: children (the KVCacheStatus gets its NoReports status) and
        #    the server's status.
        claims = ownership.Claims()
        assert handlers.apply_children(body, kube, ours, LOG, claims=claims)
        kvcs = kube.get(api.API_VERSION, api.STATUS_KIND, ns, "tiny")
        assert (
            differences(
                {k: v for k, v in aggregate.NO_REPORTS_STATUS.items()},
                {k: v for k, v in kvcs["status"].items() if k != "lastUpdateTime"},
            )
            == []
        )
        written = server_status(server, claims.last_apply((ns, "tiny")))
        assert {"observedGeneration", "renderHash"} <= set(written)
        assert api.COND_OWNER_BOUNDARY in {c["type"] for c in written["conditions"]}
        kube.patch_status(api.API_VERSION, api.SERVER_KIND, ns, "tiny", written)
        back = kube.get(api.API_VERSION, api.SERVER_KIND, ns, "tiny")["status"]
        assert differences(written, back) == []

        # 2. The residency publisher, Auto mode: KVCacheStatus figures and the retention
        #    status (the policy in force, its ceiling and revision), applied live.
        store = ReportStore()
        for role in api.ROLES:
            rep = report(ns, "tiny", f"tiny-{role}-0", role)
            store.put(reports.Received(report=rep, received_at=NOW - 1))
        spy = Spy(kube)
        pub = publisher.Publisher(
            spy,  # type: ignore[arg-type]
            store,
            stale_after=90,
            min_write_seconds=0,
            emit=lambda *a: None,
            clock=lambda: NOW,
        )
        pub.publish(ns, "tiny")
        assert spy.patches, "the publisher wrote nothing"
        for kind, name, patch in spy.patches:
            back = kube.get(api.API_VERSION, kind, ns, name)["status"]
            # Top-level nulls are deliberate: they delete figures no longer shown.
            written = {k: v for k, v in patch.items() if v is not None}
            if kind == api.STATUS_KIND:
                written.pop("lastUpdateTime")
                back.pop("lastUpdateTime")
            else:
                back = {k: back[k] for k in written if k in back}
            assert_same(written, back, kind)

        # 3. Nothing changed in the world, so the next passes must write nothing. (The
        #    pass after an Auto decision may record that it is in force.)
        pub.publish(ns, "tiny")
        spy.patches.clear()
        pub.publish(ns, "tiny")
        assert spy.patches == [], "a pass without any change wrote status again"
        if report is full_report:
            retention = kube.get(api.API_VERSION, api.SERVER_KIND, ns, "tiny")["status"][
                "retention"
            ]
            assert "restarts" not in retention  # applied live: no restart
            assert (retention["ceiling"], len(retention["policyRevision"])) == (1800, 16)
            assert retention["autoDecision"] == "already in force"
            threshold = kube.get(api.API_VERSION, api.SERVER_KIND, ns, "tiny")["status"][
                "recomputeThreshold"
            ]
            assert threshold["applied"] == threshold["recommended"] == 0  # a pull costs < 0
            shown = kube.get(api.API_VERSION, api.STATUS_KIND, ns, "tiny")["status"]
            assert shown["costs"]["pullFixedSeconds"] < 0
            assert shown["placement"]["decodeAlone"] == {"byCosts": 4, "byColdRule": 5, "byRule": 6}
            assert shown["policy"]["prefillPlacement"] == "Measured"
    finally:
        operator.start()


# ------------------------------------------------------------------ the restart cap

# Traffic patterns whose recommendations differ by far more than 20 %: gaps with a p95
# in (20, 30] s, (90, 120] s and (240, 300] s.
SHORT_GAPS = [25.0] * 50
MEDIUM_GAPS = [100.0] * 50
LONG_GAPS = [280.0] * 50


def gap_report(ns: str, pod: str, gaps: list[float]) -> bytes:
    rep = wire.Report(
        version=1,
        server="tiny",
        namespace=ns,
        pod=pod,
        role="decode",
        started_at=time.time() - 60,
        generated_at=time.time(),
        transport="TCPFallback",
    )
    for gap in gaps:
        rep.gaps.observe(gap)
    return wire.encode(rep)


def expected_recommendation(gaps: list[float]) -> int:
    from kvferry_operator import tune

    hist = wire.Histogram.empty(wire.GAP_BOUNDS)
    for gap in gaps:
        hist.observe(gap)
    inputs = tune.TuningInputs(
        gaps=hist, current_retention=480, coverage=0.95, min_retention=30, max_retention=1800
    )
    return tune.recommend_retention(inputs).value
