"""``kvferry-operator what-if``: what bidirectional reuse would do for a trace of the
user's own sessions, before any GPU is moved. Pure: a trace and costs in, figures out.

The four questions (issue 24, item 6; docs/what-if.md):

1. **Reuse**: per turn number, the share of the prompt D would still hold (the
   earlier turn's prompt and answer, as far as the new prompt repeats them) and how
   prompts grow.
2. **Bandwidth**: the P<->D bandwidth at which pulling a turn's history beats
   recomputing it (pull = fixed latency + bytes / bandwidth; recompute = tokens x the
   per-token prefill cost: the tuner's model, kvferry_operator.tune), per turn, and
   the break-even history at the bandwidth given.
3. **Retention**: the gaps between a session's turns and, for a retention, the share of
   later turns whose history is still held and the KV that pins (peak and mean).
4. **TTFT**: the prefill part of time to first token with reuse and without, by
   percentile, under the same model: a later turn pulls when its history is held and
   is at least the break-even, and computes only its tail; otherwise it recomputes.

Gaps are arrival to arrival (a trace has no answer times), which overstates how long
a handle must live by the answer's length: the retention asked for errs long, the KV
it pins errs high.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from . import tune
from .traces import Turn

# Turn-number rows of the reuse table: the first turns one by one, then bands.
TURN_BANDS: tuple[tuple[int, int | None], ...] = (
    (2, 2),
    (3, 3),
    (4, 4),
    (5, 5),
    (6, 10),
    (11, 20),
    (21, None),
)
PERCENTILES = (50, 95, 99)
VLLM_TTL_SECONDS = 480  # vLLM 0.32's fixed decoder_kv_blocks_ttl default


@dataclass(frozen=True)
class Costs:
    """The server's costs, as the tuner models them (kvferry_operator.tune)."""

    recompute_seconds_per_token: float
    bytes_per_token: float
    transfer_bytes_per_second: float
    pull_fixed_seconds: float = 0.0

    def recompute(self, tokens: int) -> float:
        return tokens * self.recompute_seconds_per_token

    def pull(self, tokens: int) -> float:
        return (
            self.pull_fixed_seconds + tokens * self.bytes_per_token / self.transfer_bytes_per_second
        )

    def break_even_tokens(self) -> int | None:
        """The shortest history whose pull beats recomputing it (the tuner's
        ``recomputeThreshold`` before its clamp); None: never."""
        return tune.break_even_tokens(
            self.bytes_per_token,
            self.transfer_bytes_per_second,
            self.pull_fixed_seconds,
            self.recompute_seconds_per_token,
        )

    def bandwidth_to_win(self, tokens: int) -> float | None:
        """Bytes/s above which pulling ``tokens`` beats recomputing them; None: no
        bandwidth does (the fixed latency alone costs more than recomputing)."""
        margin = self.recompute(tokens) - self.pull_fixed_seconds
        if tokens <= 0 or margin <= 0:
            return None
        return tokens * self.bytes_per_token / margin


@dataclass(frozen=True)
class Later:
    """A turn after a session's first: what D would hold for it, and how long after."""

    turn: Turn
    number: int  # 2 for a session's second turn
    gap: float  # seconds since the session's previous turn arrived
    reusable: int  # tokens of its prompt D would hold: min(its prefix, the last turn's KV)


def later_turns(turns: Sequence[Turn]) -> tuple[list[Later], list[tuple[Turn, float | None]]]:
    """Every later turn, and every turn with the time until its session's next (None
    for a session's last): the handle each turn leaves and how long it is needed."""
    by_session: dict[str, list[Turn]] = {}
    for t in sorted(turns, key=lambda x: x.t):
        by_session.setdefault(t.session, []).append(t)
    later: list[Later] = []
    held: list[tuple[Turn, float | None]] = []
    for session_turns in by_session.values():
        for i, t in enumerate(session_turns):
            nxt = session_turns[i + 1] if i + 1 < len(session_turns) else None
            held.append((t, None if nxt is None else nxt.t - t.t))
            if i:
                prev = session_turns[i - 1]
                later.append(Later(t, i + 1, t.t - prev.t, min(t.prefix, prev.kept_tokens)))
    return later, held


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def reuse_by_turn(later: Sequence[Later]) -> list[dict[str, Any]]:
    rows = []
    for lo, hi in TURN_BANDS:
        band = [x for x in later if x.number >= lo and (hi is None or x.number <= hi)]
        if not band:
            continue
        prompt = sum(x.turn.prompt_tokens for x in band)
        label = str(lo) if lo == hi else (f"{lo}-{hi}" if hi else f"{lo}+")
        rows.append(
            {
                "turn": label,
                "turns": len(band),
                "promptTokensP50": percentile([x.turn.prompt_tokens for x in band], 50),
                "reusableTokensP50": percentile([x.reusable for x in band], 50),
                "reusableShare": sum(x.reusable for x in band) / prompt if prompt else 0.0,
            }
        )
    return rows


