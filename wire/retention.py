"""Per-session, value-based retention of decode KV handles. Pure.

The decode sidecar keeps one handle per session: the KV of its last turn, pinned in D
until the next turn reads it. This module decides whether a finished turn's handle is
kept at all, how long each stays and which goes first when D needs the room. The
decode sidecar's handle store holds one (``HandleStore.policy``), built from the
sidecar's settings by ``Wiring`` (``build``): every handle it keeps is ``keep``-ed here
with its end (the ceiling or D's lease, less the expiry margin) and admitted or not
(``take_releases``), every lookup is an ``arrive`` (the session's gap), its caps take
the lowest value (``lowest``), and the sidecar's background loop applies ``decide``
each probe interval with D's pressure from its /metrics (``Pressure.of_engine``):
releases go through the store's drop hook to the release path. The store's expiry
rules stay the outer bound. ``replay.py`` replays traces through the same ``Wiring``
(``make bench-eviction``, ``what-if --capacity-gb``).

**Value.** A handle of n tokens saves, if the session's next turn reads it,
``n x (recompute - pull)`` seconds of prefill (``Costs``), and pins
``blocks(n) x block bytes``. Its value at elapsed time a since the turn is that saving
x P(the next turn arrives in (a, end] | none by a) / pinned bytes, where ``end`` is
when the handle must go anyway: the ceiling (``maxRetentionSeconds``, D's
``decoder_kv_blocks_ttl`` less the expiry margin) or, for a turn D prefilled alone, D's
lease (``observe_turn(lease_s=...)``). Both bounds are in the same structure and the
same value: a lease-bounded handle is worth less as its lease runs out.

**The chance of a next turn.** ``P(gap in (a, T] | gap > a) = c (F(T) - F(a)) / (1 - c F(a))``
where c is the chance that a session continues at all and F the distribution of its
gaps. F is the posterior predictive of a Dirichlet process whose base measure is the
server's gap distribution: ``F(x) = (#own gaps <= x + K F_server(x)) / (n_own + K)``
with K pseudo-gaps. Why this estimator: a session with no history behaves like the
server's sessions; each gap of its own moves it towards its own pattern (agent tool
loops seconds apart, a human minutes apart), with no fitted shape (gaps are
multi-modal: tool calls and a human's pause in one session); it needs only counts, so
it is cheap per handle. The session keeps its last ``OWN_GAPS`` gaps (its pattern may
change).

K is how far a session's own few gaps are to be trusted, so it is estimated from how
much sessions differ: Buhlmann-Straub credibility on the log-gaps, K = (the variance
within a session) / (the variance of the sessions' means), over the sessions with at
least two gaps, refreshed every ``K_EVERY_TURNS`` turns. Sessions all alike (every
chat drawing from one distribution) give a large K: a session's own gaps are noise
and the server's distribution decides; agents beside people give a small K: a
session's own gaps decide. ``Limits.prior_weight`` fixes K instead; before
``K_MIN_SESSIONS`` sessions have two gaps it is ``K_DEFAULT``.

The server's distribution is a ``kvferry_wire.report.Histogram`` on the report's
``GAP_BOUNDS`` (linear within a bucket), the same one the operator merges from every
pod, plus ``PRIOR_GAPS`` pseudo-gap log-uniform over [1 s, ceiling], so that a handful
of gaps does not yet say that none comes later. c is Laplace's estimate from the
server's gaps and its ended sessions (a session with no turn for a whole ceiling
ended): ``(gaps + 1) / (gaps + ended + 2)``.

**Rules** (each has a test named after it, ``tests/unit/sidecar/test_retention.py``):

- admission: a finished turn's handle stays only if it fits in the handles' share of
  D's KV (``share_blocks``: the high-water mark less what D's running requests claim),
  or if the handles it would displace are each worth less per pinned byte-second and
  all together less per second held (``worth``) than it is; one larger than the whole
  share goes at birth (``REASON_ADMISSION``). Making room never releases more value
  than it admits (``tests/unit/test_replay.py``);
- under pressure the lowest value goes first: when D's KV usage is above
  ``Limits.kv_high_water`` (the blocks above it), per preemption or request waiting
  for KV blocks (``Pressure.stalled``), or over the handle cap,
  handles are released in order of value until the need is met;
- usefulness ends: without pressure a handle is released when the best expected saving
  per pinned byte-second of keeping it any longer, ``max_T saving x P(a, T) / (bytes x (T - a))``,
  falls below the floor: ``Limits.min_hit`` (1 %) of a hit spread over the whole ceiling,
  ``min_hit x (recompute - pull) / (bytes per token x ceiling)``. A handle whose session
  has no chance left of a turn before its end (past every gap seen) goes; a heavy tail
  keeps it; never before ``Limits.min_retention_s`` (the retention in force,
  ``decodeRetentionSeconds`` or Auto's: ``set_floor``), so without pressure it keeps at
  least what that fixed TTL would;
- K follows how much sessions differ (credibility), the default until they have gaps;
- nothing outlives its end: the ceiling, or the lease of a turn D prefilled alone;
- a release is not met twice: blocks released within ``Limits.release_window_s`` still
  count in D's usage until their release lands, so pressure and preemptions are not
  answered again for them;
- single use: the turn that reads a handle takes it (``observe_turn`` and ``arrive``
  return it) and leaves its own;
- the gaps follow the conversation: a turn that keeps its handle under another slot
  than it looked up (``keep(previous=...)``) carries its gaps there;
- every release names its reason (``REASON_*``).
"""

