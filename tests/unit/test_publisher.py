"""The residency publisher's status writes, against an in-memory store of objects.

What the API server does to them (pruning, merge-patch nulls) is checked for real in
tests/cluster/test_status_fields.py; here: the shape the publisher writes, Auto's live decisions
(applied, no restart, no re-render) and the policy it keeps for the report endpoint.
"""

from __future__ import annotations

import copy
from typing import Any

from kvferry_operator import api, publisher, reports, tune
from kvferry_wire import policy as wire_policy
from kvferry_wire import report as wire
from tests.manifests import server
from tests.unit.test_tune import prefill_fit

NOW = 1_800_000_000.0
DAY = tune.DAY_SECONDS


class MemoryKube:
    """get/patch_status over dicts, with a JSON merge patch's null = delete."""

    def __init__(self, *objs: dict[str, Any]) -> None:
        self.objs = {(o["kind"], o["metadata"]["name"]): copy.deepcopy(o) for o in objs}
        self.patches: list[tuple[str, dict[str, Any]]] = []

    def get(self, api_version: str, kind: str, ns: str, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.objs.get((kind, name)))

    def get_pod(self, ns: str, name: str) -> dict[str, Any] | None:
        return {"metadata": {"name": name, "uid": ""}}  # every reporting pod still runs

    def patch_status(self, api_version: str, kind: str, ns: str, name: str, body: Any) -> None:
        self.patches.append((kind, copy.deepcopy(body)))
        obj = self.objs[(kind, name)]
        obj["status"] = merge_patch(obj.get("status") or {}, body)


def merge_patch(target: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def auto_server(restarts: list[str] | None = None, applied: int = 480) -> dict[str, Any]:
    obj = server({"cacheTuning": {"mode": "Auto", "maxRestartsPerDay": 2}})
    obj["status"] = {
        "conditions": [{"type": "Ready", "status": "True"}],
        "prefill": {"updatedReplicas": 1},
        "decode": {"updatedReplicas": 1},
        "retention": {"applied": applied, **({"restarts": restarts} if restarts else {})},
    }
    return obj


def kvcs() -> dict[str, Any]:
    return {"kind": api.STATUS_KIND, "metadata": {"name": "tiny"}, "status": {}}


def decode_report(gaps: list[float], started_at: float, generated_at: float, **fields: Any):
    """tiny-decode-0's report with these gaps between turns."""
    rep = wire.Report(
        version=1,
        server="tiny",
        namespace="default",
        pod="tiny-decode-0",
        role="decode",
        started_at=started_at,
        generated_at=generated_at,
        **fields,
    )
    for gap in gaps:
        rep.gaps.observe(gap)
    return rep


def store_with(gaps: list[float]) -> Any:
    rep = decode_report(gaps, NOW - 600, NOW)

    class Store:
        def servers(self) -> list[tuple[str, str]]:
            return [("default", "tiny")]

        def get(self, ns: str, name: str) -> list[reports.Received]:
            return [reports.Received(rep, NOW - 1)]

        def forget(self, ns: str, name: str) -> None:
            pass

    return Store()


def publish(kube: MemoryKube, gaps: list[float]) -> list[tuple]:
    """One pass; the Events it posted."""
    return publish_with(kube, gaps)[1]


def publish_with(kube: MemoryKube, gaps: list[float]) -> tuple[publisher.Publisher, list[tuple]]:
    events: list[tuple] = []
    pub = publisher.Publisher(
        kube,  # type: ignore[arg-type]
        store_with(gaps),
        stale_after=90,
        min_write_seconds=0,
        emit=lambda *a: events.append(a),
        clock=lambda: NOW,
    )
    pub.publish("default", "tiny")
    return pub, events


def test_unknown_figures_are_left_out_not_written_as_null():
    # A merge patch deletes a null's key: the figure would read back as a change.
    kube = MemoryKube(auto_server(), kvcs())
    publish(kube, gaps=[])  # no measurements at all
    assert kube.patches
    for kind, body in kube.patches:
        # Nulls only delete figures no longer shown (none on a first write).
        assert null_paths({k: v for k, v in body.items() if v is not None}) == [], kind


def null_paths(value: Any, path: str = "status") -> list[str]:
    if value is None:
        return [path]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in null_paths(v, f"{path}.{k}")]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in null_paths(v, f"{path}[{i}]")]
    return []


