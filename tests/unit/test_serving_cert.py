"""The report endpoint's certificate follows its files: real TLS handshakes against
the endpoint's own context, before and after the Secret's files are swapped the way
the kubelet swaps them (a new folder, then one rename)."""

from __future__ import annotations

import os
import shutil
import ssl
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from kvferry_operator import report_endpoint, serving_cert
from tests.kube import free_port, self_signed_cert


def make_pair(folder: Path) -> tuple[Path, Path]:
    folder.mkdir(parents=True)
    return self_signed_cert(folder)


def swap_in(live: Path, cert: Path, key: Path) -> None:
    """Replace live/tls.crt and live/tls.key at once, as a Secret volume update does."""
    staged = live.parent / f"{live.name}.new"
    staged.mkdir()
    shutil.copy(cert, staged / "tls.crt")
    shutil.copy(key, staged / "tls.key")
    old = live.parent / f"{live.name}.old"
    os.rename(live, old)
    os.rename(staged, live)
    shutil.rmtree(old)


async def status_with(port: int, trust: Path, host: str) -> int:
    ctx = ssl.create_default_context(cafile=str(trust))
    # A new connection per call: an open connection keeps its handshake's certificate.
    async with (
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http,
        http.get(f"https://{host}:{port}/healthz", ssl=ctx) as resp,
    ):
        return resp.status


@pytest.fixture
def pairs(tmp_path: Path) -> dict[str, tuple[Path, Path]]:
    return {name: make_pair(tmp_path / name) for name in ("old", "new")}


async def healthz(_: web.Request) -> web.Response:
    return web.Response(text="ok")


class Clock:
    """The time the certificate's file checks see; tests move it past a check."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def next_check(self) -> None:
        self.now += serving_cert.CHECK_SECONDS


async def serve(live: Path, clock: Clock) -> tuple[web.AppRunner, int]:
    app = web.Application()
    app.router.add_get("/healthz", healthz)
    port = free_port()
    ctx = report_endpoint.tls_context(str(live / "tls.crt"), str(live / "tls.key"), clock)
    return await report_endpoint.serve(app, "127.0.0.1", port, ctx), port


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"], ids=["no-sni", "sni"])
async def test_a_rotated_certificate_is_served_to_new_connections(pairs, tmp_path, host):
    live = tmp_path / "live"
    live.mkdir()
    swap_in(live, *pairs["old"])
    clock = Clock()
    runner, port = await serve(live, clock)
    try:
        assert await status_with(port, pairs["old"][0], host) == 200
        swap_in(live, *pairs["new"])
        clock.next_check()
        assert await status_with(port, pairs["new"][0], host) == 200
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            await status_with(port, pairs["old"][0], host)
    finally:
        await runner.cleanup()


async def test_a_pair_that_does_not_load_keeps_the_previous_certificate(pairs, tmp_path):
    live = tmp_path / "live"
    live.mkdir()
    swap_in(live, *pairs["old"])
    clock = Clock()
    runner, port = await serve(live, clock)
    try:
        # The new certificate with the old key: a half-done rotation.
        swap_in(live, pairs["new"][0], pairs["old"][1])
        clock.next_check()
        assert await status_with(port, pairs["old"][0], "127.0.0.1") == 200
        # Completed: now the new pair is served.
        swap_in(live, *pairs["new"])
        clock.next_check()
        assert await status_with(port, pairs["new"][0], "127.0.0.1") == 200
    finally:
        await runner.cleanup()


def test_files_are_looked_at_once_a_second_at_most(pairs, tmp_path):
    now = [0.0]
    cert = serving_cert.ReloadingCert(*map(str, pairs["old"]), clock=lambda: now[0])
    first = cert.current()
    shutil.copy(pairs["new"][0], pairs["old"][0])
    shutil.copy(pairs["new"][1], pairs["old"][1])
    now[0] = 0.5
    assert cert.current() is first and cert.reloads == 0
    now[0] = 1.5
    assert cert.current() is not first and cert.reloads == 1


def test_missing_files_fail_at_start(tmp_path):
    with pytest.raises(FileNotFoundError):
        serving_cert.ReloadingCert(str(tmp_path / "tls.crt"), str(tmp_path / "tls.key"))
