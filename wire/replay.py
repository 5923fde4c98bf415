"""A trace replayed through one decode engine's KV as the decode sidecar keeps handles.
Pure: turns in, figures out; ``make bench-eviction`` and ``kvferry-operator what-if
--capacity-blocks`` both run it, so the adopter's answer is the bench's.

What it replays is what the sidecar runs, built the same way (``retention.Wiring``):

- the policy from the same constructor and settings: the handle cap, the ceiling, the
  retention in force as the floor, each handle offered until the ceiling less the
  margin (``Wiring.hold_s``);
- a turn's lookup (``arrive``: single use, a read frees D's blocks at once) and the
  keeping of its own handle when D's answer ends (``keep``: admission may refuse it or
  displace others), with the store's cap after it (the lowest value goes);
- every probe tick (``Wiring.tick_s``), ``decide`` with D's KV usage as a scrape would
  read it: the held handles, the releases not landed yet and the running requests;
  D's preemptions (a request that found no room) since the last tick;
- a handle let go stays pinned on D until its release lands ``release_after_s`` later.

A request that finds D's KV full counts as a preemption, which the policy answers at
its next tick (the replay does not delay the request: D's running requests, and so the
releases that follow them, may claim more than its blocks for a moment; the handles
held never do, admission keeps them within the share). The running request of a turn
claims its prompt and answer (``kept_tokens``) from its arrival until its answer
ends, ``decode_s_per_token`` per output token (at most half the time to the session's
next turn: a client waits for the answer before it sends the next). Its blocks then
become the handle, or are released. D's size is known from the first tick on, as the
sidecar knows it from its first scrape.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from . import retention as rp

# A GPU decode step at a moderate batch: what a running request's claim lasts per token.
DECODE_S_PER_TOKEN = 0.02
REASON_FULL = "d-full"  # a request arrived to a D with no free block (a preemption)


class TurnLike(Protocol):
    @property
    def session(self) -> str: ...
    @property
    def t(self) -> float: ...
    @property
    def prefix(self) -> int: ...
    @property
    def kept_tokens(self) -> int: ...
    @property
    def output_tokens(self) -> int: ...


@dataclass
class Figures:
    turns: int = 0
    hits: int = 0
    tokens_saved: int = 0  # prefill tokens a read handle spared P
    pinned_byte_s: float = 0.0  # D's KV pinned by handles (held or release pending)
    releases: Counter[str] = field(default_factory=Counter)  # by the policy's reason
    preemptions: int = 0  # requests that found D's KV full
    peak_pinned_blocks: int = 0
    hits_at: set[int] = field(default_factory=set)  # the turns (indexes) that read a handle


@dataclass
class _Pin:
    t: float
    blocks: int
    bytes: float


class Replay:
    """D's KV and the sidecar's policy over one trace (``run``)."""

    def __init__(
        self,
        wiring: rp.Wiring,
        costs: rp.Costs,
        capacity_blocks: int,
        *,
        policy: rp.RetentionPolicy | None = None,
        decode_s_per_token: float = DECODE_S_PER_TOKEN,
    ) -> None:
        if capacity_blocks < 1:
            raise ValueError("capacity_blocks must be >= 1")
        self.wiring = wiring
        self.costs = costs
        self.capacity = capacity_blocks
        self.policy = policy if policy is not None else wiring.policy(costs)
        self.decode_s_per_token = decode_s_per_token
        self.figures = Figures()
        self._held: dict[str, _Pin] = {}
        self._held_blocks = 0
        self._pending: list[tuple[float, int, _Pin]] = []  # (lands at, seq, pin)
        self._pending_blocks = 0
        self._running: dict[int, int] = {}  # turn index -> blocks
        self._running_blocks = 0
        self._preempted = 0  # since the last tick
        self._seq = 0

    # ------------------------------------------------------------------ D's KV
    def _used(self) -> int:
        return self._held_blocks + self._pending_blocks + self._running_blocks

    def _unhold(self, session: str) -> _Pin | None:
        pin = self._held.pop(session, None)
        if pin is not None:
            self._held_blocks -= pin.blocks
        return pin

    def _unpin(self, pin: _Pin, now: float) -> None:
        self.figures.pinned_byte_s += pin.bytes * max(0.0, now - pin.t)

    def _let_go(self, releases: Sequence[rp.Release], now: float) -> None:
        """The policy released these: each stays pinned until its release lands."""
        for r in releases:
            pin = self._unhold(r.session)
            if pin is None:
                continue
            self.figures.releases[r.reason] += 1
            self._seq += 1
            heapq.heappush(self._pending, (now + self.wiring.release_after_s, self._seq, pin))
            self._pending_blocks += pin.blocks

    def _land(self, now: float) -> None:
        # A release sent at a tick lands after the next tick's look (the sidecar waits
        # release_after for a ride, then P takes the release request).
        while self._pending and self._pending[0][0] < now:
            at, _, pin = heapq.heappop(self._pending)
            self._pending_blocks -= pin.blocks
            self._unpin(pin, at)

    def _note_peak(self) -> None:
        pinned = self._held_blocks + self._pending_blocks
        self.figures.peak_pinned_blocks = max(self.figures.peak_pinned_blocks, pinned)

    # ------------------------------------------------------------------ events
    def _tick(self, now: float) -> None:
        self._land(now)
        used = min(self._used(), self.capacity)
        pressure = rp.Pressure(used, self.capacity, self._preempted)
        self._preempted = 0
        self._let_go(self.policy.decide(now, pressure), now)

    def _arrive(self, i: int, turn: TurnLike) -> None:
        f = self.figures
        f.turns += 1
        taken = self.policy.arrive(turn.session, turn.t)
        pin = self._unhold(turn.session)
        if pin is not None:
            self._unpin(pin, turn.t)  # read or not, a lookup frees D's blocks
            if taken is not None and turn.t < taken.end:
                f.hits += 1
                f.hits_at.add(i)
                f.tokens_saved += min(taken.tokens, turn.prefix)
        need = self.costs.blocks(turn.kept_tokens)
        if self._used() + need > self.capacity:
            # D has no room for the request: vLLM makes it wait or preempts another;
            # the sidecar sees it at its next look (one release per preemption).
            self._preempted += 1
            f.preemptions += 1
        self._running[i] = need
        self._running_blocks += need

    def _finish(self, i: int, turn: TurnLike, now: float) -> None:
        self._running_blocks -= self._running.pop(i)
        tokens = turn.kept_tokens
        held = self.policy.keep(
            turn.session, now, tokens, retention_s=self.wiring.hold_s(), previous=None
        )
        blocks = self.costs.blocks(tokens)
        pin = _Pin(now, blocks, self.costs.pinned_bytes(tokens))
        if tokens > 0:
            self._unhold(turn.session)
            self._held[turn.session] = pin
            self._held_blocks += pin.blocks
        releases = self.policy.take_releases()
        self._let_go(releases, now)
        # The store's cap: the lowest value goes, never the handle just kept while
        # another can (handles.HandleStore.put).
        while held is not None and len(self.policy.held) > self.wiring.handle_cap:
            others = [s for s in self.policy.held if s != turn.session] or [turn.session]
            victim = self.policy.lowest(others, now)
            self.policy.forget(victim)
            self._let_go([rp.Release(victim, 0, rp.REASON_CAP, 0.0)], now)
        if self._held_blocks > self.capacity:
            # More held than D has: its request could not have finished without D
            # making room. Admission keeps the handles within its share, so only a
            # policy that keeps every handle (the bench's "before") gets here: it
            # releases now what its next look would.
            used = min(self._used(), 2**62)
            self._let_go(self.policy.decide(now, rp.Pressure(used, self.capacity)), now)
        self._note_peak()

    def run(self, turns: Sequence[TurnLike]) -> Figures:
        """Replay ``turns`` (sorted by time) to the last one's end."""
        if not turns:
            return self.figures
        nexts = next_arrivals(turns)
        t0 = turns[0].t
        tick = self.wiring.tick_s
        next_tick = t0
        events: list[tuple[float, int, int]] = []  # (time, kind 0 finish / 1 arrive, i)
        for i, turn in enumerate(turns):
            heapq.heappush(events, (turn.t, 1, i))
        while events:
            at, kind, i = heapq.heappop(events)
            while next_tick <= at:
                if not self._held and not self._pending and not self._running:
                    # Nothing to look at until the next event: skip the idle ticks.
                    next_tick = t0 + math.ceil((at - t0) / tick) * tick
                    if next_tick > at:
                        break
                self._tick(next_tick)
                next_tick += tick
            turn = turns[i]
            if kind == 1:
                self._arrive(i, turn)
                service = service_s(turn, self.decode_s_per_token, nexts[i])
                heapq.heappush(events, (turn.t + service, 0, i))
            else:
                self._finish(i, turn, at)
        end = turns[-1].t
        for pin in self._held.values():
            self._unpin(pin, end)
        for _, _, pin in self._pending:
            self._unpin(pin, end)
        return self.figures


def next_arrivals(turns: Sequence[TurnLike]) -> list[float]:
    """Each turn's session's next arrival (inf: its last)."""
    out = [math.inf] * len(turns)
    last: dict[str, int] = {}
    for i, turn in enumerate(turns):
        j = last.get(turn.session)
        if j is not None:
            out[j] = turn.t
        last[turn.session] = i
    return out


def service_s(turn: TurnLike, per_token: float, next_t: float) -> float:
    service = turn.output_tokens * per_token
    if math.isfinite(next_t):
        service = min(service, (next_t - turn.t) / 2)
    return max(0.0, service)


def replay(
    turns: Sequence[TurnLike],
    wiring: rp.Wiring,
    costs: rp.Costs,
    capacity_blocks: int,
    **kw: float,
) -> Figures:
    """``Replay(...).run(turns)``: the sidecar's policy over ``turns`` at a capacity."""
    return Replay(wiring, costs, capacity_blocks, **kw).run(turns)  # type: ignore[arg-type]