def test_a_figure_gone_at_any_depth_is_deleted_by_the_merge_patch():
    """A merge patch keeps what it does not mention: the rises of an expired window
    (status.pressure.preemptions) must go while its usage peaks stay."""
    old = {
        "pressure": {"preemptions": [{"time": "t", "count": 2}], "kvUsage": [{"kvUsage": 0.9}]},
        "retention": {"appliedSeconds": 480, "gapSeconds": 30},
        "phase": "Reporting",
    }
    new = {"pressure": {"kvUsage": [{"kvUsage": 0.8}]}, "retention": {"appliedSeconds": 480}}
    patch = publisher._nulls_for_removed(old, new)
    assert merge_patch(old, patch) == new
    assert patch["pressure"]["preemptions"] is None and patch["phase"] is None


def test_without_nulls_drops_null_keys_at_any_depth():
    value = {"a": None, "b": {"c": None, "d": 1}, "e": [{"f": None, "g": 2}]}
    assert publisher.without_nulls(value) == {"b": {"d": 1}, "e": [{"g": 2}]}


def test_auto_applies_live_and_logs_no_restart():
    # The retention is the sidecars' live policy: Auto's decision restarts nothing, so
    # it is applied at once and the restart log stays empty.
    kube = MemoryKube(auto_server(), kvcs())
    pub, events = publish_with(kube, gaps=[25.0] * 50)
    retention = kube.objs[("DisaggregatedServer", "tiny")]["status"]["retention"]
    assert retention["applied"] < 480
    assert "restarts" not in retention
    assert retention["autoDecision"] == f"applied {retention['applied']}s live (was 480s)"
    applied = [e for e in events if e[2] == publisher.EVENT_APPLIED]
    assert len(applied) == 1 and "live" in applied[0][3] and "no restart" in applied[0][3]
    # The policy the sidecars are told is the applied one, named as status names it.
    told = pub.policy("default", "tiny")
    assert told is not None
    assert told[wire_policy.K_RETENTION] == retention["applied"]
    assert told[wire_policy.K_REVISION] == retention["policyRevision"]
    # KVCacheStatus shows the same policy in force, in the same pass.
    shown = kube.objs[(api.STATUS_KIND, "tiny")]["status"]
    assert shown["policy"] == {
        "revision": retention["policyRevision"],
        "retentionSeconds": retention["applied"],
        "recomputeThreshold": 64,
        "skipPrefillBelowTokens": 256,
        "prefillPlacement": "Measured",
        "ceilingSeconds": 1800,
        "reason": f"retention {retention['applied']}s: applied by cacheTuning Auto from the "
        "tuner's recommendation; ceiling 1800s: spec.cacheTuning.maxRetentionSeconds; "
        "recomputeThreshold 64: spec.kvTransfer.recomputeThreshold; prefill placement: "
        "spec.routing.prefillPlacement Measured",
    }
    assert shown["summary"]["retention"] == f"{retention['applied']}s"
    assert shown["retention"]["inputs"]["current"] == 480  # what the tuner worked from


def test_auto_applies_past_the_old_restart_budget():
    # maxRestartsPerDay counted restarts; a live change costs none, so a spent budget
    # (two restarts logged by an earlier operator) no longer holds a decision back.
    two = [api.iso_time(NOW - 3600), api.iso_time(NOW - 60)]
    kube = MemoryKube(auto_server(restarts=two), kvcs())
    publish(kube, gaps=[25.0] * 50)
    retention = kube.objs[("DisaggregatedServer", "tiny")]["status"]["retention"]
    assert retention["applied"] < 480
    assert retention["restarts"] == two  # kept as history, never added to