from __future__ import annotations

import math
from bisect import bisect_right, insort
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from itertools import pairwise
from typing import TYPE_CHECKING

from .protocol import HANDLE_EXPIRY_MARGIN_SECONDS
from .report import GAP_BOUNDS, Histogram

if TYPE_CHECKING:
    from .settings import SidecarSettings

REASON_CEILING = "ceiling"  # maxRetentionSeconds reached
REASON_LEASE = "lease"  # D's lease of a turn it prefilled alone ran out
REASON_USELESS = "usefulness"  # expected saving per byte-second below the floor
REASON_PRESSURE = "pressure"  # D's KV usage above the high-water mark
REASON_PREEMPTION = "preemption"  # D preempted a request
REASON_CAP = "cap"  # more handles than the cap
REASON_ADMISSION = "admission"  # not kept: worth less than it would displace, or too big
REASONS = (
    REASON_CEILING,
    REASON_LEASE,
    REASON_USELESS,
    REASON_PRESSURE,
    REASON_PREEMPTION,
    REASON_CAP,
    REASON_ADMISSION,
)
# D's KV usage above this share is pressure (vLLM keeps a watermark of free blocks
# too, and new requests need room before the next look).
KV_HIGH_WATER = 0.90

# Pseudo-gaps, log-uniform over [1 s, ceiling], in the server's distribution.
PRIOR_GAPS = 1.0
# Buhlmann-Straub K: refreshed this often, from this many sessions with two gaps on,
# within these bounds (a session's own gaps never count for nothing, nor for all).
K_EVERY_TURNS = 32
K_MIN_SESSIONS = 3
K_DEFAULT = 2.0
K_BOUNDS = (0.5, 1000.0)
# A session's own gaps kept: enough to learn its pattern, few enough to follow a change.
OWN_GAPS = 16
# Sessions remembered (~300 B each): the least recently seen is forgotten first (its
# handle, if one is still held, is then judged as a session with no gaps of its own).
MAX_SESSIONS = 100_000


@dataclass(frozen=True)
class Costs:
    """What a token costs: to recompute on P, to pull from D, and to pin in D."""

    recompute_s_per_token: float
    pull_s_per_token: float
    bytes_per_token: float
    block_tokens: int

    def __post_init__(self) -> None:
        if self.recompute_s_per_token <= 0 or self.pull_s_per_token < 0:
            raise ValueError("costs: recompute_s_per_token > 0 and pull_s_per_token >= 0")
        if self.bytes_per_token <= 0 or self.block_tokens < 1:
            raise ValueError("costs: bytes_per_token > 0 and block_tokens >= 1")

    @property
    def saving_per_token(self) -> float:
        return max(0.0, self.recompute_s_per_token - self.pull_s_per_token)

    def blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_tokens)

    def pinned_bytes(self, tokens: int) -> float:
        return self.blocks(tokens) * self.block_tokens * self.bytes_per_token


def nominal_costs(block_tokens: int) -> Costs:
    """Costs for ranking and releasing handles in a sidecar that has not measured its
    own: a handle's value is ``saving_per_token x tokens / pinned bytes x ...`` and the
    usefulness floor ``min_hit x saving_per_token / (bytes_per_token x ceiling)``, so the
    saving and the bytes per token cancel out of every decision; only the block
    rounding (D's block size) and a saving above zero matter. The figures are the
    engine tier's (docs/performance.md): recompute 2 ms a token, a pull 56 us, 16 KiB."""
    return Costs(2.0e-3, 5.6e-5, 16_384.0, max(1, block_tokens))


