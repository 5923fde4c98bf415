"""The kvferry Grafana dashboard, generated with grafana-foundation-sdk.

    python -m kvferry_dev.dashboard          # rewrite charts/kvferry/dashboards/kvferry.json
    python -m kvferry_dev.dashboard --check  # exit 1 when the file is not current

One row per question an adopter asks (reuse, bandwidth, retention, TTFT), then
the decode pods' pinned KV and pressure, the sidecar's own overhead, and the
operator's recommendation history. Every query filters on the ``namespace``,
``server`` and ``pod`` variables; the labels come from the scrape configuration
(the chart's PodMonitor / ServiceMonitor relabel ``server`` and ``role`` from the
pods' labels; ``namespace``, ``pod``, ``container`` are Prometheus's own). The
operator's series carry ``namespace`` and ``server`` themselves (scraped with
``honorLabels``).

The engine tier evaluates every query of this file against a real Prometheus
that scraped a real run (tests/engine/test_kv_cache_status.py): a query that does
not parse or names a series nobody exports fails it. ``PANEL_QUERIES`` is the
list it evaluates.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from grafana_foundation_sdk.builders import dashboard as gd
from grafana_foundation_sdk.builders import prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync,
    DataSourceRef,
    VariableRefresh,
    VariableSort,
)

OUT = Path(__file__).resolve().parents[1] / "charts" / "kvferry" / "dashboards" / "kvferry.json"
UID = "kvferry-reuse"
DS = DataSourceRef(type_val="prometheus", uid="${datasource}")

# Selectors: every series of a server's pods, and the operator's per-server series.
POD = 'namespace=~"$namespace", server=~"$server", pod=~"$pod"'
SRV = 'namespace=~"$namespace", server=~"$server"'
SIDECAR = f'{POD}, container="kvferry-sidecar"'
RI = "$__rate_interval"
LATER_TURNS = 'turn!="1"'
P2P = 'source="p2p"'
EXPIRED = 'fate="expired"'
QUEUE = 'stage="queue"'


def rate(metric: str, sel: str = POD, extra: str = "") -> str:
    inner = f"{sel}, {extra}" if extra else sel
    return f"rate({metric}{{{inner}}}[{RI}])"


def srate(metric: str, by: str, extra: str = "") -> str:
    return f"sum by ({by}) ({rate(metric, extra=extra)})"


def agg(op: str, metric: str, by: str, sel: str = POD) -> str:
    return f"{op} by ({by}) ({metric}{{{sel}}})"


def quantile(q: float, metric: str, by: str, sel: str = POD, extra: str = "") -> str:
    return f"histogram_quantile({q}, sum by (le, {by}) ({rate(metric + '_bucket', sel, extra)}))"


@dataclass(frozen=True)
class Q:
    expr: str
    legend: str


@dataclass(frozen=True)
class P:
    title: str
    description: str
    queries: tuple[Q, ...]
    unit: str = "short"
    kind: str = "timeseries"  # or "stat"
    width: int = 8


ROWS: list[tuple[str, list[P]]] = [
    (
        "1. Reuse: how much of each prompt is reused",
        [
            P(
                "Reused share of prompt tokens, turns 2+",
                "Prompt tokens of later turns not recomputed (pulled from decode's handle, "
                "or held by decode on a skip), over all their prompt tokens.",
                (
                    Q(
                        srate("kvferry_reused_tokens_by_index_total", "server", LATER_TURNS)
                        + " / "
                        + srate("kvferry_prompt_tokens_by_index_total", "server", LATER_TURNS),
                        "{{server}}",
                    ),
                ),
                unit="percentunit",
            ),
            P(
                "Hit rate by turn index",
                "Turns that reused KV over all turns, per turn index of the session (8 = 8+).",
                (
                    Q(
                        f"sum by (turn) ({rate('kvferry_reused_turns_by_index_total')})"
                        f" / sum by (turn) ({rate('kvferry_turns_by_index_total')})",
                        "turn {{turn}}",
                    ),
                ),
                unit="percentunit",
            ),
            P(
                "Turn outcomes",
                "What happened to each turn's KV: reused, no-handle, expired, misaligned, ...",
                (Q(f"sum by (outcome) ({rate('kvferry_turns_total')})", "{{outcome}}"),),
                unit="reqps",
            ),
            P(
                "Tokens pulled over NIXL (engine)",
                "vLLM's own count of prompt tokens received from another instance (p2p).",
                (
                    Q(
                        srate("vllm:prompt_tokens_cached_by_source_total", "pod", P2P),
                        "{{pod}}",
                    ),
                ),
            ),
        ],
    ),
    (
        "2. Bandwidth: does the prefill-decode path suffice",
        [
            P(
                "NIXL bandwidth",
                "NIXL bytes over NIXL transfer seconds of each engine, as its sidecar reads them.",
                (
                    Q(
                        f"sum by (pod) ({rate('kvferry_transferred_bytes_total')})"
                        f" / sum by (pod) ({rate('kvferry_transfer_seconds_total')})",
                        "{{pod}}",
                    ),
                ),
                unit="Bps",
            ),
            P(
                "NIXL transfer time p95 (engine)",
                "vLLM's histogram of one NIXL transfer's duration.",
                (
                    Q(
                        quantile(0.95, "vllm:nixl_xfer_time_seconds", "pod"),
                        "{{pod}}",
                    ),
                ),
                unit="s",
            ),
            P(
                "Prefill leg with a pull, p50 / p95",
                "The sidecar's view of prefill requests that carried a handle: "
                "pull + tail compute.",
                (
                    Q(quantile(0.5, "kvferry_pull_latency_seconds", "server"), "p50"),
                    Q(quantile(0.95, "kvferry_pull_latency_seconds", "server"), "p95"),
                ),
                unit="s",
            ),
            P(
                "Transport",
                "RDMA, TCP, TCPFallback, NoTransport or Unknown per pod; the evidence is in "
                "kubectl get kv-cache-status -o yaml (transfer.transportReason).",
                (
                    Q(
                        f"max by (pod, transport) (kvferry_transport_info{{{POD}}})",
                        "{{pod}}: {{transport}}",
                    ),
                ),
                kind="stat",
            ),
            P(
                "Failed and expired NIXL reads (engine)",
                "Transfers that failed, and reads declined because the handle had expired.",
                (
                    Q(
                        f"sum by (pod) ({rate('vllm:nixl_num_failed_transfers_total')})",
                        "failed {{pod}}",
                    ),
                    Q(
                        f"sum by (pod) ({rate('vllm:nixl_num_kv_expired_reqs_total')})",
                        "expired {{pod}}",
                    ),
                ),
                unit="reqps",
            ),
        ],
    ),
    (
        "3. Retention: how long decode holds KV, how often it is gone before the next turn",
        [
            P(
                "Inter-turn gap vs retention",
                "Gaps between a session's turns (p50/p95/p99) against the retention decode "
                "runs with: a gap above it is a turn whose KV had expired.",
                (
                    Q(quantile(0.5, "kvferry_inter_turn_gap_seconds", "server"), "gap p50"),
                    Q(quantile(0.95, "kvferry_inter_turn_gap_seconds", "server"), "gap p95"),
                    Q(quantile(0.99, "kvferry_inter_turn_gap_seconds", "server"), "gap p99"),
                    Q(f"max by (server) (kvferry_retention_seconds{{{POD}}})", "retention"),
                ),
                unit="s",
            ),
            P(
                "Handle fates",
                "What became of each handle decode kept for a next turn.",
                (Q(f"sum by (fate) ({rate('kvferry_handle_fates_total')})", "{{fate}}"),),
                unit="ops",
            ),
            P(
                "Expired before the next turn",
                "Share of handles that expired unread.",
                (
                    Q(
                        srate("kvferry_handle_fates_total", "server", EXPIRED)
                        + " / "
                        + srate("kvferry_handle_fates_total", "server"),
                        "{{server}}",
                    ),
                ),
                unit="percentunit",
            ),
        ],
    ),
    (
        "4. TTFT with and without reuse",
        [
            P(
                "TTFT p50 / p95 / p99 by reuse",
                "Time to first token of turns that reused KV vs turns computed from scratch.",
                tuple(
                    Q(
                        quantile(q, "kvferry_ttft_seconds", "reuse"),
                        f"p{int(q * 100)} {{{{reuse}}}}",
                    )
                    for q in (0.5, 0.95, 0.99)
                ),
                unit="s",
                width=12,
            ),
            P(
                "Engine TTFT p95 by role (vLLM)",
                "vLLM's own time to first token histogram, per role.",
                (Q(quantile(0.95, "vllm:time_to_first_token_seconds", "role"), "{{role}}"),),
                unit="s",
                width=12,
            ),
        ],
    ),
    (
        "Pinned KV and decode pressure",
        [
            P(
                "Pinned KV",
                "KV bytes held by handles kept for a next turn (vLLM 0.32 also spins a core "
                "while any is pinned).",
                (Q(f"sum by (pod) (kvferry_pinned_bytes{{{POD}}})", "{{pod}}"),),
                unit="bytes",
            ),
            P(
                "Pinned handles and the oldest one's age",
                "",
                (
                    Q(f"sum by (pod) (kvferry_pinned_handles{{{POD}}})", "handles {{pod}}"),
                    Q(
                        f"max by (pod) (kvferry_pinned_oldest_age_seconds{{{POD}}})",
                        "oldest (s) {{pod}}",
                    ),
                ),
            ),
            P(
                "KV cache usage and preemptions (engine)",
                "The engines' KV usage and preemptions per second: the tuner lowers retention "
                "when decode preempts or passes 90% usage.",
                (
                    Q(f"max by (pod) (vllm:kv_cache_usage_perc{{{POD}}})", "usage {{pod}}"),
                    Q(
                        f"sum by (pod) ({rate('vllm:num_preemptions_total')})",
                        "preemptions/s {{pod}}",
                    ),
                ),
            ),
            P(
                "Handles let go unread, by reason",
                "Evictions per second by why: the caps and decode's pressure (lowest value "
                "first), and the ends of a handle's life (usefulness: no next turn expected; "
                "retention; lease: D's own, for a turn it prefilled alone).",
                (Q(f"sum by (reason) ({rate('kvferry_handle_evictions_total')})", "{{reason}}"),),
                width=12,
            ),
            P(
                "Orphaned and unreleasable pinned handles",
                "Pinned on decode with no turn to read them: orphaned (held by a sidecar "
                "process that restarted, being released through prefill) and unreleasable "
                "(no release can free them: pinned to the ceiling, and a raise of "
                "maxRetentionSeconds waits while any is reported).",
                (
                    Q(agg("sum", "kvferry_pinned_orphaned_handles", "pod"), "orphaned {{pod}}"),
                    Q(
                        agg("sum", "kvferry_pinned_unreleasable_handles", "pod"),
                        "unreleasable {{pod}}",
                    ),
                    Q(
                        f"sum by (pod) (increase(kvferry_orphaned_handles_found_total{{{POD}}}"
                        f"[{RI}]))",
                        "found after a restart {{pod}}",
                    ),
                ),
                width=12,
            ),
        ],
    ),
    (
        "Sidecar overhead",
        [
            P(
                "Time before the first engine request, p95",
                "Routing, tokenizing and the handle check: what the sidecar adds to a turn.",
                (Q(quantile(0.95, "kvferry_ttft_stage_seconds", "pod", extra=QUEUE), "{{pod}}"),),
                unit="s",
            ),
            P(
                "Sidecar CPU",
                "",
                (
                    Q(
                        f"sum by (pod) (rate(process_cpu_seconds_total{{{SIDECAR}}}[{RI}]))",
                        "{{pod}}",
                    ),
                ),
                unit="short",
            ),
            P(
                "Sidecar memory",
                "",
                (Q(f"max by (pod) (process_resident_memory_bytes{{{SIDECAR}}})", "{{pod}}"),),
                unit="bytes",
            ),
        ],
    ),
    (
        "Recommendation history (operator)",
        [
            P(
                "Retention: applied and recommended",
                "decodeRetentionSeconds as the operator applies and recommends it "
                "(Events on the DisaggregatedServer give each reason and its inputs).",
                (
                    Q(
                        f"max by (server) (kvferry_operator_retention_applied_seconds{{{SRV}}})",
                        "applied {{server}}",
                    ),
                    Q(
                        agg("max", "kvferry_operator_retention_recommended_seconds", "server", SRV),
                        "recommended {{server}}",
                    ),
                ),
                unit="s",
            ),
            P(
                "Recompute threshold recommended",
                "Prefix length from which a pull beats recomputing, from the measured "
                "bandwidth and prefill speed.",
                (
                    Q(
                        agg(
                            "max",
                            "kvferry_operator_recompute_threshold_recommended_tokens",
                            "server",
                            SRV,
                        ),
                        "{{server}}",
                    ),
                ),
            ),
            P(
                "Decode preemptions in the tuner's window",
                "What the tuner's pressure rule sees.",
                (
                    Q(
                        f"max by (server) (kvferry_operator_decode_preemptions_recent{{{SRV}}})",
                        "{{server}}",
                    ),
                ),
            ),
        ],
    ),
]


def _variable(name: str, label: str, query: str) -> gd.QueryVariable:
    return (
        gd.QueryVariable(name)
        .label(label)
        .datasource(DS)
        .query(query)
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(".*")
    )


# Grafana variable queries (label_values) the engine tier checks like the panels.
VARIABLES = [
    ("namespace", "Namespace", "label_values(kvferry_turns_total, namespace)"),
    ("server", "Server", 'label_values(kvferry_turns_total{namespace=~"$namespace"}, server)'),
    (
        "pod",
        "Pod",
        'label_values(kvferry_engine_ready{namespace=~"$namespace", server=~"$server"}, pod)',
    ),
]


def _panel(p: P) -> timeseries.Panel | stat.Panel:
    builder = timeseries.Panel() if p.kind == "timeseries" else stat.Panel()
    builder = builder.title(p.title).datasource(DS).unit(p.unit).span(p.width).height(8)
    if p.description:
        builder = builder.description(p.description)
    for i, q in enumerate(p.queries):
        builder = builder.with_target(
            prometheus.Dataquery().expr(q.expr).legend_format(q.legend).ref_id(chr(ord("A") + i))
        )
    return builder


def build() -> dict:  # type: ignore[type-arg]
    board = (
        gd.Dashboard("kvferry: does bidirectional KV reuse pay off?")
        .uid(UID)
        .tags(["kvferry", "vllm"])
        .description(
            "The four questions of kubectl get kv-cache-status over time: reuse, bandwidth, "
            "retention, TTFT. Generated by kvferry_dev/dashboard.py; do not edit by hand."
        )
        .refresh("30s")
        .time("now-3h", "now")
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .with_variable(gd.DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
    )
    for name, label, query in VARIABLES:
        board = board.with_variable(_variable(name, label, query))
    for title, panels in ROWS:
        board = board.with_row(gd.Row(title))
        for p in panels:
            board = board.with_panel(_panel(p))
    return _without_nulls(json.loads(json.dumps(board.build(), cls=JSONEncoder)))


def _without_nulls(value: object) -> object:
    """The SDK writes unset fields as null (``"options": null``); Grafana expects them
    absent."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


def panel_queries(board: dict) -> list[tuple[str, str]]:
    """(panel title, expr) of every target in a dashboard JSON."""
    return [
        (panel.get("title", ""), target["expr"])
        for panel in board.get("panels", [])
        for target in panel.get("targets", [])
        if target.get("expr")
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail when the file is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is stale: run python -m kvferry_dev.dashboard", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
