"""What NIXL's spinning progress thread costs a test engine, side by side in one run:
the pair started with NIXL's own 0 ms poll (``KVFERRY_NIXL_PTHR_DELAY_US=0``) and with
the harness's 1 ms (kvferry_dev/nixl_poll/kvferry_nixl_poll.py).

``python -m bench.nixl_poll`` (``make bench-nixl-poll``; holds the engine lock). For each
delay: the pair's start time, each engine's CPU over ``--idle`` seconds with nothing
to do (its whole process group), the median of three 1-token prefills of fresh
prompts per size on each engine, and one 64-token answer. Writes
docs/performance/nixl_poll.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from kvferry_dev.client import filler_text
from kvferry_dev.engines import EnginePair, build_tiny_model, engine_env, start_pair
from kvferry_dev.procs import stop_all

from .common import DEFAULT_OUT, Result, engine_versions, process_cpu_seconds, say, table

DELAYS_US = (0, 1000)
WORDS = (300, 1500)


def group_cpu_seconds(pgid: int) -> float:
    """CPU seconds of every live process in the process group (an engine is its API
    server, engine core and worker processes)."""
    total = 0.0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getpgid(int(entry.name)) == pgid:
                total += process_cpu_seconds(int(entry.name))
        except (OSError, ValueError):  # gone meanwhile
            continue
    return total


def measure(pair: EnginePair, idle: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    time.sleep(3)  # past vLLM's 1 s busy loop after its last request
    before = {e.role: group_cpu_seconds(e.proc.pid) for e in pair}
    t0 = time.monotonic()
    time.sleep(idle)
    wall = time.monotonic() - t0
    for e in pair:
        used = group_cpu_seconds(e.proc.pid) - before[e.role]
        out[f"{e.role}_idle_cpu_pct"] = 100 * used / wall
    for words in WORDS:
        for e in pair:
            times = []
            for i in range(3):
                prompt = [{"role": "user", "content": filler_text(f"w{words}-{i}-{e.role}", words)}]
                t = time.monotonic()
                e.chat(prompt, max_tokens=1)
                times.append(time.monotonic() - t)
            out[f"{e.role}_prefill_{words}w_s"] = statistics.median(times)
    for e in pair:
        prompt = [{"role": "user", "content": filler_text(f"answer-{e.role}", 300)}]
        t = time.monotonic()
        e.chat(prompt, max_tokens=64)
        out[f"{e.role}_answer_64_s"] = time.monotonic() - t
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--idle", type=float, default=10.0, help="seconds of idle CPU sampled")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    python = engine_env()
    model = build_tiny_model(python)
    result = Result("nixl_poll", settings={"idleSeconds": args.idle, "delaysUs": list(DELAYS_US)})
    result.versions.update(engine_versions(python))
    started = time.monotonic()
    rows: dict[int, dict[str, Any]] = {}
    try:
        for delay in DELAYS_US:
            say(f"pair with NIXL's progress-thread poll at {delay} us")
            t0 = time.monotonic()
            pair = start_pair(
                python,
                model,
                Path(f"/tmp/kvferry-bench-nixl-poll/{delay}"),
                extra_env={"KVFERRY_NIXL_PTHR_DELAY_US": str(delay)},
            )
            try:
                rows[delay] = {"start_s": time.monotonic() - t0, **measure(pair, args.idle)}
            finally:
                pair.stop()
    finally:
        stop_all()
    result.results = {str(k): v for k, v in rows.items()}
    result.seconds = time.monotonic() - started
    spin, poll = DELAYS_US
    keys = list(rows[spin])
    print(result.header())
    print(
        table(
            ["figure", *(f"{d} us" for d in DELAYS_US), "ratio"],
            [
                [k, *(rows[d][k] for d in DELAYS_US), rows[spin][k] / max(rows[poll][k], 1e-9)]
                for k in keys
            ],
        )
    )
    print(f"wrote {result.write(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
