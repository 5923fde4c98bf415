"""Prometheus series and the per-turn log line. Request code returns a TurnReport;
this module alone turns it into numbers.

One series per fact, from one of two sources. ``Metrics`` holds the series the
request path counts (turns by outcome and route, TTFT stages, prefill attempts,
forwards, releases, report pushes, readiness); ``report_families`` exports the
residency report's other figures (inter-turn gaps, handle fates, pinned KV, tokens
by turn index, transfers, engine and KV-event state) from its snapshot at scrape
time, so a dashboard, an alert and the operator read the same number. The series
removed to get there, with PromQL rewrites: docs/upgrading.md.

Each app gets its own registry (tests build many apps in one process).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from kvferry_wire import report as rpt
from kvferry_wire.protocol import Outcome, Route

from . import logfmt
from .config import ROLE_DECODE, Settings
from .placement import BY_COLD, BY_COSTS, BY_RULE
from .policy import InForce
from .types import Stage, TurnReport

log = logging.getLogger("kvferry_sidecar.turn")
_log = logging.getLogger(__name__)

# TTFT spans ms (a short tail on D) to minutes (a cold 100k-token prefill).
STAGE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TOKEN_BUCKETS = (0, 64, 256, 1024, 4096, 16384, 65536, 262144)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self._decode = False  # the policy series are a decode pod's (bind_settings)
        # process_cpu_seconds_total, process_resident_memory_bytes, ...: the
        # sidecar's own cost, next to the time it adds to a turn (stage "queue").
        ProcessCollector(registry=r)
        # The live policy in force (policy.LivePolicy), on decode pods.
        self.retention = Gauge(
            "kvferry_retention_seconds",
            "How long this decode sidecar holds a handle for the next turn: the live "
            "policy's retention in force (at most the ceiling).",
            registry=r,
        )
        self.retention_ceiling = Gauge(
            "kvferry_retention_ceiling_seconds",
            "D's decoder_kv_blocks_ttl: the longest any policy may hold a handle "
            "(raising it restarts the decode pods).",
            registry=r,
        )
        self.recompute_threshold = Gauge(
            "kvferry_recompute_threshold_tokens",
            "The live policy's recompute threshold in force: shorter usable prefixes are "
            "not pulled.",
            registry=r,
        )
        self.skip_prefill_below = Gauge(
            "kvferry_skip_prefill_below_tokens",
            "The live policy's skip-prefill bound in force: D prefills alone below it.",
            registry=r,
        )
        self.policy_info = Gauge(
            "kvferry_policy_info",
            "1 for the live policy in force: its revision and source (config: the "
            "settings file's, no operator policy heard yet; operator).",
            ["revision", "source"],
            registry=r,
        )
        self.turns = Counter(
            "kvferry_turns",
            "Turns served, by handle outcome and prefill route.",
            ["outcome", "route"],
            registry=r,
        )
        self.reused_per_turn = Histogram(
            "kvferry_reused_tokens_per_turn",
            "Reused tokens per turn, by outcome.",
            ["outcome"],
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.stage = Histogram(
            "kvferry_ttft_stage_seconds",
            "Time to first token split by stage (see kvferry_sidecar.types.Stage).",
            ["stage", "outcome"],
            buckets=STAGE_BUCKETS,
            registry=r,
        )
        self.handles_not_kept = Counter(
            "kvferry_handles_not_kept",
            "Turns that left no handle for the next, by reason.",
            ["reason"],
            registry=r,
        )
        self.prefill_attempts = Counter(
            "kvferry_prefill_attempts",
            "Prefill requests sent, by result (ok, unavailable, timeout, no-params, "
            "pull-failed, error, abandoned: the client left while P computed).",
            ["result"],
            registry=r,
        )
        self.forwarded = Counter(
            "kvferry_forwarded",
            "Requests forwarded to the session's owner, by result.",
            ["result"],
            registry=r,
        )
        self.engine_ready = Gauge(
            "kvferry_engine_ready", "1 when the local engine answers /health.", registry=r
        )
        self.prefill_ready = Gauge(
            "kvferry_prefill_engines_ready", "Prefill engines answering /health.", registry=r
        )
        self.releases = Counter(
            "kvferry_handle_releases",
            "Handles no turn read, by how D was told to free them: rider (on a turn's own "
            "prefill), request (a release request), failed, unreleasable (pinned until "
            "D's deadline).",
            ["method"],
            registry=r,
        )
        for method in ("rider", "request", "failed", "unreleasable"):
            self.releases.labels(method)
        self.pin_journal_errors = Counter(
            "kvferry_pin_journal_errors",
            "Pin journal reads and writes that failed (the turn went on; a restart may "
            "then leave those handles pinned on D until its deadline).",
            registry=r,
        )
        self.report_pushes = Counter(
            "kvferry_report_pushes",
            "Residency report pushes to the operator, by result (ok, error).",
            ["result"],
            registry=r,
        )
        for result in ("ok", "error"):
            self.report_pushes.labels(result)
        # Counted instead of logged: aiohttp would log a traceback per connection
        # (httplog.py; its reasons are a fixed set, labelled there).
        self.malformed = Counter(
            "kvferry_malformed_requests",
            "HTTP requests refused (400) before routing because they were not HTTP: a bad "
            "request line or method, an invalid or oversized header, ..., by reason.",
            ["reason"],
            registry=r,
        )
        for outcome in Outcome:
            for route in Route:
                self.turns.labels(outcome.value, route.value)
        self.placements = Counter(
            "kvferry_placements",
            "Where turns were chosen to prefill (prefill: the P path; decode: D alone) and "
            "what decided (costs: the measured costs and D's load; cold: the "
            "skip-prefill rule until both costs are measured; rule: prefillPlacement "
            "Threshold). The route a turn took (a fallback) is kvferry_turns_total's.",
            ["placement", "decided_by"],
            registry=r,
        )
        for where in ("prefill", "decode"):
            for by in (BY_COSTS, BY_COLD, BY_RULE):
                self.placements.labels(where, by)

    def bind_settings(self, settings: Settings) -> None:
        self._decode = settings.role == ROLE_DECODE
        if self._decode:
            self.retention_ceiling.set(settings.retention_ceiling)

    def bind_policy(self, in_force: InForce) -> None:
        """The policy in force (at start, then at each change), on decode pods."""
        if not self._decode:
            return
        self.retention.set(in_force.retention_seconds)
        self.recompute_threshold.set(in_force.recompute_threshold)
        self.skip_prefill_below.set(in_force.skip_prefill_below_tokens)
        self.policy_info.clear()
        self.policy_info.labels(in_force.revision, in_force.source).set(1)

    def bind_report(self, snapshot: Callable[[], rpt.Report]) -> None:
        """Serve the residency report's figures as series, read at scrape time."""
        self.registry.register(ReportCollector(snapshot))

    def on_push(self, ok: bool) -> None:
        self.report_pushes.labels("ok" if ok else "error").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def record(self, report: TurnReport) -> None:
        outcome = report.outcome.value
        self.turns.labels(outcome, report.route.value).inc()
        self.reused_per_turn.labels(outcome).observe(report.reused_tokens)
        t = report.timings
        for stage, value in (
            (Stage.QUEUE, t.queue_s),
            (Stage.PREFILL, t.prefill_s),
            (Stage.P_TO_D, t.p_to_d_s),
            (Stage.FIRST_TOKEN, t.first_token_s),
        ):
            if value is not None:
                self.stage.labels(stage.value, outcome).observe(value)
        if not report.handle_kept and report.handle_not_kept_reason:
            self.handles_not_kept.labels(report.handle_not_kept_reason).inc()
        if report.choice is not None:
            where = "decode" if report.choice.alone else "prefill"
            self.placements.labels(where, report.choice.decided_by).inc()
        log_turn(report)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def q(text: str | None) -> str:
    """A free-text value of the turn line: ``logfmt.value``, and "-" for none or empty."""
    return logfmt.value(text or None)


