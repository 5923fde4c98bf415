"""The decode sidecar's handle store: one KV handle per session, single use.

Rules (each has a test named after it):
- single use: ``take`` removes the handle; a second request of the same session
  in flight gets none (vLLM frees D's blocks after the first completed read).
- expiry: a handle is dropped ``margin`` seconds before D frees its blocks; P would
  decline the read anyway (vLLM's own 5 s margin) or, without the deadline, read
  freed blocks.
- LRU cap: at most ``cap`` handles; the least recently stored goes first.
- clear: when the local engine restarts every handle points at freed memory.
- expired stays expired: a handle ``purge_expired`` dropped still makes the session's
  next ``take`` report EXPIRED (not NO_HANDLE), whichever saw the expiry first.

Clocks: vLLM stamps ``remote_blocks_expiry_time`` with D's ``time.perf_counter()``,
which on Linux is CLOCK_MONOTONIC, shared by every process on the node, so the
sidecar (same pod as D) can compare it with its own ``perf_counter``. The deadline
is also bounded by receipt time + retention, and an expiry on an unrecognised clock
falls back to that bound alone.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvferry_wire.protocol import Outcome

from .types import K_REMOTE_EXPIRY, HandleFate, KVHandle, SessionTag

log = logging.getLogger(__name__)

Clock = Callable[[], float]
# A deadline further than retention + this from "now" is not on a clock we know.
CLOCK_SLACK_S = 60.0


def local_deadline(
    params: Mapping[str, Any],
    *,
    received_at: float,
    received_wall: float,
    retention_s: float,
) -> float:
    """D's block deadline on the store clock (perf_counter), never later than receipt +
    retention."""
    bound = received_at + retention_s
    raw = params.get(K_REMOTE_EXPIRY)
    if not isinstance(raw, (int, float)) or isinstance(raw, bool):
        return bound
    window = retention_s + CLOCK_SLACK_S
    if abs(raw - received_at) <= window:  # D's perf_counter: same node, same clock
        return min(bound, float(raw))
    if abs(raw - received_wall) <= window:  # a wall-clock deadline (other builds)
        return min(bound, received_at + (raw - received_wall))
    log.debug("handle expiry on an unknown clock value=%s; using retention", raw)
    return bound


@dataclass(frozen=True)
class Lookup:
    """The result of ``take``: a usable handle, or why there is none."""

    handle: KVHandle | None
    outcome: Outcome  # REUSED when a handle is returned (alignment may still drop it)
    age_s: float | None = None


DropHook = Callable[[HandleFate, KVHandle], None]


class HandleStore:
    def __init__(
        self,
        *,
        cap: int,
        margin_s: float,
        engine_build: str | None = None,
        clock: Clock = time.perf_counter,
        on_drop: DropHook | None = None,
    ) -> None:
        self._cap = cap
        self._margin_s = margin_s
        self._engine_build = engine_build
        self._clock = clock
        self._on_drop = on_drop
        self._items: OrderedDict[SessionTag, KVHandle] = OrderedDict()
        # Sessions whose handle purge_expired dropped -> that handle's created_at. The
        # background purge runs every probe interval, so without this a turn arriving
        # after its handle expired almost always found nothing and was counted as
        # no-handle (seen with real engines: `expired` was never reported).
        self._expired: OrderedDict[SessionTag, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, session: SessionTag) -> bool:
        return session in self._items

    def now(self) -> float:
        return self._clock()

    def _drop(self, fate: HandleFate, handle: KVHandle) -> None:
        if self._on_drop is not None:
            self._on_drop(fate, handle)

    def _usable_until(self, handle: KVHandle) -> float | None:
        return None if handle.expires_at is None else handle.expires_at - self._margin_s

    def is_expired(self, handle: KVHandle, now: float) -> bool:
        until = self._usable_until(handle)
        return until is not None and now >= until

    def put(self, handle: KVHandle) -> None:
        """Keep ``handle`` for its session, replacing (and evicting) as the rules say."""
        self._expired.pop(handle.session, None)
        old = self._items.pop(handle.session, None)
        if old is not None:
            self._drop(HandleFate.SUPERSEDED, old)
        self._items[handle.session] = handle
        while len(self._items) > self._cap:
            _, evicted = self._items.popitem(last=False)
            self._drop(HandleFate.EVICTED, evicted)

    def take(self, session: SessionTag) -> Lookup:
        """Remove and return the session's handle if it is still usable.

        Synchronous on purpose: with no await between the lookup and the removal,
        two requests of one session can never both get the handle.
        """
        handle = self._items.pop(session, None)
        if handle is None:
            created = self._expired.pop(session, None)
            if created is not None:
                return Lookup(None, Outcome.EXPIRED, self._clock() - created)
            return Lookup(None, Outcome.NO_HANDLE)
        now = self._clock()
        age = now - handle.created_at
        if self.is_expired(handle, now):
            self._drop(HandleFate.EXPIRED, handle)
            return Lookup(None, Outcome.EXPIRED, age)
        if handle.engine_build != self._engine_build:
            # Another engine build cannot read these blocks (NIXL compatibility hash).
            self._drop(HandleFate.EXPIRED, handle)
            return Lookup(None, Outcome.EXPIRED, age)
        self._drop(HandleFate.TAKEN, handle)
        return Lookup(handle, Outcome.REUSED, age)

    def purge_expired(self) -> int:
        """Drop every handle past expiry - margin; returns how many."""
        now = self._clock()
        stale = [s for s, h in self._items.items() if self.is_expired(h, now)]
        for session in stale:
            handle = self._items.pop(session)
            self._expired[session] = handle.created_at
            self._drop(HandleFate.EXPIRED, handle)
        while len(self._expired) > self._cap:
            self._expired.popitem(last=False)
        return len(stale)

    def clear(self) -> int:
        """Forget every handle (the local engine restarted: its blocks are gone)."""
        count = len(self._items)
        self._expired.clear()
        while self._items:
            _, handle = self._items.popitem(last=False)
            self._drop(HandleFate.CLEARED, handle)
        return count

    def values(self) -> list[KVHandle]:
        """The handles held now, oldest stored first."""
        return list(self._items.values())

    def ages(self) -> list[float]:
        now = self._clock()
        return [now - h.created_at for h in self._items.values()]
