"""The sidecar's two ports: clients on listen_port, peers and monitoring on
internal_port. Served here on two real ports, as the operator renders them."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvferry_dev.fakeengines import FakeEngine
from kvferry_operator import api, render
from kvferry_sidecar.app import app_factory, scrape
from kvferry_sidecar.config import Settings
from kvferry_sidecar.session import owner
from tests.kube import free_port
from tests.manifests import MINIMAL

from .conftest import Engines, MakeSidecar, sidecar_of, sidecar_settings, start

CHAT = "/v1/chat/completions"


def body(session: str) -> dict[str, Any]:
    return {"model": "m", "session_id": session, "messages": [{"role": "user", "content": "hi"}]}


@contextlib.asynccontextmanager
async def served(
    engines: Engines, aiohttp_server: Any, *, metrics_port: int = 0
) -> AsyncIterator[tuple[str, str, FakeEngine]]:
    """A decode sidecar of ordinal 0 in a ring of 2 (peer 1 a fake that records what it
    gets), listening on a public and an internal port (and on ``metrics_port`` when
    given); diagnostics left at default."""
    peer = await start(aiohttp_server, FakeEngine("decode", "peer-1"))
    public, internal = free_port(), free_port()
    settings = sidecar_settings(
        engines,
        ordinal=0,
        decode_sidecars=("http://127.0.0.1:1", peer.url),
        listen_host="127.0.0.1",
        listen_port=public,
        internal_port=internal,
        metrics_port=metrics_port,
        diagnostic_headers=False,
    )
    runner = web.AppRunner(app_factory(settings, clock=engines.clock))
    await runner.setup()
    for port in (public, internal, metrics_port):
        if port:
            await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{public}", f"http://127.0.0.1:{internal}", peer
    finally:
        await runner.cleanup()


@pytest.fixture
async def two_ports(
    engines: Engines, aiohttp_server: Any
) -> AsyncIterator[tuple[str, str, FakeEngine]]:
    async with served(engines, aiohttp_server) as ports:
        yield ports


@pytest.mark.parametrize("path", ["/metrics", "/v1/residency", "/drain"])
async def test_internal_routes_answer_on_the_internal_port_only(
    two_ports: tuple[str, str, FakeEngine], path: str
) -> None:
    """The entry Service exposes the public port: clients cannot read the sidecar's
    figures (other sessions' reuse) there, nor stop the pod (/drain)."""
    public, internal, _ = two_ports
    async with aiohttp.ClientSession() as http:
        refused = await http.get(public + path, headers={"X-Request-Id": "r-404"})
        assert (refused.status, refused.headers["X-Request-Id"]) == (404, "r-404")
        assert (await http.get(internal + path)).status == 200


# vLLM's own series as the fake engine adds them to its /metrics.
ENGINE_SERIES = (
    "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
    "# TYPE vllm:num_requests_running gauge\n"
    'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
    "# HELP python_gc_objects_collected_total Objects collected during gc\n"
    "# TYPE python_gc_objects_collected_total counter\n"
    'python_gc_objects_collected_total{generation="0"} 7.0\n'
)


@contextlib.asynccontextmanager
async def with_metrics_port(
    engines: Engines, aiohttp_server: Any
) -> AsyncIterator[tuple[str, str, str, FakeEngine]]:
    """``served`` plus the metrics port; the engine's /metrics scraped once, as the
    sidecar's probe loop does."""
    metrics = free_port()
    engines.decode.metrics_text = ENGINE_SERIES
    async with served(engines, aiohttp_server, metrics_port=metrics) as (public, internal, peer):
        yield public, internal, f"http://127.0.0.1:{metrics}", peer


async def test_the_metrics_port_serves_the_sidecars_and_the_engines_series(
    engines: Engines, aiohttp_server: Any
) -> None:
    """A scraper needs one port: the sidecar's kvferry_* series and the engine's vllm:*
    ones (from the sidecar's own scrape of the engine; the engine's process and python
    series would collide with the sidecar's and are left out)."""
    async with (
        with_metrics_port(engines, aiohttp_server) as (_, internal, metrics, _peer),
        aiohttp.ClientSession() as http,
    ):
        async with http.get(internal + "/readyz") as resp:  # the sidecar has started
            assert resp.status == 200
        resp = await http.get(metrics + "/metrics")
        assert resp.status == 200
        assert resp.content_type == "text/plain"
        text = await resp.text()
    assert "kvferry_turns_total" in text
    assert "kvferry_engine_ready" in text
    assert 'vllm:num_requests_running{engine="0",model_name="m"} 3.0' in text
    assert "vllm:cache_config_info" in text
    assert "python_gc_objects_collected_total" not in text
    names = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]
    assert len(names) == len(set(names)), "a family twice: Prometheus refuses the scrape"


@pytest.mark.parametrize(
    "method, path, status",
    [
        ("GET", "/v1/residency", 404),
        ("GET", "/readyz", 404),
        ("GET", "/healthz", 404),
        ("GET", "/v1/models", 404),
        ("POST", CHAT, 404),
        ("POST", "/v1/completions", 404),
        ("GET", "/metrics/", 404),
        # The engine's preStop: only the internal port drains the pod.
        ("GET", "/drain", 404),
        ("POST", "/metrics", 405),
        ("DELETE", "/metrics", 405),
    ],
)
async def test_the_metrics_port_answers_nothing_but_metrics(
    engines: Engines, aiohttp_server: Any, method: str, path: str, status: int
) -> None:
    """Whoever may scrape gets no peer's rights: no residency report (other sessions'
    figures), no readiness detail, no turn (relayed or not), no engine."""
    async with (
        with_metrics_port(engines, aiohttp_server) as (_, _internal, metrics, peer),
        aiohttp.ClientSession() as http,
    ):
        headers = {"X-Kvferry-Forwarded-By": "1"}
        resp = await http.request(method, metrics + path, json=body("s1"), headers=headers)
        assert resp.status == status
        text = await resp.text()
    assert "kvferry_" not in text and engines.decode.url not in text
    assert engines.decode.completions() == [] and peer.completions() == []


