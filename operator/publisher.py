"""Fold received reports into KVCacheStatus and the server's retention status.

Runs on a timer inside the operator. Per server with reports:
  0. prune pod rows that can no longer report: stale and the pod gone or
     replaced, or silent longer than ``prune_after`` (status lists no ghosts);
  1. aggregate the pods' latest reports (pure, ``aggregate.aggregate``; one
     pod's unusable report is left out, never stops the others), with the
     decode preemptions and KV usage peak of the last minutes
     (``pressure.PreemptionWindow``, ``pressure.UsagePeak``: the state kept
     between aggregations). They are written to KVCacheStatus with the figures
     (``status.pressure``, the pod rows' counters) and, on this process's first
     pass for a server, seeded from it (``pressure.seed``): a new leader or a
     restarted operator carries on with the window rather than an empty one;
  2. run the tuner (pure, ``tune``) unless the mode is Observe;
  3. write KVCacheStatus status when a figure changed, at most once per
     ``min_write_seconds`` (``lastUpdateTime`` alone never triggers a write);
     an unknown figure is left out rather than written as null (a merge patch
     deletes a null's key: it would read back as a change on every pass);
  4. write the server's ``status.retention`` when the recommendation changed,
     with an Event (reason and inputs) in Recommend and Auto modes; Auto also
     applies it (``tune.plan_live_apply``) live: it changes the server's policy and
     no child object, so nothing restarts; likewise ``status.recomputeThreshold``,
     the measured break-even (``tune.recommend_threshold``), which Auto applies live
     when it moved far enough (``tune.plan_threshold_apply``, an Event each time);
     and the server's ``status.transport`` /
     ``transportReason`` (the KVTransport condition is computed from them by the
     status handler);
  5. keep the server's live policy (``policy.build_policy``, after Auto's decision)
     for the report endpoint, which answers each of the server's sidecars with it
     (``policy``): a policy reaches the sidecars within a publish interval plus a
     report interval of the change.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from kvferry_wire import policy as wire_policy
from kvferry_wire.report import Report

from . import aggregate, api, policy, pressure, reports, tune
from .kube import Kube
from .metrics import Decision

EVENT_RECOMMENDED = "RetentionRecommended"
EVENT_APPLIED = "RetentionApplied"
EVENT_CEILING_HELD = "CeilingHeld"
EVENT_CEILING_RAISED = "CeilingRaised"
EVENT_THRESHOLD_APPLIED = "RecomputeThresholdApplied"


def without_nulls(value: Any) -> Any:
    """``value`` with every null-valued key dropped, at any depth."""
    if isinstance(value, dict):
        return {k: without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [without_nulls(v) for v in value]
    return value


def retention_status(
    old: dict[str, Any], server: api.Server, rec: tune.Recommendation | None, mode: str
) -> dict[str, Any]:
    """``status.retention``: the policy in force (``applied``, its ``policyRevision``,
    the ``ceiling`` over it) and the tuner's recommendation."""
    out = {
        **old,
        "applied": server.decode_retention_seconds,
        "ceiling": policy.retention_ceiling(server),
        "policyRevision": policy.build_policy(server).revision(),
    }
    if rec is not None and mode != api.MODE_OBSERVE:
        out["recommended"] = rec.value
        out["reason"] = rec.reason
    return out


