"""Aggregating residency reports into KVCacheStatus figures."""

from __future__ import annotations

import json

import pytest

from kvferry_operator import aggregate, api, reports, tune
from kvferry_wire import report as wire
from tests.manifests import server

SERVER = api.parse_server({**server(), "metadata": {"name": "tiny", "namespace": "ns"}})
NOW = 1000.0


def rep(pod: str, role: str = "decode", gaps: list[float] = (), **kw) -> wire.Report:
    r = wire.Report(
        version=wire.REPORT_VERSION,
        server="tiny",
        namespace="ns",
        pod=pod,
        role=role,
        started_at=0.0,
        generated_at=NOW,
        **kw,
    )
    for g in gaps:
        r.gaps.observe(g)
    return r


def turns(**buckets: tuple[int, int, int, int]) -> dict[str, wire.TurnBucket]:
    return {k.lstrip("t"): wire.TurnBucket(*v) for k, v in buckets.items()}


def test_no_reports_says_so():
    agg = aggregate.aggregate(SERVER, [], NOW, 480)
    assert agg.status["phase"] == "NoReports"
    assert agg.status["summary"]["hitRate"] == "-"
    assert agg.tuning is None


def test_hit_rate_and_reused_share_count_turns_after_the_first():
    a = rep("tiny-decode-0", by_turn=turns(t1=(10, 0, 1000, 0), t2=(10, 8, 2000, 1600)))
    b = rep("tiny-decode-1", by_turn=turns(t2=(10, 10, 2000, 1900), t3=(5, 5, 1500, 1400)))
    agg = aggregate.aggregate(
        SERVER, [reports.Received(a, NOW), reports.Received(b, NOW)], NOW, 480
    )
    # turns >= 2: 25 turns, 23 reused; tokens 5500, reused 4900.
    assert agg.status["summary"]["hitRate"] == "92%"
    assert agg.status["summary"]["reusedTokenShare"] == "89%"
    assert [row["turn"] for row in agg.status["reuse"]["byTurn"]] == ["1", "2", "3"]
    assert agg.status["reuse"]["byTurn"][1]["reusedShare"] == "88%"


def test_stale_reports_are_shown_but_not_counted():
    old = rep("tiny-decode-0", by_turn=turns(t2=(10, 0, 1000, 0)))
    new = rep("tiny-decode-1", by_turn=turns(t2=(10, 10, 1000, 1000)))
    agg = aggregate.aggregate(
        SERVER,
        [reports.Received(old, NOW - 500), reports.Received(new, NOW - 1)],
        NOW,
        480,
        stale_after=90,
    )
    assert agg.status["summary"]["hitRate"] == "100%"
    rows = {p["name"]: p["stale"] for p in agg.status["pods"]}
    assert rows == {"tiny-decode-0": True, "tiny-decode-1": False}


def test_all_stale_is_phase_stale():
    agg = aggregate.aggregate(SERVER, [reports.Received(rep("tiny-decode-0"), 0.0)], NOW, 480)
    assert agg.status["phase"] == "Stale"


def test_gap_quantiles_merge_across_pods():
    a = rep("tiny-decode-0", gaps=[40.0] * 50)
    b = rep("tiny-decode-1", gaps=[40.0] * 50)
    agg = aggregate.aggregate(
        SERVER, [reports.Received(a, NOW), reports.Received(b, NOW)], NOW, 480
    )
    assert agg.status["retention"]["gapSeconds"]["count"] == 100
    assert 30 <= agg.status["retention"]["gapSeconds"]["p95"] <= 45
    assert agg.tuning.gaps.total == 100


def test_transport_is_the_majority_of_known_reports():
    reps = [
        rep("a", transport="RDMA"),
        rep("b", transport="RDMA"),
        rep("c", transport="TCPFallback"),
        rep("d"),
    ]
    agg = aggregate.aggregate(SERVER, [reports.Received(r, NOW) for r in reps], NOW, 480)
    assert agg.transport == "RDMA"