async def test_client_posing_as_a_peer_is_routed_like_any_client(
    two_ports: tuple[str, str, FakeEngine],
) -> None:
    """X-Kvferry-Forwarded-By from a client (public port) is ignored: a session owned
    by pod 1 still goes to pod 1; the same header from a peer (internal port) makes
    this pod serve it."""
    public, internal, peer = two_ports
    session = next(f"s{i}" for i in range(100) if owner(f"session_id=s{i}", 2) == 1)
    headers = {"X-Kvferry-Forwarded-By": "1"}
    async with aiohttp.ClientSession() as http:
        resp = await http.post(public + CHAT, json=body(session), headers=headers)
        assert resp.status == 200
        assert len(peer.completions()) == 1  # relayed to the owner
        resp = await http.post(internal + CHAT, json=body(session), headers=headers)
        assert resp.status == 200
        assert len(peer.completions()) == 1  # served here


async def test_reuse_diagnostics_are_off_by_default(
    two_ports: tuple[str, str, FakeEngine],
) -> None:
    """A turn's answer does not say how much of its prompt matched a session's last turn
    (a client guessing another's key could probe it) unless the server enables it."""
    public, _, _ = two_ports
    session = next(f"s{i}" for i in range(100) if owner(f"session_id=s{i}", 2) == 0)
    async with aiohttp.ClientSession() as http:
        resp = await http.post(public + CHAT, json=body(session))
        assert resp.status == 200
        assert resp.headers.get("X-Request-Id")
        assert not [h for h in resp.headers if h.lower().startswith("x-kvferry-")]


async def test_readyz_on_the_public_port_says_ready_and_nothing_else(
    two_ports: tuple[str, str, FakeEngine], engines: Engines
) -> None:
    """Clients learn neither the engine's URL nor how many handles the pod keeps; the
    internal port (peers, monitoring) still has the detail."""
    public, internal, _ = two_ports
    async with aiohttp.ClientSession() as http:
        resp = await http.get(public + "/readyz")
        assert (resp.status, await resp.json()) == (200, {"status": "ready"})
        assert resp.headers.get("X-Request-Id")
        detail = await (await http.get(internal + "/readyz")).json()
    assert detail["status"] == "ready" and detail["engine"] == engines.decode.url
    assert detail["handles"] == 0 and detail["prefill_engines"] == 2


async def test_readyz_on_the_public_port_says_not_ready_without_the_reason(
    engines: Engines, aiohttp_server: Any
) -> None:
    """Not ready: 503 with the status alone (the reason names the engine)."""
    engines.decode.healthy = False
    async with (
        served(engines, aiohttp_server) as (public, internal, _),
        aiohttp.ClientSession() as http,
    ):
        resp = await http.get(public + "/readyz")
        assert (resp.status, await resp.json()) == (503, {"status": "not-ready"})
        resp = await http.get(internal + "/readyz")
        detail = await resp.json()
    assert resp.status == 503 and detail["reason"] and detail["engine"] == engines.decode.url


@pytest.mark.parametrize("role", ["prefill", "decode"])
async def test_the_rendered_startup_probe_passes_before_the_engine_runs(role: str) -> None:
    """A native sidecar's startup probe holds the engine's start, so the path the
    operator renders for it must answer while no engine listens (a probe on /readyz
    would never pass and the engine would never start); readiness still waits for it."""
    objs = render.render(api.parse_server(MINIMAL))
    (sts,) = [
        o for o in objs if o["kind"] == "StatefulSet" and o["metadata"]["name"].endswith(role)
    ]
    container = sts["spec"]["template"]["spec"]["initContainers"][0]
    ports = {p["name"]: free_port() for p in container["ports"]}
    refused = "http://127.0.0.1:1"  # nothing listens: the engine has not started
    settings = Settings(
        role=role,
        engine_url=refused,
        prefill_engines=(refused,),
        listen_host="127.0.0.1",
        listen_port=ports["http"],
        internal_port=ports["internal"],
        metrics_port=ports["metrics"],
        probe_interval_seconds=3600.0,
        topology_reload_seconds=3600.0,
        connect_timeout_seconds=1.0,
        kv_events="",
    )
    runner = web.AppRunner(app_factory(settings))
    await runner.setup()
    for port in ports.values():
        await web.TCPSite(runner, "127.0.0.1", port).start()

    async def status(probe: str) -> int:
        get = container[probe]["httpGet"]
        async with http.get(f"http://127.0.0.1:{ports[get['port']]}{get['path']}") as resp:
            return resp.status

    try:
        async with aiohttp.ClientSession() as http:
            assert await status("startupProbe") == 200
            assert await status("livenessProbe") == 200
            assert await status("readinessProbe") == 503
    finally:
        await runner.cleanup()


async def test_a_failed_scrape_of_the_engine_drops_its_series(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """The metrics port re-serves the engine's series of the last good scrape only:
    after a scrape that fails they are absent, not frozen at their last values."""
    engines.decode.metrics_text = ENGINE_SERIES
    client = await make_sidecar()
    sc = sidecar_of(client)
    assert await sc.scrape_engine()
    assert b"vllm:num_requests_running" in scrape(sc).body
    engines.decode.metrics_text = "this is { not the exposition format\n"
    assert not await sc.scrape_engine()
    body = scrape(sc).body
    assert b"vllm:" not in body and b"kvferry_engine_ready" in body