@dataclass(frozen=True)
class Limits:
    max_retention_s: float  # the ceiling: no handle is kept longer
    handle_cap: int = 10_000
    kv_high_water: float = KV_HIGH_WATER  # D's KV usage above this share is pressure
    min_hit: float = 0.01  # the floor: this chance of a hit over the whole ceiling
    # K: the server's distribution counts as K gaps of a session; None: estimated
    # from how much the sessions differ (module docstring).
    prior_weight: float | None = None
    # Without pressure no handle goes for usefulness before this (the server's
    # decodeRetentionSeconds): the policy then never keeps less than that fixed TTL would.
    min_retention_s: float = 0.0
    # A released handle's blocks count in D's usage until its release lands: what it
    # released this long ago is taken as still pinned (not met twice, not running).
    release_window_s: float = 0.0

    def __post_init__(self) -> None:
        if self.max_retention_s <= 0 or self.handle_cap < 1:
            raise ValueError("limits: max_retention_s > 0 and handle_cap >= 1")
        if not 0 < self.kv_high_water <= 1 or not 0 < self.min_hit < 1:
            raise ValueError("limits: kv_high_water in (0, 1], min_hit in (0, 1)")
        if self.prior_weight is not None and self.prior_weight <= 0:
            raise ValueError("limits: prior_weight > 0")
        if not 0 <= self.min_retention_s <= self.max_retention_s:
            raise ValueError("limits: 0 <= min_retention_s <= max_retention_s")


@dataclass(frozen=True)
class Pressure:
    """D's state as the caller sees it now (blocks: D's KV blocks, used and total)."""

    kv_used_blocks: int = 0
    kv_total_blocks: int = 0
    preemptions: int = 0  # since the last decide
    # Requests waiting for KV blocks now (enginemetrics.EngineFigures.stalled): each
    # asks for room as a preemption does, whatever the usage.
    stalled: int = 0

    @classmethod
    def of_engine(
        cls, kv_usage: float | None, total_blocks: int | None, preemptions: int, stalled: int = 0
    ) -> Pressure:
        """From D's /metrics (``enginemetrics``): its KV usage fraction of its
        ``num_gpu_blocks``, and the preemptions since the last look. An unknown usage
        or size is no KV pressure (preemptions still count); a known size is kept."""
        if not total_blocks:
            return cls(preemptions=max(0, preemptions), stalled=max(0, stalled))
        if kv_usage is None:  # D's size without its usage: no KV pressure known
            return cls(0, total_blocks, max(0, preemptions), max(0, stalled))
        used = math.ceil(min(1.0, max(0.0, kv_usage)) * total_blocks)
        return cls(used, total_blocks, max(0, preemptions), max(0, stalled))


NO_PRESSURE = Pressure()

# A ceiling within the expiry margin leaves no time to hold a handle; the policy still
# needs a positive one (the store's expiry rules then let every handle go at once).
MIN_POLICY_CEILING_S = 1.0


