"""The operator's own /metrics: what it decided, per server, for dashboards.

The sidecars export what happened in each pod; only the operator knows what it
recommends and applies. Series (labels ``namespace``, ``server``):

- ``kvferry_operator_retention_applied_seconds`` / ``..._recommended_seconds``:
  the retention in force (the live policy) and recommended (the recommendation history);
- ``kvferry_operator_recompute_threshold_recommended_tokens``;
- ``kvferry_operator_decode_preemptions_recent``: the tuner's pressure input;
- ``kvferry_operator_transport_info{transport}``: the server's transport;
- ``kvferry_operator_reporting_pods``: pods whose report is fresh;
- ``kvferry_operator_leader``: 1 here, 0 on a standby (``standby.py``).

Read at scrape time from the publisher's last pass (``Decision``), so a deleted
server's series disappear with it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

LABELS = ["namespace", "server"]


@dataclass(frozen=True)
class Decision:
    """One server as of the publisher's last pass."""

    namespace: str
    server: str
    applied_retention: int
    recommended_retention: int | None
    recommended_threshold: int | None
    preemptions_recent: int
    transport: str
    reporting_pods: int
    # The recompute threshold the decode sidecars are told (Auto's applied, else the spec's).
    threshold_in_force: int | None = None


class DecisionCollector(Collector):
    def __init__(self, decisions: Callable[[], Iterable[Decision]]) -> None:
        self._decisions = decisions

    def collect(self):  # type: ignore[override]
        def gauge(name: str, doc: str, extra: list[str] | None = None) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=LABELS + (extra or []))

        applied = gauge(
            "kvferry_operator_retention_applied_seconds",
            "The retention the decode sidecars hold handles for (the live policy in force).",
        )
        recommended = gauge(
            "kvferry_operator_retention_recommended_seconds",
            "decodeRetentionSeconds the tuner recommends (absent in Observe mode).",
        )
        threshold = gauge(
            "kvferry_operator_recompute_threshold_recommended_tokens",
            "recomputeThreshold the tuner recommends (absent in Observe mode).",
        )
        threshold_in_force = gauge(
            "kvferry_operator_recompute_threshold_tokens",
            "recomputeThreshold the decode sidecars are told (Auto's applied, else the spec's).",
        )
        preemptions = gauge(
            "kvferry_operator_decode_preemptions_recent",
            "Decode preemptions in the tuner's pressure window.",
        )
        transport = gauge(
            "kvferry_operator_transport_info",
            "The server's KV transport as its sidecars report it.",
            ["transport"],
        )
        pods = gauge("kvferry_operator_reporting_pods", "Pods with a fresh residency report.")
        try:
            decisions = list(self._decisions())
        except Exception:  # a scrape must not fail because of the publisher
            log.exception("operator metrics: reading decisions failed")
            decisions = []
        for d in decisions:
            key = [d.namespace, d.server]
            applied.add_metric(key, d.applied_retention)
            if d.recommended_retention is not None:
                recommended.add_metric(key, d.recommended_retention)
            if d.recommended_threshold is not None:
                threshold.add_metric(key, d.recommended_threshold)
            if d.threshold_in_force is not None:
                threshold_in_force.add_metric(key, d.threshold_in_force)
            preemptions.add_metric(key, d.preemptions_recent)
            transport.add_metric([*key, d.transport], 1)
            pods.add_metric(key, d.reporting_pods)
        yield from (
            applied,
            recommended,
            threshold,
            threshold_in_force,
            preemptions,
            transport,
            pods,
        )


def registry_for(decisions: Callable[[], Iterable[Decision]]) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(DecisionCollector(decisions))
    # This replica reconciles (it holds the Lease, or runs without election); a
    # standby serves 0 (standby.py).
    Gauge(
        "kvferry_operator_leader", "1 on the replica that holds the lease.", registry=registry
    ).set(1)
    return registry


def app_factory(registry: CollectorRegistry) -> web.Application:
    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    return app
