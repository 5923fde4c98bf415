"""The residency model: turns, gaps, handle fates, engine figures -> the report."""

from __future__ import annotations

from typing import Any

from kvferry_sidecar.enginemetrics import EngineFigures
from kvferry_sidecar.residency import (
    Identity,
    PinnedFigures,
    Residency,
    ttft_of,
)
from kvferry_sidecar.types import Api, HandleFate, TurnReport, TurnTimings, handle_blocks
from kvferry_wire import report
from kvferry_wire.protocol import Outcome, Route

IDENT = Identity(server="llama", namespace="serving", pod="llama-decode-0", role="decode")
STARTED = 1_700_000_000.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(**kwargs: Any) -> tuple[Residency, Clock]:
    clock = Clock()
    return Residency(IDENT, started_at=STARTED, clock=clock, **kwargs), clock


def turn(
    session: str = "s1",
    outcome: Outcome = Outcome.NO_HANDLE,
    route: Route = Route.REMOTE,
    *,
    stream: bool = True,
    prompt: int = 1000,
    reused: int = 0,
    status: int = 200,
    **timings: float,
) -> TurnReport:
    t = {"queue_s": 0.01, "prefill_s": 0.5, "first_token_s": 0.6, "total_s": 2.0}
    t.update(timings)
    return TurnReport(
        request_id="r",
        session=session,
        api=Api.CHAT,
        stream=stream,
        outcome=outcome,
        route=route,
        status=status,
        prompt_tokens=prompt,
        reused_tokens=reused,
        timings=TurnTimings(**{k: v for k, v in t.items() if v is not None}),
    )


def bucket_of(hist: report.Histogram, value: float) -> int:
    for i, bound in enumerate(hist.bounds):
        if value <= bound:
            return i
    return len(hist.bounds)


# ------------------------------------------------------------------ gaps


def test_gap_is_observed_even_after_the_handle_expired() -> None:
    """The gap of a turn whose handle expired is still measured: otherwise gaps
    longer than the retention never appear and the tuner could never raise it."""
    res, clock = make()
    res.observe_turn(turn(total_s=2.0))
    clock.now += 1000.0  # longer than any retention: the store dropped the handle
    res.on_handle_drop(HandleFate.EXPIRED, "s1")
    res.observe_turn(turn(outcome=Outcome.EXPIRED, total_s=2.0))
    snap = res.snapshot(STARTED + 1)
    assert snap.gaps.total == 1
    assert snap.gaps.sum == 998.0  # arrival (finish - total) minus the last finish
    assert snap.gaps.counts[bucket_of(snap.gaps, 998.0)] == 1
    assert snap.handles == {"expired": 1}


def test_gap_is_observed_when_the_handle_was_evicted() -> None:
    """An evicted handle (LRU cap) does not hide the gap either."""
    res, clock = make()
    res.observe_turn(turn())
    res.on_handle_drop(HandleFate.EVICTED, "s1")
    clock.now += 30.0
    res.observe_turn(turn(total_s=0.0))
    assert res.snapshot(STARTED).gaps.sum == 30.0
    assert res.snapshot(STARTED).handles == {"evicted": 1}


def test_first_turn_of_a_session_observes_no_gap() -> None:
    res, _ = make()
    res.observe_turn(turn("a"))
    res.observe_turn(turn("b"))
    assert res.snapshot(STARTED).gaps.total == 0


def test_overlapping_turns_of_a_session_count_as_a_zero_gap() -> None:
    """A turn that arrived before the previous one finished (parallel agent calls)."""
    res, clock = make()
    res.observe_turn(turn(total_s=0.0))
    clock.now += 1.0
    res.observe_turn(turn(total_s=5.0))
    assert res.snapshot(STARTED).gaps.sum == 0.0
    assert res.snapshot(STARTED).gaps.counts[0] == 1


def test_sessions_remembered_are_bounded() -> None:
    """The per-session memory is an LRU: the oldest session is forgotten first."""
    res, clock = make(session_cap=2)
    for s in ("a", "b", "c"):
        res.observe_turn(turn(s, total_s=0.0))
    clock.now += 10.0
    res.observe_turn(turn("a", total_s=0.0))  # forgotten: a first turn again
    res.observe_turn(turn("c", total_s=0.0))
    snap = res.snapshot(STARTED)
    assert snap.gaps.total == 1
    assert snap.by_turn["1"].turns == 4
    assert snap.by_turn["2"].turns == 1