class Publisher:
    def __init__(
        self,
        kube: Kube,
        store: reports.ReportStore,
        stale_after: float,
        min_write_seconds: float,
        emit: Callable[[dict[str, Any], str, str, str], None],
        clock: Callable[[], float] = time.time,
        prune_after: float = 600.0,
        reapply: Callable[[str, str], None] | None = None,
    ) -> None:
        self.kube = kube
        # Asks for a whole apply of a server (handlers: an apply retry), after a lift.
        self.reapply = reapply
        self.store = store
        self.stale_after = stale_after
        self.min_write_seconds = min_write_seconds
        self.emit = emit
        self.clock = clock
        self.prune_after = prune_after
        self._last_write: dict[tuple[str, str], float] = {}
        self._preemptions: dict[tuple[str, str], pressure.PreemptionWindow] = {}
        self._usage: dict[tuple[str, str], pressure.UsagePeak] = {}
        # The last pass per server, for the operator's /metrics.
        self.decisions: dict[tuple[str, str], Decision] = {}
        # (transport, evidence) as last aggregated, for the status handlers.
        self._transports: dict[tuple[str, str], tuple[str, str]] = {}
        # Each server's live policy as of its last pass, encoded for the report answer.
        self._policies: dict[tuple[str, str], dict[str, Any]] = {}

    def publish_all(self, logger: logging.Logger) -> None:
        for namespace, name in self.store.servers():
            try:
                self.publish(namespace, name)
            except Exception as exc:  # one server's trouble must not stop the others
                logger.warning("publishing residency of %s/%s failed: %s", namespace, name, exc)

    def transport(self, key: tuple[str, str]) -> tuple[str, str] | None:
        """The server's (transport, evidence) as last aggregated; None before its
        first pass (then status keeps what it has). A dict read: atomic enough for
        the handler threads."""
        return self._transports.get(key)

    def policy(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The server's live policy as the report answer carries it; None before its
        first pass (the sidecars keep what they have). A dict read, as ``transport``."""
        return self._policies.get((namespace, name))

    def _fresh_decode(self, key: tuple[str, str]) -> list[Report]:
        """The server's decode reports within ``stale_after``, one per pod."""
        now = self.clock()
        return [
            r.report
            for r in self.store.get(*key)
            if r.report.role == api.ROLE_DECODE and not reports.is_stale(r, now, self.stale_after)
        ]

    def unreleasable_everywhere(self, key: tuple[str, str], decode_pods: int) -> int | None:
        """The pinned handles no release can free, summed over fresh reports of at
        least ``decode_pods`` decode pods; None with fewer (a pod not heard from may
        hold some): what lifting a hold needs."""
        fresh = self._fresh_decode(key)
        pods = {r.pod for r in fresh}
        total = sum(r.pinned.unreleasable_handles for r in fresh)
        return total if pods and len(pods) >= decode_pods else None

    def unreleasable(self, key: tuple[str, str]) -> int | None:
        """The pinned handles the server's fresh decode reports say no release can free
        (the ceiling gate's figure, ``policy.ceiling_hold``). With none fresh here (a
        leader that just took over has no report yet), what the last writer of its
        KVCacheStatus counted, while that was written within ``stale_after``; None
        when neither is known. A read of whole rows, as ``transport``."""
        fresh = self._fresh_decode(key)
        if fresh:
            return sum(r.pinned.unreleasable_handles for r in fresh)
        now = self.clock()
        shown = (self.kube.get(api.API_VERSION, api.STATUS_KIND, *key) or {}).get("status") or {}
        written = api.parse_time(shown.get("lastUpdateTime"))
        count = (shown.get("retention") or {}).get("unreleasablePinnedHandles")
        if (
            written is None
            or now - written > self.stale_after
            or shown.get("phase") != aggregate.PHASE_REPORTING
            or not isinstance(count, int)
        ):
            return None
        return count

    def publish(self, namespace: str, name: str) -> None:
        obj = self.kube.get(api.API_VERSION, api.SERVER_KIND, namespace, name)
        if obj is None:
            self.store.forget(namespace, name)
            self._preemptions.pop((namespace, name), None)
            self._usage.pop((namespace, name), None)
            self.decisions.pop((namespace, name), None)
            self._transports.pop((namespace, name), None)
            self._policies.pop((namespace, name), None)
            return
        server = api.parse_server(obj)
        now = self.clock()
        self.prune(namespace, name, now)
        mode = server.spec.cache_tuning.mode
        # The retention in force (Auto's applied value, else the spec's, under the
        # ceiling): one function.
        applied = server.decode_retention_seconds
        received = self.store.get(namespace, name)
        fresh = [r.report for r in received if not reports.is_stale(r, now, self.stale_after)]
        key = (namespace, name)
        current = self.kube.get(api.API_VERSION, api.STATUS_KIND, namespace, name)
        if key not in self._preemptions:
            # This process's first pass for the server: the windows start where the
            # last writer of its status (a previous leader, this operator before a
            # restart) left them, not empty.
            seeded = pressure.seed((current or {}).get("status") or {})
            self._preemptions[key], self._usage[key] = seeded
        preemptions, usage = self._preemptions[key], self._usage[key]
        agg = aggregate.aggregate(
            server,
            received,
            now,
            applied,
            self.stale_after,
            preemptions_delta=preemptions.observe(fresh, now),
            decode_kv_usage_peak=usage.observe(fresh, now),
        )
        self._transports[key] = (agg.transport, agg.transport_reason)
        lifted = server.ceiling_held is not None and policy.hold_lifts(
            server.spec.cache_tuning.max_retention_seconds,
            server.ceiling_held,
            self.unreleasable_everywhere(key, server.replicas(api.ROLE_DECODE)),
        )
        if lifted:
            # No pin the longer ceiling would keep: the raise goes in. Its status write
            # (below) and the re-apply asked for after it roll decode.
            server = dataclasses.replace(server, ceiling_held=None)
        rec = tune.recommend_retention(agg.tuning) if agg.tuning else None
        threshold = tune.recommend_threshold(agg.tuning) if agg.tuning else None
        # Auto's decisions first: both statuses and the sidecars' answer show its policy.
        decision = auto_decision(server, rec)
        if decision is not None and decision.apply and rec is not None:
            # In force from this pass on: no child changes, nothing restarts.
            server = dataclasses.replace(server, applied_retention=rec.value)
        threshold_decision = (
            tune.plan_threshold_apply(mode, threshold, server.recompute_threshold)
            if threshold is not None and mode == api.MODE_AUTO
            else None
        )
        threshold_was = server.recompute_threshold
        if threshold_decision is not None and threshold is not None and threshold_decision.apply:
            server = dataclasses.replace(server, applied_threshold=threshold.value)
        status = without_nulls(
            {
                **aggregate.with_recommendations(agg.status, mode, rec, threshold),
                "pressure": pressure.status(preemptions, usage),
                "policy": policy_status(server),
            }
        )
        if server.decode_retention_seconds != applied:
            # Auto applied a new one this pass: the figures show it in force (the
            # tuner's inputs keep the one it worked from).
            status["summary"]["retention"] = f"{server.decode_retention_seconds}s"
            status["retention"]["appliedSeconds"] = server.decode_retention_seconds
        shown = mode != api.MODE_OBSERVE
        self.decisions[(namespace, name)] = Decision(
            namespace=namespace,
            server=name,
            applied_retention=server.decode_retention_seconds,
            recommended_retention=rec.value if rec and shown else None,
            recommended_threshold=threshold.value if threshold and shown else None,
            preemptions_recent=agg.tuning.preemptions_delta if agg.tuning else 0,
            transport=agg.transport,
            reporting_pods=len(fresh),
            threshold_in_force=server.recompute_threshold,
        )

        old = {
            k: v for k, v in ((current or {}).get("status") or {}).items() if k != "lastUpdateTime"
        }
        if (
            current is not None
            and old != status
            and (now - self._last_write.get(key, 0.0) >= self.min_write_seconds)
        ):
            self.kube.patch_status(
                api.API_VERSION,
                api.STATUS_KIND,
                namespace,
                name,
                {**_nulls_for_removed(old, status), "lastUpdateTime": api.iso_time(now)},
            )
            self._last_write[key] = now

        self._publish_retention(
            obj, server, rec, decision, agg, lifted, threshold, threshold_decision
        )
        if threshold_decision is not None and threshold_decision.apply and threshold is not None:
            self.emit(
                obj,
                "Normal",
                EVENT_THRESHOLD_APPLIED,
                f"applied recomputeThreshold {threshold.value} live (was {threshold_was}; no "
                f"restart): {threshold.reason}",
            )
        if lifted:
            if self.reapply is not None:
                # A new leader has no whole apply of its own to compare the lifted
                # hold with (handlers.server_changed): ask for one.
                self.reapply(namespace, name)
            self.emit(
                obj,
                "Normal",
                EVENT_CEILING_RAISED,
                policy.lift_message(server.spec.cache_tuning.max_retention_seconds),
            )
        self._policies[key] = wire_policy.encode(policy.build_policy(server))

    def prune(self, namespace: str, name: str, now: float) -> None:
        """Drop rows of pods that are gone, replaced, or silent past ``prune_after``.
        Only stale rows cost a lookup, so a healthy server costs none."""
        gone = []
        for item in self.store.get(namespace, name):
            age = now - item.received_at
            if age <= self.stale_after:
                continue
            if age > self.prune_after:
                gone.append(item.report.pod)
                continue
            pod = self.kube.get_pod(namespace, item.report.pod)
            uid = ((pod or {}).get("metadata") or {}).get("uid")
            if pod is None or (item.pod_uid and uid != item.pod_uid):
                gone.append(item.report.pod)
        if gone:
            self.store.prune(namespace, name, gone)

    def _publish_retention(
        self,
        obj: dict[str, Any],
        server: api.Server,
        rec: tune.Recommendation | None,
        decision: tune.ApplyDecision | None,
        agg: aggregate.Aggregate,
        lifted: bool = False,
        threshold: tune.Recommendation | None = None,
        threshold_decision: tune.ApplyDecision | None = None,
    ) -> None:
        """Write ``status.retention`` (``server`` is the server with Auto's decision
        in force) and the transport. ``ceilingHeld`` is the apply's (handlers.gate_ceiling):
        never sent from what this pass read, only nulled when ``lifted``, so a pass
        that read a hold the apply has cleared since cannot bring it back."""
        mode = server.spec.cache_tuning.mode
        st = obj.get("status") or {}
        old = {k: v for k, v in (st.get("retention") or {}).items() if k != "ceilingHeld"}
        applying = decision is not None and decision.apply
        new = without_nulls(retention_status(old, server, rec, mode))
        if decision is not None:
            new["autoDecision"] = decision.reason
        old_threshold = st.get("recomputeThreshold") or {}
        new_threshold = threshold_status(server, threshold, threshold_decision, mode)
        transport_changed = (st.get("transport"), st.get("transportReason") or "") != (
            agg.transport,
            agg.transport_reason,
        )
        if new == old and new_threshold == old_threshold and not transport_changed and not lifted:
            return
        patch: dict[str, Any] = {
            # A merge patch keeps what it does not name: a lifted hold is nulled.
            "retention": {**new, **({"ceilingHeld": None} if lifted else {})},
            "recomputeThreshold": {
                **{k: None for k in old_threshold if k not in new_threshold},
                **new_threshold,
            }
            or None,
            "transport": agg.transport,
            "transportReason": agg.transport_reason or None,
        }
        self.kube.patch_status(
            api.API_VERSION, api.SERVER_KIND, server.namespace, server.name, patch
        )
        if rec is not None and mode != api.MODE_OBSERVE and old.get("recommended") != rec.value:
            self.emit(obj, "Normal", EVENT_RECOMMENDED, recommendation_message(rec))
        if applying:
            self.emit(
                obj,
                "Normal",
                EVENT_APPLIED,
                f"applied decodeRetentionSeconds {new['applied']}s live (policy "
                f"{new['policyRevision']}, no restart): the sidecars hold handles for it "
                "from their next report",
            )


def threshold_status(
    server: api.Server,
    rec: tune.Recommendation | None,
    decision: tune.ApplyDecision | None,
    mode: str,
) -> dict[str, Any]:
    """The server's ``status.recomputeThreshold``: Auto's applied value (none outside
    Auto: the spec's is in force), the measured recommendation and why (not in
    Observe), Auto's decision."""
    out: dict[str, Any] = {}
    if server.applied_threshold is not None:
        out["applied"] = server.applied_threshold
    if rec is not None and mode != api.MODE_OBSERVE:
        out["recommended"] = rec.value
        out["reason"] = rec.reason
    if decision is not None:
        out["autoDecision"] = decision.reason
    return out


def auto_decision(server: api.Server, rec: tune.Recommendation | None) -> tune.ApplyDecision | None:
    """Auto's decision on a recommendation (None: not Auto, or nothing recommended)."""
    if server.spec.cache_tuning.mode != api.MODE_AUTO or rec is None:
        return None
    return tune.plan_live_apply(
        api.MODE_AUTO, rec.value, server.decode_retention_seconds, policy.retention_ceiling(server)
    )


def policy_status(server: api.Server) -> dict[str, Any]:
    """KVCacheStatus ``status.policy``: the live policy the sidecars are told, and the
    ceiling over its retention."""
    told = policy.build_policy(server)
    return {
        "revision": told.revision(),
        "retentionSeconds": server.decode_retention_seconds,
        "recomputeThreshold": told.recompute_threshold,
        "skipPrefillBelowTokens": told.skip_prefill_below_tokens,
        "prefillPlacement": told.prefill_placement,
        "ceilingSeconds": policy.retention_ceiling(server),
        "reason": policy.reason(server),
    }


def recommendation_message(rec: tune.Recommendation) -> str:
    """What `kubectl describe dserver` shows: the value, why, and every input."""
    inputs = ", ".join(f"{k}={v}" for k, v in rec.inputs.items() if v is not None)
    return f"decodeRetentionSeconds {rec.value}s recommended: {rec.reason} (inputs: {inputs})"


def _nulls_for_removed(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """A merge patch keeps keys it does not mention, at every depth: null out the ones
    now gone (``status.pressure.preemptions`` once the window's rises expire, a
    figure that became unknown). Lists are replaced whole."""
    out: dict[str, Any] = {k: None for k in old if k not in new}
    for key, value in new.items():
        before = old.get(key)
        both = isinstance(before, dict) and isinstance(value, dict)
        out[key] = _nulls_for_removed(before, value) if both else value
    return out


async def publish_forever(publisher: Publisher, interval: float, logger: logging.Logger) -> None:
    while True:
        await asyncio.sleep(interval)
        await asyncio.to_thread(publisher.publish_all, logger)