def pinned_bytes(
    held: Sequence[tuple[Turn, float | None]], retention: float, bytes_per_token: float
) -> tuple[float, float]:
    """(peak, mean) bytes D pins when every turn's handle lives until its session's
    next turn or ``retention`` seconds, whichever is first (a session's last turn: the
    whole retention). The mean is over the trace's span."""
    events: list[tuple[float, float]] = []
    for t, until_next in held:
        life = retention if until_next is None else min(until_next, retention)
        life = min(life, sys.float_info.max - t.t)  # its end a finite time, however far
        size = t.kept_tokens * bytes_per_token
        events += [(t.t, size), (t.t + life, -size)]
    if not events:
        return 0.0, 0.0
    events.sort(key=lambda e: (e[0], e[1]))  # a release before a pin at the same time
    span = events[-1][0] - events[0][0]
    now = peak = mean = 0.0
    last_t = events[0][0]
    for when, delta in events:
        if span > 0:  # each interval's share of the span, not its seconds: no product
            mean += now * ((when - last_t) / span)  # overflows, turns 1e308 s apart
        now += delta
        peak = max(peak, now)
        last_t = when
    return peak, (mean if span > 0 else peak)


@dataclass
class Report:
    sessions: int
    turns: int
    later_turns: int
    costs: Costs
    retention_seconds: float
    reuse: list[dict[str, Any]] = field(default_factory=list)
    bandwidth: dict[str, Any] = field(default_factory=dict)
    retention: dict[str, Any] = field(default_factory=dict)
    ttft: dict[str, Any] = field(default_factory=dict)
    capacity: dict[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "sessions": self.sessions,
            "turns": self.turns,
            "laterTurns": self.later_turns,
            "costs": {
                "recomputeSecondsPerToken": self.costs.recompute_seconds_per_token,
                "bytesPerToken": self.costs.bytes_per_token,
                "transferBytesPerSecond": self.costs.transfer_bytes_per_second,
                "pullFixedLatencySeconds": self.costs.pull_fixed_seconds,
            },
            "retentionSeconds": self.retention_seconds,
            "reuse": self.reuse,
            "bandwidth": self.bandwidth,
            "retention": self.retention,
            "ttft": self.ttft,
            "capacity": self.capacity,
        }


@dataclass(frozen=True)
class Capacity:
    """D's KV for handles and running requests: its blocks, of ``block_tokens`` each."""

    blocks: int
    block_tokens: int = 16  # vLLM's default block size


def at_capacity(
    turns: Sequence[Turn], costs: Costs, retention: float, capacity: Capacity
) -> tuple[dict[str, Any], set[int]]:
    """The trace replayed through a D of ``capacity`` as the decode sidecar keeps handles
    (``kvferry_wire.replay``, the sidecar's own policy and wiring at ``retention``, the
    CRD's 1,800 s ceiling): what it holds there against a D without limit, and the ids
    of the turns that read a handle."""
    from kvferry_wire import replay
    from kvferry_wire import retention as rp
    from kvferry_wire.settings import SidecarSettings

    ordered = sorted(turns, key=lambda x: x.t)
    wiring = rp.Wiring.of(
        SidecarSettings(
            retention_seconds=retention,
            retention_ceiling_seconds=max(retention, CEILING_SECONDS),
        )
    )
    pull = costs.bytes_per_token / costs.transfer_bytes_per_second
    rc = rp.Costs(
        costs.recompute_seconds_per_token, pull, costs.bytes_per_token, capacity.block_tokens
    )
    fig = replay.replay(ordered, wiring, rc, capacity.blocks)
    free = replay.replay(ordered, wiring, rc, UNLIMITED_BLOCKS)
    later = sum(1 for t in later_turns(ordered)[0])
    lost = free.tokens_saved - fig.tokens_saved
    out = {
        "capacityBlocks": capacity.blocks,
        "blockTokens": capacity.block_tokens,
        "capacityBytes": rc.pinned_bytes(capacity.blocks * capacity.block_tokens),
        "peakDemandBlocks": free.peak_pinned_blocks,
        "demandExceedsCapacity": free.peak_pinned_blocks > capacity.blocks,
        "laterTurnsHeld": fig.hits / later if later else 0.0,
        "laterTurnsHeldWithoutLimit": free.hits / later if later else 0.0,
        "tokensSaved": fig.tokens_saved,
        "tokensSavedWithoutLimit": free.tokens_saved,
        "prefillSecondsLost": lost * costs.recompute_seconds_per_token,
        "pinnedBytesPeak": rc.pinned_bytes(fig.peak_pinned_blocks * capacity.block_tokens),
        "releases": dict(sorted(fig.releases.items())),
        "requestsFindingDFull": fig.preemptions,
    }
    return out, {id(ordered[i]) for i in fig.hits_at}


