"""Decode preemptions and KV usage between aggregations (pressure.PreemptionWindow,
pressure.UsagePeak), and both windows rebuilt from status by a new leader (pressure.seed)."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry_operator import aggregate, api, pressure, publisher
from kvferry_operator.pressure import PreemptionWindow, UsagePeak
from kvferry_wire import report as wire

NOW = 10_000.0
WINDOW, BUCKET = pressure.WINDOW_SECONDS, pressure.BUCKET_SECONDS


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


# ------------------------------------------------------------------ surviving the operator
#
# A new leader (or a restarted operator) seeds both windows from the KVCacheStatus
# status the last one wrote: the pods' rows (their counters and sidecar starts) and
# status.pressure (the window's rises and usage peaks, per minute).


def written(
    last: dict[str, wire.Report], preemptions: PreemptionWindow, peak: UsagePeak
) -> dict[str, Any]:
    """The KVCacheStatus status as the publisher writes it and reads it back: the pod
    rows (aggregate.window_fields) and status.pressure, through JSON."""
    out = {
        "pods": [{"name": pod, **aggregate.window_fields(r)} for pod, r in sorted(last.items())],
        "pressure": pressure.status(preemptions, peak),
    }
    return json.loads(json.dumps(publisher.without_nulls(out)))


def test_a_seeded_window_keeps_recent_preemptions_of_a_sidecar_started_long_ago():
    # The case: started 20 minutes ago, 4 then 6; the operator restarts; 6 again.
    started = NOW - 1200
    w, u = PreemptionWindow(), UsagePeak()
    w.observe([rep("d-0", 4, started)], NOW)
    assert w.observe([rep("d-0", 6, started)], NOW + 10) == 2
    status = written({"d-0": rep("d-0", 6, started)}, w, u)
    assert status["pressure"] == {"preemptions": [{"time": api.iso_time(NOW + 10), "count": 2}]}
    assert status["pods"][0]["startedAt"] == api.iso_time(started)

    seeded, _ = pressure.seed(status)
    assert seeded.observe([rep("d-0", 6, started)], NOW + 20) == 2  # not forgotten
    assert seeded.observe([rep("d-0", 9, started)], NOW + 30) == 5  # 6 not counted again
    assert seeded.observe([rep("d-0", 9, started)], NOW + 611) == 3  # the first rise aged out
    # An empty window (the operator before this change) forgets the rise:
    assert PreemptionWindow().observe([rep("d-0", 6, started)], NOW + 20) == 0


def test_a_seeded_pod_whose_sidecar_restarted_counts_its_new_counter_in_full():
    w = PreemptionWindow()
    w.observe([rep("d-0", 50, 0.0)], NOW)
    seeded, _ = pressure.seed(written({"d-0": rep("d-0", 50, 0.0)}, w, UsagePeak()))
    assert seeded.observe([rep("d-0", 3, NOW + 5)], NOW + 10) == 3


def test_a_seeded_usage_peak_holds_the_windows_highest():
    u = UsagePeak()
    u.observe([usage("d-0", 0.95)], NOW)
    u.observe([usage("d-0", 0.30)], NOW + 70)
    status = written({}, PreemptionWindow(), u)
    assert [e["kvUsage"] for e in status["pressure"]["kvUsage"]] == [0.95, 0.30]
    _, seeded = pressure.seed(status)
    assert seeded.observe([usage("d-0", 0.40)], NOW + 80) == 0.95
    assert seeded.observe([usage("d-0", 0.40)], NOW + 601) == 0.40


def test_seeding_ignores_what_it_cannot_read_and_an_empty_status_seeds_empty_windows():
    w, u = pressure.seed({})
    assert (w.observe([rep("d-0", 5)], NOW), u.observe([], NOW)) == (0, None)
    odd = {
        "pods": [
            {"name": "d-0", "role": "decode", "startedAt": "yesterday", "preemptions": 5},
            {"name": "p-0", "role": "prefill", "startedAt": api.iso_time(0), "preemptions": 5},
            "not a row",
        ],
        "pressure": {"preemptions": [{"time": "soon", "count": 3}, {"count": 2}, 7]},
    }
    w, u = pressure.seed(odd)
    assert w.observe([rep("d-0", 5)], NOW) == 0  # first sight of an old sidecar: baseline
    assert pressure.status(w, u) is None


def test_rises_coalesce_per_minute_so_status_stays_small():
    # A rise on every pass (10 s) for an hour: at most one entry per minute of the window.
    w, u = PreemptionWindow(), UsagePeak()
    for i in range(360):
        w.observe([rep("d-0", i, 0.0)], NOW + 10 * i)
        u.observe([usage("d-0", (i % 7) / 10)], NOW + 10 * i)
    block = pressure.status(w, u)
    assert len(block["preemptions"]) <= pressure.max_entries() == 11
    assert len(block["kvUsage"]) <= pressure.max_entries()
    # Coalescing only ever keeps a rise longer: the last 10 minutes' 60 rises are all in.
    assert w.recent() >= 60


# What a history of passes can do to a decode pod between two of them.
STEP = st.tuples(
    st.floats(2.0, 130.0),  # seconds since the previous pass (a sidecar restarts in more than 1)
    st.lists(
        st.tuples(
            st.sampled_from(["same", "rise", "restart"]),
            st.integers(0, 5),
            st.none() | st.floats(0.0, 1.0),
        ),
        min_size=2,
        max_size=2,
    ),
)


def run_history(steps: list, restart_at: int, window: float, old_starts: list[bool]) -> list:
    """Feed the passes to a window that never restarts and to one rebuilt from its
    status before pass ``restart_at``; for each pass from then on: (now, the
    uninterrupted count, the seeded count, both peaks, the seeded status's longest
    list, the true rises so far as (time, count))."""
    now = NOW
    starts = [NOW - 3600 if old else NOW - 100 for old in old_starts]
    counts = [3, 0]
    plain, plain_peak = PreemptionWindow(window=window), UsagePeak(window=window)
    seeded, seeded_peak = PreemptionWindow(window=window), UsagePeak(window=window)
    last: dict[str, wire.Report] = {}
    truth: list[tuple[float, int]] = []
    out = []
    for i, (dt, pods) in enumerate(steps):
        now += dt
        batch = []
        for p, (action, n, kv) in enumerate(pods):
            if action == "rise":
                counts[p] += n
            elif action == "restart":
                starts[p], counts[p] = now - 0.5, n
            r = rep(f"d-{p}", counts[p], starts[p])
            r.engine.kv_usage = kv
            batch.append(r)
        if i == restart_at:
            seeded, seeded_peak = pressure.seed(written(last, seeded, seeded_peak), window)
        truth.append((now, true_rise(last, batch, now, window)))
        last.update({r.pod: r for r in batch})
        count, seeded_count = plain.observe(batch, now), seeded.observe(batch, now)
        peaks = (plain_peak.observe(batch, now), seeded_peak.observe(batch, now))
        block = pressure.status(seeded, seeded_peak) or {}
        longest = max((len(v) for v in block.values()), default=0)
        if i >= restart_at:
            out.append((now, count, seeded_count, *peaks, longest, list(truth)))
    return out


def true_rise(last: dict[str, wire.Report], batch: list[wire.Report], now: float, window: float):
    """The preemptions new in ``batch``, from the counters alone (the module's rules)."""
    new = 0
    for r in batch:
        before = last.get(r.pod)
        if before is None:
            new += r.engine.preemptions if now - r.started_at <= window else 0
        elif before.started_at != r.started_at:
            new += r.engine.preemptions
        else:
            new += r.engine.preemptions - before.engine.preemptions
    return new


HISTORY = {
    "steps": st.lists(STEP, min_size=1, max_size=25),
    "restart": st.integers(0, 24),
    "old": st.lists(st.booleans(), min_size=2, max_size=2),
}


@settings(max_examples=300, deadline=None)
@given(**HISTORY)
def test_a_seeded_window_counts_every_preemption_exactly_once(steps, restart, old):
    # A window that nothing leaves: the seeded count is the uninterrupted one and the
    # true one, exactly (a preemption counted twice, or forgotten, would show).
    restart = min(restart, len(steps) - 1)
    for _, plain, seeded, *_, truth in run_history(steps, restart, 1e9, old):
        assert seeded == plain == sum(n for _, n in truth)


@settings(max_examples=300, deadline=None)
@given(**HISTORY)
def test_a_seeded_window_errs_toward_pressure_and_stays_small(steps, restart, old):
    # The real window: never less than the uninterrupted one (nothing forgotten), and
    # nothing beyond what a window a few minutes longer would still hold (its minutes
    # and the rounding up to the second only ever keep a rise longer).
    restart = min(restart, len(steps) - 1)
    for now, plain, seeded, plain_peak, seeded_peak, longest, truth in run_history(
        steps, restart, WINDOW, old
    ):
        assert seeded >= plain
        assert seeded <= sum(n for t, n in truth if now - t <= WINDOW + 4 * BUCKET)
        if plain_peak is not None:
            assert seeded_peak is not None and seeded_peak >= plain_peak
        assert longest <= pressure.max_entries()