def log_turn(report: TurnReport) -> None:
    t, choice = report.timings, report.choice
    log.info(
        # Free text (the client's id above all) is one field each: logfmt.value.
        "turn request_id=%s client_request_id=%s session=%s owner=%s api=%s stream=%s status=%s "
        "outcome=%s route=%s "
        "prefill_engine=%s attempts=%s prompt_tokens=%s aligned=%s reused=%s gap_s=%s "
        "handle_kept=%s not_kept=%s finish=%s queue_s=%s prefill_s=%s p_to_d_s=%s ttft_s=%s "
        "total_s=%s reanchor_s=%s decode_s=%s placed_by=%s p_path_s=%s alone_s=%s "
        "interference_s=%s decode_holds=%s error=%s",
        report.request_id,
        logfmt.value(report.client_request_id),
        q(report.session),
        q(report.owner),
        report.api.value,
        report.stream,
        report.status,
        report.outcome.value,
        report.route.value,
        q(report.prefill_engine),
        report.prefill_attempts,
        report.prompt_tokens if report.prompt_tokens is not None else "-",
        report.aligned_tokens,
        report.reused_tokens,
        _fmt(report.handle_age_s),
        report.handle_kept,
        q(report.handle_not_kept_reason),
        q(report.finish_reason),
        _fmt(t.queue_s),
        _fmt(t.prefill_s),
        _fmt(t.p_to_d_s),
        _fmt(t.first_token_s),
        _fmt(t.total_s),
        _fmt(t.reanchor_s),
        _fmt(t.decode_s),
        q(choice.decided_by if choice else None),
        _fmt(choice.p_path_s if choice else None),
        _fmt(choice.alone_s if choice else None),
        _fmt(choice.interference_s if choice else None),
        report.decode_holds,
        q(report.error),
    )


