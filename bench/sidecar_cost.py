"""Sidecar cost: what the decode sidecar adds to a turn, against a direct call to D and
against the reference-style proxy (bench/refproxy.py), on fake engines.

``python -m bench.sidecar_cost`` (``make bench-sidecar``; holds the engine lock: it
pins cores). The unit tier's fake vLLM engines (kvferry_dev/fakeengines.py, served by
bench/fakeengines.py) serve P and D on real ports; the front end under test (the real
``kvferry-sidecar`` process with the operator's settings, or the reference proxy) runs
alone on core 0; the fakes and this load generator share core 1. Each stream is a
conversation of 8 turns (history growing, ``session_id`` and ``conversation_id`` set),
then a new one; non-streaming chat completions, as the sidecar must call D on vLLM
0.32 to keep handles.

Front ends: **direct D** (no front end: the floor), the **reference proxy** (P then D
every turn, no checks), the **sidecar, defaults** (the operator's default settings:
short fake prompts are prefilled by D, so a turn is /tokenize + D, and the handle it
did not read goes back to P in a release request), the **sidecar, P path**
(``skipPrefillBelowTokens: 0``: /tokenize + P + D, the reference's path), and the
sidecar's defaults again on asyncio's own event loop instead of uvloop (before/after).

Per front end and concurrency (1, 16, 64 streams): latency p50/p99 at the client,
turns/s, and the front end's CPU time per turn (from /proc). On 2 cores the harness
(fakes + load generator on one core) caps turns/s before the sidecar's core does, so
the sidecar's capacity on one core is also given as 1 / (its CPU seconds per turn).
Targets (issue 13): >= 3,000 turns/s on one core at 64 streams; <= 1 ms added over
direct D at p50 with 1 stream.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from kvferry_dev.configs import tiny_server
from kvferry_dev.procs import LIVE, EngineError, free_port, stop_all, stop_group
from kvferry_dev.sidecars import SidecarProcess
from kvferry_operator.render import build_sidecar_settings

from .common import (
    DEFAULT_OUT,
    ROOT,
    Result,
    Target,
    process_cpu_seconds,
    pyplot,
    quantile,
    say,
    table,
)

DIRECT, PROXY, SC_DEFAULTS, SC_PPATH, SC_ASYNCIO = (
    "direct-d",
    "reference-proxy",
    "sidecar-defaults",
    "sidecar-p-path",
    "sidecar-defaults-asyncio",
)
FRONTS = (DIRECT, PROXY, SC_DEFAULTS, SC_PPATH, SC_ASYNCIO)
LABELS = {
    DIRECT: "direct D",
    PROXY: "reference proxy",
    SC_DEFAULTS: "sidecar, defaults",
    SC_PPATH: "sidecar, P path",
    SC_ASYNCIO: "sidecar, defaults, asyncio loop",
}
TURNS_PER_SESSION = 8
FRONT_CORE, HARNESS_CORE = 0, 1


PINNING = True


def pin(pid: int, core: int) -> None:
    """Every thread of `pid` onto one core."""
    if PINNING and (os.cpu_count() or 1) > core:
        subprocess.run(
            ["taskset", "-a", "-cp", str(core), str(pid)], check=True, capture_output=True
        )


@dataclass(eq=False)
class Proc:
    """A helper process of this benchmark (fakes, reference proxy)."""

    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Proc:
        log = open(self.log_path, "ab")  # noqa: SIM115 - the process owns it
        self.proc = subprocess.Popen(
            self.argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True
        )
        LIVE.add(self)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stop(self) -> None:
        LIVE.discard(self)
        proc, self.proc = self.proc, None
        if proc is not None:
            stop_group(proc, 5.0)


async def wait_http(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with s.get(url) as r:
                    if r.status < 500:
                        return
            await asyncio.sleep(0.1)
    raise EngineError(f"{url} did not answer in {timeout:.0f} s")


def sidecar(name: str, p_url: str, d_url: str, logs: Path, *, skip: int | None) -> SidecarProcess:
    """The real sidecar process with the operator's settings for the tiny server (the
    fakes' block size; no KV-event socket: the fakes publish none)."""
    server = tiny_server() if skip is None else tiny_server(skip_prefill_below_tokens=skip)
    settings = dict(build_sidecar_settings(server))
    settings.pop("enginePort", None)
    internal = free_port()
    port = free_port()
    settings.update(
        {
            "role": "decode",
            "listenHost": "127.0.0.1",
            "listenPort": port,
            "internalPort": internal,
            "metricsPort": 0,  # no scrape-only port: a fixed one would collide here
            "engineUrl": d_url,
            "ordinal": 0,
            "blockSize": 4,
            "kvEvents": "",
            "kvEventsReplay": "",
            # As rendered (off by default): the benchmark reads no per-turn headers.
            "diagnosticHeaders": False,
        }
    )
    topology = {
        "version": 1,
        "prefillEngines": [p_url],
        "decodeSidecars": [f"http://127.0.0.1:{internal}"],
    }
    return SidecarProcess(name=name, settings=settings, topology=topology, log_dir=logs, port=port)