def test_status_shows_the_ceiling_over_the_policy_in_force():
    obj = server({"kvTransfer": {"decodeRetentionSeconds": 7200}})
    kube = MemoryKube(obj, kvcs())
    pub, _ = publish_with(kube, gaps=[25.0] * 50)
    retention = kube.objs[("DisaggregatedServer", "tiny")]["status"]["retention"]
    # The spec asks past the ceiling: the sidecars hold for the ceiling, and say so.
    assert (retention["applied"], retention["ceiling"]) == (1800, 1800)
    assert pub.policy("default", "tiny")[wire_policy.K_RETENTION] == 1800


def test_no_policy_before_a_servers_first_pass_and_none_after_it_is_gone():
    kube = MemoryKube(auto_server(), kvcs())
    pub = publisher.Publisher(
        kube,  # type: ignore[arg-type]
        store_with([25.0] * 50),
        stale_after=90,
        min_write_seconds=0,
        emit=lambda *a: None,
        clock=lambda: NOW,
    )
    assert pub.policy("default", "tiny") is None
    pub.publish("default", "tiny")
    assert pub.policy("default", "tiny") is not None
    del kube.objs[(api.SERVER_KIND, "tiny")]
    pub.publish("default", "tiny")
    assert pub.policy("default", "tiny") is None


def test_an_unchanged_world_writes_nothing_the_second_time():
    kube = MemoryKube(auto_server(applied=45), kvcs())
    publish(kube, gaps=[25.0] * 50)
    kube.patches.clear()
    publish(kube, gaps=[25.0] * 50)
    assert kube.patches == []


def test_recommend_mode_ignores_a_leftover_auto_applied_retention():
    # Left Auto for Recommend: the policy is the spec's 480 s (api.parse_server),
    # so KVCacheStatus and the tuner must see 480 too, not the stale 120.
    obj = auto_server(applied=120)
    obj["spec"]["cacheTuning"]["mode"] = "Recommend"
    kube = MemoryKube(obj, kvcs())
    pub, events = publish_with(kube, [25.0] * 50)
    assert api.parse_server(obj).decode_retention_seconds == 480
    # The status now says 480 (what the sidecars hold for), but nothing was applied:
    # no RetentionApplied Event, and the policy told is the spec's.
    assert [e[2] for e in events] == [publisher.EVENT_RECOMMENDED]
    assert pub.policy("default", "tiny")[wire_policy.K_RETENTION] == 480
    server_status = kube.objs[(api.SERVER_KIND, "tiny")]["status"]["retention"]
    assert server_status["applied"] == 480
    shown = kube.objs[(api.STATUS_KIND, "tiny")]["status"]
    assert shown["summary"]["retention"] == "480s"
    assert shown["retention"]["appliedSeconds"] == 480
    assert shown["retention"]["inputs"]["current"] == 480
    assert pub.decisions[("default", "tiny")].applied_retention == 480


# ------------------------------------------------------------------ a new leader


class MutableStore:
    """The report store of one decode pod, whose latest report a test replaces."""

    def __init__(self) -> None:
        self.report: wire.Report | None = None

    def servers(self) -> list[tuple[str, str]]:
        return [("default", "tiny")]

    def get(self, ns: str, name: str) -> list[reports.Received]:
        return [reports.Received(self.report, self.report.generated_at)] if self.report else []

    def prune(self, ns: str, name: str, pods: list[str]) -> None:
        raise AssertionError("nothing here is stale")


def decode(preemptions: int, kv_usage: float, at: float) -> wire.Report:
    return decode_report(
        [25.0] * 50,
        NOW - 1200,  # the sidecar started 20 minutes before
        at,
        engine=wire.Engine(preemptions=preemptions, kv_usage=kv_usage),
    )


def operator_process(kube: MemoryKube, store: MutableStore, clock: list[float]) -> Any:
    return publisher.Publisher(
        kube,  # type: ignore[arg-type]
        store,  # type: ignore[arg-type]
        stale_after=90,
        min_write_seconds=0,
        emit=lambda *a: None,
        clock=lambda: clock[0],
    )