@dataclass(frozen=True)
class Wiring:
    """How a decode sidecar runs the policy, all of it from its settings: the one
    description the sidecar (``kvferry_sidecar.runtime``) and the simulator
    (``replay.py``, ``make bench-eviction``, ``what-if --capacity-gb``) build from, so
    the two cannot drift (``tests/unit/test_replay.py``).

    A handle is offered until the ceiling (D's ``decoder_kv_blocks_ttl``) less the
    expiry margin; the retention in force is its floor: no handle goes for usefulness
    before it, only for room. The simulator showed why (``docs/performance.md``,
    "Eviction against the best possible"): ending handles at the retention in force
    lost every gap between it and the ceiling (chat: 13 % of the tokens saved) while
    admission and pressure already keep D's KV in bounds. The policy runs every probe
    tick with D's KV usage as scraped then (its running requests included); a handle
    let go stays pinned on D until its release lands."""

    ceiling_s: float  # D's decoder_kv_blocks_ttl: no handle outlives it
    floor_s: float  # the retention in force (decodeRetentionSeconds): kept at least this
    tick_s: float  # probe_interval_seconds: D scraped and decide() run this often
    handle_cap: int  # handle_store_cap
    release_after_s: float  # an unread handle's release lands this long after
    margin_s: float = HANDLE_EXPIRY_MARGIN_SECONDS
    kv_high_water: float = KV_HIGH_WATER
    # The bench's "before" row only: handles ended at this (the retention in force, as
    # the sidecar did) instead of the ceiling. None: the ceiling.
    end_s: float | None = None

    @classmethod
    def of(cls, settings: SidecarSettings) -> Wiring:
        ceiling = settings.retention_ceiling_seconds
        ceiling = settings.retention_seconds if ceiling is None else ceiling
        return cls(
            ceiling_s=ceiling,
            floor_s=min(settings.retention_seconds, ceiling),
            tick_s=settings.probe_interval_seconds,
            handle_cap=settings.handle_store_cap,
            release_after_s=settings.release_after_seconds,
        )

    def hold_s(self) -> float:
        """Seconds from its keeping that a handle is offered at most: the ceiling less
        the margin."""
        end = self.ceiling_s if self.end_s is None else min(self.end_s, self.ceiling_s)
        return end - self.margin_s

    def limits(self) -> Limits:
        ceiling = max(self.ceiling_s - self.margin_s, MIN_POLICY_CEILING_S)
        return Limits(
            max_retention_s=ceiling,
            handle_cap=self.handle_cap,
            kv_high_water=self.kv_high_water,
            min_retention_s=floor_within(self.floor_s, ceiling),
            release_window_s=self.release_after_s + self.tick_s,
        )

    def policy(self, costs: Costs) -> RetentionPolicy:
        return RetentionPolicy(costs, self.limits())


def floor_within(floor_s: float, ceiling_s: float) -> float:
    return min(max(0.0, floor_s), ceiling_s)


def build(settings: SidecarSettings, block_tokens: int) -> RetentionPolicy:
    """The policy a decode sidecar with ``settings`` runs, D's blocks of
    ``block_tokens``: the one constructor (``Wiring``)."""
    return Wiring.of(settings).policy(nominal_costs(block_tokens))


@dataclass
class Held:
    """One kept handle: the session's last turn, ``tokens`` long, kept from ``t``."""

    session: str
    t: float
    tokens: int
    end: float  # the ceiling or the lease, whichever is first
    bounded_by_lease: bool
    recheck_at: float = math.inf  # when usefulness is looked at again
    blocks: int = 0  # D's blocks it pins, counted at its keeping (the block size may change)


@dataclass(frozen=True)
class Release:
    session: str
    tokens: int
    reason: str
    value: float  # seconds saved per pinned byte as expected when released


@dataclass
class _Session:
    last_t: float
    gaps: deque[float] = field(default_factory=lambda: deque(maxlen=OWN_GAPS))
    sorted_gaps: list[float] = field(default_factory=list)

    def add_gap(self, gap: float) -> None:
        if len(self.gaps) == self.gaps.maxlen:
            self.sorted_gaps.remove(self.gaps[0])
        self.gaps.append(gap)
        insort(self.sorted_gaps, gap)