# ----------------------------------------------------------------------------- load


@dataclass
class Measured:
    front: str
    streams: int
    turns: int
    seconds: float
    p50_ms: float
    p99_ms: float
    turns_per_s: float
    front_cpu_s: float | None
    harness_cpu_s: float
    errors: int

    @property
    def cpu_us_per_turn(self) -> float | None:
        return (
            None
            if self.front_cpu_s is None or not self.turns
            else self.front_cpu_s / self.turns * 1e6
        )

    @property
    def capacity_per_core(self) -> float | None:
        """Turns/s the front end could serve with one core to itself."""
        us = self.cpu_us_per_turn
        return 1e6 / us if us else None


def turn_body(stream: int, session: int, history: list[dict[str, str]], k: int) -> dict[str, Any]:
    sid = f"s{stream}-{session}"
    user = {"role": "user", "content": f"turn {k} of {sid} asks about the weather here again"}
    history.append(user)
    return {
        "model": "tiny-llama",
        "messages": list(history),
        "max_tokens": 8,
        "temperature": 0,
        "session_id": sid,
        "conversation_id": sid,
    }


async def load(
    url: str, streams: int, warmup: float, seconds: float
) -> tuple[list[float], int, float]:
    """`streams` conversations at once for warmup + seconds; latencies (s) of the turns
    that started after the warm-up, errors, and the measured window's length."""
    latencies: list[float] = []
    errors = 0
    t0 = time.monotonic()
    start, stop = t0 + warmup, t0 + warmup + seconds
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=60)
    ) as s:

        async def stream(i: int) -> None:
            nonlocal errors
            session = 0
            while time.monotonic() < stop:
                history: list[dict[str, str]] = []
                for k in range(TURNS_PER_SESSION):
                    body = json.dumps(turn_body(i, session, history, k)).encode()
                    a = time.monotonic()
                    if a >= stop:
                        return
                    async with s.post(
                        url, data=body, headers={"Content-Type": "application/json"}
                    ) as r:
                        await r.read()
                        ok = r.status == 200
                    b = time.monotonic()
                    if a >= start:
                        if ok:
                            latencies.append(b - a)
                        else:
                            errors += 1
                    history.append({"role": "assistant", "content": "fine thanks"})
                session += 1

        await asyncio.gather(*(stream(i) for i in range(streams)))
    return latencies, errors, seconds


def measure(
    front: str, url: str, front_pid: int | None, streams: int, warmup: float, seconds: float
) -> Measured:
    cpu0 = process_cpu_seconds(front_pid) if front_pid else None
    me0 = process_cpu_seconds(os.getpid())
    t0 = time.monotonic()
    lat, errors, window = asyncio.run(load(url, streams, warmup, seconds))
    # CPU over the whole run includes the warm-up: scale it to the measured window.
    total = time.monotonic() - t0
    share = window / total
    cpu = (
        (process_cpu_seconds(front_pid) - cpu0) * share if front_pid and cpu0 is not None else None
    )
    me = (process_cpu_seconds(os.getpid()) - me0) * share
    return Measured(
        front=front,
        streams=streams,
        turns=len(lat),
        seconds=window,
        p50_ms=(quantile(lat, 0.5) or 0) * 1e3,
        p99_ms=(quantile(lat, 0.99) or 0) * 1e3,
        turns_per_s=len(lat) / window,
        front_cpu_s=cpu,
        harness_cpu_s=me,
        errors=errors,
    )


