"""The handle store's rules: single use, expiry margin, LRU cap, clear, build, owners."""

from __future__ import annotations

import dataclasses

import pytest

from kvferry_sidecar.handles import HandleStore, first_to_evict, local_deadline
from kvferry_sidecar.owners import EVICT_OWNER_HANDLES, EVICT_OWNER_TOKENS, EVICT_STORE_CAP, Caps
from kvferry_sidecar.session import handle_slot
from kvferry_sidecar.types import (
    HandleFate,
    KVHandle,
    token_array,
)
from kvferry_wire.protocol import Outcome

NOW = 1000.0
TTL = 480.0
MARGIN = 15.0
BUILD = "build-a"


class Clock:
    def __init__(self, now: float = NOW) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_handle(session: str = "s1", *, created: float = NOW, ttl: float | None = TTL) -> KVHandle:
    return KVHandle(
        session=session,
        params={"remote_block_ids": [[1, 2]], "remote_num_tokens": 7},
        token_ids=token_array(range(8)),
        num_tokens=7,
        engine_build=BUILD,
        created_at=created,
        expires_at=None if ttl is None else created + ttl,
    )


def make_store(clock: Clock, cap: int = 8, drops: list | None = None) -> HandleStore:
    def on_drop(fate: HandleFate, handle: KVHandle) -> None:
        if drops is not None:
            drops.append((fate, handle.session))

    return HandleStore(cap=cap, margin_s=MARGIN, engine_build=BUILD, clock=clock, on_drop=on_drop)


def test_handle_single_use() -> None:
    """A handle is returned once; the second take finds nothing."""
    # Bug prevented: two in-flight turns of a session both sending the handle; vLLM
    # frees D's blocks after the first read, the second would read freed memory.
    store = make_store(Clock())
    store.put(make_handle())
    first = store.take("s1")
    second = store.take("s1")
    assert first.handle is not None and first.outcome is Outcome.REUSED
    assert second.handle is None and second.outcome is Outcome.NO_HANDLE


def test_handle_usable_until_expiry_minus_margin() -> None:
    """Just inside expiry - margin the handle is still returned."""
    clock = Clock()
    store = make_store(clock)
    store.put(make_handle())
    clock.now = NOW + TTL - MARGIN - 0.001
    assert store.take("s1").handle is not None


def test_handle_expiry_margin_drops_handle() -> None:
    """At expiry - margin the handle is refused as expired, with its age."""
    # Bug prevented: sending P a handle D frees before P reads it (P declines reads
    # within 5 s of the deadline; without a deadline it would read freed blocks).
    clock = Clock()
    store = make_store(clock)
    store.put(make_handle())
    clock.now = NOW + TTL - MARGIN
    lookup = store.take("s1")
    assert lookup.handle is None
    assert lookup.outcome is Outcome.EXPIRED
    assert lookup.age_s == pytest.approx(TTL - MARGIN)


def test_handle_purge_expired() -> None:
    """purge_expired drops only handles past their margin."""
    clock = Clock()
    drops: list = []
    store = make_store(clock, drops=drops)
    store.put(make_handle("old", created=NOW - 470))
    store.put(make_handle("new"))
    assert store.purge_expired() == 1
    assert "old" not in store and "new" in store
    assert drops == [(HandleFate.EXPIRED, "old")]


def test_handle_purged_as_expired_is_reported_expired() -> None:
    """A turn after the background purge dropped its handle is EXPIRED, with the age."""
    # Bug prevented (seen with real engines): the purge runs every probe interval, so
    # the next turn found nothing and reported no-handle; `expired` was never seen.
    clock = Clock()
    store = make_store(clock)
    store.put(make_handle())
    clock.now = NOW + TTL - MARGIN + 1
    assert store.purge_expired() == 1
    lookup = store.take("s1")
    assert lookup.handle is None and lookup.outcome is Outcome.EXPIRED
    assert lookup.age_s == pytest.approx(TTL - MARGIN + 1)
    assert store.take("s1").outcome is Outcome.NO_HANDLE  # reported once
    # A newer handle of the session, or an engine restart, forgets the expiry.
    store.put(make_handle(created=clock.now))
    assert store.take("s1").outcome is Outcome.REUSED
    store.put(make_handle(created=NOW))
    store.purge_expired()
    store.clear()
    assert store.take("s1").outcome is Outcome.NO_HANDLE


