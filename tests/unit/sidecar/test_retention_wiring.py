"""The handle store with the retention policy wired in (handles.py, retention.py): which
handle goes first under a cap or D's pressure, and when each is let go without
pressure. A fake clock, no engine, no sleeps: each test moves the clock and calls what
the sidecar's background loop calls (``release_due``, ``purge_expired``)."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry_sidecar.handles import (
    EVICT_LEASE,
    EVICT_PRESSURE,
    EVICT_RETENTION,
    EVICT_STORE_CAP,
    EVICT_USEFULNESS,
    HandleStore,
)
from kvferry_sidecar.types import HandleFate, KVHandle, token_array
from kvferry_wire import retention as r
from kvferry_wire.protocol import Outcome

T0 = 10_000.0
TTL = 480.0  # D's deadline from a handle's receipt (the ceiling)
MARGIN = 15.0
HOLD = TTL - MARGIN  # what the expiry rules let a handle live
LEASE = 30.0  # D's lease of a turn it prefilled alone
BUILD = "build-a"
BLOCK = 16
COSTS = r.nominal_costs(BLOCK)


class Clock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@dataclasses.dataclass
class Rig:
    """A store with a policy, its clock, and what it let go: (reason, session) of each
    eviction and (fate, session) of each drop."""

    clock: Clock
    store: HandleStore
    evictions: list[tuple[str, str]]
    drops: list[tuple[HandleFate, str]]

    @property
    def policy(self) -> r.RetentionPolicy:
        assert self.store.policy is not None
        return self.store.policy

    def turn(self, session: str, at: float, *, tokens: int = 1000, lease: bool = False) -> None:
        """A turn of ``session`` at ``at``: it looks its handle up and keeps its own."""
        self.clock.now = at
        self.store.take(session)
        self.store.put(handle(session, at, tokens=tokens, lease=lease))

    def run_until(self, end: float, step: float = 1.0) -> None:
        """The background loop, every ``step`` seconds up to ``end``: release_due only
        (the expiry rules' own purge is left out, so what goes is the policy's doing)."""
        while self.clock.now + step <= end:
            self.clock.now += step
            self.store.release_due()

    def gone(self, session: str) -> tuple[str, str] | None:
        return next((e for e in self.evictions if e[1] == session), None)


def handle(session: str, at: float, *, tokens: int = 1000, lease: bool = False) -> KVHandle:
    blocks = COSTS.blocks(tokens)
    return KVHandle(
        session=session,
        params={"remote_block_ids": [list(range(blocks))], "remote_num_tokens": tokens},
        token_ids=token_array(range(tokens + 1)),
        num_tokens=tokens,
        engine_build=BUILD,
        created_at=at,
        expires_at=at + (LEASE if lease else TTL),
        lease_bound=lease,
    )


def rig(*, cap: int = 64, retention: float | None = None, policy: bool = True) -> Rig:
    clock = Clock()
    evictions: list[tuple[str, str]] = []
    drops: list[tuple[HandleFate, str]] = []
    pol = r.RetentionPolicy(COSTS, r.Limits(max_retention_s=HOLD, handle_cap=cap))
    store = HandleStore(
        cap=cap,
        margin_s=MARGIN,
        engine_build=BUILD,
        clock=clock,
        on_drop=lambda fate, h: drops.append((fate, h.session)),
        on_evict=lambda reason, h: evictions.append((reason, h.session)),
        retention=(lambda: retention) if retention is not None else None,
        policy=pol if policy else None,
    )
    return Rig(clock, store, evictions, drops)


def ended_sessions(rg: Rig, n: int = 20) -> float:
    """``n`` sessions of ten turns 3 s apart that then stopped for a whole ceiling: the
    server has seen quick gaps and sessions that end. Returns the time after them."""
    for i in range(n):
        for _ in range(10):
            rg.turn(f"old{i}", rg.clock.now + 3.0)
    rg.run_until(rg.clock.now + HOLD + 100, step=50.0)
    assert rg.policy.ended == n
    assert not rg.store.values()
    rg.evictions.clear()
    rg.drops.clear()
    return rg.clock.now


def test_over_the_cap_the_lowest_value_goes_not_the_oldest() -> None:
    """The store's cap takes the human's handle (minutes between turns), not the
    agent's (2 s tool gaps), although the agent's was stored first."""
    # Bug prevented: the least recently stored going first, which under a full store
    # drops the agent handle its next turn reads in seconds to keep a human's for minutes.
    rg = rig(cap=2)
    for t in (0, 120, 240, 360):
        rg.turn("human", T0 + t)
    for t in range(470, 482, 2):
        rg.turn("agent", T0 + t)
    rg.turn("human", T0 + 480.5)  # stored after the agent's last
    rg.turn("new", T0 + 481)  # a third handle, a second after the agent's: the cap is two
    assert rg.evictions == [(EVICT_STORE_CAP, "human")]
    assert sorted(h.session for h in rg.store.values()) == ["agent", "new"]
    assert (HandleFate.EVICTED, "human") in rg.drops


def test_without_a_policy_the_cap_takes_the_oldest_as_before() -> None:
    """The same turns through a store without a policy: the least recently stored."""
    rg = rig(cap=2, policy=False)
    for t in (0, 120, 240, 360):
        rg.turn("human", T0 + t)
    for t in range(470, 482, 2):
        rg.turn("agent", T0 + t)
    rg.turn("human", T0 + 480.5)
    rg.turn("new", T0 + 481)
    assert rg.evictions == [(EVICT_STORE_CAP, "agent")]


def test_a_quick_session_goes_after_its_predicted_end_while_a_chat_session_is_kept() -> None:
    """Without pressure, on a server whose quick sessions stop: an agent loop of 3 s
    steps that stopped is released within a minute of its last step (usefulness), its
    next turn told ``expired``; a chat session of 5-minute gaps, stored before it, is
    kept for its own pattern (minutes), then goes too, before its bound."""
    # Bug prevented: every handle held to the retention in force alike, the agent's
    # pinning D for minutes after its loop ended, or the chat's dropped with it.
    rg = rig()
    start = ended_sessions(rg, 60)
    last_chat = start + 600.0
    turns = [(start + 300.0 * k, "chat") for k in range(3)]
    turns += [(last_chat - 80.0 + 3.0 * k, "agent") for k in range(30)]  # to last_chat + 7
    for t, session in sorted(turns):
        rg.turn(session, t)
    last_agent = last_chat + 7.0
    while "agent" in rg.store and rg.clock.now < last_agent + 60:
        rg.run_until(rg.clock.now + 1)
    assert rg.gone("agent") == (EVICT_USEFULNESS, "agent")
    assert (HandleFate.EXPIRED, "agent") in rg.drops
    assert rg.clock.now - last_agent > 3.0  # not before its own gaps passed
    lookup = rg.store.take("agent")
    assert lookup.outcome is Outcome.EXPIRED
    # The chat session, within its own 5-minute pattern, is held on.
    assert rg.gone("chat") is None and "chat" in rg.store
    rg.run_until(last_chat + 280)
    assert "chat" in rg.store
    rg.run_until(last_chat + HOLD - 1)
    assert rg.gone("chat") == (EVICT_USEFULNESS, "chat")


def test_the_policy_releases_nothing_before_its_deadline() -> None:
    """Between a handle's keeping and the policy's next deadline release_due lets
    nothing go; at the deadline the quick session goes (the timer the loop relies on)."""
    rg = rig()
    start = ended_sessions(rg)
    for k in range(30):
        rg.turn("agent", start + 3.0 * k)
    deadline = rg.policy.next_deadline()
    assert deadline is not None and rg.clock.now < deadline < rg.clock.now + HOLD
    rg.clock.now = deadline - 0.01
    assert rg.store.release_due() == 0 and "agent" in rg.store
    rg.clock.now = deadline
    assert rg.store.release_due() == 1
    assert rg.evictions == [(EVICT_USEFULNESS, "agent")]


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 5), st.floats(0.5, 400), st.booleans()),
        min_size=1,
        max_size=30,
    ),
    st.sampled_from([None, 60.0, 200.0]),
)
def test_no_handle_outlives_its_bound_by_the_policy_alone(turns, retention) -> None:
    """Whatever the sessions do, release_due alone (no purge) lets every handle go by
    the earlier of D's deadline, the retention in force and D's lease, less the margin:
    the policy's end is the store's own bound."""
    rg = rig(retention=retention)
    for session, gap, lease in turns:
        rg.turn(f"s{session}", rg.clock.now + gap, lease=lease)
        rg.store.release_due()
        for h in rg.store.values():
            hold = LEASE if h.lease_bound else TTL
            if retention is not None:
                hold = min(hold, retention)
            assert rg.clock.now < h.created_at + hold - MARGIN
    rg.run_until(rg.clock.now + TTL, step=7.0)
    assert rg.store.values() == []


def test_the_retention_in_force_ends_a_handle_the_policy_would_keep() -> None:
    """A live retention of 60 s: the handle goes at 45 s (60 less the margin), counted
    as ``retention``, expired; a lower retention told later ends the held ones sooner."""
    live = {"s": 60.0}
    clock = Clock()
    evictions: list[tuple[str, str]] = []
    store = HandleStore(
        cap=8,
        margin_s=MARGIN,
        engine_build=BUILD,
        clock=clock,
        on_evict=lambda reason, h: evictions.append((reason, h.session)),
        retention=lambda: live["s"],
        policy=r.RetentionPolicy(COSTS, r.Limits(max_retention_s=HOLD)),
    )
    store.put(handle("a", T0))
    clock.now = T0 + 44.9
    assert store.release_due() == 0
    clock.now = T0 + 45.0
    assert store.release_due() == 1 and evictions == [(EVICT_RETENTION, "a")]
    store.put(handle("b", clock.now))
    live["s"] = 30.0
    store.rebound()  # what the live policy's change hook calls
    clock.now += 15.0
    assert store.release_due() == 1 and evictions[-1] == (EVICT_RETENTION, "b")


def test_a_lease_bounded_handle_is_in_the_same_accounting() -> None:
    """A turn D prefilled alone: held by the policy to its lease (30 s less the margin),
    released then as ``lease``; under D's pressure it is ranked with the others."""
    rg = rig()
    rg.turn("local", T0, lease=True)
    held = rg.policy.held["local"]
    assert held.bounded_by_lease and held.end == T0 + LEASE - MARGIN
    rg.run_until(T0 + LEASE - MARGIN - 1)
    assert "local" in rg.store
    rg.run_until(T0 + LEASE - MARGIN)
    assert rg.evictions == [(EVICT_LEASE, "local")]

    rg.turn("long", rg.clock.now + 1)
    rg.turn("local", rg.clock.now + 1, lease=True)
    need = COSTS.blocks(1000)  # one handle's blocks over the high-water mark
    used = 2 * need
    total = int(used / rg.policy.limits.kv_high_water)
    pressure = r.Pressure(kv_used_blocks=used + need, kv_total_blocks=total)
    now = rg.clock.now
    lowest = min(("long", "local"), key=lambda s: rg.policy.value(rg.policy.held[s], now))
    assert rg.store.release_due(pressure) == 1
    assert [e for e in rg.evictions if e[0] == EVICT_PRESSURE] == [(EVICT_PRESSURE, lowest)]
    assert len(rg.store) == 1


def test_pressure_of_engine_reads_usage_in_blocks_and_preemptions() -> None:
    """D's KV usage fraction of its blocks, rounded up; unknown usage is no pressure
    (its size is still told: admission needs it)."""
    assert r.Pressure.of_engine(0.5, 1001, 2) == r.Pressure(501, 1001, 2)
    assert r.Pressure.of_engine(None, 1000, 1) == r.Pressure(0, 1000, preemptions=1)
    assert r.Pressure.of_engine(0.9, None, -3) == r.Pressure()


def test_the_slot_a_turn_looked_up_carries_its_gaps_to_the_next_slot() -> None:
    """A conversation whose next turn looks up another slot (session.next_handle_slot)
    keeps its gaps: the policy files them under the new slot."""
    rg = rig()
    slots = [f"slot{k}" for k in range(6)]
    for k, slot in enumerate(slots[1:]):
        rg.clock.now = T0 + 2.0 * k
        rg.store.take(slots[k])
        rg.store.put(handle(slot, rg.clock.now), previous=slots[k])
    assert rg.policy.chance(slots[-1], 0.0, 5.0) > rg.policy.chance("never-seen", 0.0, 5.0)