def test_pulls_that_all_fail_say_no_transport_whatever_the_sidecars_see():
    """RDMA's shared device plugin mode shows every pod the node's HCAs: the sidecars
    say RDMA while every NIXL transfer fails. What the engines measured wins."""
    broken = rep(
        "tiny-decode-0",
        transport="RDMA",
        transport_reason="RDMA device(s) mlx5_0 active",
        outcomes={"pull-failed": 2},
        engine=wire.Engine(nixl_failed=3),
    )
    agg = aggregate.aggregate(SERVER, [reports.Received(broken, NOW)], NOW, 480)
    assert agg.transport == "NoTransport"
    assert "3 KV transfers between the pods failed and none succeeded" in agg.transport_reason
    assert "RDMA (tiny-decode-0: RDMA device(s) mlx5_0 active)" in agg.transport_reason
    assert agg.status["transfer"]["transport"] == "NoTransport"


def test_failed_pulls_beside_one_that_worked_leave_the_transport_as_seen():
    for worked in ({"pulls": 1}, {"transfers": 1}):
        r = rep(
            "tiny-decode-0",
            transport="RDMA",
            engine=wire.Engine(nixl_failed=5),
            transfer=wire.Transfer(**worked),
        )
        agg = aggregate.aggregate(SERVER, [reports.Received(r, NOW)], NOW, 480)
        assert agg.transport == "RDMA", worked
    few = rep("tiny-decode-0", transport="TCP", engine=wire.Engine(nixl_failed=2))
    agg = aggregate.aggregate(SERVER, [reports.Received(few, NOW)], NOW, 480)
    assert agg.transport == "TCP"


def test_pull_failed_turns_alone_are_not_evidence_against_the_transport():
    """A P that timed out or went away with a handle also ends a turn pull-failed;
    without the engines' own failed-transfer counts nothing was measured."""
    r = rep("tiny-decode-0", transport="TCP", outcomes={"pull-failed": 50})
    agg = aggregate.aggregate(SERVER, [reports.Received(r, NOW)], NOW, 480)
    assert agg.transport == "TCP"


def test_recommendations_are_hidden_in_observe_mode():
    agg = aggregate.aggregate(SERVER, [reports.Received(rep("a", gaps=[40.0] * 50), NOW)], NOW, 480)
    rec = tune.recommend_retention(agg.tuning)
    assert aggregate.with_recommendations(agg.status, "Observe", rec, None) == agg.status
    shown = aggregate.with_recommendations(agg.status, "Recommend", rec, None)
    assert shown["summary"]["recommendedRetention"] == f"{rec.value}s"
    assert shown["retention"]["reason"] == rec.reason


def test_unused_pinned_handles_and_releases_are_summed():
    """Handles pinned for nothing and how unread ones were released reach status."""
    a = rep("a", pinned=wire.Pinned(handles=3, blocks=30, unused_handles=1, unused_blocks=10))
    b = rep("b", pinned=wire.Pinned(handles=1, blocks=5), releases=wire.Releases(rider=2))
    a.releases.request = 4
    agg = aggregate.aggregate(
        SERVER, [reports.Received(a, NOW), reports.Received(b, NOW)], NOW, 480
    )
    retention = agg.status["retention"]
    assert retention["pinnedHandles"] == 4 and retention["unusedPinnedHandles"] == 1
    assert retention["unusedPinnedBlocks"] == 10
    assert retention["releases"] == {"rider": 2, "request": 4, "failed": 0, "unreleasable": 0}
    assert [p["unusedPinnedHandles"] for p in agg.status["pods"]] == [1, 0]