def test_a_new_leader_carries_on_with_the_pressure_window_from_status():
    obj = server({"cacheTuning": {"mode": "Recommend"}})
    kube, store, clock = MemoryKube(obj, kvcs()), MutableStore(), [NOW]
    first = operator_process(kube, store, clock)
    store.report = decode(4, 0.95, NOW)
    first.publish("default", "tiny")
    clock[0], store.report = NOW + 10, decode(6, 0.40, NOW + 10)
    first.publish("default", "tiny")
    shown = kube.objs[(api.STATUS_KIND, "tiny")]["status"]
    assert shown["retention"]["decodePreemptionsRecent"] == 2
    assert shown["pods"][0]["startedAt"] == api.iso_time(NOW - 1200)

    # The leader goes; the next one starts with empty memory and the same pod reports
    # the same counter again.
    clock[0], store.report = NOW + 30, decode(6, 0.40, NOW + 30)
    second = operator_process(kube, store, clock)
    second.publish("default", "tiny")
    shown = kube.objs[(api.STATUS_KIND, "tiny")]["status"]
    assert shown["retention"]["decodePreemptionsRecent"] == 2
    inputs = shown["retention"]["inputs"]
    assert (inputs["preemptionsDelta"], inputs["decodeKVUsageMax"]) == (2, 0.95)
    assert "under KV pressure" in shown["retention"]["reason"]
    assert second.decisions[("default", "tiny")].preemptions_recent == 2
    # One more rise after the takeover counts once, on top of the two.
    clock[0], store.report = NOW + 40, decode(7, 0.40, NOW + 40)
    second.publish("default", "tiny")
    assert (
        kube.objs[(api.STATUS_KIND, "tiny")]["status"]["retention"]["decodePreemptionsRecent"] == 3
    )


# ------------------------------------------------------------------ the ceiling gate


def held_server(unreleasable: int) -> tuple[MemoryKube, MutableStore, list[tuple]]:
    """A raise to 3600 s held at 600 s; tiny-decode-0 reports ``unreleasable`` pins."""
    obj = server({"cacheTuning": {"maxRetentionSeconds": 3600}})
    obj["status"] = {"retention": {"applied": 480, "ceiling": 600, "ceilingHeld": 600}}
    kube, store = MemoryKube(obj, kvcs()), MutableStore()
    store.report = decode_report(
        [25.0] * 50,
        NOW - 600,
        NOW,
        pinned=wire.Pinned(handles=3, unused_handles=2, unreleasable_handles=unreleasable),
    )
    return kube, store, []


def test_a_held_ceiling_stays_while_a_decode_pod_reports_unreleasable_pins():
    kube, store, events = held_server(unreleasable=2)
    pub = operator_process(kube, store, [NOW])
    pub.emit = lambda *a: events.append(a)
    assert pub.unreleasable(("default", "tiny")) == 2
    pub.publish("default", "tiny")
    retention = kube.objs[(api.SERVER_KIND, "tiny")]["status"]["retention"]
    assert (retention["ceiling"], retention["ceilingHeld"]) == (600, 600)
    shown = kube.objs[(api.STATUS_KIND, "tiny")]["status"]["policy"]
    assert shown["ceilingSeconds"] == 600
    assert shown["reason"] == (
        "retention 480s: spec.kvTransfer.decodeRetentionSeconds; ceiling 600s: held below "
        "maxRetentionSeconds 3600s while the decode sidecars report unreleasable pinned handles"
        "; recomputeThreshold 64: spec.kvTransfer.recomputeThreshold; prefill placement: "
        "spec.routing.prefillPlacement Measured"
    )
    assert publisher.EVENT_CEILING_RAISED not in [e[2] for e in events]