CEILING_SECONDS = 1800.0  # the CRD's default maxRetentionSeconds
UNLIMITED_BLOCKS = 2**62


def analyse(
    turns: Sequence[Turn],
    costs: Costs,
    retention: float,
    candidates: Sequence[float] = (),
    capacity: Capacity | None = None,
) -> Report:
    """The four answers for ``turns`` under ``costs``; TTFT and hits at ``retention``
    seconds; the retention table at the gap percentiles, vLLM's 480 s, ``retention``
    and ``candidates``. With ``capacity``, TTFT and the capacity section replay D's
    KV at that size as the sidecar keeps handles (``at_capacity``)."""
    later, held = later_turns(turns)
    report = Report(
        sessions=len({t.session for t in turns}),
        turns=len(turns),
        later_turns=len(later),
        costs=costs,
        retention_seconds=retention,
    )
    report.reuse = reuse_by_turn(later)

    # 2. bandwidth
    needed = [costs.bandwidth_to_win(x.reusable) for x in later if x.reusable > 0]
    winnable = [b for b in needed if b is not None]
    be = costs.break_even_tokens()
    wins = [x for x in later if be is not None and x.reusable >= max(be, 1)]
    report.bandwidth = {
        "bytesPerSecondToWin": {f"p{q}": percentile(winnable, q) for q in PERCENTILES},
        "turnsNoBandwidthWins": len(needed) - len(winnable),
        "breakEvenTokens": be,
        "laterTurnsAtOrAboveBreakEven": len(wins),
    }

    # 3. retention
    gaps = [x.gap for x in later]
    gap_q = {f"p{q}": percentile(gaps, q) for q in (50, 90, 95, 99)}
    rows = []
    seen: set[float] = set()
    for label, r in [
        *((f"gap {k}", v) for k, v in gap_q.items() if v is not None),
        ("vLLM default", float(VLLM_TTL_SECONDS)),
        ("asked", float(retention)),
        *(("asked", float(c)) for c in candidates),
    ]:
        r = math.ceil(r)
        if r in seen:
            continue
        seen.add(r)
        peak, mean = pinned_bytes(held, r, costs.bytes_per_token)
        rows.append(
            {
                "retentionSeconds": r,
                "why": label,
                "laterTurnsHeld": sum(1 for g in gaps if g <= r) / len(gaps) if gaps else 0.0,
                "pinnedBytesPeak": peak,
                "pinnedBytesMean": mean,
            }
        )
    report.retention = {
        "gapSeconds": gap_q,
        "byRetention": sorted(rows, key=lambda x: x["retentionSeconds"]),
    }

    hits: set[int] | None = None
    if capacity is not None:
        report.capacity, hits = at_capacity(turns, costs, retention, capacity)

    # 4. TTFT (its prefill part)
    off, on, ratio = [], [], []
    pulled = 0
    for x in later:
        t_off = costs.recompute(x.turn.prompt_tokens)
        t_on = t_off
        still = x.gap <= retention if hits is None else id(x.turn) in hits
        if still and be is not None and x.reusable >= max(be, 1):
            t_on = costs.recompute(x.turn.prompt_tokens - x.reusable) + costs.pull(x.reusable)
            pulled += 1
        off.append(t_off)
        on.append(t_on)
        ratio.append(t_off / t_on if t_on > 0 else 1.0)
    report.ttft = {
        "laterTurnsPulled": pulled,
        "withoutReuseSeconds": {f"p{q}": percentile(off, q) for q in PERCENTILES},
        "withReuseSeconds": {f"p{q}": percentile(on, q) for q in PERCENTILES},
        "speedup": {f"p{q}": percentile(ratio, q) for q in PERCENTILES},
    }
    return report


