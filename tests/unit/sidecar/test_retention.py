"""The retention policy's rules (sidecar/retention.py), one test per rule: pure, no
engine; hypothesis where the rule holds for every input."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry_wire import retention as r

COSTS = r.Costs(
    recompute_s_per_token=2.017e-3, pull_s_per_token=5.6e-5, bytes_per_token=16_531, block_tokens=32
)
CEILING = 1785.0


def policy(**limits: float) -> r.RetentionPolicy:
    return r.RetentionPolicy(COSTS, r.Limits(max_retention_s=CEILING, **limits))  # type: ignore[arg-type]


def feed(pol: r.RetentionPolicy, session: str, times: list[float], tokens: int = 1000) -> None:
    for t in times:
        pol.observe_turn(session, t, tokens)


def full(pol: r.RetentionPolicy, extra_blocks: int) -> r.Pressure:
    """D's KV exactly at the high-water mark plus ``extra_blocks``."""
    used = sum(COSTS.blocks(h.tokens) for h in pol.held.values())
    return r.Pressure(kv_used_blocks=used + extra_blocks, kv_total_blocks=used, preemptions=0)


# A session: its turn times as gaps after a start.
sessions_st = st.lists(
    st.tuples(
        st.floats(0, 100),
        st.lists(st.floats(0.5, 900), min_size=0, max_size=6),
        st.integers(1, 20_000),
    ),
    min_size=1,
    max_size=8,
)


def replay(pol: r.RetentionPolicy, sessions: list[tuple[float, list[float], int]]) -> float:
    """Turns of every session in time order; returns the last turn's time."""
    turns = []
    for i, (start, gaps, tokens) in enumerate(sessions):
        t = start
        turns.append((t, f"s{i}", tokens))
        for g in gaps:
            t += g
            turns.append((t, f"s{i}", tokens))
    turns.sort()
    for t, s, tokens in turns:
        pol.observe_turn(s, t, tokens)
    return turns[-1][0]


@settings(max_examples=60, deadline=None)
@given(sessions_st, st.integers(1, 2000))
def test_under_pressure_the_lowest_value_goes_first(sessions, need_blocks) -> None:
    pol = policy(kv_high_water=1.0, min_retention_s=CEILING)
    now = replay(pol, sessions) + 1.0
    pol.decide(now)  # what is past its end goes first, pressure or not
    values = {s: pol.value(h, now) for s, h in pol.held.items()}
    out = pol.decide(now, full(pol, need_blocks))
    released = {x.session for x in out}
    assert {x.reason for x in out} <= {r.REASON_PRESSURE}
    kept = [v for s, v in values.items() if s not in released]
    if kept and released:
        assert max(values[s] for s in released) <= min(kept)
    # enough went to meet the need, and no more than one beyond it
    freed = sum(COSTS.blocks(x.tokens) for x in out)
    assert freed >= need_blocks or not pol.held
    if out:
        assert freed - COSTS.blocks(out[-1].tokens) < need_blocks


@settings(max_examples=60, deadline=None)
@given(
    sessions_st,
    st.lists(st.floats(0, 4000), min_size=1, max_size=10),
    st.one_of(st.none(), st.floats(1, 3000)),
)
def test_nothing_outlives_its_end(sessions, checks, lease) -> None:
    pol = policy()
    last = replay(pol, sessions)
    pol.observe_turn("leased", last, 500, lease_s=lease)
    for now in sorted(last + c for c in checks):
        for x in pol.decide(now):
            assert x.reason in r.REASONS
        for h in pol.held.values():
            assert now < h.end <= h.t + CEILING
            if lease is not None and h.session == "leased":
                assert h.end <= h.t + lease


@settings(max_examples=40, deadline=None)
@given(sessions_st, st.floats(0, 3000))
def test_no_release_before_the_next_deadline(sessions, wait) -> None:
    """A timer on ``next_deadline`` misses nothing: before it, decide releases nothing."""
    pol = policy()
    last = replay(pol, sessions)
    deadline = pol.next_deadline()
    assert deadline is not None
    now = last + wait
    if now < deadline:
        assert pol.decide(now) == []
    else:
        pol.decide(deadline)


