"""Stopping without cutting turns (drain.py): the real sidecar against fake engines."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from kvferry_dev.fakeengines import FakeEngine
from kvferry_sidecar import config
from kvferry_sidecar.app import SIDECAR, app_factory
from kvferry_sidecar.drain import RETRY_AFTER_SECONDS, Drainer
from kvferry_wire.protocol import HDR_DRAINING, HDR_FORWARDED_BY

from .conftest import Engines, MakeSidecar, sidecar_of, sidecar_settings, start
from .test_forwarding import UNUSED, session_owned_by

CHAT = "/v1/chat/completions"


def body(session: str = "s", *, stream: bool = False) -> dict[str, Any]:
    return {
        "model": "m",
        "session_id": session,
        "stream": stream,
        "messages": [{"role": "user", "content": "hello there"}],
    }


def streamed_text(raw: str) -> str:
    text = ""
    for line in raw.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:]).get("choices", []):
                text += choice.get("delta", {}).get("content") or ""
    return text


def releases(engines: Engines) -> list[dict[str, Any]]:
    """The release requests P received: D's coordinates, nothing to pull."""
    seen = [s for p in engines.prefill for s in p.completions()]
    params = [s.body.get("kv_transfer_params") or {} for s in seen]
    return [p for p in params if p.get("remote_num_tokens") == 0]


# ------------------------------------------------------------------ Drainer, alone


async def test_wait_returns_when_the_last_turn_ends() -> None:
    """Rule 3: the wait ends on the event the last turn sets, long before the grace."""
    d = Drainer()
    turn = d.turn()
    turn.__enter__()
    d.begin(3600.0)
    waiting = asyncio.ensure_future(d.wait())
    await asyncio.sleep(0)  # let the wait start: it must not be done with a turn open
    assert not waiting.done()
    turn.__exit__(None, None, None)
    result = await asyncio.wait_for(waiting, timeout=5.0)
    assert result.left == 0 and result.waited_s < 5.0


async def test_wait_returns_at_the_grace_deadline_with_turns_left() -> None:
    """Rule 3: a turn that does not end is cut at the deadline, and counted."""
    d = Drainer()
    with d.turn():
        d.begin(0.05)  # the deadline itself is what is tested: a short one
        result = await asyncio.wait_for(d.wait(), timeout=5.0)
    assert result.left == 1 and result.waited_s >= 0.05
    assert result.as_json()["drained"] is False


async def test_wait_ends_when_the_engine_is_down() -> None:
    """Rule 3: turns of an engine that is down cannot finish; no waiting for them."""
    d = Drainer()
    with d.turn():
        d.begin(3600.0)
        waiting = asyncio.ensure_future(d.wait())
        await asyncio.sleep(0)
        d.engine_down()
        result = await asyncio.wait_for(waiting, timeout=5.0)
    assert result.left == 1 and result.engine_down


async def test_a_second_begin_keeps_the_first_deadline() -> None:
    """Rule 4: the preStop hook, then SIGTERM: one drain, the first deadline."""
    d = Drainer()
    with d.turn():
        d.begin(0.05)
        d.begin(3600.0)
        result = await asyncio.wait_for(d.wait(), timeout=5.0)
    assert result.left == 1


def test_reset_ends_the_drain() -> None:
    """Rule 5: an engine restart (a liveness kill ran the preStop) ends the drain."""
    d = Drainer()
    d.begin(10.0)
    assert d.draining
    assert d.reset() is True
    assert not d.draining and d.reset() is False


# ------------------------------------------------------------------ the sidecar


