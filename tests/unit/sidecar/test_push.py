"""Pushing the residency report to the operator: token, TLS, failures."""

from __future__ import annotations

import json
import logging
import shutil
import ssl
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvferry_sidecar.push import Pusher
from kvferry_wire import report

BODY = b'{"version": 1}'


@dataclass
class FakeOperator:
    """Records what each push carried; answers the statuses queued in ``fail``."""

    auth: list[str | None] = field(default_factory=list)
    bodies: list[bytes] = field(default_factory=list)
    content_types: list[str] = field(default_factory=list)
    fail: list[int] = field(default_factory=list)
    # The raw body of the next accepted answers (default: {"accepted": true}).
    answers: list[bytes] = field(default_factory=list)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/reports", self.post)
        return app

    async def post(self, request: web.Request) -> web.Response:
        self.auth.append(request.headers.get("Authorization"))
        self.content_types.append(request.content_type)
        self.bodies.append(await request.read())
        if self.fail:
            return web.json_response({"error": "refused"}, status=self.fail.pop(0))
        if self.answers:
            return web.Response(
                body=self.answers.pop(0), status=202, content_type="application/json"
            )
        return web.json_response({"accepted": True}, status=202)


@pytest.fixture
async def operator(aiohttp_server: Any) -> tuple[FakeOperator, str]:
    op = FakeOperator()
    server = await aiohttp_server(op.app())
    return op, str(server.make_url("/v1/reports"))


def pusher(url: str, token_file: Path | None = None, **kwargs: Any) -> Pusher:
    return Pusher(
        url,
        lambda: BODY,
        token_file=str(token_file) if token_file else None,
        ca_file=kwargs.pop("ca_file", None),
        interval_s=kwargs.pop("interval_s", 15.0),
        **kwargs,
    )


async def test_push_sends_the_report_with_the_bearer_token(
    operator: tuple[FakeOperator, str], tmp_path: Path
) -> None:
    op, url = operator
    token = tmp_path / "token"
    token.write_text("tok-1\n")
    async with aiohttp.ClientSession() as session:
        assert await pusher(url, token).push_once(session) is True
    assert op.auth == ["Bearer tok-1"]
    assert op.bodies == [BODY]
    assert op.content_types == ["application/json"]


async def test_token_is_read_again_for_every_push(
    operator: tuple[FakeOperator, str], tmp_path: Path
) -> None:
    """The kubelet rotates the projected token: a cached one would expire."""
    op, url = operator
    token = tmp_path / "token"
    token.write_text("tok-1")
    p = pusher(url, token)
    async with aiohttp.ClientSession() as session:
        await p.push_once(session)
        token.write_text("tok-2")
        await p.push_once(session)
    assert op.auth == ["Bearer tok-1", "Bearer tok-2"]


async def test_unreadable_token_skips_the_push_without_raising(
    operator: tuple[FakeOperator, str], tmp_path: Path
) -> None:
    op, url = operator
    p = pusher(url, tmp_path / "missing")
    async with aiohttp.ClientSession() as session:
        assert await p.push_once(session) is False
    assert op.auth == []
    assert p.failures == 1


async def test_push_survives_refusals_and_an_unreachable_operator(
    operator: tuple[FakeOperator, str], tmp_path: Path
) -> None:
    """A 5xx/4xx or a dead endpoint is a failed push, never an exception."""
    op, url = operator
    op.fail = [500, 403]
    token = tmp_path / "token"
    token.write_text("tok")
    results = []
    p = pusher(url, token, on_result=results.append)
    dead = pusher("http://127.0.0.1:1/v1/reports", token)
    async with aiohttp.ClientSession() as session:
        outcomes = [await p.push_once(session) for _ in range(3)]
        assert await dead.push_once(session) is False
    assert outcomes == [False, False, True]
    assert results == [False, False, True]
    assert (p.failures, p.successes) == (2, 1)


async def test_failures_are_logged_at_most_once_a_minute(
    operator: tuple[FakeOperator, str], caplog: pytest.LogCaptureFixture
) -> None:
    op, url = operator
    op.fail = [500, 500, 500]
    now = [0.0]
    p = pusher(url, clock=lambda: now[0])
    caplog.set_level(logging.WARNING, logger="kvferry_sidecar.push")
    async with aiohttp.ClientSession() as session:
        await p.push_once(session)
        now[0] = 30.0
        await p.push_once(session)
        now[0] = 61.0
        await p.push_once(session)
    assert len([r for r in caplog.records if "push failed" in r.message]) == 2