def test_a_session_with_second_gaps_keeps_its_handle_past_a_minute_session_under_pressure() -> None:
    pol = policy(kv_high_water=1.0)
    feed(pol, "human", [0, 120, 240, 360, 480])
    feed(pol, "agent", [470, 472, 474, 476, 478, 480])  # 2 s tool gaps
    # Both handles were just stored and hold the same tokens; D needs one block.
    out = pol.decide(481, full(pol, 1))
    assert [x.session for x in out] == ["human"]
    assert out[0].reason == r.REASON_PRESSURE
    assert list(pol.held) == ["agent"]


def ended_sessions(pol: r.RetentionPolicy, n: int = 20) -> float:
    """``n`` sessions of ten turns 3 s apart that ended (no turn for a ceiling): the
    server has seen gaps and sessions that stop. Returns a time after them."""
    for i in range(n):
        feed(pol, f"old{i}", [3.0 * k for k in range(10)])
    pol.decide(CEILING + 100)
    assert pol.ended == n
    return CEILING + 100


def released_at(pol: r.RetentionPolicy, session: str) -> tuple[float, str]:
    """Run the policy's timer (decide at each next deadline) until ``session`` goes."""
    while (d := pol.next_deadline()) is not None:
        for x in pol.decide(d):
            if x.session == session:
                return d, x.reason
    raise AssertionError(f"{session} was never released")


def test_usefulness_ends_past_every_gap_seen() -> None:
    """Without pressure a session of 3 s gaps, on a server whose sessions stop, goes a
    few minutes after its turns stop, long before the ceiling."""
    pol = policy()
    start = ended_sessions(pol)
    feed(pol, "a", [start + 3.0 * i for i in range(60)])
    stored = start + 3.0 * 59
    deadline = pol.next_deadline()
    assert deadline is not None and 30 < deadline - stored < 300
    assert pol.decide(deadline - 1) == []
    out = pol.decide(deadline)
    assert [(x.session, x.reason) for x in out] == [("a", r.REASON_USELESS)]


def test_a_heavy_tail_keeps_the_handle_longer() -> None:
    quick, tailed = policy(), policy()
    start = ended_sessions(quick)
    assert ended_sessions(tailed) == start
    quick_times = [start + 3.0 * i for i in range(60)]
    feed(quick, "a", quick_times)
    times = [start]
    for i in range(59):
        times.append(times[-1] + (600.0 if i % 10 == 9 else 3.0))
    feed(tailed, "a", times)
    q, q_reason = released_at(quick, "a")
    t, t_reason = released_at(tailed, "a")
    assert (q_reason, t_reason) == (r.REASON_USELESS, r.REASON_USELESS)
    # kept through its own 600 s pauses; the quick one gone long before
    assert t - times[-1] >= 600 > 2 * (q - quick_times[-1])


def test_usefulness_is_not_judged_before_the_minimum_retention() -> None:
    pol = policy(min_retention_s=480)
    start = ended_sessions(pol)
    feed(pol, "a", [start + 3.0 * i for i in range(60)])
    assert released_at(pol, "a") == (pytest.approx(start + 177 + 480), r.REASON_USELESS)


def test_a_lease_bounds_the_handle_of_a_turn_d_prefilled_alone() -> None:
    pol = policy()
    pol.observe_turn("a", 10.0, 800, lease_s=75)
    assert pol.held["a"].end == 85.0 and pol.held["a"].bounded_by_lease
    assert [(x.session, x.reason) for x in pol.decide(85.0)] == [("a", r.REASON_LEASE)]


def test_the_ceiling_ends_a_handle_that_is_still_useful() -> None:
    pol = policy()
    pol.observe_turn("a", 0.0, 800)
    assert pol.held["a"].end == CEILING
    assert [(x.session, x.reason) for x in pol.decide(CEILING)] == [("a", r.REASON_CEILING)]


def test_single_use_the_turn_takes_the_handle_and_leaves_its_own() -> None:
    pol = policy()
    assert pol.observe_turn("a", 0.0, 500) is None
    taken = pol.observe_turn("a", 5.0, 900)
    assert taken is not None and (taken.t, taken.tokens) == (0.0, 500)
    assert pol.held["a"].tokens == 900
    assert pol.observe_turn("a", 6.0, 0).tokens == 900  # type: ignore[union-attr]
    assert "a" not in pol.held  # a turn with no KV leaves nothing