# ------------------------------------------------------------------ turns


def test_turn_index_buckets_count_turns_tokens_and_reuse() -> None:
    """Turn N of a session lands in bucket "N"; the 8th and later share "8"."""
    res, _ = make()
    for i in range(10):
        reused = 0 if i == 0 else 900
        res.observe_turn(
            turn(outcome=Outcome.REUSED if reused else Outcome.NO_HANDLE, reused=reused)
        )
    snap = res.snapshot(STARTED)
    assert sorted(snap.by_turn) == ["1", "2", "3", "4", "5", "6", "7", "8"]
    assert snap.by_turn["1"] == report.TurnBucket(1, 0, 1000, 0)
    assert snap.by_turn["2"] == report.TurnBucket(1, 1, 1000, 900)
    assert snap.by_turn["8"] == report.TurnBucket(3, 3, 3000, 2700)


def test_outcomes_are_counted_per_turn() -> None:
    res, _ = make()
    res.observe_turn(turn(outcome=Outcome.NO_HANDLE))
    res.observe_turn(turn(outcome=Outcome.REUSED, reused=10))
    res.observe_turn(turn(outcome=Outcome.REUSED, reused=10))
    assert res.snapshot(STARTED).outcomes == {"no-handle": 1, "reused": 2}


def test_ttft_is_split_by_reuse() -> None:
    """Turns that reused KV go to ttftReused, the others to ttftRecomputed."""
    res, _ = make()
    res.observe_turn(turn(outcome=Outcome.REUSED, reused=900, first_token_s=0.2))
    res.observe_turn(turn(outcome=Outcome.SKIPPED_PREFILL, route=Route.SKIP, reused=990,
                          first_token_s=0.05))  # fmt: skip
    res.observe_turn(turn(outcome=Outcome.EXPIRED, first_token_s=2.5))
    snap = res.snapshot(STARTED)
    assert (snap.ttft_reused.total, snap.ttft_reused.sum) == (2, 0.25)
    assert (snap.ttft_recomputed.total, snap.ttft_recomputed.sum) == (1, 2.5)


def test_non_streamed_ttft_is_time_to_p_answer() -> None:
    """Without a first byte to time, a turn prefilled on P reports queue + prefill
    (P computed the first token); a non-streamed turn D prefilled has no figure."""
    remote = turn(stream=False, first_token_s=None, queue_s=0.1, prefill_s=0.4)
    local = turn(stream=False, route=Route.FALLBACK, first_token_s=None, prefill_s=None)
    assert ttft_of(remote) == 0.5
    assert ttft_of(local) is None


def test_failed_turns_leave_ttft_alone() -> None:
    res, _ = make()
    res.observe_turn(turn(status=502))
    snap = res.snapshot(STARTED)
    assert snap.ttft_recomputed.total == 0
    assert snap.outcomes == {"no-handle": 1}


def test_pulls_and_their_latency_come_from_reused_remote_turns() -> None:
    res, _ = make()
    res.observe_turn(turn(outcome=Outcome.REUSED, reused=900, prefill_s=0.3))
    res.observe_turn(turn(outcome=Outcome.SKIPPED_PREFILL, route=Route.SKIP, reused=900))
    snap = res.snapshot(STARTED)
    assert snap.transfer.pulls == 1
    assert (snap.transfer.pull_latency.total, snap.transfer.pull_latency.sum) == (1, 0.3)


def test_recompute_cost_counts_remote_turns_without_reuse() -> None:
    """Break-even needs tokens and seconds of the same turns: P prefills from scratch."""
    res, _ = make()
    res.observe_turn(turn(outcome=Outcome.NO_HANDLE, prompt=1000, prefill_s=2.0))
    res.observe_turn(turn(outcome=Outcome.PULL_FAILED, prompt=500, prefill_s=1.0))
    res.observe_turn(turn(outcome=Outcome.REUSED, reused=900, prompt=1000, prefill_s=0.3))
    res.observe_turn(turn(route=Route.FALLBACK, prompt=700, prefill_s=None))
    snap = res.snapshot(STARTED)
    assert (snap.transfer.recompute_tokens, snap.transfer.recompute_seconds) == (1500, 3.0)


