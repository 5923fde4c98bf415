"""Malformed HTTP requests: a 400 each, counted by reason, and at most a short line in
the log, never a traceback per connection (a client could fill the pod's log)."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from aiohttp.http_exceptions import BadHttpMessage
from aiohttp.test_utils import TestClient

from kvferry_sidecar import httplog
from kvferry_sidecar.promtext import Scrape

from .conftest import MakeSidecar

# What a careless or hostile client sends instead of HTTP (kinds, not the counter's
# reasons: aiohttp's parser files several under one).
MALFORMED = {
    "no-method": b"GARBAGE\r\n\r\n",
    "tls-hello": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 / HTTP/1.1\r\n\r\n",
    "header-without-colon": b"GET /healthz HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
    "oversized-header": b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n",
    "binary": bytes(range(256)) + b"\r\n\r\n",
}
ROUNDS = 40  # x 5 kinds = 200 connections


async def send(client: TestClient, raw: bytes) -> int:
    """One connection that sends ``raw``: the answer's status code."""
    reader, writer = await asyncio.open_connection(client.host, client.port)
    try:
        writer.write(raw)
        await writer.drain()
        status_line = await reader.readline()
        await reader.read()
        return int(status_line.split()[1])
    finally:
        writer.close()


def malformed_counts(text: str) -> dict[str, float]:
    return {
        s.labels["reason"]: s.value
        for s in Scrape(text).samples
        if s.name == "kvferry_malformed_requests_total"
    }


async def test_malformed_requests_are_400_counted_and_never_a_traceback(
    make_sidecar: MakeSidecar, caplog: pytest.LogCaptureFixture
) -> None:
    """200 malformed requests of five kinds: each a 400, the counter by reason moves by
    the number sent, and the log has at most one short line per rate window, no
    traceback (aiohttp logs one per connection on its own)."""
    client = await make_sidecar()
    caplog.set_level(logging.DEBUG)
    started = time.monotonic()
    statuses = [await send(client, raw) for _ in range(ROUNDS) for raw in MALFORMED.values()]
    elapsed = time.monotonic() - started
    assert set(statuses) == {400}
    # The test server logs access lines; the sidecar runs without (cli: access_log=None).
    records = [
        r for r in caplog.records if r.levelno >= logging.INFO and r.name != "aiohttp.access"
    ]
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
    assert "Traceback" not in caplog.text
    # The limiter's own bound: the first line, then one per window at most.
    assert len(records) <= 1 + int(elapsed / httplog.LOG_WINDOW_SECONDS) + 1, [
        r.getMessage() for r in records
    ]
    assert all(len(r.getMessage()) < 300 for r in records)
    resp = await client.get("/metrics")
    counts = malformed_counts(await resp.text())
    assert sum(counts.values()) == len(statuses), counts
    assert set(counts) <= set(httplog.REASONS)
    # Several kinds are told apart (the C and the pure-Python parser name some alike).
    assert len([reason for reason, n in counts.items() if n]) >= 3, counts


async def test_a_good_request_after_a_malformed_one_is_served(make_sidecar: MakeSidecar) -> None:
    """A malformed request costs its own connection only."""
    client = await make_sidecar()
    assert await send(client, MALFORMED["header-without-colon"]) == 400
    assert (await client.get("/healthz")).status == 200


def test_our_own_errors_stay_loud(caplog: pytest.LogCaptureFixture) -> None:
    """An exception of our own code (aiohttp's 500 path) keeps its traceback; a
    parser error of the client's is one counted line."""
    counted: list[str] = []
    logger = httplog.ServerLog(logging.getLogger("test.httplog"), counted.append)
    caplog.set_level(logging.DEBUG)
    try:
        raise RuntimeError("bug in a handler")
    except RuntimeError as exc:
        logger.exception("Error handling request from %s", "1.2.3.4", exc_info=exc)
    assert caplog.records[-1].exc_info is not None
    assert counted == []
    logger.exception("Error handling request from %s", "1.2.3.4", exc_info=BadHttpMessage("x"))
    assert counted == ["bad-message"]
    assert caplog.records[-1].exc_info is None


def test_the_log_is_rate_limited_by_window() -> None:
    """Within a window, one line; the next window's line says how many were quiet."""
    now = [0.0]
    lines: list[str] = []
    limiter = httplog.LogLimiter(clock=lambda: now[0])
    for _ in range(100):
        if limiter.allow():
            lines.append(f"suppressed={limiter.take_suppressed()}")
    now[0] += httplog.LOG_WINDOW_SECONDS
    if limiter.allow():
        lines.append(f"suppressed={limiter.take_suppressed()}")
    assert lines == ["suppressed=0", "suppressed=99"]