async def test_stream_in_flight_when_drain_starts_completes_whole(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """A stream D is still sending when the drain begins reaches the client whole, and
    the drain answers once it has ended, not before."""
    client = await make_sidecar()
    sc = sidecar_of(client)
    engines.decode.hold_after_finish = asyncio.Event()
    resp = await client.post(CHAT, json=body(stream=True))
    assert resp.status == 200
    first = await resp.content.readline()  # the stream is under way
    assert first.startswith(b"data: ")
    drain = asyncio.ensure_future(client.get("/drain"))
    draining = sc.begin_drain()
    # Let the drain task and the /drain request run as far as they can: both wait.
    for _ in range(5):
        await asyncio.sleep(0)
    assert sc.drainer.inflight == 1 and not draining.done() and not drain.done()
    engines.decode.hold_after_finish.set()
    raw = first.decode() + (await resp.read()).decode()
    assert streamed_text(raw) == "fine thanks "
    assert raw.rstrip().endswith("data: [DONE]")
    answer = await asyncio.wait_for(drain, timeout=10.0)
    assert answer.status == 200
    assert await answer.json() == {
        "drained": True,
        "inflight": 0,
        "waitedSeconds": pytest.approx((await draining).waited_s, abs=0.01),
        "engineDown": False,
    }


async def test_new_turn_during_drain_is_refused_retryably(make_sidecar: MakeSidecar) -> None:
    """A turn after the drain began: 503, Retry-After, X-Kvferry-Draining, connection
    closed; the engines see nothing."""
    client = await make_sidecar()
    sidecar_of(client).begin_drain()
    resp = await client.post(CHAT, json=body())
    assert resp.status == 503
    assert resp.headers["Retry-After"] == str(RETRY_AFTER_SECONDS)
    assert resp.headers[HDR_DRAINING] == "true"
    assert resp.headers["Connection"] == "close"
    assert (await resp.json())["error"]["type"] == "draining"


async def test_readiness_fails_from_the_first_moment_of_a_drain(
    make_sidecar: MakeSidecar,
) -> None:
    """The pod leaves the Service's endpoints at once, on either port."""
    client = await make_sidecar(internal_port=0)
    assert (await client.get("/readyz")).status == 200
    sidecar_of(client).begin_drain()
    resp = await client.get("/readyz")
    assert resp.status == 503 and await resp.json() == {"status": "draining"}


async def test_drain_releases_the_handles_held(make_sidecar: MakeSidecar, engines: Engines) -> None:
    """The handles held go to P as release requests (an empty pull: P tells D to free
    them) before /drain answers, while the engine still runs."""
    client = await make_sidecar()
    assert (await client.post(CHAT, json=body("a"))).status == 200
    assert (await client.post(CHAT, json=body("b"))).status == 200
    held = {h.params["remote_request_id"] for h in sidecar_of(client).store.values()}
    assert len(held) == 2
    assert releases(engines) == []
    answer = await client.get("/drain")
    assert (await answer.json())["drained"] is True
    assert sorted(p["remote_request_id"] for p in releases(engines)) == sorted(held)


async def test_engine_restart_after_a_drain_takes_turns_again(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """A liveness restart runs the engine's preStop: once the new engine is seen, the
    sidecar (which stays) serves again."""
    client = await make_sidecar()
    sc = sidecar_of(client)
    await client.get("/drain")
    assert (await client.post(CHAT, json=body())).status == 503
    engines.decode.restart()
    await sc.scrape_engine()  # the new engine's start time: a restart
    assert not sc.drainer.draining
    assert (await client.post(CHAT, json=body())).status == 200


# ------------------------------------------------------------------ peers


@pytest.fixture
async def owner_draining(
    aiohttp_server: Any, aiohttp_client: Any, engines: Engines
) -> tuple[TestClient, Any, FakeEngine]:
    """Pod 0 (the test client) and pod 1 (a real server), pod 1 draining."""
    d1 = await start(aiohttp_server, FakeEngine("decode", "decode-1"))
    app1 = app_factory(
        sidecar_settings(engines, engine_url=d1.url, ordinal=1, decode_sidecars=(UNUSED, UNUSED))
    )
    s1 = await aiohttp_server(app1)
    url1 = str(s1.make_url("")).rstrip("/")
    s0 = await aiohttp_client(
        app_factory(sidecar_settings(engines, ordinal=0, decode_sidecars=(UNUSED, url1)))
    )
    app1[SIDECAR].begin_drain()
    return s0, s1, d1


async def test_peer_forward_to_a_draining_owner_is_served_here(
    owner_draining: tuple[TestClient, Any, FakeEngine], engines: Engines
) -> None:
    """The owner answers a peer's relay 503 + X-Kvferry-Draining; the peer serves the
    turn itself (a recompute) instead of passing the refusal on."""
    s0, s1, d1 = owner_draining
    resp = await s0.post(CHAT, json=body(session_owned_by(1, 2)))
    assert resp.status == 200
    assert (await resp.json())["choices"][0]["message"]["content"] == "fine thanks"
    assert d1.completions() == [] and len(engines.decode.completions()) == 1
    forwarded = sidecar_of(s0).metrics.forwarded
    assert forwarded.labels("owner-draining")._value.get() == 1
    # What the owner itself answered the relay.
    direct = await s0.session.post(
        str(s1.make_url(CHAT)), json=body(session_owned_by(1, 2)), headers={HDR_FORWARDED_BY: "0"}
    )
    assert direct.status == 503 and direct.headers[HDR_DRAINING] == "true"


def test_a_negative_drain_is_refused_naming_the_setting() -> None:
    with pytest.raises(config.ConfigError, match="drain_seconds must be >= 0"):
        config.build({"drain_seconds": -1}, env={})
