"""How much memory and CPU the decode sidecar needs: the real ``kvferry-sidecar``
process in front of fake vLLM engines (kvferry_dev/fakeengines.py, in a process of
their own so their work is not counted), driven by many concurrent multi-turn
sessions until its handle store is full (1,024 handles, each with its token array).

    .venv/bin/python hack/sidecar_load.py                     # the sizing run
    .venv/bin/python hack/sidecar_load.py --sessions 200 --turns 3 --words 500

Prints, per turn round, the turns served, the sidecar's CPU seconds per turn and
cores used, and its resident memory now and at peak (VmRSS / VmHWM). The CRD's
defaults for ``sidecarResources`` are sized from this run (see the CRD's
descriptions and docs/cluster-prerequisites.md). A sizing script, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvferry_dev import fakeengines as fakes  # noqa: E402
from kvferry_dev.procs import free_port  # noqa: E402

BLOCK_SIZE = 16
# A vocabulary of this many distinct words: token ids spread like a real tokenizer's.
VOCAB_WORDS = 30000


def run_fakes(prefill_port: int, decode_port: int) -> None:
    """Both fake engines, forever (the parent terminates this process)."""
    from aiohttp import web

    async def main() -> None:
        engines = [
            (fakes.FakeEngine("prefill", "p0", block_size=BLOCK_SIZE), prefill_port),
            (fakes.FakeEngine("decode", "d0", block_size=BLOCK_SIZE), decode_port),
        ]
        for engine, port in engines:
            runner = web.AppRunner(engine.app(), access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
        while True:  # the fakes record every request: keep their memory flat
            await asyncio.sleep(1)
            for engine, _ in engines:
                engine.seen.clear()
                engine.handles.clear()

    asyncio.run(main())


def proc_figures(pid: int) -> tuple[float, int, int]:
    """(CPU seconds, VmRSS bytes, VmHWM bytes) of ``pid``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    cpu = (int(fields[11]) + int(fields[12])) / ticks
    rss = hwm = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024
        elif line.startswith("VmHWM:"):
            hwm = int(line.split()[1]) * 1024
    return cpu, rss, hwm


def words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(VOCAB_WORDS)}" for _ in range(n))


async def one_turn(
    http: aiohttp.ClientSession, url: str, session: str, history: list[dict], stream: bool
) -> None:
    body = {"model": "fake", "messages": history, "session_id": session, "max_tokens": 8}
    if stream:
        body["stream"] = True
    async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"turn of {session}: {resp.status} {await resp.text()}")
        text = await resp.read()
    answer = "fine thanks"
    if not stream:
        answer = json.loads(text)["choices"][0]["message"]["content"]
    history.append({"role": "assistant", "content": answer})


async def drive(args: argparse.Namespace, url: str, pid: int) -> list[dict]:
    rng = random.Random(7)
    histories = {f"s{i}": [] for i in range(args.sessions)}
    limit = asyncio.Semaphore(args.concurrency)
    rows = []
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        for turn in range(1, args.turns + 1):
            for history in histories.values():
                history.append({"role": "user", "content": words(rng, args.words)})
            cpu0, _, _ = proc_figures(pid)
            started = time.monotonic()

            async def run(session: str, history: list[dict], stream: bool) -> None:
                async with limit:
                    await one_turn(http, url, session, history, stream)

            await asyncio.gather(
                *(run(s, h, i % 2 == 1) for i, (s, h) in enumerate(histories.items()))
            )
            wall = time.monotonic() - started
            cpu1, rss, hwm = proc_figures(pid)
            tokens = sum(len(m["content"].split()) + 2 for m in next(iter(histories.values())))
            rows.append(
                {
                    "turn": turn,
                    "turns": len(histories),
                    "context_tokens": tokens,
                    "wall_s": wall,
                    "turns_per_s": len(histories) / wall,
                    "cpu_ms_per_turn": 1000 * (cpu1 - cpu0) / len(histories),
                    "cores": (cpu1 - cpu0) / wall,
                    "rss_mib": rss / 2**20,
                    "peak_mib": hwm / 2**20,
                }
            )
            print(
                "turn {turn}: {turns} turns at ~{context_tokens} tokens of context, "
                "{turns_per_s:.1f} turns/s, {cpu_ms_per_turn:.1f} ms CPU/turn, "
                "{cores:.2f} cores, RSS {rss_mib:.0f} MiB (peak {peak_mib:.0f} MiB)".format(
                    **rows[-1]
                ),
                flush=True,
            )
    return rows


async def handles_held(url: str) -> str:
    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    return "\n".join(
        line
        for line in text.splitlines()
        # held in the store = pinned - pinned unused
        if line.startswith(("kvferry_pinned_handles", "kvferry_pinned_unused_handles"))
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=1100, help="more than the 1,024-handle cap")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--words", type=int, default=2000, help="new tokens per user turn")
    p.add_argument("--concurrency", type=int, default=64)
    args = p.parse_args()

    prefill_port, decode_port, sidecar_port = free_port(), free_port(), free_port()
    internal_port = free_port()
    fakes_proc = multiprocessing.Process(
        target=run_fakes, args=(prefill_port, decode_port), daemon=True
    )
    fakes_proc.start()
    url = f"http://127.0.0.1:{sidecar_port}"
    logdir = Path(tempfile.mkdtemp(prefix="kvferry-sidecar-load-"))
    cmd = [
        str(Path(sys.executable).parent / "kvferry-sidecar"),
        "--role=decode",
        "--host=127.0.0.1",
        f"--port={sidecar_port}",
        f"--internal-port={internal_port}",
        f"--engine-url=http://127.0.0.1:{decode_port}",
        f"--prefill-engines=http://127.0.0.1:{prefill_port}",
        f"--decode-sidecars={url}",
        "--ordinal=0",
        f"--block-size={BLOCK_SIZE}",
        "--kv-events=",
        "--log-level=WARNING",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVFERRY_", "POD_"))}
    with open(logdir / "sidecar.log", "wb") as log:
        sidecar = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd="/")
    try:
        deadline = time.monotonic() + 60
        while True:
            if http_status(f"{url}/readyz") == 200:
                break
            if time.monotonic() > deadline or sidecar.poll() is not None:
                print((logdir / "sidecar.log").read_text()[-3000:], file=sys.stderr)
                return 1
            time.sleep(0.5)
        _, idle_rss, _ = proc_figures(sidecar.pid)
        print(f"sidecar idle: RSS {idle_rss / 2**20:.0f} MiB", flush=True)
        asyncio.run(drive(args, url, sidecar.pid))
        print(asyncio.run(handles_held(f"http://127.0.0.1:{internal_port}")))
    finally:
        sidecar.terminate()
        sidecar.wait(timeout=20)
        fakes_proc.terminate()
    return 0


def http_status(url: str) -> int | None:
    """A blocking GET's status; None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, OSError):
        return None


if __name__ == "__main__":
    sys.exit(main())