def test_the_publisher_lifts_a_held_ceiling_once_no_pin_is_unreleasable():
    kube, store, events = held_server(unreleasable=0)
    pub = operator_process(kube, store, [NOW])
    pub.emit = lambda *a: events.append(a)
    asked: list[tuple[str, str]] = []
    pub.reapply = lambda ns, name: asked.append((ns, name))
    pub.publish("default", "tiny")
    # A whole apply is asked for: a new leader has none of its own to compare with.
    assert asked == [("default", "tiny")]
    retention = kube.objs[(api.SERVER_KIND, "tiny")]["status"]["retention"]
    # The merge patch nulled the hold (what re-applies decode with the new ceiling).
    assert "ceilingHeld" not in retention and retention["ceiling"] == 3600
    patched = [b for kind, b in kube.patches if kind == api.SERVER_KIND]
    assert patched and patched[-1]["retention"]["ceilingHeld"] is None
    assert kube.objs[(api.STATUS_KIND, "tiny")]["status"]["policy"]["ceilingSeconds"] == 3600
    raised = [e for e in events if e[2] == publisher.EVENT_CEILING_RAISED]
    assert len(raised) == 1 and "3600s in force" in raised[0][3]
    # The next pass has nothing more to say.
    kube.patches.clear()
    pub.publish("default", "tiny")
    assert [k for k, _ in kube.patches if k == api.SERVER_KIND] == []


def test_the_gate_has_no_figure_without_a_fresh_decode_report():
    kube, store, _ = held_server(unreleasable=2)
    pub = operator_process(kube, store, [NOW + 91])  # the report is past stale_after
    assert pub.unreleasable(("default", "tiny")) is None
    assert store.report is not None
    store.report.role, store.report.generated_at = "prefill", NOW + 91
    assert pub.unreleasable(("default", "tiny")) is None


def test_a_leader_with_no_report_yet_goes_by_the_kvcachestatus_its_predecessor_wrote():
    kube, _, _ = held_server(unreleasable=0)
    status = kube.objs[(api.STATUS_KIND, "tiny")]["status"]
    status["retention"] = {"unreleasablePinnedHandles": 2}
    status["phase"] = "Reporting"
    empty = MutableStore()  # this process has heard no report
    status["lastUpdateTime"] = api.iso_time(NOW - 30)
    assert operator_process(kube, empty, [NOW]).unreleasable(("default", "tiny")) == 2
    # Written longer ago than a report stays fresh: not known.
    status["lastUpdateTime"] = api.iso_time(NOW - 91)
    assert operator_process(kube, empty, [NOW]).unreleasable(("default", "tiny")) is None
    # A status that summed no fresh report says 0 for want of any: not a zero.
    status["lastUpdateTime"], status["phase"] = api.iso_time(NOW - 30), "Stale"
    assert operator_process(kube, empty, [NOW]).unreleasable(("default", "tiny")) is None


def test_a_hold_stands_while_a_decode_pod_is_not_heard_from():
    kube, store, events = held_server(unreleasable=0)
    obj = kube.objs[(api.SERVER_KIND, "tiny")]
    obj["spec"]["decode"] = {**obj["spec"].get("decode", {}), "replicas": 2}
    pub = operator_process(kube, store, [NOW])
    pub.emit = lambda *a: events.append(a)
    pub.publish("default", "tiny")  # one of two decode pods reported 0: not enough
    retention = kube.objs[(api.SERVER_KIND, "tiny")]["status"]["retention"]
    assert retention["ceilingHeld"] == 600
    # Its only report gone stale: unknown, and a hold stands on unknown.
    obj["spec"]["decode"]["replicas"] = 1
    stale = operator_process(kube, store, [NOW + 91])
    stale.emit = lambda *a: events.append(a)
    stale.publish("default", "tiny")
    assert kube.objs[(api.SERVER_KIND, "tiny")]["status"]["retention"]["ceilingHeld"] == 600
    assert publisher.EVENT_CEILING_RAISED not in [e[2] for e in events]


def test_the_publisher_never_writes_a_hold_it_read():
    # The apply owns ceilingHeld: a pass that read one the apply has cleared since must
    # not send it back (a merge patch would revive it).
    kube, store, _ = held_server(unreleasable=2)
    pub = operator_process(kube, store, [NOW])
    pub.publish("default", "tiny")
    sent = [b["retention"] for kind, b in kube.patches if kind == api.SERVER_KIND]
    assert sent and all("ceilingHeld" not in r for r in sent)


