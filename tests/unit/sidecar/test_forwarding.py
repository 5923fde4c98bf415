"""One hop to the session's owner, and never more than one."""

from __future__ import annotations

import re
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from kvferry_dev.fakeengines import FakeEngine
from kvferry_sidecar.app import app_factory
from kvferry_sidecar.session import owner

from .conftest import Engines, sidecar_of, sidecar_settings, start

CHAT = "/v1/chat/completions"
UNUSED = "http://127.0.0.1:9"  # a ring slot the test never calls


def session_owned_by(ordinal: int, ring: int) -> str:
    """A session_id whose owner in a ring of ``ring`` pods is ``ordinal``."""
    for i in range(1000):
        if owner(f"session_id=s{i}", ring) == ordinal:
            return f"s{i}"
    raise AssertionError("no such session")


def body(session: str) -> dict[str, Any]:
    return {"model": "m", "session_id": session, "messages": [{"role": "user", "content": "hi"}]}


class Pair:
    """Two decode pods: sidecar 0 (test client) and sidecar 1 (a real server)."""

    def __init__(self, s0: TestClient, s1: TestServer, d0: FakeEngine, d1: FakeEngine) -> None:
        self.s0, self.s1, self.d0, self.d1 = s0, s1, d0, d1


@pytest.fixture
async def pair(aiohttp_server: Any, aiohttp_client: Any, engines: Engines) -> Pair:
    d1 = await start(aiohttp_server, FakeEngine("decode", "decode-1"))
    s1 = await aiohttp_server(
        app_factory(
            sidecar_settings(
                engines, engine_url=d1.url, ordinal=1, decode_sidecars=(UNUSED, UNUSED)
            )
        )
    )
    url1 = str(s1.make_url("")).rstrip("/")
    s0 = await aiohttp_client(
        app_factory(sidecar_settings(engines, ordinal=0, decode_sidecars=(UNUSED, url1)))
    )
    return Pair(s0, s1, engines.decode, d1)


async def test_forwarding_to_owner(pair: Pair) -> None:
    """A session owned by pod 1 arriving at pod 0 is served by pod 1's engine."""
    resp = await pair.s0.post(
        CHAT, json=body(session_owned_by(1, 2)), headers={"X-Request-Id": "f1"}
    )
    assert resp.status == 200
    assert resp.headers["X-Kvferry-Owner"] == "1"
    assert resp.headers["X-Request-Id"] == "f1"
    assert (await resp.json())["choices"][0]["message"]["content"] == "fine thanks"
    assert len(pair.d1.completions()) == 1
    assert pair.d0.completions() == []
    # The owner's engine gets the owner sidecar's own id, never the client's.
    assert re.fullmatch(r"[0-9a-f]{32}", pair.d1.last().headers["X-Request-Id"])


async def test_forwarding_own_sessions_served_locally(pair: Pair) -> None:
    """A session pod 0 owns is not forwarded."""
    resp = await pair.s0.post(CHAT, json=body(session_owned_by(0, 2)))
    assert resp.headers["X-Kvferry-Owner"] == "0"
    assert len(pair.d0.completions()) == 1


async def test_forwarding_streams_through(pair: Pair) -> None:
    """A streamed answer from the owner is relayed as a stream."""
    resp = await pair.s0.post(CHAT, json={**body(session_owned_by(1, 2)), "stream": True})
    text = await resp.text()
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    assert text.rstrip().endswith("data: [DONE]")


async def test_forwarded_request_is_never_forwarded_again(pair: Pair) -> None:
    """A request marked as forwarded is served where it lands, whatever the ring says."""
    # Bug prevented: two pods with different ring views bouncing a request forever.
    async with TestClient(pair.s1) as s1:
        session = session_owned_by(0, 2)
        resp = await s1.post(CHAT, json=body(session), headers={"X-Kvferry-Forwarded-By": "0"})
        metrics = await (await s1.get("/metrics")).text()
    assert resp.status == 200
    assert resp.headers["X-Kvferry-Owner"] == "1"
    assert len(pair.d1.completions()) == 1
    assert "kvferry_forwarded_total{" not in metrics  # not even attempted


