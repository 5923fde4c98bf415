"""The decode sidecar's handle store: one KV handle per session, single use.

Rules (each has a test named after it):
- single use: ``take`` removes the handle; a second request of the same session
  in flight gets none (vLLM frees D's blocks after the first completed read).
- expiry: a handle is dropped ``margin`` seconds before D frees its blocks; P would
  decline the read anyway (vLLM's own 5 s margin) or, without the deadline, read
  freed blocks.
- live bound: a handle is also dropped ``margin`` seconds before its receipt plus
  ``retention()`` *now* (the runtime passes the ceiling once D's size is known, the
  retention in force until then: ``Sidecar._offered_seconds``), so a change reaches
  the handles already held; D's deadline (``expires_at``, at most the ceiling) stays
  the bound. ``engine_expiring`` tells the two apart: a handle the
  policy let go while D still holds it must be released, one near D's deadline not.
- cap: at most ``cap`` handles; the lowest value goes first (the retention policy's
  ranking, ``retention.py``), the least recently stored without a policy.
- bound to the owner: with owners on (``owners.py``) a handle's slot digests its
  owner with the key, so another owner's turn looks up another slot and finds nothing.
- owner caps: an owner over its ``owners.Caps`` (handles, or the tokens they pin)
  loses its own handles, lowest value first, never another owner's; a handle alone
  over the token cap is not kept either.
- which goes first is ``first_to_evict`` alone (the eviction policy's one decision);
  every eviction is reported with its reason (``on_evict``) besides its fate.
- the policy decides when, within the bounds: with a ``RetentionPolicy`` every kept
  handle is observed (its session, tokens and blocks, its end: the retention in force
  or, for a turn D prefilled alone, D's lease, less the margin); ``release_due`` lets
  go what the policy releases now: under pressure (D's KV usage, its preemptions) the
  lowest value first (fate evicted, reason ``pressure``/``preemption``), and without
  pressure a handle whose usefulness ended (fate expired, reason ``usefulness``). The
  expiry rules above stay the outer bound: no handle is held past them, whatever the
  policy says (fate expired, reason ``retention`` or ``lease``). Its tests:
  ``tests/unit/sidecar/test_retention_wiring.py`` and ``test_retention_app.py``.
- clear: when the local engine restarts every handle points at freed memory.
- expired stays expired: a handle ``purge_expired`` dropped still makes the session's
  next ``take`` report EXPIRED (not NO_HANDLE), whichever saw the expiry first.

Clocks: vLLM stamps ``remote_blocks_expiry_time`` with D's ``time.perf_counter()``,
which on Linux is CLOCK_MONOTONIC, shared by every process on the node, so the
sidecar (same pod as D) can compare it with its own ``perf_counter``. The deadline
is also bounded by receipt time + D's hold (``retention_s`` of ``local_deadline``: the
ceiling, ``decoder_kv_blocks_ttl``, or D's lease for a turn it prefilled alone), and
an expiry on an unrecognised clock falls back to that bound alone.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvferry_wire import retention as rp
from kvferry_wire.protocol import Outcome

from .owners import EVICT_OWNER_HANDLES, EVICT_OWNER_TOKENS, EVICT_STORE_CAP, Caps, OwnerTag
from .types import K_REMOTE_EXPIRY, HandleFate, KVHandle, SessionTag

log = logging.getLogger(__name__)

Clock = Callable[[], float]
Retention = Callable[[], float]  # how long a handle is offered now (Sidecar._offered_seconds)
# A deadline further than retention + this from "now" is not on a clock we know.
CLOCK_SLACK_S = 60.0

# Why the store let a handle go before a turn read it, besides the caps (owners.EVICT_*):
# metric label; report.Evictions has one field each.
EVICT_PRESSURE = "pressure"  # D's KV usage above the policy's high-water mark
EVICT_PREEMPTION = "preemption"  # D preempted a request
EVICT_USEFULNESS = "usefulness"  # the policy: the session's next turn is not coming
EVICT_RETENTION = "retention"  # the retention in force (at most the ceiling) ran out
EVICT_LEASE = "lease"  # D's lease of a turn it prefilled alone ran out
# A finished turn's handle worth less than what it would displace, or larger than the
# handles' share of D's KV: not kept (released at birth).
EVICT_ADMISSION = "admission"
# The policy's release reasons as the store counts them, and the fate each gives: a
# handle let go for being out of time (usefulness, retention, lease) is expired, and
# the session's next turn is told so; one a cap or D's pressure took is evicted.
POLICY_REASONS: dict[str, tuple[str, HandleFate]] = {
    rp.REASON_PRESSURE: (EVICT_PRESSURE, HandleFate.EVICTED),
    rp.REASON_PREEMPTION: (EVICT_PREEMPTION, HandleFate.EVICTED),
    rp.REASON_CAP: (EVICT_STORE_CAP, HandleFate.EVICTED),
    rp.REASON_USELESS: (EVICT_USEFULNESS, HandleFate.EXPIRED),
    rp.REASON_CEILING: (EVICT_RETENTION, HandleFate.EXPIRED),
    rp.REASON_LEASE: (EVICT_LEASE, HandleFate.EXPIRED),
    rp.REASON_ADMISSION: (EVICT_ADMISSION, HandleFate.EVICTED),
}


def local_deadline(
    params: Mapping[str, Any],
    *,
    received_at: float,
    received_wall: float,
    retention_s: float,
) -> float:
    """D's block deadline on the store clock (perf_counter), never later than receipt +
    ``retention_s`` (D's own hold: the ceiling, or its lease)."""
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
EvictHook = Callable[[str, KVHandle], None]  # (owners.EVICT_* reason, the handle)
CapsSource = Callable[[], Caps]  # an owner's caps as of now (D's KV size may change)


def first_to_evict(
    handles: Iterable[KVHandle], policy: rp.RetentionPolicy | None = None, now: float = 0.0
) -> KVHandle:
    """Which of ``handles`` (oldest stored first) a cap evicts: the lowest value as the
    retention policy ranks them at ``now`` (the oldest among equals), the least
    recently stored without one. The eviction policy's one decision, here alone."""
    if policy is None:
        return next(iter(handles))
    by_session = {h.session: h for h in handles}
    return by_session[policy.lowest(by_session, now)]


class _Owned:
    """One owner's handles in the store, oldest stored first, and the tokens they pin."""

    __slots__ = ("slots", "tokens")

    def __init__(self) -> None:
        self.slots: OrderedDict[SessionTag, KVHandle] = OrderedDict()
        self.tokens = 0


class HandleStore:
    def __init__(
        self,
        *,
        cap: int,
        margin_s: float,
        engine_build: str | None = None,
        clock: Clock = time.perf_counter,
        on_drop: DropHook | None = None,
        on_evict: EvictHook | None = None,
        owner_caps: CapsSource | None = None,
        retention: Retention | None = None,
        policy: rp.RetentionPolicy | None = None,
    ) -> None:
        self._cap = cap
        self.policy = policy
        self._retention = retention
        self._on_evict = on_evict
        self._owner_caps = owner_caps
        self._owned: dict[OwnerTag, _Owned] = {}
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
        # Why the last ``put`` did not keep its handle (an EVICT_* reason), else None.
        self.refused_by: str | None = None

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
        ends = [] if handle.expires_at is None else [handle.expires_at]
        if self._retention is not None:
            ends.append(handle.created_at + self._retention())
        return min(ends) - self._margin_s if ends else None

    def is_expired(self, handle: KVHandle, now: float) -> bool:
        """No longer offered: within the margin of D's deadline or of the retention."""
        until = self._usable_until(handle)
        return until is not None and now >= until

    def engine_expiring(self, handle: KVHandle, now: float) -> bool:
        """Within the margin of D's own deadline: D frees it soon, releasing it is moot."""
        return handle.expires_at is not None and now >= handle.expires_at - self._margin_s

    def _pop(self, session: SessionTag) -> KVHandle | None:
        """Remove a handle from the store and from its owner's account."""
        handle = self._items.pop(session, None)
        if handle is not None and self.policy is not None:
            self.policy.forget(session)
        if handle is not None and handle.owner is not None:
            owned = self._owned[handle.owner]
            del owned.slots[session]
            owned.tokens -= handle.num_tokens
            if not owned.slots:
                del self._owned[handle.owner]
        return handle

    def _evict(self, handle: KVHandle, reason: str) -> None:
        self._pop(handle.session)
        if self._on_evict is not None:
            self._on_evict(reason, handle)
        self._drop(HandleFate.EVICTED, handle)

    def owner_figures(self, owner: OwnerTag) -> tuple[int, int]:
        """(handles, pinned tokens) the owner keeps here now."""
        owned = self._owned.get(owner)
        return (len(owned.slots), owned.tokens) if owned else (0, 0)

    def put(self, handle: KVHandle, *, previous: SessionTag | None = None) -> bool:
        """Keep ``handle`` for its session, replacing (and evicting) as the rules say;
        False when the handle itself went at once (admission refused it, or it is
        alone over its owner's token cap). ``previous``: the slot the turn looked up,
        whose gaps the policy carries on under the handle's
        (``session.next_handle_slot``)."""
        self._expired.pop(handle.session, None)
        self.refused_by = None
        old = self._pop(handle.session)
        if old is not None:
            self._drop(HandleFate.SUPERSEDED, old)
        self._items[handle.session] = handle
        if handle.owner is not None:
            owned = self._owned.setdefault(handle.owner, _Owned())
            owned.slots[handle.session] = handle
            owned.tokens += handle.num_tokens
        if handle.owner is not None and self._owner_caps is not None:
            # The owner's caps first: admission must not make room for a handle its
            # owner's caps then throw out.
            self._enforce(self._owned[handle.owner], self._owner_caps(), handle)
            if self._items.get(handle.session) is not handle:
                self.refused_by = EVICT_OWNER_TOKENS
        if self.policy is not None and self._items.get(handle.session) is handle:
            # Admission: kept only if worth what it displaces (kvferry_wire.retention).
            self._observe(handle, previous)
            releases = self.policy.take_releases()
            if any(r.session == handle.session for r in releases):
                self.refused_by = EVICT_ADMISSION
            self._apply(releases)
        while len(self._items) > self._cap:
            self._evict(self._first_to_evict(self._items.values(), handle), EVICT_STORE_CAP)
        return self._items.get(handle.session) is handle

    def _first_to_evict(self, handles: Iterable[KVHandle], new: KVHandle) -> KVHandle:
        """The cap's victim among ``handles``, never ``new`` (the handle being stored)
        while another can go: the policy has seen nothing of it since its turn ended,
        and put's answer (False) means "alone over its owner's token cap"."""
        others = [h for h in handles if h is not new]
        return first_to_evict(others or [new], self.policy, self._clock())

    def _bound(self, handle: KVHandle) -> tuple[float | None, bool]:
        """The seconds from its receipt the expiry rules let ``handle`` live (None: no
        bound known), and whether D's lease is that bound (a turn D prefilled alone)."""
        until = self._usable_until(handle)
        if until is None:
            return None, False
        # The lease bounds it unless the retention in force ends it sooner.
        by_lease = handle.lease_bound and handle.expires_at is not None
        if by_lease and self._retention is not None:
            by_lease = handle.expires_at <= handle.created_at + self._retention()
        return until - handle.created_at, by_lease

    def _observe(self, handle: KVHandle, previous: SessionTag | None) -> None:
        assert self.policy is not None
        hold, by_lease = self._bound(handle)
        self.policy.keep(
            handle.session,
            handle.created_at,
            handle.num_tokens,
            lease_s=hold if by_lease else None,
            retention_s=None if by_lease else hold,
            previous=previous,
        )

    def rebound(self) -> None:
        """The retention in force changed: each held handle's end follows it (a lower
        one ends them sooner, a higher one keeps them up to D's own deadline)."""
        if self.policy is None:
            return
        now = self._clock()
        for handle in self._items.values():
            hold, by_lease = self._bound(handle)
            if hold is not None:
                self.policy.rebound(
                    handle.session, handle.created_at + hold, by_lease=by_lease, now=now
                )

    def release_due(self, pressure: rp.Pressure = rp.NO_PRESSURE) -> int:
        """Let go what the policy releases now (module docstring): the handles past
        their end or their usefulness, then under ``pressure`` the lowest values until
        it is met. Each goes with its fate and reason (released on D by the drop hook).
        Returns how many went."""
        if self.policy is None:
            return 0
        return self._apply(self.policy.decide(self._clock(), pressure))

    def _apply(self, releases: list[rp.Release]) -> int:
        """Let go the handles the policy released, each with its fate and reason."""
        count = 0
        for release in releases:
            handle = self._items.get(release.session)
            if handle is None:
                continue
            reason, fate = POLICY_REASONS[release.reason]
            self._pop(release.session)
            if fate is HandleFate.EXPIRED:
                self._expired[release.session] = handle.created_at
            if self._on_evict is not None:
                self._on_evict(reason, handle)
            self._drop(fate, handle)
            count += 1
        self._trim_expired()
        return count

    def _enforce(self, owned: _Owned, caps: Caps, new: KVHandle) -> None:
        """The owner's own handles go, lowest value first, until it is within its caps."""
        while len(owned.slots) > caps.max_handles:
            self._evict(self._first_to_evict(owned.slots.values(), new), EVICT_OWNER_HANDLES)
        limit = caps.max_pinned_tokens
        while limit is not None and owned.slots and owned.tokens > limit:
            self._evict(self._first_to_evict(owned.slots.values(), new), EVICT_OWNER_TOKENS)

    def take(self, session: SessionTag) -> Lookup:
        """Remove and return the session's handle if it is still usable.

        Synchronous on purpose: with no await between the lookup and the removal,
        two requests of one session can never both get the handle.
        """
        handle = self._pop(session)
        if self.policy is not None:
            self.policy.arrive(session, self._clock())  # the session's gap, observed
        if handle is None:
            created = self._expired.pop(session, None)
            if created is not None:
                return Lookup(None, Outcome.EXPIRED, self._clock() - created)
            return Lookup(None, Outcome.NO_HANDLE)
        now = self._clock()
        age = now - handle.created_at
        if self.is_expired(handle, now):
            self._count_expiry(handle)
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
            handle = self._pop(session)
            if handle is None:
                continue
            self._expired[session] = handle.created_at
            self._count_expiry(handle)
            self._drop(HandleFate.EXPIRED, handle)
        self._trim_expired()
        return len(stale)

    def _count_expiry(self, handle: KVHandle) -> None:
        """An expiry rule let ``handle`` go: counted by its bound (retention or lease)."""
        if self._on_evict is not None:
            self._on_evict(EVICT_LEASE if handle.lease_bound else EVICT_RETENTION, handle)

    def _trim_expired(self) -> None:
        while len(self._expired) > self._cap:
            self._expired.popitem(last=False)

    def clear(self) -> int:
        """Forget every handle (the local engine restarted: its blocks are gone)."""
        count = len(self._items)
        self._expired.clear()
        self._owned.clear()
        while self._items:
            session, handle = self._items.popitem(last=False)
            if self.policy is not None:
                self.policy.forget(session)
            self._drop(HandleFate.CLEARED, handle)
        return count

    def values(self) -> list[KVHandle]:
        """The handles held now, oldest stored first."""
        return list(self._items.values())

    def ages(self) -> list[float]:
        now = self._clock()
        return [now - h.created_at for h in self._items.values()]
