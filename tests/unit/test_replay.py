"""The simulator runs the sidecar's policy as the sidecar runs it (``retention.Wiring``),
and admission: a finished turn's handle is kept only while it is worth more than what it
displaces (``kvferry_wire.retention``, ``kvferry_wire.replay``)."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from bench import eviction as ev
from kvferry_sidecar.config import Settings
from kvferry_sidecar.runtime import Sidecar
from kvferry_sidecar.types import KVHandle, token_array
from kvferry_wire import replay, retention
from kvferry_wire.protocol import HANDLE_EXPIRY_MARGIN_SECONDS

COSTS = retention.Costs(2e-3, 5e-5, 16_384.0, 32)


@settings(max_examples=25, deadline=None)
@given(
    retention_s=st.floats(20, 3600),
    ceiling=st.one_of(st.none(), st.floats(20, 7200)),
    cap=st.integers(1, 5000),
    tick=st.floats(0.1, 30),
    release_after=st.floats(0, 30),
)
def test_the_sidecar_and_the_simulator_build_one_policy(
    retention_s: float, ceiling: float | None, cap: int, tick: float, release_after: float
) -> None:
    s = Settings(
        retention_seconds=retention_s,
        retention_ceiling_seconds=ceiling,
        handle_store_cap=cap,
        probe_interval_seconds=tick,
        release_after_seconds=release_after,
    )
    wiring = retention.Wiring.of(s)
    sidecar = Sidecar(s)
    # The same limits from the same settings: ceiling, cap, high water, release window.
    assert sidecar.retention.limits == wiring.limits()
    assert (wiring.tick_s, wiring.release_after_s) == (tick, release_after)
    # A handle is offered for the same time in both: the store's bound is the wiring's.
    handle = KVHandle(
        session="s",
        params={},
        token_ids=token_array([1, 2, 3]),
        num_tokens=3,
        engine_build=None,
        created_at=100.0,
        expires_at=None,
    )
    # Until D's size is known (no admission, no KV pressure) the retention in force
    # ends a handle; from then on, as in the replay (which knows D from its first
    # tick), the ceiling does, the retention in force the floor of usefulness.
    hold, by_lease = sidecar.store._bound(handle)
    assert not by_lease and hold is not None
    assert math.isclose(hold, wiring.floor_s - HANDLE_EXPIRY_MARGIN_SECONDS)
    sidecar.retention.observe_engine(retention.Pressure(0, 1000), now=0.0)
    hold, by_lease = sidecar.store._bound(handle)
    assert not by_lease
    assert hold is not None and math.isclose(hold, wiring.hold_s())
    assert wiring.hold_s() == wiring.ceiling_s - HANDLE_EXPIRY_MARGIN_SECONDS
    assert sidecar.retention.limits.min_retention_s == min(retention_s, wiring.hold_s())


def held_policy(total: int, handles: list[tuple[str, float, int]]) -> retention.RetentionPolicy:
    pol = retention.RetentionPolicy(COSTS, retention.Limits(max_retention_s=1000.0))
    for session, t, tokens in handles:
        pol.keep(session, t, tokens)
    pol.observe_engine(retention.Pressure(pol.held_blocks, total), now=100.0)
    pol.take_releases()
    return pol


@settings(max_examples=150, deadline=None)
@given(
    old=st.lists(st.tuples(st.floats(0, 99), st.integers(1, 2000)), min_size=1, max_size=12),
    new_tokens=st.integers(1, 3000),
    gaps=st.lists(st.floats(0.5, 600), max_size=20),
    room=st.integers(0, 40),
)
def test_making_room_never_releases_more_value_than_it_admits(
    old: list[tuple[float, int]], new_tokens: int, gaps: list[float], room: int
) -> None:
    handles = [(f"s{i}", t, tokens) for i, (t, tokens) in enumerate(old)]
    pol = retention.RetentionPolicy(COSTS, retention.Limits(max_retention_s=1000.0))
    for i, g in enumerate(gaps):  # some sessions with gaps of their own
        pol.arrive(f"s{i % len(handles)}", 0.0)
        pol.arrive(f"s{i % len(handles)}", g)
    for session, t, tokens in handles:
        pol.keep(session, t, tokens)
    used = pol.held_blocks
    total = math.ceil((used + room) / pol.limits.kv_high_water) + 1
    pol.observe_engine(retention.Pressure(used, total), now=100.0)
    before = {s: (pol.value(h, 100.0), pol.worth(h, 100.0)) for s, h in pol.held.items()}
    kept = pol.keep("new", 100.0, new_tokens)
    releases = pol.take_releases()
    share = pol.share_blocks()
    assert share is not None
    displaced = [r for r in releases if r.session != "new"]
    if kept is None:
        assert [r.session for r in releases] == ["new"]
        assert releases[0].reason == retention.REASON_ADMISSION
        return
    # Kept: it fits now, and whatever made room was worth less than it is.
    assert pol.held_blocks <= share
    new = pol.held["new"]
    assert sum(before[r.session][1] for r in displaced) < pol.worth(new, 100.0) or not displaced
    assert all(before[r.session][0] < pol.value(new, 100.0) for r in displaced)
    assert all(r.reason == retention.REASON_PRESSURE for r in displaced)


def test_a_handle_larger_than_the_share_is_released_at_birth() -> None:
    pol = held_policy(100, [("a", 0.0, 320)])  # 10 blocks of a 100-block D (share 90)
    assert pol.keep("big", 10.0, 91 * 32) is None
    (release,) = pol.take_releases()
    assert (release.session, release.reason) == ("big", retention.REASON_ADMISSION)
    assert "a" in pol.held  # nothing flushed for a handle that could not stay


def test_a_newcomer_worth_less_than_the_kept_handle_is_refused_not_kept_by_flushing() -> None:
    # The two-handle trace: A keeps 256 tokens read 10 s later; B's 128-token turn
    # arrives between them and is never read. Only one fits. Keeping the newest (the
    # old policy) flushed A and saved nothing; a fixed TTL refuses B and saves 256.
    turns = [
        ev.Turn("A", 0.0, prompt_tokens=192, new_tokens=192, output_tokens=64),  # 8 blocks
        ev.Turn("B", 1.0, prompt_tokens=96, new_tokens=96, output_tokens=32),  # 4 blocks
        ev.Turn("A", 10.0, prompt_tokens=288, new_tokens=32, output_tokens=0),  # reads 256
    ]
    capacity = 13  # room for B's request beside A; share floor(0.9 x 13) = 11: A or B
    fixed = ev.run_fixed(turns, capacity, ev.VLLM_TTL_S)
    value = ev.run_value(turns, capacity)
    assert fixed.tokens_saved == 256
    assert value.tokens_saved == 256
    assert value.evictions[retention.REASON_ADMISSION] == 1


def test_the_replay_offers_a_handle_until_the_ceiling_less_the_margin() -> None:
    wiring = ev.sidecar_wiring()  # 480 s in force (the floor), ceiling 1800
    hold = wiring.hold_s()
    assert hold == 1800 - HANDLE_EXPIRY_MARGIN_SECONDS
    for gap, hits in ((hold - 1, 1), (hold + 1, 0)):
        turns = [
            ev.Turn("A", 0.0, prompt_tokens=64, new_tokens=64, output_tokens=0),
            ev.Turn("A", gap, prompt_tokens=96, new_tokens=32, output_tokens=0),
        ]
        fig = replay.replay(turns, wiring, COSTS, 10_000)
        assert fig.hits == hits
