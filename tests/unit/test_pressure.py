"""Decode preemptions between aggregations (pressure.PreemptionWindow)."""

from __future__ import annotations

from kvferry_operator.pressure import PreemptionWindow, UsagePeak
from kvferry_wire import report as wire

NOW = 10_000.0


def rep(pod: str, preemptions: int, started_at: float = 0.0, role: str = "decode") -> wire.Report:
    return wire.Report(
        version=wire.REPORT_VERSION,
        server="tiny",
        namespace="ns",
        pod=pod,
        role=role,
        started_at=started_at,
        generated_at=NOW,
        engine=wire.Engine(preemptions=preemptions),
    )


def test_a_rise_counts_for_the_window_then_ages_out():
    w = PreemptionWindow(window=600)
    assert w.observe([rep("d-0", 5)], NOW) == 0  # first sight of an old sidecar: baseline
    assert w.observe([rep("d-0", 9)], NOW + 10) == 4
    assert w.observe([rep("d-0", 9)], NOW + 20) == 4  # no flapping back on the next pass
    assert w.observe([rep("d-0", 9)], NOW + 611) == 0


def test_rises_add_up_across_pods_and_passes():
    w = PreemptionWindow(window=600)
    w.observe([rep("d-0", 0), rep("d-1", 0)], NOW)
    assert w.observe([rep("d-0", 2), rep("d-1", 3)], NOW + 10) == 5
    assert w.observe([rep("d-0", 3), rep("d-1", 3)], NOW + 20) == 6


def test_a_restarted_sidecar_counts_from_zero():
    w = PreemptionWindow(window=600)
    w.observe([rep("d-0", 50, started_at=0.0)], NOW)
    assert w.observe([rep("d-0", 2, started_at=NOW + 5)], NOW + 10) == 2


def test_a_new_sidecar_started_within_the_window_counts_in_full():
    assert PreemptionWindow(window=600).observe([rep("d-0", 7, started_at=NOW - 60)], NOW) == 7


def test_prefill_preemptions_do_not_move_decode_retention():
    w = PreemptionWindow(window=600)
    w.observe([rep("p-0", 0, role="prefill")], NOW)
    assert w.observe([rep("p-0", 9, role="prefill")], NOW + 10) == 0


def usage(pod: str, value: float | None, role: str = "decode") -> wire.Report:
    r = rep(pod, 0, role=role)
    r.engine.kv_usage = value
    return r


def test_usage_peak_holds_the_highest_decode_usage_of_the_window():
    # Usage hovering around the high-water mark must not flip the recommendation.
    peak = UsagePeak(window=600)
    assert peak.observe([usage("d-0", 0.95), usage("p-0", 0.99, role="prefill")], NOW) == 0.95
    assert peak.observe([usage("d-0", 0.40)], NOW + 10) == 0.95
    assert peak.observe([usage("d-0", 0.50)], NOW + 700) == 0.50
    assert UsagePeak().observe([usage("d-0", None)], NOW) is None
