"""The Releaser's rules (release.py), one test each, without a Sidecar: a fake send
function, a hand-moved clock and a list of the release methods counted."""

from __future__ import annotations

import asyncio

from kvferry_sidecar.release import (
    PINNED_EXPIRING,
    PINNED_NO_PREFILL,
    PINNED_PULL_FAILED,
    PINNED_RELEASE_FAILED,
    PINNED_RELEASING,
    RELEASE_FAILED,
    RELEASE_REQUEST,
    RELEASE_RIDER,
    RELEASE_UNRELEASABLE,
    Releaser,
    release_params,
)
from kvferry_sidecar.types import KVHandle, PrefillResult, token_array
from kvferry_wire.protocol import Outcome, Route

MARGIN_S = 10.0
PULL = {"remote_request_id": "pull", "remote_num_tokens": 64}


def handle(rid: str, expires: float | None = 500.0) -> KVHandle:
    return KVHandle(
        session=f"s-{rid}",
        params={"remote_request_id": rid, "remote_block_ids": [[1, 2]], "remote_num_tokens": 64},
        token_ids=token_array([5, 6]),
        num_tokens=64,
        engine_build=None,
        created_at=100.0,
        expires_at=expires,
    )


class Fixture:
    """A Releaser with what it is given recorded: the handles sent, the methods counted."""

    def __init__(self, *, after_s: float = 1000.0, concurrency: int = 4) -> None:
        self.now = 200.0
        self.sent: list[str] = []
        self.counted: list[str] = []
        self.answer: str | None = None  # what the send function returns
        self.gate: asyncio.Event | None = None  # when set, sends wait for it
        self.in_flight = 0
        self.most_in_flight = 0
        self.started = asyncio.Event()
        self.releaser = Releaser(
            send=self.send,
            clock=lambda: self.now,
            expired=lambda h, now: h.expires_at is not None and now >= h.expires_at - MARGIN_S,
            count=self.counted.append,
            retention_s=480.0,
            after_s=after_s,
            concurrency=concurrency,
        )

    async def send(self, h: KVHandle) -> str | None:
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        self.started.set()
        if self.gate is not None:
            await self.gate.wait()
        self.sent.append(str(h.params["remote_request_id"]))
        self.in_flight -= 1
        return self.answer

    def reason(self, h: KVHandle) -> str | None:
        return self.releaser.ledger.reason(h)

    async def settle(self) -> None:
        """Let call_later(0) fire and every release request finish."""
        for _ in range(100):
            await asyncio.sleep(0)
            if self.releaser.idle:
                return
            await self.releaser.sent()
        raise AssertionError("releases did not finish")


async def test_waits_for_a_ride() -> None:
    """A handle to release first waits for a prefill that carries nothing of its own:
    that prefill takes it (the oldest waiting first) and P's answer frees it, free."""
    f = Fixture()
    old, new = handle("old"), handle("new")
    f.releaser.release(old)
    f.releaser.release(new)
    assert f.reason(old) == PINNED_RELEASING and not f.sent
    with f.releaser.ride(None, None) as ride:
        assert ride.params() == release_params(old.params)
        assert ride.answered() is False  # not the turn's own handle
    assert f.reason(old) is None and f.reason(new) == PINNED_RELEASING
    assert f.counted == [RELEASE_RIDER] and not f.sent


async def test_waits_then_a_request_of_its_own() -> None:
    """No ride within ``after_s``: a one-token release request carries it."""
    f = Fixture(after_s=0.0)
    h = handle("h")
    f.releaser.release(h)
    await f.settle()
    assert f.sent == ["h"] and f.counted == [RELEASE_REQUEST]
    assert f.reason(h) is None and f.releaser.figures().handles == 0


async def test_a_prefill_with_its_own_handle_takes_no_rider() -> None:
    f = Fixture()
    waiting, own = handle("waiting"), handle("own")
    f.releaser.release(waiting)
    with f.releaser.ride(PULL, own) as ride:
        assert ride.params() == PULL and ride.pulling
        assert ride.answered() is True  # P read the session's handle
    with f.releaser.ride(None, own) as ride:
        assert ride.params() == release_params(own.params)
        assert ride.answered() is True  # P registered an empty pull for it
    assert f.reason(waiting) == PINNED_RELEASING and f.counted == []


async def test_expiring_is_not_released() -> None:
    """Within the expiry margin D frees it shortly: pinned, no request, no method."""
    f = Fixture(after_s=0.0)
    h = handle("h", expires=205.0)
    f.releaser.release(h)
    await f.settle()
    assert f.reason(h) == PINNED_EXPIRING and not f.sent and f.counted == []


async def test_an_expiring_rider_is_not_taken() -> None:
    f = Fixture()
    h = handle("h", expires=215.0)
    f.releaser.release(h)
    f.now = 206.0
    with f.releaser.ride(None, None) as ride:
        assert ride.params() is None
    assert f.reason(h) == PINNED_EXPIRING and f.counted == []