def test_handle_lru_cap_evicts_oldest() -> None:
    """Past the cap the least recently stored handle is evicted."""
    drops: list = []
    store = make_store(Clock(), cap=2, drops=drops)
    for session in ("a", "b", "c"):
        store.put(make_handle(session))
    assert len(store) == 2
    assert "a" not in store
    assert drops == [(HandleFate.EVICTED, "a")]


def test_handle_newer_turn_supersedes() -> None:
    """Storing a session's next handle replaces the old one and refreshes its LRU slot."""
    drops: list = []
    store = make_store(Clock(), cap=2, drops=drops)
    store.put(make_handle("a"))
    store.put(make_handle("b"))
    store.put(make_handle("a"))
    store.put(make_handle("c"))
    assert drops == [(HandleFate.SUPERSEDED, "a"), (HandleFate.EVICTED, "b")]
    assert "a" in store and "c" in store


def test_handle_store_clear_on_engine_restart() -> None:
    """clear() forgets every handle and reports each as cleared."""
    drops: list = []
    store = make_store(Clock(), drops=drops)
    store.put(make_handle("a"))
    store.put(make_handle("b"))
    assert store.clear() == 2
    assert len(store) == 0
    assert {fate for fate, _ in drops} == {HandleFate.CLEARED}


def test_handle_of_other_engine_build_is_void() -> None:
    """A handle made by another engine build is refused (NIXL would reject the pair)."""
    store = make_store(Clock())
    other = make_handle()
    store.put(KVHandle(**{**other.__dict__, "engine_build": "build-b"}))
    assert store.take("s1").outcome is Outcome.EXPIRED


def test_handle_without_deadline_never_expires_by_clock() -> None:
    """A handle with no known deadline is only dropped by LRU or use."""
    clock = Clock()
    store = make_store(clock)
    store.put(make_handle(ttl=None))
    clock.now = NOW + 10 * TTL
    assert store.take("s1").handle is not None


class TestLocalDeadline:
    """remote_blocks_expiry_time is D's perf_counter; the store works on the same clock."""

    def test_same_node_monotonic_deadline_is_used(self) -> None:
        """A deadline on the receipt clock is taken as is."""
        assert local_deadline(
            {"remote_blocks_expiry_time": NOW + 100},
            received_at=NOW,
            received_wall=1.7e9,
            retention_s=TTL,
        ) == pytest.approx(NOW + 100)

    def test_wall_clock_deadline_is_rebased(self) -> None:
        """A unix-time deadline is rebased onto the receipt clock."""
        assert local_deadline(
            {"remote_blocks_expiry_time": 1.7e9 + 200},
            received_at=NOW,
            received_wall=1.7e9,
            retention_s=TTL,
        ) == pytest.approx(NOW + 200)

    def test_unknown_clock_falls_back_to_retention(self) -> None:
        """A deadline on no recognisable clock leaves receipt + retention."""
        assert local_deadline(
            {"remote_blocks_expiry_time": 5.0e6},
            received_at=NOW,
            received_wall=1.7e9,
            retention_s=TTL,
        ) == pytest.approx(NOW + TTL)

    def test_deadline_never_exceeds_retention(self) -> None:
        """A deadline later than receipt + retention is capped."""
        assert local_deadline(
            {"remote_blocks_expiry_time": NOW + TTL + 30},
            received_at=NOW,
            received_wall=1.7e9,
            retention_s=TTL,
        ) == pytest.approx(NOW + TTL)


# ------------------------------------------------------------------ owners


def owned_handle(session: str, owner: str, *, tokens: int = 7) -> KVHandle:
    return dataclasses.replace(make_handle(session), owner=owner, num_tokens=tokens)