# ----------------------------------------------------------------------------- report


def plot(rows: list[Measured], path: Path) -> None:
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = {
        DIRECT: "#888888",
        PROXY: "#d62728",
        SC_DEFAULTS: "#2ca02c",
        SC_PPATH: "#1f77b4",
        SC_ASYNCIO: "#98df8a",
    }
    concs = sorted({r.streams for r in rows})
    width = 0.8 / len(FRONTS)
    for i, f in enumerate(FRONTS):
        got = {r.streams: r for r in rows if r.front == f}
        xs = [j + (i - (len(FRONTS) - 1) / 2) * width for j in range(len(concs))]
        ax1.bar(
            xs,
            [got[c].p50_ms if c in got else 0 for c in concs],
            width,
            color=colors[f],
            label=LABELS[f],
        )
        ax1.scatter(
            xs, [got[c].p99_ms if c in got else 0 for c in concs], marker="_", s=80, color="black"
        )
        cap = [got[c].capacity_per_core or 0 for c in concs]
        ach = [got[c].turns_per_s if c in got else 0 for c in concs]
        if f != DIRECT:
            ax2.bar(xs, cap, width, color=colors[f], alpha=0.35)
        ax2.bar(xs, ach, width, color=colors[f], label=LABELS[f])
    ax1.set_xticks(range(len(concs)), [f"{c} streams" for c in concs])
    ax1.set_yscale("log")
    ax1.set_ylabel("latency at the client (ms; bar p50, tick p99)")
    ax1.set_title("Latency per turn")
    ax1.legend(fontsize=8)
    ax2.axhline(3000, color="grey", ls="--", lw=1)
    ax2.text(-0.45, 3050, "target: 3,000 turns/s on one core", color="grey", fontsize=8)
    ax2.set_xticks(range(len(concs)), [f"{c} streams" for c in concs])
    ax2.set_ylabel("turns/s")
    ax2.set_title("Throughput (solid: achieved; pale: 1 / front-end CPU per turn)")
    fig.suptitle(
        "Front ends on fake engines; front end alone on core 0, fakes + load on core 1", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.sidecar_cost", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--streams", default="1,16,64")
    p.add_argument("--seconds", type=float, default=6.0, help="measured window per point")
    p.add_argument("--warmup", type=float, default=1.5)
    p.add_argument("--fronts", default=",".join(FRONTS))
    p.add_argument(
        "--no-pin", action="store_true", help="no core pinning (a quick look; not for figures)"
    )
    p.add_argument("--log-dir", type=Path)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    logs = args.log_dir or Path("/tmp/kvferry-bench-sidecar") / time.strftime("%Y%m%d-%H%M%S")
    logs.mkdir(parents=True, exist_ok=True)
    try:
        return _run(args, logs)
    finally:
        stop_all()


