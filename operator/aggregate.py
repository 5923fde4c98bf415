"""Residency reports -> KVCacheStatus status and tuner inputs. Pure.

Each sidecar's report is cumulative since it started; the latest one per pod
is kept. One pod's report can never stop the others' figures: each report must
aggregate on its own before it joins the rest, and one that cannot is left out,
named in its pod row and in the message (``report.decode`` refuses such reports at
the endpoint; this is the second line).

Reports older than the staleness bound are shown per pod (marked
stale) but not added into the server's figures, so a dead pod does not freeze
the numbers. The status answers four questions:

1. reuse: how much of each prompt is reused, by turn index;
2. transfer: the transport the sidecars see (and why), GB/s measured from the
   engines' NIXL bytes and seconds, pull latency, break-even prefix;
3. retention: how long decode holds KV vs the gaps between turns, and what
   happened to handles (consumed, expired, misaligned, evicted);
4. ttft: time to first token p50/p95/p99 with reuse vs without.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

import msgspec

from kvferry_wire.protocol import ROLE_DECODE
from kvferry_wire.report import (
    GAP_BOUNDS,
    LATENCY_BOUNDS,
    TRANSPORT_NONE,
    TRANSPORT_UNKNOWN,
    Evictions,
    Histogram,
    Orphans,
    Releases,
    Report,
    TurnBucket,
    merge_histograms,
)

from . import costs, tune
from .api import MODE_OBSERVE, Server, iso_time
from .reports import Received, is_stale

# The KVCacheStatus before any sidecar has reported: the reconcile writes it when it
# creates the object, aggregate() when the reports it had are gone.
NO_REPORTS_PHASE = "NoReports"
NO_REPORTS_MESSAGE = "no residency reports yet: figures appear once the sidecars report"
NO_REPORTS_STATUS: dict[str, Any] = {
    "phase": NO_REPORTS_PHASE,
    "message": NO_REPORTS_MESSAGE,
    "summary": {
        "hitRate": "-",
        "reusedTokenShare": "-",
        "gapP95": "-",
        "retention": "-",
        "recommendedRetention": "-",
        "ttftP95": "-",
        "transport": TRANSPORT_UNKNOWN,
    },
}

DEFAULT_STALE_SECONDS = 90.0

# KVCacheStatus phase while some pod's report is fresh.
PHASE_REPORTING = "Reporting"


def _q(h: Histogram, q: float) -> float | None:
    value, _ = h.quantile(q)
    return None if math.isnan(value) else round(value, 3)


def quantiles(h: Histogram) -> dict[str, Any]:
    return {"count": h.total, "p50": _q(h, 0.50), "p95": _q(h, 0.95), "p99": _q(h, 0.99)}


def _pct(num: float, den: float) -> str:
    return f"{100 * num / den:.0f}%" if den else "-"


def _secs(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}s" if value >= 10 else f"{value:.2f}s"


def majority_transport(reports: list[Report]) -> str:
    known = Counter(r.transport for r in reports if r.transport != TRANSPORT_UNKNOWN)
    return known.most_common(1)[0][0] if known else TRANSPORT_UNKNOWN


# Failed NIXL transfers, with not one done, before a server is said to have no
# transport: one failure may be a peer that restarted mid-read.
FAILED_TRANSFERS_FOR_NO_TRANSPORT = 3


def measured_transport(
    transport: str, reason: str, failed: int, pulls: int, transfers: int
) -> tuple[str, str]:
    """What the sidecars see, unless what was measured says otherwise: when the
    engines' KV transfers keep failing and none ever succeeded, no transport works,
    whatever sysfs and UCX_TLS suggest (e.g. the RDMA shared device plugin's mode,
    where every pod sees the node's HCAs).

    ``failed`` is the engines' own count of failed NIXL transfers
    (``vllm:nixl_num_failed_transfers``), not the sidecars' ``pull-failed`` turns:
    those also count a P that timed out or went away, which says nothing of the
    transport. Without the engines' metrics nothing is measured and the sidecars'
    verdict stands."""
    if failed < FAILED_TRANSFERS_FOR_NO_TRANSPORT or pulls or transfers:
        return transport, reason
    seen = f"{transport} ({reason})" if reason else transport
    return (
        TRANSPORT_NONE,
        f"{failed} KV transfers between the pods failed and none succeeded "
        f"(the engines' NIXL counters); the sidecars see {seen}",
    )


def transport_reason(reports: list[Report], transport: str) -> str:
    """The evidence of the first pod (by name) that reports ``transport``."""
    for rep in sorted(reports, key=lambda r: r.pod):
        if rep.transport == transport and rep.transport_reason:
            return f"{rep.pod}: {rep.transport_reason}"
    return ""


def gigabytes_per_second(nbytes: float, seconds: float) -> float | None:
    return round(nbytes / seconds / 1e9, 3) if nbytes > 0 and seconds > 0 else None


def _gbps(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}GB/s"


def _bytes(value: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= size:
            return f"{value / size:.1f}{unit}"
    return f"{value:.0f}B"


def window_fields(rep: Report) -> dict[str, Any]:
    """A pod row's role, preemption counter and its sidecar's start: what a new
    leader's ``pressure.seed`` reads (an absurd start is left out, not fatal)."""
    try:
        started: str | None = iso_time(rep.started_at)
    except (OverflowError, OSError, ValueError):
        started = None
    return {"role": rep.role, "startedAt": started, "preemptions": rep.engine.preemptions}


@dataclass(frozen=True)
class Aggregate:
    status: dict[str, Any]  # KVCacheStatus .status (without lastUpdateTime)
    tuning: tune.TuningInputs | None  # None when no fresh report
    transport: str
    transport_reason: str = ""


def aggregate(
    server: Server,
    received: list[Received],
    now: float,
    applied_retention: int,
    stale_after: float = DEFAULT_STALE_SECONDS,
    preemptions_delta: int = 0,
    decode_kv_usage_peak: float | None = None,
) -> Aggregate:
    """The server's figures from the pods' latest reports, each pod isolated."""
    usable: list[Received] = []
    left_out: dict[str, str] = {}
    for item in received:
        try:
            alone = _aggregate(
                server,
                [item],
                now,
                applied_retention,
                stale_after,
                preemptions_delta,
                decode_kv_usage_peak,
            )
            # What the API server would refuse (NaN, infinities) fails the write of all.
            json.dumps(alone.status, allow_nan=False)
        except Exception as exc:  # whatever it is, it is this pod's alone
            left_out[item.report.pod] = f"{type(exc).__name__}: {exc}"[:300]
        else:
            usable.append(item)
    agg = _aggregate(
        server,
        usable,
        now,
        applied_retention,
        stale_after,
        preemptions_delta,
        decode_kv_usage_peak,
    )
    if not left_out:
        return agg
    reps = {item.report.pod: item.report for item in received}
    rows = agg.status["pods"] + [
        # The pressure window saw this report too: its counter and start, for a new leader.
        {"name": pod, "stale": False, "excluded": why, **window_fields(reps[pod])}
        for pod, why in left_out.items()
    ]
    names = ", ".join(sorted(left_out))
    status = {
        **agg.status,
        "message": f"{agg.status['message']}; left out (report unusable): {names}",
        "pods": sorted(rows, key=lambda row: row["name"]),
    }
    return Aggregate(
        status=status,
        tuning=agg.tuning,
        transport=agg.transport,
        transport_reason=agg.transport_reason,
    )


def _aggregate(
    server: Server,
    received: list[Received],
    now: float,
    applied_retention: int,
    stale_after: float = DEFAULT_STALE_SECONDS,
    preemptions_delta: int = 0,
    decode_kv_usage_peak: float | None = None,
) -> Aggregate:
    """``preemptions_delta`` and ``decode_kv_usage_peak``: decode pressure of the
    recent past, which only the caller can know (``pressure``: reports are
    cumulative or instantaneous). Without a peak the tuner sees the latest usage."""
    spec = server.spec
    fresh = [r.report for r in received if not is_stale(r, now, stale_after)]
    pods = [
        {
            "name": r.report.pod,
            "role": r.report.role,
            "stale": is_stale(r, now, stale_after),
            "lastReport": iso_time(r.received_at),
            "ageSeconds": round(now - r.received_at, 1),
            "sessionsHeld": r.report.kv_events.sessions_held,
            "pinnedHandles": r.report.pinned.handles,
            "unusedPinnedHandles": r.report.pinned.unused_handles,
            "orphanedPinnedHandles": r.report.pinned.orphaned_handles,
            "pinnedBlocks": r.report.pinned.blocks,
            "pinnedBytes": r.report.pinned.bytes,
            "oldestPinnedSeconds": round(r.report.pinned.oldest_age_seconds, 1),
            "kvUsage": r.report.engine.kv_usage,
            **window_fields(r.report),
            "transport": r.report.transport,
            "gigabytesPerSecond": gigabytes_per_second(
                r.report.transfer.bytes, r.report.transfer.seconds
            ),
        }
        for r in sorted(received, key=lambda r: r.report.pod)
    ]
    if not received:
        phase, message = NO_REPORTS_PHASE, NO_REPORTS_MESSAGE
    elif not fresh:
        phase = "Stale"
        message = f"every report is older than {stale_after:.0f}s: sidecars are not reporting"
    else:
        phase, message = PHASE_REPORTING, f"{len(fresh)} of {len(received)} pods reporting"

    # 1. reuse by turn index
    buckets: dict[str, TurnBucket] = {}
    for rep in fresh:
        for key, b in rep.by_turn.items():
            acc = buckets.setdefault(key, TurnBucket())
            acc.turns += b.turns
            acc.reused_turns += b.reused_turns
            acc.prompt_tokens += b.prompt_tokens
            acc.reused_tokens += b.reused_tokens
    by_turn = [
        {
            "turn": key if key != "8" else "8+",
            "turns": b.turns,
            "reusedTurns": b.reused_turns,
            "promptTokens": b.prompt_tokens,
            "reusedTokens": b.reused_tokens,
            "reusedShare": _pct(b.reused_tokens, b.prompt_tokens),
        }
        for key, b in sorted(buckets.items(), key=lambda kv: int(kv[0]))
    ]
    later = [b for key, b in buckets.items() if key != "1"]
    later_turns = sum(b.turns for b in later)
    later_reused = sum(b.reused_turns for b in later)
    later_prompt = sum(b.prompt_tokens for b in later)
    later_reused_tokens = sum(b.reused_tokens for b in later)
    outcomes: Counter[str] = Counter()
    handles: Counter[str] = Counter()
    for rep in fresh:
        outcomes.update(rep.outcomes)
        handles.update(rep.handles)

    # 2. transfer
    pull_bytes = sum(r.transfer.bytes for r in fresh)
    pull_seconds = sum(r.transfer.seconds for r in fresh)
    transfers = sum(r.transfer.transfers for r in fresh)
    pulls = sum(r.transfer.pulls for r in fresh)
    pull_latency = merge_histograms([r.transfer.pull_latency for r in fresh], LATENCY_BOUNDS)
    recompute_tokens = sum(r.transfer.recompute_tokens for r in fresh)
    recompute_seconds = sum(r.transfer.recompute_seconds for r in fresh)
    bpt = [r.transfer.bytes_per_token for r in fresh if r.transfer.bytes_per_token]
    bytes_per_token = max(bpt) if bpt else None
    gbps = gigabytes_per_second(pull_bytes, pull_seconds)
    seen = majority_transport(fresh)
    transport, reason = measured_transport(
        seen,
        transport_reason(fresh, seen),
        failed=sum(r.engine.nixl_failed for r in fresh),
        pulls=pulls,
        transfers=transfers,
    )

    prefill_leg, decode_leg = costs.merged(fresh)

    # 3. retention vs gaps
    gaps = merge_histograms([r.gaps for r in fresh], GAP_BOUNDS)
    usage = [
        r.engine.kv_usage for r in fresh if r.role == ROLE_DECODE and r.engine.kv_usage is not None
    ]
    tuning = None
    if fresh:
        tuning = tune.TuningInputs(
            gaps=gaps,
            current_retention=applied_retention,
            coverage=spec.cache_tuning.coverage,
            min_retention=spec.cache_tuning.min_retention_seconds,
            max_retention=spec.cache_tuning.max_retention_seconds,
            decode_kv_usage_max=(
                decode_kv_usage_peak
                if decode_kv_usage_peak is not None
                else (max(usage) if usage else None)
            ),
            preemptions_delta=preemptions_delta,
            current_threshold=server.recompute_threshold,
            max_model_len=spec.model.max_model_len or tune.DEFAULT_MAX_MODEL_LEN,
            prefill_leg=prefill_leg,
        )

    # 4. ttft
    ttft_reused = merge_histograms([r.ttft_reused for r in fresh], LATENCY_BOUNDS)
    ttft_recomputed = merge_histograms([r.ttft_recomputed for r in fresh], LATENCY_BOUNDS)
    r95, c95 = _q(ttft_reused, 0.95), _q(ttft_recomputed, 0.95)

    gap_q = quantiles(gaps)
    fates = sum(handles.values())
    pinned_handles = sum(r.pinned.handles for r in fresh)
    pinned_bytes = sum(r.pinned.bytes for r in fresh)
    status: dict[str, Any] = {
        "phase": phase,
        "message": message,
        "summary": {
            "hitRate": _pct(later_reused, later_turns),
            "reusedTokenShare": _pct(later_reused_tokens, later_prompt),
            "gapP95": _secs(gap_q["p95"]),
            "retention": f"{applied_retention}s",
            "recommendedRetention": "-",
            "ttftP95": f"{_secs(r95)}/{_secs(c95)}",
            "transport": transport if gbps is None else f"{transport}@{_gbps(gbps)}",
            "bandwidth": _gbps(gbps),
            "expiredShare": _pct(handles.get("expired", 0), fates),
            "pinnedKV": f"{pinned_handles}/{_bytes(pinned_bytes)}" if fresh else "-",
        },
        "reuse": {
            "turnsAfterFirst": later_turns,
            "reusedTurnsAfterFirst": later_reused,
            "hitRate": _pct(later_reused, later_turns),
            "reusedTokenShare": _pct(later_reused_tokens, later_prompt),
            "byTurn": by_turn,
            "outcomes": dict(sorted(outcomes.items())),
            # What reuse saved, by the server's own measured costs (since the pods
            # started): the reused tokens at the recompute cost P's prefills measured,
            # less the engines' NIXL time. The sidecars' eviction ranks handles by
            # ratios of these costs, so it needs no constant; this is the figure in
            # seconds for the people running it.
            "recomputeSecondsPerToken": (
                round(recompute_seconds / recompute_tokens, 7) if recompute_tokens else None
            ),
            "estimatedPrefillSecondsSaved": (
                # Negative when the pulls took longer than recomputing would have.
                round(later_reused_tokens * recompute_seconds / recompute_tokens - pull_seconds, 3)
                if recompute_tokens
                else None
            ),
        },
        "transfer": {
            "transport": transport,
            "transportReason": reason,
            "pulls": pulls,
            "bytes": pull_bytes,
            "seconds": round(pull_seconds, 3),
            "transfers": transfers,
            "meanTransferSeconds": round(pull_seconds / transfers, 4) if transfers else None,
            "gigabytesPerSecond": gbps,
            "pullLatencySeconds": quantiles(pull_latency),
            "bytesPerToken": bytes_per_token,
        },
        "retention": {
            "appliedSeconds": applied_retention,
            "gapSeconds": gap_q,
            "handles": dict(sorted(handles.items())),
            "expiredShare": _pct(handles.get("expired", 0), fates),
            "pinnedHandles": pinned_handles,
            "pinnedBytes": pinned_bytes,
            # Of those, pinned although no turn will read them (release pending or
            # impossible), and how handles dropped unread were let go.
            "unusedPinnedHandles": sum(r.pinned.unused_handles for r in fresh),
            "unusedPinnedBlocks": sum(r.pinned.unused_blocks for r in fresh),
            # Of those, what a decode sidecar's earlier process held (its pin journal),
            # and what the sidecars found and released after a restart (cumulative).
            "orphanedPinnedHandles": sum(r.pinned.orphaned_handles for r in fresh),
            "orphanedPinnedBlocks": sum(r.pinned.orphaned_blocks for r in fresh),
            # Of the unused, what no release can free: pinned to D's deadline, the
            # ceiling (what a higher maxRetentionSeconds makes costlier).
            "unreleasablePinnedHandles": sum(r.pinned.unreleasable_handles for r in fresh),
            "orphans": {
                field.encode_name: sum(getattr(r.orphans, field.name) for r in fresh)
                for field in msgspec.structs.fields(Orphans)
            },
            "releases": {
                name: sum(getattr(r.releases, name) for r in fresh)
                for name in Releases.__struct_fields__
            },
            # Handles a cap evicted, by the cap: the store's own (handleStoreCap is too
            # small for the sessions) or one owner's (spec.owners: that owner keeps
            # more than its share).
            "evictions": {
                field.encode_name: sum(getattr(r.evictions, field.name) for r in fresh)
                for field in msgspec.structs.fields(Evictions)
            },
            "decodeKVUsageMax": max(usage) if usage else None,
            "decodePreemptionsRecent": preemptions_delta,
        },
        # What each leg costs (the decode sidecars' fits) and where turns prefilled.
        "costs": costs.status(prefill_leg, decode_leg),
        "placement": costs.placement_status(fresh),
        "ttft": {
            "withReuseSeconds": quantiles(ttft_reused),
            "withoutReuseSeconds": quantiles(ttft_recomputed),
        },
        "pods": pods,
    }
    return Aggregate(status=status, tuning=tuning, transport=transport, transport_reason=reason)


def with_recommendations(
    status: dict[str, Any],
    mode: str,
    retention: tune.Recommendation | None,
    threshold: tune.Recommendation | None,
) -> dict[str, Any]:
    """Add the tuner's recommendations; Observe shows figures only."""
    if mode == MODE_OBSERVE or retention is None:
        return status
    out = {**status, "summary": {**status["summary"]}}
    out["summary"]["recommendedRetention"] = f"{retention.value}s"
    out["retention"] = {
        **status["retention"],
        "recommendedSeconds": retention.value,
        "reason": retention.reason,
        "inputs": retention.inputs,
    }
    if threshold is not None:
        out["transfer"] = {
            **status["transfer"],
            "breakEvenTokens": threshold.value,
            "recommendedRecomputeThreshold": threshold.value,
            "reason": threshold.reason,
        }
    return out