def owned_store(
    caps: Caps, *, cap: int = 8, drops: list | None = None, evictions: list | None = None
) -> HandleStore:
    def on_drop(fate: HandleFate, handle: KVHandle) -> None:
        if drops is not None:
            drops.append((fate, handle.session))

    def on_evict(reason: str, handle: KVHandle) -> None:
        if evictions is not None:
            evictions.append((reason, handle.session))

    return HandleStore(
        cap=cap,
        margin_s=MARGIN,
        engine_build=BUILD,
        clock=Clock(),
        on_drop=on_drop,
        on_evict=on_evict,
        owner_caps=lambda: caps,
    )


def test_handle_owner_caps_evict_the_owners_oldest_never_another_owners() -> None:
    # Bug prevented: one client filling the store pushes every other client's handles
    # out (the store's LRU cap alone), pinning most of D's KV for itself.
    drops: list = []
    evictions: list = []
    store = owned_store(Caps(2, None), drops=drops, evictions=evictions)
    store.put(owned_handle("b1", "bob"))
    for slot in ("a1", "a2", "a3"):
        store.put(owned_handle(slot, "alice"))
    assert evictions == [(EVICT_OWNER_HANDLES, "a1")]
    assert drops == [(HandleFate.EVICTED, "a1")]
    assert [h.session for h in store.values()] == ["b1", "a2", "a3"]
    assert store.owner_figures("alice") == (2, 14)
    assert store.owner_figures("bob") == (1, 7)


def test_handle_owner_caps_count_pinned_tokens() -> None:
    evictions: list = []
    store = owned_store(Caps(8, 20), evictions=evictions)
    store.put(owned_handle("a1", "alice", tokens=10))
    store.put(owned_handle("b1", "bob", tokens=15))
    store.put(owned_handle("a2", "alice", tokens=10))
    assert evictions == []
    store.put(owned_handle("a3", "alice", tokens=5))
    assert evictions == [(EVICT_OWNER_TOKENS, "a1")]
    assert store.owner_figures("alice") == (2, 15)


def test_handle_owner_caps_do_not_keep_a_handle_alone_over_the_token_cap() -> None:
    evictions: list = []
    store = owned_store(Caps(8, 20), evictions=evictions)
    assert store.put(owned_handle("a1", "alice", tokens=25)) is False
    assert evictions == [(EVICT_OWNER_TOKENS, "a1")]
    assert len(store) == 0 and store.owner_figures("alice") == (0, 0)


def test_handle_owner_accounts_follow_take_supersede_purge_and_clear() -> None:
    store = owned_store(Caps(8, None))
    store.put(owned_handle("a1", "alice"))
    store.put(owned_handle("a1", "alice", tokens=9))  # superseded
    store.put(owned_handle("a2", "alice"))
    assert store.owner_figures("alice") == (2, 16)
    store.take("a2")
    assert store.owner_figures("alice") == (1, 9)
    store.clear()
    assert store.owner_figures("alice") == (0, 0)


def test_handle_bound_to_the_owner() -> None:
    """Another owner sending the same key looks up another slot: nothing found."""
    alices = handle_slot("session_id=s", {}, "own-alice")
    bobs = handle_slot("session_id=s", {}, "own-bob")
    store = owned_store(Caps(8, None))
    store.put(owned_handle(alices, "own-alice"))
    assert store.take(bobs).outcome is Outcome.NO_HANDLE
    assert store.take(alices).outcome is Outcome.REUSED


def test_handle_store_cap_evicts_across_owners_with_its_own_reason() -> None:
    evictions: list = []
    store = owned_store(Caps(8, None), cap=2, evictions=evictions)
    for slot, owner in (("a1", "alice"), ("b1", "bob"), ("c1", "carol")):
        store.put(owned_handle(slot, owner))
    assert evictions == [(EVICT_STORE_CAP, "a1")]
    assert store.owner_figures("alice") == (0, 0)


def test_handle_first_to_evict_is_the_least_recently_stored() -> None:
    handles = [make_handle("old"), make_handle("new")]
    assert first_to_evict(handles).session == "old"
