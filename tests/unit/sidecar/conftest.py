"""Fixtures: fake engines on real local ports, and a sidecar app built against them."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from kvferry_dev.fakeengines import FakeClock, FakeEngine
from kvferry_sidecar.app import SIDECAR, app_factory
from kvferry_sidecar.config import Settings
from kvferry_sidecar.runtime import Sidecar


@dataclass
class Engines:
    prefill: list[FakeEngine]
    decode: FakeEngine
    clock: FakeClock = field(default_factory=FakeClock)

    @property
    def p0(self) -> FakeEngine:
        return self.prefill[0]

    @property
    def p1(self) -> FakeEngine:
        return self.prefill[1]

    def prefill_calls(self) -> int:
        return sum(len(p.completions()) for p in self.prefill)


async def start(aiohttp_server: Any, engine: FakeEngine) -> FakeEngine:
    server = await aiohttp_server(engine.app())
    engine.url = str(server.make_url("")).rstrip("/")
    return engine


@pytest.fixture
async def engines(aiohttp_server: Any) -> Engines:
    p0 = await start(aiohttp_server, FakeEngine("prefill", "prefill-0"))
    p1 = await start(aiohttp_server, FakeEngine("prefill", "prefill-1"))
    d = await start(aiohttp_server, FakeEngine("decode", "decode-0"))
    return Engines([p0, p1], d)


def sidecar_settings(engines: Engines, **overrides: Any) -> Settings:
    """Settings for tiny fake prompts: no skipping, a 4-token recompute threshold,
    background loops slow enough never to run during a test, no KV-event socket. The
    route by the skip-prefill rule alone: the fakes' timings say nothing about costs
    (test_placement_app.py sets prefillPlacement Measured and the fakes' delays)."""
    values: dict[str, Any] = {
        "engine_url": engines.decode.url,
        "prefill_engines": tuple(p.url for p in engines.prefill),
        "skip_prefill_below_tokens": 0,
        "prefill_placement": "Threshold",
        "recompute_threshold": 4,
        "probe_interval_seconds": 3600.0,
        "topology_reload_seconds": 3600.0,
        "connect_timeout_seconds": 1.0,
        "prefill_timeout_seconds": 5.0,
        "kv_events": "",
        # Handles dropped unread go to P at once (test_reuse_safety covers the wait).
        "release_after_seconds": 0.0,
        # The tests read the per-turn X-Kvferry-* headers (off by default: test_ports).
        "diagnostic_headers": True,
        "pod_name": "x-decode-0",
        "namespace": "serving",
        "server": "x",
    }
    values.update(overrides)
    return Settings(**values)


MakeSidecar = Callable[..., Awaitable[TestClient]]


@pytest.fixture
def make_sidecar(aiohttp_client: Any, engines: Engines) -> MakeSidecar:
    async def make(**overrides: Any) -> TestClient:
        app = app_factory(sidecar_settings(engines, **overrides), clock=engines.clock)
        return await aiohttp_client(app)

    return make


def sidecar_of(client: TestClient) -> Sidecar:
    return client.app[SIDECAR]  # type: ignore[index]


async def post_raw(
    client: TestClient, path: str, headers: dict[str, bytes], body: bytes
) -> tuple[int, bytes]:
    """POST as raw HTTP/1.1 (aiohttp's client sends only UTF-8 headers): the status
    and the rest of the answer, headers included."""
    reader, writer = await asyncio.open_connection(client.host, client.port)
    try:
        head = b"".join(b"%s: %s\r\n" % (k.encode(), v) for k, v in headers.items())
        writer.write(
            b"POST %s HTTP/1.1\r\nHost: sidecar\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s"
            % (path.encode(), len(body), head, body)
        )
        await writer.drain()
        status_line = await reader.readline()
        rest = await reader.read()  # to the end: the answer is complete, streamed or not
        return int(status_line.split()[1]), rest
    finally:
        writer.close()