# ------------------------------------------------------------------ handles


def test_taken_handles_get_the_fate_of_their_turn() -> None:
    """A handle taken by a turn is consumed, misaligned, ... as that turn went."""
    res, _ = make()
    cases = [
        ("a", Outcome.REUSED),
        ("b", Outcome.MISALIGNED),
        ("c", Outcome.BELOW_THRESHOLD),
        ("d", Outcome.PULL_FAILED),
        ("e", Outcome.SKIPPED_PREFILL),
    ]
    for session, outcome in cases:
        res.on_handle_drop(HandleFate.TAKEN, session)
        res.observe_turn(turn(session, outcome=outcome))
    res.on_handle_drop(HandleFate.SUPERSEDED, "f")
    res.on_handle_drop(HandleFate.CLEARED, "g")
    assert res.snapshot(STARTED).handles == {
        "consumed": 1,
        "misaligned": 1,
        "below-threshold": 1,
        "pull-failed": 1,
        "skipped": 1,
        "superseded": 1,
        "cleared": 1,
    }


def test_pinned_bytes_are_blocks_times_block_size_times_bytes_per_token() -> None:
    res, _ = make(pinned=lambda: PinnedFigures(handles=2, blocks=10, oldest_age_seconds=42.0,
                                               block_size=16))  # fmt: skip
    assert res.snapshot(STARTED).pinned == report.Pinned(2, 10, 0, 42.0)  # bytes/token unknown
    res.observe_engine(EngineFigures(nixl_bytes=2048.0 * 100, p2p_tokens=100.0))
    snap = res.snapshot(STARTED)
    assert snap.transfer.bytes_per_token == 2048.0
    assert snap.pinned.bytes == 10 * 16 * 2048


def test_handle_blocks_reads_flat_and_per_group_block_ids() -> None:
    assert handle_blocks({"remote_block_ids": [1, 2, 3]}) == 3
    assert handle_blocks({"remote_block_ids": [[1, 2, 3], [4, 5]]}) == 3
    assert handle_blocks({}) == 0


# ------------------------------------------------------------------ engine


def test_engine_counters_stay_monotonic_across_an_engine_restart() -> None:
    """The engine's counters restart at 0; the report's run from the sidecar's start."""
    res, _ = make()
    res.observe_engine(EngineFigures(kv_usage=0.5, preemptions=3, nixl_expired=2))
    res.observe_engine(EngineFigures(kv_usage=0.6, preemptions=5, nixl_expired=2))
    res.observe_engine(EngineFigures(kv_usage=0.1, preemptions=1, nixl_expired=0))  # restarted
    engine = res.snapshot(STARTED).engine
    assert (engine.kv_usage, engine.preemptions, engine.nixl_expired) == (0.1, 6, 2)


# ------------------------------------------------------------------ the report


def test_snapshot_passes_the_operators_decode() -> None:
    """Every field filled, and the operator's decoder accepts what we encode."""
    res, _ = make(kv_events=lambda: report.KVEvents(blocks_held=5, sessions_held=1))
    res.engine_healthy = True
    res.observe_engine(EngineFigures(kv_usage=0.25, nixl_bytes=1e6, nixl_seconds=0.5,
                                     p2p_tokens=100))  # fmt: skip
    res.observe_turn(turn(outcome=Outcome.REUSED, reused=900))
    res.observe_turn(turn(outcome=Outcome.REUSED, reused=950))
    snap = res.snapshot(STARTED + 60)
    decoded = report.decode(report.encode(snap))
    assert decoded == snap
    assert (decoded.version, decoded.server, decoded.namespace) == (
        report.REPORT_VERSION,
        "llama",
        "serving",
    )
    assert (decoded.pod, decoded.role, decoded.started_at) == ("llama-decode-0", "decode", STARTED)
    assert decoded.generated_at == STARTED + 60
    assert decoded.kv_events.blocks_held == 5
    assert decoded.engine.healthy is True
    assert decoded.transfer.bytes == 1_000_000
    assert decoded.gaps.total == 1


def test_snapshot_is_a_copy() -> None:
    """A report already handed out does not change under later turns."""
    res, _ = make()
    snap = res.snapshot(STARTED)
    res.observe_turn(turn())
    res.observe_turn(turn())
    assert snap.gaps.total == 0
    assert snap.outcomes == {}