def test_orphaned_handles_are_summed():
    """What a restarted decode sidecar found of its predecessor's, released or not."""
    a = rep("a", pinned=wire.Pinned(handles=2, unused_handles=2, orphaned_handles=1))
    a.pinned.orphaned_blocks = 7
    a.pinned.unreleasable_handles = 1
    a.orphans = wire.Orphans(found=3, found_blocks=21, released=2, void=1)
    b = rep("b", pinned=wire.Pinned(orphaned_handles=2, orphaned_blocks=4))
    b.orphans = wire.Orphans(found=2, found_blocks=4)
    agg = aggregate.aggregate(
        SERVER, [reports.Received(a, NOW), reports.Received(b, NOW)], NOW, 480
    )
    retention = agg.status["retention"]
    assert (retention["orphanedPinnedHandles"], retention["orphanedPinnedBlocks"]) == (3, 11)
    assert retention["unreleasablePinnedHandles"] == 1
    assert retention["orphans"] == {"found": 5, "foundBlocks": 25, "released": 2, "void": 1}
    assert [p["orphanedPinnedHandles"] for p in agg.status["pods"]] == [1, 2]


def test_evictions_by_cap_are_summed_over_pods():
    """Handles a cap evicted, by the cap: a store too small and one owner crowding out
    the others call for different fixes."""
    a = rep("a", evictions=wire.Evictions(store_cap=1, owner_handles=2))
    b = rep("b", evictions=wire.Evictions(owner_handles=3, owner_tokens=4))
    agg = aggregate.aggregate(
        SERVER, [reports.Received(a, NOW), reports.Received(b, NOW)], NOW, 480
    )
    assert agg.status["retention"]["evictions"] == {
        "storeCap": 1,
        "ownerHandles": 5,
        "ownerTokens": 4,
        "pressure": 0,
        "preemption": 0,
        "usefulness": 0,
        "retention": 0,
        "lease": 0,
        "admission": 0,
    }


def test_evictions_by_the_retention_policy_are_summed_and_round_trip():
    """The policy's reasons (D's pressure, its preemptions, usefulness, the retention in
    force, D's lease) survive encode/decode and add up over pods like the caps."""
    a = rep("a", evictions=wire.Evictions(pressure=1, usefulness=2, retention=3))
    b = rep("b", evictions=wire.Evictions(preemption=4, usefulness=5, lease=6))
    assert wire.decode(wire.encode(a)).evictions == a.evictions
    agg = aggregate.aggregate(
        SERVER, [reports.Received(a, NOW), reports.Received(b, NOW)], NOW, 480
    )
    ev = agg.status["retention"]["evictions"]
    assert (ev["pressure"], ev["preemption"], ev["usefulness"]) == (1, 4, 7)
    assert (ev["retention"], ev["lease"], ev["storeCap"]) == (3, 6, 0)


def test_a_report_from_a_sidecar_without_evictions_decodes_as_none():
    """An older sidecar's report has no evictions field: no evictions, not refused."""
    raw = wire.encode(rep("a"))
    older = json.loads(raw)
    del older["evictions"]
    assert wire.decode(json.dumps(older).encode()).evictions == wire.Evictions()


def test_a_report_with_only_the_cap_evictions_reads_as_no_policy_evictions():
    """A sidecar from before the retention policy sends the three caps alone."""
    older = json.loads(wire.encode(rep("a")))
    older["evictions"] = {"storeCap": 1, "ownerHandles": 0, "ownerTokens": 2}
    decoded = wire.decode(json.dumps(older).encode()).evictions
    assert decoded == wire.Evictions(store_cap=1, owner_tokens=2)


@pytest.mark.parametrize("field", ["pressure", "usefulness", "lease"])
def test_a_negative_policy_eviction_count_is_refused_naming_the_field(field):
    bad = json.loads(wire.encode(rep("a")))
    bad["evictions"][field] = -1
    with pytest.raises(wire.ReportError, match=f"evictions.{field}"):
        wire.decode(json.dumps(bad).encode())


