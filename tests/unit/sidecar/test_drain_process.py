"""The real ``kvferry-sidecar`` process drains on SIGTERM: the turn in flight reaches
its client whole, a new one is refused retryably, and the process exits only after."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import aiohttp

from kvferry_dev import hostile
from kvferry_dev.fakeengines import FakeEngine

from .conftest import start
from .test_drain import body, streamed_text

CHAT = "/v1/chat/completions"
EXIT_TIMEOUT_S = 30.0


async def test_sigterm_drains_before_the_process_exits(aiohttp_server: Any, tmp_path: Path):
    p = await start(aiohttp_server, FakeEngine("prefill", "prefill-0"))
    d = await start(aiohttp_server, FakeEngine("decode", "decode-0"))
    d.hold_after_finish = asyncio.Event()
    sc = hostile.sidecar_for_fakes(
        p.url, d.url, tmp_path, {"drainSeconds": 600, "logLevel": "INFO"}, name="drain"
    )
    await asyncio.to_thread(sc.start)
    try:
        assert sc.proc is not None
        async with aiohttp.ClientSession() as http:
            resp = await http.post(sc.url + CHAT, json=body(stream=True))
            first = await resp.content.readline()
            assert resp.status == 200 and first.startswith(b"data: ")
            os.kill(sc.proc.pid, signal.SIGTERM)
            # Draining is a lasting state: bounded, it cannot be missed.
            for _ in range(200):
                ready = await http.get(sc.url + "/readyz")
                if ready.status == 503:
                    break
                await asyncio.sleep(0.05)
            assert (await ready.json()) == {"status": "draining"}
            refused = await http.post(sc.url + CHAT, json=body("other"))
            assert refused.status == 503 and refused.headers["Retry-After"] == "1"
            assert sc.proc.poll() is None, "exited with a turn in flight"
            d.hold_after_finish.set()
            raw = first.decode() + (await resp.read()).decode()
        assert streamed_text(raw) == "fine thanks "
        code = await asyncio.to_thread(sc.proc.wait, EXIT_TIMEOUT_S)
        assert code == 0, sc.logtail()
        drained = [line for line in sc.log_path.read_text().splitlines() if "drained " in line]
        assert len(drained) == 1 and "drained inflight=0" in drained[0], drained
        print(f"\n{drained[0]}")
    finally:
        await asyncio.to_thread(sc.stop)