def render_text(report: Report) -> str:
    """The report as a person reads it."""
    c = report.costs

    def secs(v: float | None) -> str:
        if v is None:
            return "-"
        return f"{v * 1e3:.0f}ms" if v < 1 else (f"{v:.2f}s" if v < 1e6 else held_for(v))

    def held_for(v: int) -> str:
        return f"{v}s" if v < 1e6 else f"{v:.3g}s"

    def size(v: float) -> str:
        for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
            if v >= scale:
                return f"{v / scale:.1f}{unit}"
        return f"{v:.0f}B"

    def rate(v: float | None) -> str:
        return "-" if v is None else f"{v / 1e9:.2f}GB/s"

    out = [
        f"{report.sessions} sessions, {report.turns} turns, {report.later_turns} after a first",
        f"costs: recompute {c.recompute_seconds_per_token * 1e6:.1f}us/token, "
        f"{c.bytes_per_token:.0f} KV bytes/token, transfer {rate(c.transfer_bytes_per_second)}, "
        f"pull fixed {c.pull_fixed_seconds * 1e3:.1f}ms",
        "",
        "1. reuse: the share of each prompt D would still hold",
        f"{'turn':>6}  {'turns':>6}  {'prompt p50':>10}  {'held p50':>9}  {'held share':>10}",
    ]
    for r in report.reuse:
        out.append(
            f"{r['turn']:>6}  {r['turns']:>6}  {r['promptTokensP50']:>10.0f}  "
            f"{r['reusableTokensP50']:>9.0f}  {r['reusableShare']:>10.0%}"
        )
    b = report.bandwidth
    need = b["bytesPerSecondToWin"]
    be = b["breakEvenTokens"]
    out += [
        "",
        "2. bandwidth: P<->D bandwidth above which a turn's pull beats recomputing it",
        "   "
        + ", ".join(f"{k} {rate(v)}" for k, v in need.items())
        + (f"; {b['turnsNoBandwidthWins']} turns: none does" if b["turnsNoBandwidthWins"] else ""),
        f"   at {rate(c.transfer_bytes_per_second)}: "
        + (
            "pulling never wins (a token moves slower than it recomputes)"
            if be is None
            else f"pulls win from {be} tokens of history; {b['laterTurnsAtOrAboveBreakEven']} of "
            f"{report.later_turns} later turns have that much"
        ),
        "",
        "3. retention: gaps between a session's turns, and what holding their KV pins",
        "   gaps " + ", ".join(f"{k} {secs(v)}" for k, v in report.retention["gapSeconds"].items()),
        "   "
        + "  ".join(
            f"{h:>{w}}"
            for h, w in (
                ("retention", 10),
                ("why", 12),
                ("later turns held", 16),
                ("pinned peak", 11),
                ("pinned mean", 11),
            )
        ),
    ]
    for r in report.retention["byRetention"]:
        out.append(
            f"   {held_for(r['retentionSeconds']):>10}  {r['why']:>12}  "
            f"{r['laterTurnsHeld']:>16.0%}  "
            f"{size(r['pinnedBytesPeak']):>11}  {size(r['pinnedBytesMean']):>11}"
        )
    t = report.ttft

    def row(name: str, values: dict[str, float | None], fmt: Any) -> str:
        cells = ("-" if values[f"p{q}"] is None else fmt(values[f"p{q}"]) for q in PERCENTILES)
        return f"   {name:>10}  " + "  ".join(f"{c:>8}" for c in cells)

    cap = report.capacity
    if cap is not None:
        releases = ", ".join(f"{k} {v}" for k, v in cap["releases"].items()) or "none"
        out += [
            "",
            f"   at D's capacity, {cap['capacityBlocks']:,} blocks of {cap['blockTokens']} "
            f"tokens ({size(cap['capacityBytes'])}), as the decode sidecar keeps handles: "
            f"{cap['laterTurnsHeld']:.0%} of later turns held "
            f"({cap['laterTurnsHeldWithoutLimit']:.0%} without a limit)",
            (
                f"   demand exceeds it: a peak of {cap['peakDemandBlocks']:,} blocks; reuse "
                f"saves {cap['tokensSaved']:,} of {cap['tokensSavedWithoutLimit']:,} tokens, "
                f"{cap['prefillSecondsLost']:.1f}s more prefill; "
                f"{cap['requestsFindingDFull']} requests found D full"
                if cap["demandExceedsCapacity"]
                else f"   it holds the peak demand ({cap['peakDemandBlocks']:,} blocks)"
            ),
            f"   handles let go: {releases}; pinned peak {size(cap['pinnedBytesPeak'])}",
        ]
    where = "" if cap is None else f" and {cap['capacityBlocks']:,} blocks"
    out += [
        "",
        f"4. TTFT (its prefill part) at {report.retention_seconds:g}s retention{where}; "
        f"{t['laterTurnsPulled']} of {report.later_turns} later turns pull",
        f"   {'':>10}  " + "  ".join(f"{f'p{q}':>8}" for q in PERCENTILES),
        row("without", t["withoutReuseSeconds"], secs),
        row("with", t["withReuseSeconds"], secs),
        row("speedup", t["speedup"], lambda v: f"{v:.2f}x"),
    ]
    return "\n".join(out) + "\n"