def _run(args: argparse.Namespace, logs: Path) -> int:
    started = time.monotonic()
    streams = [int(x) for x in args.streams.split(",")]
    fronts = [f for f in args.fronts.split(",") if f]
    global PINNING
    PINNING = not args.no_pin
    if PINNING and (os.cpu_count() or 1) > HARNESS_CORE:
        os.sched_setaffinity(0, {HARNESS_CORE})
    result = Result("sidecar-cost")
    result.settings = {
        "streams": streams,
        "seconds": args.seconds,
        "warmup": args.warmup,
        "turnsPerSession": TURNS_PER_SESSION,
        "fakeVersion": "0.32.0",
    }
    print(result.header())
    p_port, d_port = free_port(), free_port()
    fakes = Proc(
        [
            sys.executable,
            "-m",
            "bench.fakeengines",
            "--prefill-port",
            str(p_port),
            "--decode-port",
            str(d_port),
        ],
        logs / "fakes.log",
    ).start()
    p_url, d_url = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"
    asyncio.run(wait_http(d_url + "/health"))
    pin(fakes.pid, HARNESS_CORE)
    rows: list[Measured] = []
    for front in fronts:
        proc_pid: int | None = None
        stopper: Any = None
        if front == DIRECT:
            url = d_url
        elif front == PROXY:
            port = free_port()
            proxy = Proc(
                [
                    sys.executable,
                    "-m",
                    "bench.refproxy",
                    "--port",
                    str(port),
                    "--prefill",
                    p_url,
                    "--decode",
                    d_url,
                ],
                logs / "refproxy.log",
            ).start()
            asyncio.run(wait_http(f"http://127.0.0.1:{port}/health"))
            url, proc_pid, stopper = f"http://127.0.0.1:{port}", proxy.pid, proxy
        else:
            sc = sidecar(front, p_url, d_url, logs, skip=0 if front == SC_PPATH else None)
            if front == SC_ASYNCIO:
                sc.extra_env["KVFERRY_SIDECAR_EVENT_LOOP"] = "asyncio"
            sc.start()
            assert sc.proc is not None
            url, proc_pid, stopper = sc.url, sc.proc.pid, sc
        if proc_pid:
            pin(proc_pid, FRONT_CORE)
        try:
            for n in streams:
                m = measure(
                    front,
                    url + "/v1/chat/completions",
                    proc_pid,
                    n,
                    args.warmup,
                    args.seconds,
                )
                rows.append(m)
                say(
                    f"{LABELS[front]:18} {n:3d} streams: p50 {m.p50_ms:.2f} ms, "
                    f"p99 {m.p99_ms:.2f} ms, "
                    f"{m.turns_per_s:.0f} turns/s"
                    + (f", {m.cpu_us_per_turn:.0f} us CPU/turn" if m.cpu_us_per_turn else "")
                    + (f", {m.errors} errors" if m.errors else "")
                )
        finally:
            if stopper is not None:
                stopper.stop()
    result.seconds = round(time.monotonic() - started, 1)
    direct = {r.streams: r for r in rows if r.front == DIRECT}
    out_rows = []
    for r in rows:
        added = (
            r.p50_ms - direct[r.streams].p50_ms
            if r.streams in direct and r.front != DIRECT
            else None
        )
        out_rows.append(
            (
                LABELS[r.front],
                r.streams,
                f"{r.p50_ms:.2f}",
                f"{r.p99_ms:.2f}",
                "-" if added is None else f"{added:+.2f}",
                f"{r.turns_per_s:.0f}",
                "-" if r.cpu_us_per_turn is None else f"{r.cpu_us_per_turn:.0f}",
                "-" if r.capacity_per_core is None else f"{r.capacity_per_core:.0f}",
                r.errors,
            )
        )
    print()
    print(
        table(
            (
                "front end",
                "streams",
                "p50 ms",
                "p99 ms",
                "added p50 ms",
                "turns/s",
                "CPU us/turn",
                "turns/s per core",
                "errors",
            ),
            out_rows,
        )
    )
    sc64 = next((r for r in rows if r.front == SC_DEFAULTS and r.streams == max(streams)), None)
    sc1 = next((r for r in rows if r.front == SC_DEFAULTS and r.streams == 1), None)
    px64 = next((r for r in rows if r.front == PROXY and r.streams == max(streams)), None)
    if sc64 and px64 and sc64.capacity_per_core and px64.capacity_per_core:
        print(
            f"\nat {sc64.streams} streams: sidecar (defaults) "
            f"{sc64.capacity_per_core:.0f} turns/s per core vs "
            f"reference proxy {px64.capacity_per_core:.0f} "
            f"({sc64.capacity_per_core / px64.capacity_per_core:.2f}x)"
        )
    if sc64:
        result.targets.append(
            Target(
                f"sidecar (defaults) turns/s on one core at {sc64.streams} streams "
                "(1 / CPU per turn)",
                round(sc64.capacity_per_core or 0),
                ">=",
                3000,
                "",
                f"achieved {sc64.turns_per_s:.0f} turns/s with the harness on the other core",
            )
        )
    if sc1 and 1 in direct:
        result.targets.append(
            Target(
                "sidecar (defaults) p50 added over direct D, 1 stream",
                round(sc1.p50_ms - direct[1].p50_ms, 3),
                "<=",
                1.0,
                " ms",
            )
        )
    result.results = {
        "rows": [
            asdict(r) | {"cpuUsPerTurn": r.cpu_us_per_turn, "capacityPerCore": r.capacity_per_core}
            for r in rows
        ]
    }
    result.print_targets()
    path = result.write(args.out)
    plot(rows, args.out / "sidecar-cost.png")
    say(f"wrote {path} and {args.out / 'sidecar-cost.png'} in {result.seconds:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