async def test_pinned_until_settled() -> None:
    """In the ledger from hand-over until P took its release; a failed request leaves
    it there until D's deadline, counted as failed (or unreleasable: no P)."""
    f = Fixture(after_s=0.0)
    f.gate = asyncio.Event()
    failed, no_prefill = handle("failed"), handle("no-prefill")
    f.releaser.release(failed)
    await f.started.wait()
    assert f.reason(failed) == PINNED_RELEASING and f.releaser.figures().handles == 1
    f.answer = PINNED_RELEASE_FAILED
    f.gate.set()
    await f.settle()
    f.answer = PINNED_NO_PREFILL
    f.releaser.release(no_prefill)
    await f.settle()
    assert f.reason(failed) == PINNED_RELEASE_FAILED
    assert f.reason(no_prefill) == PINNED_NO_PREFILL
    assert f.counted == [RELEASE_FAILED, RELEASE_UNRELEASABLE]
    f.now = 500.0  # D's deadline
    assert f.releaser.figures().handles == 0 and f.releaser.purge() == 2


def test_without_a_loop_it_stays_pinned() -> None:
    f = Fixture()
    h = handle("h")
    f.releaser.release(h)
    assert f.reason(h) == PINNED_RELEASE_FAILED and f.counted == [RELEASE_FAILED]
    assert f.releaser.idle


async def test_bounded() -> None:
    """At most ``concurrency`` release requests are in flight at once."""
    f = Fixture(after_s=0.0, concurrency=2)
    f.gate = asyncio.Event()
    for i in range(5):
        f.releaser.release(handle(f"h{i}"))
    await f.started.wait()
    for _ in range(20):
        await asyncio.sleep(0)  # give every waiting request its chance to start
    assert f.in_flight == 2
    f.gate.set()
    await f.settle()
    assert f.most_in_flight == 2 and len(f.sent) == 5
    assert f.counted == [RELEASE_REQUEST] * 5


async def test_nothing_sent_twice() -> None:
    """An attempt that broke off ends the ride: later attempts carry nothing. A queued
    rider is pinned pull-failed; the turn's own handle or pull is unknown."""
    f = Fixture()
    queued, own = handle("queued"), handle("own")
    f.releaser.release(queued)
    with f.releaser.ride(None, None) as ride:
        ride.broke_off()
        assert ride.params() is None and not ride.taken_unknown
    assert f.reason(queued) == PINNED_PULL_FAILED and f.counted == [RELEASE_UNRELEASABLE]
    assert f.releaser.idle  # not waiting again
    with f.releaser.ride(None, own) as ride:
        ride.broke_off()
        assert ride.params() is None and ride.taken_unknown
        assert ride.answered() is False
    with f.releaser.ride(PULL, own) as ride:
        ride.broke_off()
        assert ride.params() is None and not ride.pulling and ride.taken_unknown
    assert f.counted == [RELEASE_UNRELEASABLE]  # the turn settles its own handle


async def test_an_unsent_rider_waits_again() -> None:
    """A queued rider on a prefill that never reached P goes back to waiting."""
    f = Fixture()
    h = handle("h")
    f.releaser.release(h)
    with f.releaser.ride(None, None) as ride:
        assert ride.params() is not None
    assert not f.releaser.idle and f.reason(h) == PINNED_RELEASING
    with f.releaser.ride(None, None) as ride:
        assert ride.params() == release_params(h.params)


async def test_settle_on_take() -> None:
    """The turn's taken handle after its prefill: a rider when P freed it without
    reading it, pinned when unknown, released otherwise; read by P counts nothing."""
    f = Fixture()
    read, rode, unknown, unsent = (handle(r) for r in ("read", "rode", "unknown", "unsent"))
    remote = PrefillResult(Route.REMOTE, Outcome.REUSED, None, handle_freed=True)
    f.releaser.settle_taken(read, remote)
    assert f.counted == [] and f.reason(read) is None
    ridden = PrefillResult(Route.REMOTE, Outcome.MISALIGNED, None, handle_freed=True)
    f.releaser.settle_taken(rode, ridden)
    assert f.counted == [RELEASE_RIDER] and f.reason(rode) is None
    broken = PrefillResult(Route.FALLBACK, Outcome.PULL_FAILED, None, handle_unknown=True)
    f.releaser.settle_taken(unknown, broken)
    assert f.reason(unknown) == PINNED_PULL_FAILED
    assert f.counted == [RELEASE_RIDER, RELEASE_UNRELEASABLE]
    skipped = PrefillResult(Route.SKIP, Outcome.SKIPPED_PREFILL, None)
    f.releaser.settle_taken(unsent, skipped)
    assert f.reason(unsent) == PINNED_RELEASING and not f.releaser.idle
    f.releaser.settle_taken(None, skipped)  # no handle taken: nothing to do
    assert len(f.releaser.ledger) == 2


async def test_release_all_on_stop() -> None:
    """Stopping sends every held and waiting handle at once and waits for them."""
    f = Fixture()
    f.releaser.release(handle("waiting"))
    await f.releaser.release_all([handle("held")], timeout_s=5.0)
    assert sorted(f.sent) == ["held", "waiting"] and f.releaser.idle
    assert f.counted == [RELEASE_REQUEST, RELEASE_REQUEST]


async def test_cancel_leaves_them_pinned() -> None:
    f = Fixture(after_s=0.0)
    f.gate = asyncio.Event()  # never set: the request hangs
    h = handle("h")
    f.releaser.release(h)
    await f.started.wait()
    await f.releaser.cancel()
    assert f.releaser.idle and f.reason(h) == PINNED_RELEASING and f.counted == []