async def test_forwarding_owner_unreachable_serves_here(
    aiohttp_client: Any, engines: Engines
) -> None:
    """An owner that cannot be reached is skipped: this pod serves (a recompute)."""
    client = await aiohttp_client(
        app_factory(sidecar_settings(engines, ordinal=0, decode_sidecars=(UNUSED, UNUSED)))
    )
    resp = await client.post(CHAT, json=body(session_owned_by(1, 2)))
    assert resp.status == 200
    assert len(engines.decode.completions()) == 1
    text = await (await client.get("/metrics")).text()
    assert 'kvferry_forwarded_total{result="unreachable"} 1.0' in text


async def test_forwarding_keeps_handle_with_owner(pair: Pair) -> None:
    """Turns of one session arriving at different pods all use the owner's handle."""
    session = session_owned_by(1, 2)
    messages = [{"role": "user", "content": "one two three four five six seven eight"}]
    await pair.s0.post(CHAT, json={"model": "m", "session_id": session, "messages": messages})
    messages += [
        {"role": "assistant", "content": "fine thanks"},
        {"role": "user", "content": "more"},
    ]
    async with TestClient(pair.s1) as s1:
        resp = await s1.post(CHAT, json={"model": "m", "session_id": session, "messages": messages})
    assert resp.headers["X-Kvferry-Outcome"] == "reused"
    assert pair.d0.completions() == []
    assert len(sidecar_of(pair.s0).store) == 0


async def test_forwarding_carries_the_owner_so_the_owner_pod_binds_the_handle(
    aiohttp_server: Any, aiohttp_client: Any, engines: Engines
) -> None:
    """The owner header reaches the session's pod: the same owner reuses its handle
    through either pod, another owner with the same session_id finds nothing."""
    owners = {"owner_header": "X-User"}
    d1 = await start(aiohttp_server, FakeEngine("decode", "decode-1"))
    s1 = await aiohttp_server(
        app_factory(
            sidecar_settings(
                engines, engine_url=d1.url, ordinal=1, decode_sidecars=(UNUSED, UNUSED), **owners
            )
        )
    )
    url1 = str(s1.make_url("")).rstrip("/")
    s0 = await aiohttp_client(
        app_factory(sidecar_settings(engines, ordinal=0, decode_sidecars=(UNUSED, url1), **owners))
    )
    session = session_owned_by(1, 2)
    first = body(session)
    first["messages"][0]["content"] = "one two three four five six seven eight nine ten"
    resp = await s0.post(CHAT, json=first, headers={"X-User": "alice"})
    answer = (await resp.json())["choices"][0]["message"]
    later = {**first, "messages": [*first["messages"], answer, {"role": "user", "content": "and"}]}
    resp = await s0.post(CHAT, json=later, headers={"X-User": "bob"})
    assert resp.headers["X-Kvferry-Outcome"] == "no-handle"
    resp = await s0.post(CHAT, json=later, headers={"X-User": "alice"})
    assert resp.headers["X-Kvferry-Outcome"] == "reused"
    assert engines.decode.completions() == []


def test_a_header_sent_twice_is_relayed_twice_so_the_owner_pod_reads_it_as_this_pod_did():
    # A plain dict kept the last copy: this pod read "no owner" (twice), the owner pod
    # then served the client's chosen identity with reuse.
    from multidict import CIMultiDict, CIMultiDictProxy

    from kvferry_sidecar import forward

    sent = CIMultiDictProxy(
        CIMultiDict([("X-User", "victim"), ("X-User", "gw"), ("Connection", "keep-alive")])
    )
    relayed = forward._relay_headers(sent)
    assert relayed.getall("X-User") == ["victim", "gw"]
    assert "Connection" not in relayed
