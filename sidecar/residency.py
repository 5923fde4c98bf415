"""The residency model: what this pod's KV did, as the report the operator reads.

Pure (no aiohttp, no zmq). Fed by the owner (``runtime.Sidecar``):

1. turns (``observe_turn``, one ``TurnReport`` each): outcome counts; the session's
   turn index (``byTurn`` "1".."8", 8 = eighth and later); TTFT into ``ttftReused``
   (the turn reused tokens: pulled, or held by D on a skip) or ``ttftRecomputed``;
   pulls and their latency; the recompute cost (prompt tokens and prefill seconds
   of turns P computed from scratch).
2. inter-turn gaps, per session, **independently of the handle store**: the time
   from a session's last finished turn to the arrival of its next one, observed
   whether or not a handle survived. A gap longer than the retention is exactly the
   turn whose handle expired; if gaps were only measured on handles still held,
   those would never be seen and the tuner could never raise retention.
3. handle fates (``on_handle_drop``): a handle taken for a turn is classified by
   that turn's outcome (consumed, misaligned, below-threshold, pull-failed,
   skipped); the others by the store's fate (expired, evicted, superseded, cleared).
4. pinned handles, blocks and bytes (a source callable, read at snapshot time).
5. engine figures (``observe_engine``, from ``enginemetrics``): counters made
   monotonic across engine restarts; bytes per token = NIXL bytes / p2p tokens.
6. KV-event state (a source callable returning ``report.KVEvents``).
7. the transport verdict (a source callable, see ``kvferry_sidecar.transport``).

TTFT: a streamed turn's TTFT is arrival -> first byte written to the client
(``timings.first_token_s``). A non-streamed answer has no first byte before the
whole answer, so for turns prefilled on P the best available figure is arrival ->
P's answer (queue + prefill: P computes the first token, max_tokens=1); the P->D
hand-off cannot be separated from the decode there. A non-streamed turn D
prefilled itself has no TTFT figure and is not observed.

Turn index: the count of turns this sidecar served for the session key (a bounded
LRU); a sidecar restart or an evicted entry starts a session at 1 again.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from kvferry_wire import costfit
from kvferry_wire import report as rpt
from kvferry_wire.protocol import Outcome, Route

from . import placement
from .enginemetrics import Cumulative, EngineFigures
from .types import HandleFate, SessionTag, TurnReport

Clock = Callable[[], float]

# A decode leg timed to its whole answer tells its prefill's cost only when the answer
# is short (a streamed leg is timed to its first token).
MAX_TIMED_OUTPUT_TOKENS = 64
SESSION_CAP = 100_000  # sessions remembered for gaps and turn index (~100 B each)
PENDING_CAP = 10_000  # handles taken by turns still in flight

# Report keys for handle fates.
FATE_CONSUMED = HandleFate.CONSUMED.value  # P was sent the handle and the prefill succeeded
FATE_SKIPPED = HandleFate.SKIPPED.value  # taken, but D held the prefix and prefilled alone
FATE_TAKEN = HandleFate.TAKEN.value  # taken by a turn whose outcome says nothing more
_TAKEN_BY_OUTCOME = {
    Outcome.REUSED: FATE_CONSUMED,
    Outcome.MISALIGNED: Outcome.MISALIGNED.value,
    Outcome.BELOW_THRESHOLD: Outcome.BELOW_THRESHOLD.value,
    Outcome.PULL_FAILED: Outcome.PULL_FAILED.value,
    Outcome.KV_MISMATCH: Outcome.KV_MISMATCH.value,
    Outcome.SKIPPED_PREFILL: FATE_SKIPPED,
    Outcome.CACHED_ON_DECODE: FATE_SKIPPED,
}


# placement.Choice.decided_by -> the report's field name part.
_BY = {placement.BY_COSTS: "costs", placement.BY_COLD: "cold_rule", placement.BY_RULE: "rule"}


@dataclass(frozen=True)
class Identity:
    server: str
    namespace: str
    pod: str
    role: str
    engine_build: str | None = None
    transport: str = rpt.TRANSPORT_UNKNOWN


@dataclass(frozen=True)
class PinnedFigures:
    handles: int = 0
    blocks: int = 0
    oldest_age_seconds: float = 0.0
    block_size: int | None = None
    unused_handles: int = 0  # of the above, pinned although no turn will read them
    unused_blocks: int = 0
    orphaned_handles: int = 0  # of the unused, an earlier process's (pinjournal.py)
    orphaned_blocks: int = 0
    unreleasable_handles: int = 0  # of the unused, pinned until D's deadline


def turn_bucket(index: int) -> str:
    return str(min(max(index, 1), rpt.MAX_TURN_BUCKET))


def ttft_of(report: TurnReport) -> float | None:
    """The TTFT figure of a turn (see the module docstring), or None."""
    t = report.timings
    if t.first_token_s is not None:
        return t.first_token_s
    if report.stream or report.route is not Route.REMOTE or t.prefill_s is None:
        return None
    return (t.queue_s or 0.0) + t.prefill_s


@dataclass
class _Session:
    turns: int
    last_finish: float


class Residency:
    def __init__(
        self,
        ident: Identity,
        *,
        started_at: float | None = None,
        clock: Clock = time.monotonic,
        session_cap: int = SESSION_CAP,
        pending_cap: int = PENDING_CAP,
        pinned: Callable[[], PinnedFigures] | None = None,
        kv_events: Callable[[], rpt.KVEvents] | None = None,
        transport: Callable[[], tuple[str, str]] | None = None,
    ) -> None:
        self.ident = ident
        self.started_at = time.time() if started_at is None else started_at
        self._clock = clock
        self._session_cap = session_cap
        self._pending_cap = pending_cap
        self.pinned_source = pinned
        self.kv_events_source = kv_events
        self.transport_source = transport
        self.engine_healthy = False
        self.transport = ident.transport

        self.outcomes: dict[str, int] = {}
        self.handles: dict[str, int] = {}
        # Handles dropped unread, by how D was told to free them (release.py).
        self.releases: dict[str, int] = dict.fromkeys(rpt.Releases.__struct_fields__, 0)
        # Handles let go unread, by reason (owners.EVICT_*, handles.EVICT_*: the fields
        # of report.Evictions).
        self.evictions: dict[str, int] = dict.fromkeys(rpt.Evictions.__struct_fields__, 0)
        # What an earlier process of the sidecar left pinned (pinjournal.py).
        self.orphans = rpt.Orphans()
        self.by_turn: dict[str, rpt.TurnBucket] = {}
        self.gaps = rpt.Histogram.empty(rpt.GAP_BOUNDS)
        self.ttft_reused = rpt.Histogram.empty(rpt.LATENCY_BOUNDS)
        self.ttft_recomputed = rpt.Histogram.empty(rpt.LATENCY_BOUNDS)
        self.transfer = rpt.Transfer()
        # What each leg cost (costfit.py): P's prefill leg, D's leg.
        self.placements = rpt.Placements()
        self.prefill_leg = costfit.empty(costfit.PREFILL_LEG)
        self.decode_leg = costfit.empty(costfit.DECODE_LEG)
        self._sessions: OrderedDict[SessionTag, _Session] = OrderedDict()
        self._taken: OrderedDict[SessionTag, None] = OrderedDict()
        self._engine = Cumulative()
        self._kv_usage: float | None = None

    # -------------------------------------------------------------- turns

    def observe_turn(self, report: TurnReport) -> None:
        """Record one finished turn (called once, after the answer was sent)."""
        now = self._clock()
        arrival = now - (report.timings.total_s or 0.0)
        self._count(self.outcomes, report.outcome.value)
        index = self._session_turn(report.session, arrival, now)
        bucket = self.by_turn.setdefault(turn_bucket(index), rpt.TurnBucket())
        bucket.turns += 1
        bucket.prompt_tokens += report.prompt_tokens or 0
        if report.reused_tokens > 0:
            bucket.reused_turns += 1
            bucket.reused_tokens += report.reused_tokens
        if report.session in self._taken:
            del self._taken[report.session]
            self._count(self.handles, _TAKEN_BY_OUTCOME.get(report.outcome, FATE_TAKEN))
        if report.next_session and report.next_session != report.session:
            # The conversation's next turn looks up another slot (session.handle_slot):
            # its gap and turn index continue there.
            self._sessions[report.next_session] = self._sessions.pop(report.session)
        if report.status != 200 or report.error is not None:
            return  # timings of a failed turn describe the failure, not the cache
        ttft = ttft_of(report)
        if ttft is not None:
            (self.ttft_reused if report.reused_tokens > 0 else self.ttft_recomputed).observe(ttft)
        prefill_s = report.timings.prefill_s
        if report.route is Route.REMOTE and report.outcome is Outcome.REUSED:
            self.transfer.pulls += 1
            if prefill_s is not None:
                # The sidecar sees P's whole prefill leg (pull + tail): an upper bound.
                self.transfer.pull_latency.observe(prefill_s)
        elif report.route is Route.REMOTE and report.reused_tokens == 0 and prefill_s is not None:
            self.transfer.recompute_tokens += report.prompt_tokens or 0
            self.transfer.recompute_seconds += prefill_s
        self._observe_legs(report)
        if report.choice is not None:
            where = "decode" if report.choice.alone else "prefill"
            key = f"{where}_by_{_BY[report.choice.decided_by]}"
            setattr(self.placements, key, getattr(self.placements, key) + 1)

    def _observe_legs(self, report: TurnReport) -> None:
        """The turn's legs into the cost fits (a successful turn's only, see above).
        A prefill that took more than one attempt timed the failures too: not a leg."""
        prompt = report.prompt_tokens
        if prompt is None:
            return
        prefill_s = report.timings.prefill_s
        if report.route is Route.REMOTE and prefill_s is not None and report.prefill_attempts == 1:
            pulled = report.reused_tokens if report.outcome is Outcome.REUSED else 0
            costfit.observe(
                self.prefill_leg,
                costfit.PREFILL_LEG,
                {
                    costfit.PULL: 1.0 if pulled else 0.0,
                    costfit.PULLED_TOKENS: pulled,
                    costfit.COMPUTED_TOKENS: prompt - pulled,
                },
                prefill_s,
                prompt,
            )
        decode_s, output = report.timings.decode_s, report.timed_output_tokens
        # No choice: several sequences (output_tokens counts the first alone) or no
        # ids; a fallback's D leg followed a failure; what D held not asked (a turn
        # off the allowlist); a non-streamed answer longer than MAX_TIMED_OUTPUT_TOKENS
        # is mostly decoding, whose pace is the batch's, not the prefill's.
        if (
            decode_s is None
            or not output
            or output > MAX_TIMED_OUTPUT_TOKENS
            or report.choice is None
            or report.route is Route.FALLBACK
            or not report.holds_known
        ):
            return
        new = max(0, prompt - report.decode_holds)
        if report.route is Route.SKIP:
            x = {costfit.ALONE: 1.0, costfit.ALONE_COMPUTED_TOKENS: new}
        else:
            x = {costfit.FETCHED_TOKENS: new}
        costfit.observe(
            self.decode_leg,
            costfit.DECODE_LEG,
            {**x, costfit.OUTPUT_TOKENS: output},
            decode_s,
            prompt,
        )

    def costs_observed(self) -> int:
        """Legs in both fits (a change means a refit may say more)."""
        return self.prefill_leg.observations + self.decode_leg.observations

    def _session_turn(self, session: SessionTag, arrival: float, now: float) -> int:
        seen = self._sessions.pop(session, None)
        if seen is None:
            seen = _Session(turns=0, last_finish=now)
        else:
            self.gaps.observe(max(0.0, arrival - seen.last_finish))
        seen.turns += 1
        seen.last_finish = now
        self._sessions[session] = seen
        while len(self._sessions) > self._session_cap:
            self._sessions.popitem(last=False)
        return seen.turns

    # -------------------------------------------------------------- handles

    def on_release(self, kind: str) -> None:
        self._count(self.releases, kind)

    def on_eviction(self, reason: str) -> None:
        """The store let a handle go unread, for ``reason`` (a cap, D's pressure, or the
        end the policy or the expiry rules set); its fate comes through on_handle_drop."""
        self._count(self.evictions, reason.replace("-", "_"))

    def on_handle_drop(self, fate: HandleFate, session: SessionTag) -> None:
        if fate is HandleFate.TAKEN:
            # Its fate is the outcome of the turn that took it (observe_turn).
            self._taken[session] = None
            self._taken.move_to_end(session)
            while len(self._taken) > self._pending_cap:
                self._taken.popitem(last=False)
                self._count(self.handles, FATE_TAKEN)
            return
        self._count(self.handles, fate.value)

    # -------------------------------------------------------------- engine

    def observe_engine(self, figures: EngineFigures) -> None:
        acc = self._engine
        acc.update("preemptions", figures.preemptions)
        acc.update("nixl_bytes", figures.nixl_bytes)
        acc.update("nixl_seconds", figures.nixl_seconds)
        acc.update("nixl_transfers", figures.nixl_transfers)
        acc.update("nixl_expired", figures.nixl_expired)
        acc.update("nixl_failed", figures.nixl_failed)
        acc.update("p2p_tokens", figures.p2p_tokens)
        self._kv_usage = figures.kv_usage

    def engine_restarted(self) -> None:
        """The engine is back from a restart: its usage figure is stale."""
        self._kv_usage = None

    def transport_verdict(self) -> tuple[str, str]:
        """(transport, reason) as of now."""
        if self.transport_source is None:
            return self.transport, ""
        return self.transport_source()

    @property
    def preemptions(self) -> int:
        """D's preemptions since this sidecar started (monotonic across its restarts)."""
        return int(self._engine.get("preemptions"))

    @property
    def bytes_per_token(self) -> float | None:
        nbytes, tokens = self._engine.get("nixl_bytes"), self._engine.get("p2p_tokens")
        return nbytes / tokens if nbytes > 0 and tokens > 0 else None

    # -------------------------------------------------------------- report

    def snapshot(self, now_unix: float | None = None) -> rpt.Report:
        """The report as of now; every field filled, nothing shared with the model."""
        now_unix = time.time() if now_unix is None else now_unix
        per_token = self.bytes_per_token
        pinned = self.pinned_source() if self.pinned_source else PinnedFigures()
        nbytes = (
            int(pinned.blocks * pinned.block_size * per_token)
            if per_token is not None and pinned.block_size
            else 0
        )
        acc = self._engine
        transport, transport_reason = self.transport_verdict()
        transfer = rpt.Transfer(
            pulls=self.transfer.pulls,
            bytes=int(acc.get("nixl_bytes")),
            seconds=acc.get("nixl_seconds"),
            transfers=int(acc.get("nixl_transfers")),
            pull_latency=self.transfer.pull_latency.copy(),
            recompute_tokens=self.transfer.recompute_tokens,
            recompute_seconds=self.transfer.recompute_seconds,
            bytes_per_token=per_token,
        )
        return rpt.Report(
            version=rpt.REPORT_VERSION,
            server=self.ident.server,
            namespace=self.ident.namespace,
            pod=self.ident.pod,
            role=self.ident.role,
            engine_build=self.ident.engine_build,
            started_at=self.started_at,
            generated_at=now_unix,
            transport=transport if transport in rpt.TRANSPORTS else rpt.TRANSPORT_UNKNOWN,
            transport_reason=transport_reason,
            outcomes=dict(self.outcomes),
            handles=dict(self.handles),
            by_turn={
                k: rpt.TurnBucket(b.turns, b.reused_turns, b.prompt_tokens, b.reused_tokens)
                for k, b in sorted(self.by_turn.items())
            },
            gaps=self.gaps.copy(),
            ttft_reused=self.ttft_reused.copy(),
            ttft_recomputed=self.ttft_recomputed.copy(),
            pinned=rpt.Pinned(
                handles=pinned.handles,
                blocks=pinned.blocks,
                bytes=nbytes,
                oldest_age_seconds=pinned.oldest_age_seconds,
                unused_handles=pinned.unused_handles,
                unused_blocks=pinned.unused_blocks,
                orphaned_handles=pinned.orphaned_handles,
                orphaned_blocks=pinned.orphaned_blocks,
                unreleasable_handles=pinned.unreleasable_handles,
            ),
            releases=rpt.Releases(**self.releases),
            evictions=rpt.Evictions(**self.evictions),
            orphans=msgspec.structs.replace(self.orphans),
            transfer=transfer,
            costs=rpt.Costs(prefill_leg=self.prefill_leg.copy(), decode_leg=self.decode_leg.copy()),
            placements=msgspec.structs.replace(self.placements),
            engine=rpt.Engine(
                kv_usage=self._kv_usage,
                preemptions=int(acc.get("preemptions")),
                nixl_expired=int(acc.get("nixl_expired")),
                nixl_failed=int(acc.get("nixl_failed")),
                healthy=self.engine_healthy,
            ),
            kv_events=self.kv_events_source() if self.kv_events_source else rpt.KVEvents(),
        )

    @staticmethod
    def _count(counts: dict[str, int], key: str) -> None:
        counts[key] = counts.get(key, 0) + 1