def test_over_the_cap_the_lowest_value_goes() -> None:
    pol = policy(handle_cap=2)
    feed(pol, "human", [0, 300, 600])
    feed(pol, "agent", [590, 592, 594, 596, 598, 600])
    pol.observe_turn("new", 600, 1000)  # no gaps: the server's
    out = pol.decide(601)
    assert [x.reason for x in out] == [r.REASON_CAP]
    assert out[0].session == "human"
    assert len(pol.held) == 2


def test_each_preemption_releases_the_lowest_value() -> None:
    pol = policy()
    feed(pol, "human", [0, 300, 600])
    feed(pol, "agent", [590, 592, 594, 596, 598, 600])
    out = pol.decide(601, r.Pressure(preemptions=1))
    assert [(x.session, x.reason) for x in out] == [("human", r.REASON_PREEMPTION)]


def test_a_request_waiting_for_blocks_releases_the_lowest_value_once() -> None:
    # D runs nothing and a request waits for room, under the high-water mark: vLLM
    # counts no preemption, but the request waits for KV blocks all the same.
    pol = policy(release_window_s=4.0)
    feed(pol, "human", [0, 300, 600])
    feed(pol, "agent", [590, 592, 594, 596, 598, 600])
    stalled = r.Pressure(kv_used_blocks=10, kv_total_blocks=100, stalled=1)
    out = pol.decide(601, stalled)
    assert [(x.session, x.reason) for x in out] == [("human", r.REASON_PREEMPTION)]
    assert pol.decide(601.5, stalled) == []  # its release is on its way


def test_the_chance_blends_the_session_with_the_server() -> None:
    """Dirichlet-process predictive: K pseudo-gaps of the server's distribution, then
    the session's own; with none of its own the session is the server's."""
    pol = policy(prior_weight=2.0)
    feed(pol, "slow", [0, 600, 1200])  # server: two 600 s gaps
    feed(pol, "fast", [2000, 2001])  # and one 1 s gap
    fresh = pol.chance("unknown", 0, 10)
    fast = pol.chance("fast", 0, 10)
    assert fast > fresh > 0
    assert pol.continues() == pytest.approx((3 + 1) / (3 + 0 + 2))
    assert 0.0 <= pol.chance("slow", 10, 1000) <= 1.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_retention_s": 0}, "max_retention_s"),
        ({"max_retention_s": 10, "kv_high_water": 1.5}, "kv_high_water"),
        ({"max_retention_s": 10, "min_retention_s": 20}, "min_retention_s"),
        ({"max_retention_s": 10, "prior_weight": 0}, "prior_weight"),
    ],
)
def test_bad_limits_are_refused_with_the_field(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        r.Limits(**kwargs)


def test_bad_costs_are_refused_with_the_field() -> None:
    with pytest.raises(ValueError, match="recompute_s_per_token"):
        r.Costs(0, 0, 1, 1)
    with pytest.raises(ValueError, match="block_tokens"):
        r.Costs(1, 0, 1, 0)
    assert COSTS.blocks(33) == 2 and COSTS.pinned_bytes(33) == 64 * 16_531
    assert math.isclose(COSTS.saving_per_token, 2.017e-3 - 5.6e-5)


def test_k_follows_how_much_sessions_differ() -> None:
    """Buhlmann-Straub credibility: sessions all alike make a session's own gaps noise
    (large K); agents beside people make them the evidence (small K)."""
    alike, apart = policy(), policy()
    for i in range(8):
        # the same two gaps, 30 s and 120 s, in every session
        feed(alike, f"c{i}", [i * 1000 + t for t in (0, 30, 150, 180, 300)])
        gap = 2.0 if i % 2 else 120.0  # every other session an agent
        feed(apart, f"m{i}", [i * 1000 + gap * k * (1 + 0.1 * (k % 2)) for k in range(5)])
    # 40 turns each: K was refreshed at the 32nd (r.K_EVERY_TURNS), from 6 sessions
    assert alike.prior_weight == r.K_BOUNDS[1]
    assert apart.prior_weight < 1.0


def test_k_is_the_default_until_sessions_have_gaps() -> None:
    pol = policy()
    for i in range(r.K_EVERY_TURNS):  # one session's gaps only: nothing to compare
        pol.observe_turn("a", 5.0 * i, 100)
    assert pol.prior_weight == r.K_DEFAULT
    assert policy(prior_weight=7.0).prior_weight == 7.0