# ------------------------------------------------------------------ the measured threshold


def measured_store(per_pulled: float = 0.0005, per_computed: float = 0.0013) -> Any:
    """tiny-decode-0's report with prefill legs timed at these costs (17 ms a pull)."""
    rep = decode_report([], NOW - 600, NOW)
    rep.costs.prefill_leg = prefill_fit(0.017, per_pulled, per_computed)

    class Store:
        def servers(self) -> list[tuple[str, str]]:
            return [("default", "tiny")]

        def get(self, ns: str, name: str) -> list[reports.Received]:
            return [reports.Received(rep, NOW - 1)]

        def forget(self, ns: str, name: str) -> None:
            pass

    return Store()


def publish_measured(kube: MemoryKube, store: Any) -> tuple[publisher.Publisher, list[tuple]]:
    events: list[tuple] = []
    pub = publisher.Publisher(
        kube,  # type: ignore[arg-type]
        store,
        stale_after=90,
        min_write_seconds=0,
        emit=lambda *a: events.append(a),
        clock=lambda: NOW,
    )
    pub.publish("default", "tiny")
    return pub, events


def test_auto_applies_the_measured_break_even_live_and_tells_the_sidecars():
    kube = MemoryKube(auto_server(), kvcs())
    pub, events = publish_measured(kube, measured_store())
    shown = kube.objs[(api.SERVER_KIND, "tiny")]["status"]["recomputeThreshold"]
    assert (shown["applied"], shown["recommended"]) == (22, 22)
    assert shown["autoDecision"] == "applied 22 live (was 64)"
    assert shown["reason"].endswith("pulls win from 22 tokens")
    told = pub.policy("default", "tiny")
    assert told is not None and told[wire_policy.K_THRESHOLD] == 22
    applied = [e for e in events if e[2] == publisher.EVENT_THRESHOLD_APPLIED]
    assert len(applied) == 1 and "recomputeThreshold 22 live (was 64; no restart)" in applied[0][3]
    policy_shown = kube.objs[(api.STATUS_KIND, "tiny")]["status"]["policy"]
    assert policy_shown["recomputeThreshold"] == 22
    assert "recomputeThreshold 22: applied by cacheTuning Auto" in policy_shown["reason"]
    costs = kube.objs[(api.STATUS_KIND, "tiny")]["status"]["costs"]
    assert (costs["prefillLegs"], costs["pullLegs"]) == (54, 27)
    assert abs(costs["pullFixedSeconds"] - 0.017) < 1e-6
    # A second pass with the same legs: in force already, nothing posted again.
    _, again = publish_measured(kube, measured_store())
    assert publisher.EVENT_THRESHOLD_APPLIED not in [e[2] for e in again]


def test_recommend_shows_the_measured_break_even_and_applies_nothing():
    obj = server({"cacheTuning": {"mode": "Recommend"}})
    kube = MemoryKube(obj, kvcs())
    pub, events = publish_measured(kube, measured_store())
    shown = kube.objs[(api.SERVER_KIND, "tiny")]["status"]["recomputeThreshold"]
    assert shown == {"recommended": 22, "reason": shown["reason"]}
    told = pub.policy("default", "tiny")
    assert told is not None and told[wire_policy.K_THRESHOLD] == 64
    assert publisher.EVENT_THRESHOLD_APPLIED not in [e[2] for e in events]


def test_leaving_auto_returns_the_sidecars_to_the_spec_threshold():
    obj = auto_server()
    obj["status"]["recomputeThreshold"] = {"applied": 22, "recommended": 22}
    obj["spec"]["cacheTuning"]["mode"] = "Recommend"
    kube = MemoryKube(obj, kvcs())
    pub, _ = publish_measured(kube, measured_store())
    told = pub.policy("default", "tiny")
    assert told is not None and told[wire_policy.K_THRESHOLD] == 64
    assert "applied" not in kube.objs[(api.SERVER_KIND, "tiny")]["status"]["recomputeThreshold"]
