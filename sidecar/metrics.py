"""Prometheus series and the per-turn log line. Request code returns a TurnReport;
this module alone turns it into numbers.

Each app gets its own registry (tests build many apps in one process).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .types import HandleFate, Outcome, Route, Stage, TurnReport

log = logging.getLogger("kvferry_sidecar.turn")

# TTFT spans ms (a short tail on D) to minutes (a cold 100k-token prefill).
STAGE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
# Inter-turn gaps: what the tuner compares with decodeRetentionSeconds (max 1800).
GAP_BUCKETS = (1, 2, 5, 10, 15, 30, 60, 120, 180, 240, 300, 480, 600, 900, 1200, 1800, 3600)
TOKEN_BUCKETS = (0, 64, 256, 1024, 4096, 16384, 65536, 262144)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.turns = Counter(
            "kvferry_turns",
            "Turns served, by handle outcome and prefill route.",
            ["outcome", "route"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvferry_prompt_tokens", "Prompt tokens of turns served here.", registry=r
        )
        self.reused_tokens = Counter(
            "kvferry_reused_tokens",
            "Prompt tokens not recomputed: pulled from D's handle, or held by D on a skip.",
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
        self.gap = Histogram(
            "kvferry_turn_gap_seconds",
            "Age of a session's handle when its next turn arrived (inter-turn gap).",
            buckets=GAP_BUCKETS,
            registry=r,
        )
        self.handle_drops = Counter(
            "kvferry_handle_drops", "Handles leaving the store, by fate.", ["fate"], registry=r
        )
        self.handles_not_kept = Counter(
            "kvferry_handles_not_kept",
            "Turns that left no handle for the next, by reason.",
            ["reason"],
            registry=r,
        )
        self.prefill_attempts = Counter(
            "kvferry_prefill_attempts",
            "Prefill requests sent, by result.",
            ["result"],
            registry=r,
        )
        self.forwarded = Counter(
            "kvferry_forwarded",
            "Requests forwarded to the session's owner, by result.",
            ["result"],
            registry=r,
        )
        self.pinned = Gauge(
            "kvferry_handles_pinned",
            "Handles held here (each pins KV blocks on D).",
            registry=r,
        )
        self.oldest = Gauge(
            "kvferry_handle_oldest_age_seconds",
            "Age of the oldest handle held here.",
            registry=r,
        )
        self.engine_ready = Gauge(
            "kvferry_engine_ready", "1 when the local engine answers /health.", registry=r
        )
        self.prefill_ready = Gauge(
            "kvferry_prefill_engines_ready", "Prefill engines answering /health.", registry=r
        )
        for outcome in Outcome:
            for route in Route:
                self.turns.labels(outcome.value, route.value)
        for fate in HandleFate:
            self.handle_drops.labels(fate.value)

    def bind_store(self, size: Callable[[], int], ages: Callable[[], list[float]]) -> None:
        self.pinned.set_function(lambda: float(size()))
        self.oldest.set_function(lambda: max(ages(), default=0.0))

    def on_drop(self, fate: HandleFate) -> None:
        self.handle_drops.labels(fate.value).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def record(self, report: TurnReport) -> None:
        outcome = report.outcome.value
        self.turns.labels(outcome, report.route.value).inc()
        if report.prompt_tokens:
            self.prompt_tokens.inc(report.prompt_tokens)
        if report.reused_tokens:
            self.reused_tokens.inc(report.reused_tokens)
        self.reused_per_turn.labels(outcome).observe(report.reused_tokens)
        if report.handle_age_s is not None:
            self.gap.observe(report.handle_age_s)
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
        log_turn(report)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def log_turn(report: TurnReport) -> None:
    t = report.timings
    log.info(
        "turn request_id=%s session=%s api=%s stream=%s status=%s outcome=%s route=%s "
        "prefill_engine=%s attempts=%s prompt_tokens=%s aligned=%s reused=%s gap_s=%s "
        "handle_kept=%s not_kept=%s queue_s=%s prefill_s=%s p_to_d_s=%s ttft_s=%s "
        "total_s=%s error=%s",
        report.request_id,
        report.session,
        report.api.value,
        report.stream,
        report.status,
        report.outcome.value,
        report.route.value,
        report.prefill_engine or "-",
        report.prefill_attempts,
        report.prompt_tokens if report.prompt_tokens is not None else "-",
        report.aligned_tokens,
        report.reused_tokens,
        _fmt(report.handle_age_s),
        report.handle_kept,
        report.handle_not_kept_reason or "-",
        _fmt(t.queue_s),
        _fmt(t.prefill_s),
        _fmt(t.p_to_d_s),
        _fmt(t.first_token_s),
        _fmt(t.total_s),
        report.error or "-",
    )