def test_transport_column_shows_the_measured_bandwidth_and_the_evidence():
    a = rep(
        "tiny-decode-0",
        transport="TCPFallback",
        transport_reason="TCP: no RDMA device in the pod; UCX_TLS=tcp,self",
        transfer=wire.Transfer(bytes=3_000_000_000, seconds=2.0, transfers=40),
    )
    b = rep("tiny-prefill-0", role="prefill", transport="TCPFallback", transport_reason="x")
    agg = aggregate.aggregate(
        SERVER, [reports.Received(a, NOW), reports.Received(b, NOW)], NOW, 480
    )
    assert agg.status["summary"]["transport"] == "TCPFallback@1.50GB/s"
    assert agg.status["summary"]["bandwidth"] == "1.50GB/s"
    t = agg.status["transfer"]
    assert (t["gigabytesPerSecond"], t["transfers"], t["meanTransferSeconds"]) == (1.5, 40, 0.05)
    # The first pod by name that reports the majority transport explains it.
    assert agg.transport_reason == "tiny-decode-0: TCP: no RDMA device in the pod; UCX_TLS=tcp,self"
    assert t["transportReason"] == agg.transport_reason
    rows = {p["name"]: p["gigabytesPerSecond"] for p in agg.status["pods"]}
    assert rows == {"tiny-decode-0": 1.5, "tiny-prefill-0": None}


def test_no_transfer_measured_leaves_the_bandwidth_out():
    agg = aggregate.aggregate(SERVER, [reports.Received(rep("a", transport="TCP"), NOW)], NOW, 480)
    assert (agg.status["summary"]["transport"], agg.status["summary"]["bandwidth"]) == ("TCP", "-")


def test_expired_share_and_pinned_kv_for_kubectl_wide():
    a = rep(
        "tiny-decode-0",
        handles={"consumed": 6, "expired": 3, "superseded": 1},
        pinned=wire.Pinned(handles=2, blocks=10, bytes=5 * 2**20),
    )
    b = rep("tiny-decode-1", handles={"expired": 2}, pinned=wire.Pinned(handles=1, bytes=2**20))
    agg = aggregate.aggregate(
        SERVER, [reports.Received(a, NOW), reports.Received(b, NOW)], NOW, 480
    )
    assert agg.status["summary"]["expiredShare"] == "42%"  # 5 of 12 handles
    assert agg.status["summary"]["pinnedKV"] == "3/6.0MiB"
    assert agg.status["retention"]["expiredShare"] == "42%"


def test_recent_preemptions_reach_the_tuner_and_lower_retention():
    gaps = [40.0] * 50
    calm = aggregate.aggregate(SERVER, [reports.Received(rep("a", gaps=gaps), NOW)], NOW, 480)
    busy = aggregate.aggregate(
        SERVER, [reports.Received(rep("a", gaps=gaps), NOW)], NOW, 480, preemptions_delta=3
    )
    assert busy.tuning.preemptions_delta == 3
    assert busy.status["retention"]["decodePreemptionsRecent"] == 3
    lowered = tune.recommend_retention(busy.tuning)
    assert lowered.value < tune.recommend_retention(calm.tuning).value
    assert "preemptions +3" in lowered.reason


def test_the_savings_estimate_uses_the_servers_own_measured_costs():
    # P recomputed 10,000 tokens in 2.5 s (250 us a token); decode's turns reused 4,900
    # tokens, pulled in 0.2 s of NIXL time: 4,900 x 250 us - 0.2 s = 1.025 s saved.
    p = rep(
        "tiny-prefill-0",
        role="prefill",
        transfer=wire.Transfer(seconds=0.2, recompute_tokens=10_000, recompute_seconds=2.5),
    )
    d = rep("tiny-decode-0", by_turn=turns(t1=(10, 0, 1000, 0), t2=(10, 8, 5500, 4900)))
    agg = aggregate.aggregate(
        SERVER, [reports.Received(p, NOW), reports.Received(d, NOW)], NOW, 480
    )
    reuse = agg.status["reuse"]
    assert reuse["recomputeSecondsPerToken"] == 0.00025
    assert reuse["estimatedPrefillSecondsSaved"] == 1.025
    # Nothing recomputed yet: no cost measured, no estimate (not a zero).
    alone = aggregate.aggregate(SERVER, [reports.Received(d, NOW)], NOW, 480)
    assert alone.status["reuse"]["recomputeSecondsPerToken"] is None
    assert alone.status["reuse"]["estimatedPrefillSecondsSaved"] is None