class RetentionPolicy:
    """The handles a decode sidecar keeps, and which to release when (module docstring)."""

    def __init__(self, costs: Costs, limits: Limits, server_gaps: Histogram | None = None):
        self.costs = costs
        self.limits = limits
        self.server_gaps = server_gaps.copy() if server_gaps else Histogram.empty(GAP_BOUNDS)
        self.ended = 0  # sessions with no turn for a whole ceiling
        self._sessions: OrderedDict[str, _Session] = OrderedDict()  # by last turn
        self._held: dict[str, Held] = {}
        self._held_blocks = 0  # the blocks of every held handle
        # D's KV as last scraped (observe_engine): its blocks, and what its running
        # requests (and releases not yet landed) claim besides the held handles.
        self._total_blocks = 0
        self._running_blocks = 0
        # Blocks kept since that scrape: they were running requests then.
        self._kept_since_scrape = 0
        self._pending: list[Release] = []  # admission's releases, for take_releases
        # Blocks released and when, while their release may not have landed yet.
        self._in_flight: deque[tuple[float, int]] = deque()
        self._in_flight_blocks = 0
        self._now = -math.inf  # the latest time the caller named
        self._cum: list[int] = []
        self._cum_total = -1
        self._k = limits.prior_weight if limits.prior_weight is not None else K_DEFAULT
        self._turns = 0
        ceiling = limits.max_retention_s
        self._floor = limits.min_hit * costs.saving_per_token / (costs.bytes_per_token * ceiling)
        # Candidate horizons: where the server's CDF bends (its pieces are linear but for
        # the small log-uniform share, so the best ratio over a piece is at one of its ends).
        self._bounds = [b for b in self.server_gaps.bounds if b < ceiling]

    # ------------------------------------------------------------------ the interface
    @property
    def held(self) -> dict[str, Held]:
        return self._held

    def observe_turn(
        self, session: str, t: float, tokens: int, *, lease_s: float | None = None
    ) -> Held | None:
        """A turn of ``session`` arrived at ``t``; its KV (``tokens``) is kept as the
        session's handle, bounded by ``lease_s`` when D prefilled it alone. Returns the
        handle this turn reads, if one was still kept (single use). ``arrive`` then
        ``keep`` at one instant: a replay's turns take no time."""
        taken = self.arrive(session, t)
        self.keep(session, t, tokens, lease_s=lease_s)
        return taken

    def arrive(self, session: str, t: float) -> Held | None:
        """A turn of ``session`` arrived at ``t``: its gap since the session's last kept
        handle is observed, and the handle it reads, if still kept, is returned (and no
        longer held). The sidecar calls this when a turn looks its handle up."""
        self._age_in_flight(t)
        taken = self._pop_held(session)
        s = self._sessions.pop(session, None)
        if s is None:
            s = _Session(last_t=t)
        else:
            gap = t - s.last_t
            s.add_gap(gap)
            self.server_gaps.observe(gap)
            s.last_t = t
        self._remember(session, s)
        self._turns += 1
        if self.limits.prior_weight is None and self._turns % K_EVERY_TURNS == 0:
            self._k = self._estimate_k()
        return taken

    def keep(
        self,
        session: str,
        t: float,
        tokens: int,
        *,
        lease_s: float | None = None,
        retention_s: float | None = None,
        previous: str | None = None,
    ) -> Held | None:
        """Hold the KV (``tokens``) a turn left at ``t`` as ``session``'s handle, until
        the ceiling or the earlier of ``retention_s`` (the retention in force) and
        ``lease_s`` (D's lease, for a turn it prefilled alone). ``previous``: the slot
        the turn looked up when the conversation's next turn looks up another one
        (``session.next_handle_slot``): its gaps continue under ``session``. The next
        gap runs from ``t``: the time from a handle's keeping to its reading is what
        the chance of a next turn is about."""
        self._age_in_flight(t)
        s = self._sessions.pop(session, None)
        if previous is not None and previous != session:
            s = self._sessions.pop(previous, None) or s
        if s is None:
            s = _Session(last_t=t)
        s.last_t = t
        self._remember(session, s)
        self._pop_held(session)
        if tokens <= 0:
            return None
        end = t + self.limits.max_retention_s
        if retention_s is not None:
            end = min(end, t + retention_s)
        by_lease = lease_s is not None and t + lease_s < end
        if by_lease:
            assert lease_s is not None
            end = t + lease_s
        # A release admission queued for this session's earlier handle is moot now.
        self._pending = [r for r in self._pending if r.session != session]
        held = Held(session, t, tokens, end, by_lease, blocks=self.costs.blocks(tokens))
        self._held[session] = held
        self._held_blocks += held.blocks
        self._kept_since_scrape += held.blocks
        self._schedule(held, t)
        self._admit(held, t)
        return held if self._held.get(session) is held else None

    def _remember(self, session: str, s: _Session) -> None:
        self._sessions[session] = s
        while len(self._sessions) > MAX_SESSIONS:
            self._sessions.popitem(last=False)

    def set_floor(self, floor_s: float, now: float) -> None:
        """The retention in force changed: no handle goes for usefulness before it."""
        floor = floor_within(floor_s, self.limits.max_retention_s)
        if floor == self.limits.min_retention_s:
            return
        self.limits = replace(self.limits, min_retention_s=floor)
        for h in self._held.values():
            self._schedule(h, now)

    def forget(self, session: str) -> None:
        """The caller let ``session``'s handle go for a reason of its own (taken, a cap,
        D restarted, superseded): no longer held, nothing to release."""
        self._pop_held(session)

    def observe_engine(self, p: Pressure, now: float | None = None) -> None:
        """D's KV as scraped at ``now``: its size, and what its running requests claim
        (its usage less the handles held here and the releases not landed yet)."""
        self._age_in_flight(now)
        if p.kv_total_blocks:
            self._total_blocks = p.kv_total_blocks
            pinned = self._held_blocks + self._in_flight_blocks
            self._running_blocks = max(0, p.kv_used_blocks - pinned)
            self._kept_since_scrape = 0

    def _age_in_flight(self, now: float | None) -> None:
        if now is not None:
            self._now = max(self._now, now)
        horizon = self._now - self.limits.release_window_s
        while self._in_flight and self._in_flight[0][0] <= horizon:
            self._in_flight_blocks -= self._in_flight.popleft()[1]

    def share_blocks(self) -> int | None:
        """The blocks the held handles may fill now: D's KV to the high-water mark less
        its running requests' claim; None until D's size is known."""
        if not self._total_blocks:
            return None
        # A handle kept since the scrape was one of its running requests: not twice.
        running = max(0, self._running_blocks - self._kept_since_scrape)
        return math.floor(self.limits.kv_high_water * self._total_blocks) - running

    @property
    def held_blocks(self) -> int:
        return self._held_blocks

    def take_releases(self) -> list[Release]:
        """What admission let go since the last call (the caller releases them on D)."""
        out, self._pending = self._pending, []
        return out

    def rebound(self, session: str, end: float, *, by_lease: bool, now: float) -> None:
        """A held handle's end moved (the retention in force changed): at most the
        ceiling from its keeping; its usefulness is judged again from ``now``."""
        h = self._held.get(session)
        if h is None:
            return
        h.end = min(end, h.t + self.limits.max_retention_s)
        h.bounded_by_lease = by_lease
        self._schedule(h, now)

    def lowest(self, sessions: Iterable[str], now: float) -> str:
        """Of ``sessions`` (held ones; oldest first), the one a cap releases first:
        the lowest value, the oldest among equals; one not held goes before any."""
        order = list(sessions)
        rank = {s: i for i, s in enumerate(order)}

        def key(session: str) -> tuple[float, int]:
            h = self._held.get(session)
            return (-math.inf if h is None else self.value(h, now), rank[session])

        return min(order, key=key)

    def decide(self, now: float, pressure: Pressure = NO_PRESSURE) -> list[Release]:
        """The handles to release at ``now``: admission's not yet taken, those past
        their end, those whose usefulness ended, then under ``pressure`` (D's KV as
        scraped now) the lowest values until it is met."""
        self.observe_engine(pressure, now)
        out = self.take_releases()
        for h in list(self._held.values()):
            if now >= h.end:
                out.append(self._release(h, REASON_LEASE if h.bounded_by_lease else REASON_CEILING))
            elif now >= h.recheck_at:
                self._schedule(h, now)
                if h.recheck_at <= now:
                    out.append(self._release(h, REASON_USELESS, self.value(h, now)))
        out += self._relieve(now, pressure)
        self._forget_ended(now)
        return out

    def next_deadline(self) -> float | None:
        """When ``decide`` next has something to release without pressure (a timer)."""
        times = [min(h.end, h.recheck_at) for h in self._held.values()]
        return min(times) if times else None

    def value(self, h: Held, now: float) -> float:
        """Expected prefill seconds saved per pinned byte-second if ``h`` is kept until
        read or its end: saving x P(read before the end) / (bytes x expected time held).
        Per byte-second, not per byte: the KV is packed over time too (the oracle's LP
        in docs/performance.md), so a handle read in seconds is worth more than one of
        the same chance held for minutes."""
        a = max(0.0, now - h.t)
        horizon = h.end - h.t
        if horizon <= a:
            return 0.0
        p = self.chance(h.session, a, horizon)
        held = self.expected_hold(h.session, a, horizon)
        per_byte = self.costs.saving_per_token * h.tokens / self.costs.pinned_bytes(h.tokens)
        return per_byte * p / held

    def expected_hold(self, session: str, a: float, horizon: float) -> float:
        """E[min(gap, horizon) - a | gap > a]: the seconds a handle at elapsed ``a``
        stays pinned if kept (the integral of the survival by midpoints, exact but for
        the log-uniform share: the CDF is otherwise linear between its points)."""
        s = self._sessions.get(session)
        own = s.sorted_gaps if s else []
        c = self.continues()
        rest = 1.0 - c * self._cdf(own, a)
        if rest <= 0.0:
            return max(horizon - a, 1e-9)
        xs = [a, *sorted({x for x in (*self._bounds, *own) if a < x < horizon}), horizon]
        total = 0.0
        for lo, hi in pairwise(xs):
            total += (hi - lo) * (1.0 - c * self._cdf(own, (lo + hi) / 2)) / rest
        return max(total, 1e-9)

    def chance(self, session: str, a: float, horizon: float) -> float:
        """P(the session's next turn comes in (a, horizon] | none by a), gaps in seconds."""
        if horizon <= a:
            return 0.0
        s = self._sessions.get(session)
        own = s.sorted_gaps if s else []
        c = self.continues()
        fa = self._cdf(own, a)
        rest = 1.0 - c * fa
        if rest <= 0.0:
            return 0.0
        return max(0.0, c * (self._cdf(own, horizon) - fa) / rest)

    def continues(self) -> float:
        gaps = self.server_gaps.total
        return (gaps + 1) / (gaps + self.ended + 2)

    # ------------------------------------------------------------------ internals
    @property
    def prior_weight(self) -> float:
        """K as used now (fixed, or the sessions' credibility estimate)."""
        return self._k

    def _estimate_k(self) -> float:
        """Buhlmann-Straub: within-session variance over the variance of the means, on
        log-gaps; K_DEFAULT until K_MIN_SESSIONS sessions have two gaps."""
        groups = [
            [math.log(max(g, 0.1)) for g in s.gaps]
            for s in self._sessions.values()
            if len(s.gaps) >= 2
        ]
        if len(groups) < K_MIN_SESSIONS:
            return K_DEFAULT
        n = [len(g) for g in groups]
        total = sum(n)
        means = [sum(g) / len(g) for g in groups]
        within = sum((x - m) ** 2 for g, m in zip(groups, means, strict=True) for x in g) / (
            total - len(groups)
        )
        grand = sum(ni * m for ni, m in zip(n, means, strict=True)) / total
        spread = sum(ni * (m - grand) ** 2 for ni, m in zip(n, means, strict=True))
        between = (spread - (len(groups) - 1) * within) / (total - sum(ni * ni for ni in n) / total)
        lo, hi = K_BOUNDS
        if between <= 0:
            return hi
        return min(hi, max(lo, within / between))

    def _cdf(self, own: list[float], x: float) -> float:
        k = self._k
        return (bisect_right(own, x) + k * self._server_cdf(x)) / (len(own) + k)

    def _server_cdf(self, x: float) -> float:
        """The server's gaps, with ``PRIOR_GAPS`` pseudo-gaps log-uniform over
        [1 s, ceiling]: a handful of gaps does not yet say that none comes later."""
        h = self.server_gaps
        if self._cum_total != h.total:  # the table is rebuilt only after new gaps
            self._cum, acc = [], 0
            for count in h.counts:
                acc += count
                self._cum.append(acc)
            self._cum_total = h.total
        n = h.total
        seen = 0.0
        i = bisect_right(h.bounds, x)
        if n:
            lo = h.bounds[i - 1] if i else 0.0
            below = self._cum[i - 1] if i else 0
            if i < len(h.bounds):
                seen = below + h.counts[i] * (x - lo) / (h.bounds[i] - lo)
            else:
                seen = below
        ceiling = self.limits.max_retention_s
        prior = 0.0 if x < 1.0 else min(1.0, math.log(x) / math.log(max(ceiling, math.e)))
        return (seen + PRIOR_GAPS * prior) / (n + PRIOR_GAPS)

    def _schedule(self, h: Held, now: float) -> None:
        """Set ``h.recheck_at`` to the first elapsed point from ``now`` on at which the
        best expected saving per byte-second of keeping ``h`` to any later horizon,
        ``max_x saving x P(a, x) / (bytes x (x - a))``, is below the floor (``now``
        itself if it already is; never past its end). The CDF steps at the session's
        gaps and bends at the histogram's bounds, so those points are the horizons to try.
        """
        s = self._sessions.get(h.session)
        own = s.sorted_gaps if s else []
        horizon = h.end - h.t
        a = max(0.0, now - h.t, self.limits.min_retention_s)
        xs = sorted({x for x in (*self._bounds, *own) if a < x < horizon} | {horizon})
        if a >= horizon:
            h.recheck_at = h.t + a
            return
        fx = [self._cdf(own, x) for x in xs]
        starts = [(a, self._cdf(own, a)), *zip(xs[:-1], fx[:-1], strict=True)]
        c = self.continues()
        per_byte = self.costs.saving_per_token * h.tokens / self.costs.pinned_bytes(h.tokens)
        for i, (start, fs) in enumerate(starts):
            rest = 1.0 - c * fs
            best = 0.0
            if rest > 0.0:
                first = i  # starts[i] is xs[i - 1]: horizons from xs[i] on
                for x, f in zip(xs[first:], fx[first:], strict=True):
                    best = max(best, (f - fs) / (x - start))
                best *= c / rest
            if best * per_byte < self._floor:
                h.recheck_at = h.t + start
                return
        h.recheck_at = math.inf

    def _release(self, h: Held, reason: str, value: float = 0.0) -> Release:
        self._pop_held(h.session)
        if self.limits.release_window_s > 0:
            blocks = h.blocks
            self._in_flight.append((self._now, blocks))
            self._in_flight_blocks += blocks
        return Release(h.session, h.tokens, reason, value)

    def _pop_held(self, session: str) -> Held | None:
        h = self._held.pop(session, None)
        if h is not None:
            self._held_blocks -= h.blocks
        return h

    def worth(self, h: Held, now: float) -> float:
        """Expected prefill seconds saved per second ``h`` is held: its value (per pinned
        byte-second) times the bytes it pins."""
        return self.value(h, now) * self.costs.pinned_bytes(h.tokens)

    def _admit(self, new: Held, now: float) -> None:
        """Admission: ``new`` (held already) stays only if it fits in the handles' share
        of D's KV, or if the handles it would displace are each worth less per pinned
        byte-second and all together less per second held than it is. Making room never
        releases more value than it admits; a handle larger than the whole share goes at
        birth (it could only flush the others and then not stay either)."""
        share = self.share_blocks()
        if share is None:
            return  # D's size not known yet: nothing to weigh against
        blocks = self.costs.blocks(new.tokens)
        whole = math.floor(self.limits.kv_high_water * self._total_blocks)
        if blocks > whole:
            self._pending.append(self._release(new, REASON_ADMISSION))
            return
        over = self._held_blocks - share
        if over <= 0:
            return
        v_new = self.value(new, now)
        worth_new = v_new * self.costs.pinned_bytes(new.tokens)
        ranked = sorted(
            ((self.value(h, now), h.t, h) for h in self._held.values() if h is not new),
            key=lambda x: (x[0], x[1]),
        )
        chosen: list[tuple[float, Held]] = []
        freed = 0
        worth = 0.0
        for v, _, h in ranked:
            if freed >= over:
                break
            if v >= v_new:
                break
            chosen.append((v, h))
            freed += self.costs.blocks(h.tokens)
            worth += v * self.costs.pinned_bytes(h.tokens)
        if freed >= over and worth < worth_new:
            for v, h in chosen:
                self._pending.append(self._release(h, REASON_PRESSURE, v))
        else:
            self._pending.append(self._release(new, REASON_ADMISSION, v_new))

    def _relieve(self, now: float, p: Pressure) -> list[Release]:
        over_cap = len(self._held) - self.limits.handle_cap
        need = 0
        if p.kv_total_blocks:
            need = p.kv_used_blocks - math.floor(self.limits.kv_high_water * p.kv_total_blocks)
            need -= self._in_flight_blocks  # met already, once those releases land
        # A preemption or a request waiting for blocks asks for room: a release on its
        # way gives it.
        preemptions = p.preemptions + p.stalled - len(self._in_flight)
        if over_cap <= 0 and need <= 0 and preemptions <= 0:
            return []
        ranked = sorted(self._held.values(), key=lambda h: (self.value(h, now), h.t))
        out: list[Release] = []
        for h in ranked:
            if over_cap > 0:
                reason = REASON_CAP
                over_cap -= 1
            elif need > 0:
                reason = REASON_PRESSURE
            elif preemptions > 0:
                reason = REASON_PREEMPTION
                preemptions -= 1
            else:
                break
            need -= self.costs.blocks(h.tokens)
            out.append(self._release(h, reason, self.value(h, now)))
        return out

    def _forget_ended(self, now: float) -> None:
        """Sessions with no turn for a whole ceiling ended: count them (the chance of
        continuing), forget them (the table stays bounded)."""
        ceiling = self.limits.max_retention_s
        while self._sessions:
            session, s = next(iter(self._sessions.items()))
            if now - s.last_t < ceiling or session in self._held:
                break
            del self._sessions[session]
            self.ended += 1