async def test_push_loop_keeps_going_after_failures(
    operator: tuple[FakeOperator, str], tmp_path: Path
) -> None:
    import asyncio

    op, url = operator
    op.fail = [503, 503]
    p = pusher(url, interval_s=0.01)
    async with aiohttp.ClientSession() as session:
        task = asyncio.create_task(p.run(session))
        try:
            async with asyncio.timeout(5.0):  # bounded: three pushes at 10 ms intervals
                while p.successes < 1:
                    await asyncio.sleep(0.01)
        finally:
            task.cancel()
    assert p.failures == 2
    assert len(op.bodies) >= 3


# ------------------------------------------------------------------ HTTPS


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (it is its own CA)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=kvferry-operator", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=30,
    )  # fmt: skip
    return cert, key


@pytest.fixture
async def tls_operator(aiohttp_server: Any, tls_files: tuple[Path, Path]):
    cert, key = tls_files
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(str(cert), str(key))
    op = FakeOperator()
    server = await aiohttp_server(op.app(), ssl=ctx)
    url = f"https://127.0.0.1:{server.port}/v1/reports"
    return op, url, cert


async def test_https_push_is_verified_against_the_configured_ca(tls_operator, tmp_path: Path):
    op, url, cert = tls_operator
    token = tmp_path / "token"
    token.write_text("tok")
    async with aiohttp.ClientSession() as session:
        assert await pusher(url, token, ca_file=str(cert)).push_once(session) is True
        # Without the CA the system trust store does not know this certificate.
        assert await pusher(url, token).push_once(session) is False
    assert op.auth == ["Bearer tok"]


async def test_pushed_body_is_the_encoded_report(operator: tuple[FakeOperator, str]) -> None:
    op, url = operator
    snap = report.Report(
        version=1, server="x", namespace="ns", pod="x-decode-0", role="decode",
        started_at=1.0, generated_at=2.0,
    )  # fmt: skip
    p = Pusher(url, lambda: report.encode(snap), token_file=None, ca_file=None, interval_s=15)
    async with aiohttp.ClientSession() as session:
        await p.push_once(session)
    assert report.decode(op.bodies[0]) == snap


async def test_a_standby_refusal_is_sent_again_to_the_leader_behind_a_balancer(
    operator: tuple[FakeOperator, str], aiohttp_server: Any
) -> None:
    """Two operator replicas behind a round-robin balancer: the standby (its real
    app) refuses and closes; the push goes again at once and the leader takes it."""
    from kvferry_operator import standby
    from tests.roundrobin import RoundRobin

    leader, url = operator
    standby_server = await aiohttp_server(standby.app_factory())
    leader_port = int(url.split(":")[2].split("/")[0])
    balancer = RoundRobin([("127.0.0.1", standby_server.port), ("127.0.0.1", leader_port)])
    port = await balancer.start()
    try:
        p = pusher(f"http://127.0.0.1:{port}/v1/reports")
        async with aiohttp.ClientSession() as session:
            assert await p.push_once(session)
            assert await p.push_once(session)
        assert (len(leader.bodies), p.standby_refusals, p.failures) == (2, 1, 0)
        # The standby's answer closed its connection, so the retry was a new one (to
        # the leader), and the leader's was kept alive for the next push.
        assert balancer.connections == [1, 1]
    finally:
        await balancer.close()


async def test_two_standby_refusals_in_a_row_count_as_one_failed_push(
    aiohttp_server: Any,
) -> None:
    from kvferry_operator import standby

    server = await aiohttp_server(standby.app_factory())
    p = pusher(str(server.make_url("/v1/reports")))
    async with aiohttp.ClientSession() as session:
        assert not await p.push_once(session)
    assert (p.standby_refusals, p.failures, p.successes) == (2, 1, 0)


POLICY = {"version": 1, "revision": "r1", "retentionSeconds": 120}


async def test_the_answer_reaches_on_answer(operator: tuple[FakeOperator, str]) -> None:
    op, url = operator
    op.answers = [json.dumps({"accepted": True, "policy": POLICY}).encode()]
    got: list[Any] = []
    async with aiohttp.ClientSession() as session:
        assert await pusher(url, on_answer=got.append).push_once(session) is True
    assert got == [{"accepted": True, "policy": POLICY}]


@pytest.mark.parametrize(
    "answer",
    [b"not json", b"[1, 2]", b"[" * 5000 + b"]" * 5000, b'{"pad": "' + b"x" * 20000 + b'"}'],
    ids=["not JSON", "not an object", "nested deep", "too long"],
)
async def test_an_odd_answer_is_handed_on_as_nothing_and_the_push_counts(
    operator: tuple[FakeOperator, str], answer: bytes
) -> None:
    op, url = operator
    op.answers = [answer]
    got: list[Any] = []
    p = pusher(url, on_answer=got.append)
    async with aiohttp.ClientSession() as session:
        assert await p.push_once(session) is True
    assert got == [None] and p.successes == 1