# ------------------------------------------------------------------ residency series


def _histogram(
    name: str, doc: str, hists: list[tuple[list[str], rpt.Histogram]], labels: list[str]
) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc, labels=labels)
    for values, hist in hists:
        cumulative, buckets = 0, []
        for bound, count in zip(hist.bounds, hist.counts, strict=False):
            cumulative += count
            buckets.append((repr(float(bound)), cumulative))
        buckets.append(("+Inf", hist.total))
        family.add_metric(values, buckets, hist.sum)
    return family


def _gauge(name: str, doc: str, value: float | None) -> GaugeMetricFamily | None:
    return None if value is None else GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _info(name: str, doc: str, labels: dict[str, str]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name + "_info", doc, labels=list(labels))
    family.add_metric(list(labels.values()), 1.0)
    return family


def _labelled_counter(name: str, doc: str, label: str, values: dict[str, float]):
    family = CounterMetricFamily(name, doc, labels=[label])
    for key, value in sorted(values.items()):
        family.add_metric([key], value)
    return family


def report_families(r: rpt.Report) -> list:
    """The residency report as Prometheus families. Names are stable (dashboards and
    alerts use them); each carries its unit: _seconds, _bytes, _tokens, _ratio."""
    turns = {k: b.turns for k, b in r.by_turn.items()}
    out = [
        _histogram(
            "kvferry_inter_turn_gap_seconds",
            "Time from a session's last finished turn to its next turn's arrival, "
            "whether or not its handle was still held.",
            [([], r.gaps)],
            [],
        ),
        _histogram(
            "kvferry_ttft_seconds",
            "Time to first token by reuse: reused (KV pulled or held by D) or recomputed.",
            [(["reused"], r.ttft_reused), (["recomputed"], r.ttft_recomputed)],
            ["reuse"],
        ),
        _histogram(
            "kvferry_pull_latency_seconds",
            "Prefill leg of turns served with pulled KV (pull + tail compute).",
            [([], r.transfer.pull_latency)],
            [],
        ),
        _labelled_counter(
            "kvferry_handle_fates",
            "Handles by what became of them: a taken handle by its turn's outcome "
            "(consumed, skipped, misaligned, ...), the others by the store's fate "
            "(expired, evicted, superseded, cleared).",
            "fate",
            r.handles,
        ),
        _labelled_counter(
            "kvferry_handle_evictions",
            "Handles let go before a turn read them, by reason: store-cap "
            "(handleStoreCap), owner-handles and owner-tokens (an owner's own caps), "
            "pressure and preemption (D's KV), the lowest value first, which add up to "
            'kvferry_handle_fates_total{fate="evicted"}; usefulness (the retention '
            "policy: no next turn expected), retention (the retention in force) and "
            "lease (D's lease of a turn it prefilled alone), part of the expired fate; "
            "admission (a finished turn's handle worth less than what it would displace, "
            "or larger than the handles' share of D's KV: released at birth, evicted).",
            "reason",
            {
                name.replace("_", "-"): getattr(r.evictions, name)
                for name in rpt.Evictions.__struct_fields__
            },
        ),
        _labelled_counter("kvferry_turns_by_index", "Turns by turn index.", "turn", turns),
        _labelled_counter(
            "kvferry_reused_turns_by_index",
            "Turns that reused KV, by turn index.",
            "turn",
            {k: b.reused_turns for k, b in r.by_turn.items()},
        ),
        _labelled_counter(
            "kvferry_prompt_tokens_by_index",
            "Prompt tokens by turn index.",
            "turn",
            {k: b.prompt_tokens for k, b in r.by_turn.items()},
        ),
        _labelled_counter(
            "kvferry_reused_tokens_by_index",
            "Reused prompt tokens by turn index.",
            "turn",
            {k: b.reused_tokens for k, b in r.by_turn.items()},
        ),
        _gauge(
            "kvferry_pinned_handles",
            "Handles pinning KV on this D: held for a next turn, or unused.",
            r.pinned.handles,
        ),
        _gauge("kvferry_pinned_blocks", "KV blocks pinned by held handles.", r.pinned.blocks),
        _gauge(
            "kvferry_pinned_bytes",
            "Bytes pinned by held handles (0 while bytes per token is unknown).",
            r.pinned.bytes,
        ),
        _gauge(
            "kvferry_pinned_unused_handles",
            "Pinned handles no turn will read (release pending, failed or impossible).",
            r.pinned.unused_handles,
        ),
        _gauge(
            "kvferry_pinned_unused_blocks",
            "KV blocks pinned by handles no turn will read.",
            r.pinned.unused_blocks,
        ),
        _gauge(
            "kvferry_pinned_orphaned_handles",
            "Of the unused, handles an earlier process of this sidecar held (its pin "
            "journal): being released, or pinned until D's deadline.",
            r.pinned.orphaned_handles,
        ),
        _gauge(
            "kvferry_pinned_unreleasable_handles",
            "Of the unused, handles no release can free (no prefill engine, a failed "
            "release or pull): pinned until D's deadline (the ceiling).",
            r.pinned.unreleasable_handles,
        ),
        _counter(
            "kvferry_orphaned_handles_found",
            "Handles an earlier process of this sidecar held that D still pinned at start.",
            r.orphans.found,
        ),
        _gauge(
            "kvferry_pinned_oldest_age_seconds",
            "Age of the oldest handle pinning KV here (held or unused).",
            r.pinned.oldest_age_seconds,
        ),
        _counter("kvferry_pulls", "Turns served with KV pulled from a handle.", r.transfer.pulls),
        _counter(
            "kvferry_transferred_bytes", "NIXL bytes read by the local engine.", r.transfer.bytes
        ),
        _counter(
            "kvferry_transfer_seconds",
            "NIXL transfer time of the local engine.",
            r.transfer.seconds,
        ),
        _counter("kvferry_transfers", "NIXL transfers of the local engine.", r.transfer.transfers),
        _info(
            "kvferry_transport",
            "What the P<->D KV path uses as this sidecar sees it (RDMA, TCP, TCPFallback, "
            "NoTransport, Unknown); the evidence is the report's transportReason.",
            {"transport": r.transport},
        ),
        _counter(
            "kvferry_recompute_tokens",
            "Prompt tokens P computed from scratch (turns without reuse).",
            r.transfer.recompute_tokens,
        ),
        _counter(
            "kvferry_recompute_seconds",
            "Prefill time of turns P computed from scratch.",
            r.transfer.recompute_seconds,
        ),
        _gauge(
            "kvferry_kv_bytes_per_token",
            "KV bytes per token (NIXL bytes / p2p tokens of the local engine).",
            r.transfer.bytes_per_token,
        ),
        _gauge("kvferry_engine_kv_usage_ratio", "Local engine KV cache usage.", r.engine.kv_usage),
        _counter("kvferry_engine_preemptions", "Local engine preemptions.", r.engine.preemptions),
        _counter(
            "kvferry_engine_nixl_expired",
            "Requests whose remote KV had expired (local engine).",
            r.engine.nixl_expired,
        ),
        _counter(
            "kvferry_engine_nixl_failed",
            "Failed NIXL transfers (local engine).",
            r.engine.nixl_failed,
        ),
        _gauge(
            "kvferry_kv_blocks_held",
            "Blocks the engine holds (KV events).",
            r.kv_events.blocks_held,
        ),
        _gauge(
            "kvferry_kv_sessions_held",
            "Sessions with blocks in the engine (KV events).",
            r.kv_events.sessions_held,
        ),
        _counter("kvferry_kv_events_batches", "KV-event batches applied.", r.kv_events.batches),
        _counter("kvferry_kv_events_missed", "KV-event sequence gaps seen.", r.kv_events.missed),
        _counter(
            "kvferry_kv_events_repaired",
            "KV-event gaps filled through the replay socket.",
            r.kv_events.repaired,
        ),
        _counter(
            "kvferry_kv_events_cleared",
            "KV state dropped (AllBlocksCleared or engine restart).",
            r.kv_events.cleared,
        ),
    ]
    return [f for f in out if f is not None]


class ReportCollector(Collector):
    def __init__(self, snapshot: Callable[[], rpt.Report]) -> None:
        self._snapshot = snapshot

    def collect(self):  # type: ignore[override]
        try:
            report = self._snapshot()
        except Exception:  # a scrape must not fail because of the report
            _log.exception("residency snapshot failed")
            return
        yield from report_families(report)
