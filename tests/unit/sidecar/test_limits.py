"""What one request, and all requests together, may cost the sidecar: each bound
refused with its status and a message naming the limit and its setting, never a 5xx,
never an engine's request; big bodies parsed off the event loop.

Bug prevented: a 60 MiB chat body took the sidecar from 43 to 1,668 MiB RSS and
stalled /healthz 4.2 s (the default sidecar memory limit is 1 Gi: an OOM kill loses
every handle and cuts every stream on the pod); a slow sender held a connection as
long as it liked."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from kvferry_sidecar import limits, upstream
from kvferry_sidecar.app import BODY_BUDGET, app_factory
from kvferry_sidecar.config import ConfigError, build
from tests.kube import free_port

from .conftest import Engines, MakeSidecar, sidecar_settings
from .test_turns import CHAT, LONG_QUESTION

JSON_HEADERS = {"Content-Type": "application/json"}
# Small caps: a text allowance of 64 tokens x 16 bytes + 1,024 = 2,048 bytes.
SMALL = {"max_model_len": 64, "body_overhead_bytes": 1024}


def chat(content: Any = LONG_QUESTION, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": content}], **extra}


def media_part(kind: str, size: int) -> dict[str, Any]:
    data = "A" * size
    if kind == "input_audio":
        return {"type": kind, kind: {"data": data, "format": "wav"}}
    return {"type": kind, kind: {"url": f"data:application/octet-stream;base64,{data}"}}


async def refusal(resp: Any, status: int) -> dict[str, Any]:
    assert resp.status == status, await resp.text()
    error = (await resp.json())["error"]
    assert error["code"] == status
    return error


def nothing_reached_an_engine(engines: Engines) -> None:
    assert engines.decode.seen == [] and engines.prefill_calls() == 0


async def open_raw(client: TestClient, head: bytes) -> tuple[asyncio.StreamReader, Any]:
    reader, writer = await asyncio.open_connection(client.host, client.port)
    writer.write(head)
    await writer.drain()
    return reader, writer


def post_head(length: int) -> bytes:
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: sidecar\r\nConnection: close\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % length
    )


async def status_of(reader: asyncio.StreamReader) -> tuple[int, dict[str, Any]]:
    """The status and the JSON error of a raw answer, read by its Content-Length (the
    server may go on reading an unread body for a while before it closes); bounded:
    a hang fails the test."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    lines = head.decode().split("\r\n")
    length = next(
        int(v) for k, _, v in (h.partition(": ") for h in lines) if k.lower() == "content-length"
    )
    body = await asyncio.wait_for(reader.readexactly(length), 10)
    return int(lines[0].split()[1]), json.loads(body)["error"]


# ------------------------------------------------------------------ the caps, pure


def test_the_text_allowance_is_bytes_per_token_times_the_context_plus_the_overhead() -> None:
    caps = limits.body_caps(build({"max_model_len": 1000}, env={}), engine_max_model_len=None)
    assert caps.text_bytes == 1000 * 16 + 1024 * 1024
    assert caps.media_bytes == 16 * 1024 * 1024
    assert caps.total_bytes == caps.text_bytes + caps.media_bytes


def test_the_setting_wins_over_the_engines_context_and_the_engines_over_the_fallback() -> None:
    settings = build({}, env={})
    assert limits.body_caps(settings, engine_max_model_len=100).max_model_len == 100
    fallback = limits.body_caps(settings, engine_max_model_len=None)
    assert fallback.max_model_len == limits.UNKNOWN_MAX_MODEL_LEN
    own = build({"max_model_len": 50}, env={})
    assert limits.body_caps(own, engine_max_model_len=100).max_model_len == 50


@pytest.mark.parametrize(
    ("models", "expected"),
    [
        ({"data": [{"id": "m", "max_model_len": 4096}]}, 4096),
        ({"data": [{"id": "m", "max_model_len": 4096}, {"id": "a", "max_model_len": 8192}]}, 8192),
        ({"data": [{"id": "m"}]}, None),
        ({"data": [{"id": "m", "max_model_len": True}, {"max_model_len": -1}]}, None),
        ({"data": "x"}, None),
        ([], None),
    ],
)
def test_the_engines_context_is_read_from_its_models_list(models: Any, expected: int) -> None:
    assert upstream.max_model_len(models) == expected


@pytest.mark.parametrize("kind", ["image_url", "audio_url", "video_url", "input_audio"])
def test_media_bytes_are_the_strings_of_media_parts(kind: str) -> None:
    body = chat([{"type": "text", "text": "x" * 500}, media_part(kind, 3000)])
    assert 3000 <= limits.media_bytes(body) < 3100


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("max_model_len", 0),
        ("body_bytes_per_token", 0),
        ("body_overhead_bytes", -1),
        ("max_media_bytes", -1),
        ("max_inflight_body_bytes", 0),
        ("max_messages", 0),
        ("max_content_parts", -1),
        ("header_timeout_seconds", 0),
        ("body_timeout_seconds", 0),
    ],
)
def test_a_bound_out_of_range_is_a_config_error_naming_it(name: str, value: int) -> None:
    with pytest.raises(ConfigError, match=name):
        build({name: value}, env={})


# ------------------------------------------------------------------ size


async def test_a_body_past_what_the_model_can_take_is_a_413_naming_the_limit(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    client = await make_sidecar(**SMALL)
    resp = await client.post(CHAT, json=chat("word " * 1000))
    error = await refusal(resp, 413)
    assert "maxModelLen" in error["message"] and "bodyBytesPerToken" in error["message"]
    assert "2048" in error["message"], error
    nothing_reached_an_engine(engines)
    assert (await client.post(CHAT, json=chat("word " * 100))).status == 200


@pytest.mark.parametrize("depth", [limits.MAX_DEPTH + 1, 970, 5000])
async def test_json_nested_past_the_depth_limit_is_a_400(
    make_sidecar: MakeSidecar, engines: Engines, depth: int
) -> None:
    # 970 levels parsed, then the /tokenize leg's re-encoding hit the recursion limit: 500.
    client = await make_sidecar()
    part = {"type": "image_url", "image_url": {"url": "data:,x"}, "extra": "NEST"}
    text = json.dumps(chat([{"type": "text", "text": "hi"}, part]))
    text = text.replace('"NEST"', "[" * depth + "]" * depth)  # json.dumps would recurse
    resp = await client.post(CHAT, data=text, headers={"Content-Type": "application/json"})
    error = await refusal(resp, 400)
    assert f"deeper than {limits.MAX_DEPTH}" in error["message"], error
    nothing_reached_an_engine(engines)


async def test_the_engines_context_length_bounds_the_body_when_the_setting_is_unset(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    engines.decode.max_model_len = 64
    client = await make_sidecar(body_overhead_bytes=1024)
    error = await refusal(await client.post(CHAT, json=chat("word " * 1000)), 413)
    assert "max_model_len 64" in error["message"], error
    assert (await client.post(CHAT, json=chat("word " * 100))).status == 200


async def test_a_declared_length_past_the_cap_is_refused_before_the_body_is_read(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """The answer comes while the body is still unsent: nothing is buffered for it."""
    client = await make_sidecar(**SMALL, max_media_bytes=1024)
    reader, writer = await open_raw(client, post_head(10_000_000))
    try:
        status, error = await status_of(reader)
    finally:
        writer.close()
    assert status == 413 and "maxMediaBytes" in error["message"], error
    nothing_reached_an_engine(engines)


async def test_a_chunked_body_past_the_cap_is_a_413(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    client = await make_sidecar(**SMALL, max_media_bytes=1024)

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(100):
            yield b" " * 1000

    resp = await client.post(CHAT, data=chunks(), headers=JSON_HEADERS)
    await refusal(resp, 413)
    nothing_reached_an_engine(engines)


@pytest.mark.parametrize("kind", ["image_url", "audio_url", "video_url", "input_audio"])
async def test_media_past_their_own_cap_are_a_413_naming_it(
    make_sidecar: MakeSidecar, engines: Engines, kind: str
) -> None:
    client = await make_sidecar(max_media_bytes=1000)
    resp = await client.post(CHAT, json=chat([media_part(kind, 2000)]))
    error = await refusal(resp, 413)
    assert "maxMediaBytes" in error["message"] and "1000" in error["message"], error
    nothing_reached_an_engine(engines)


# ------------------------------------------------------------------ counts


async def test_too_many_messages_is_a_400_naming_the_field_and_the_setting(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    client = await make_sidecar(max_messages=3)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}] * 4}
    error = await refusal(await client.post(CHAT, json=body), 400)
    assert error["param"] == "messages" and "maxMessages" in error["message"], error
    nothing_reached_an_engine(engines)


async def test_too_many_content_parts_is_a_400_naming_the_field_and_the_setting(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    client = await make_sidecar(max_content_parts=2)
    parts = [{"type": "text", "text": "hi"}] * 2
    body = {"model": "m", "messages": [{"role": "user", "content": parts}] * 2}
    error = await refusal(await client.post(CHAT, json=body), 400)
    assert error["param"] == "messages" and "maxContentParts" in error["message"], error
    nothing_reached_an_engine(engines)


# ------------------------------------------------------------------ bytes in flight


async def test_bodies_past_the_in_flight_budget_get_503_with_retry_after(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """A body held (here: still arriving) counts against maxInflightBodyBytes until
    its turn is over; another that would exceed it is refused at once, not queued."""
    client = await make_sidecar(max_inflight_body_bytes=3000)
    budget = client.app[BODY_BUDGET]
    held = json.dumps(chat("word " * 300)).encode()
    reader, writer = await open_raw(client, post_head(len(held)) + held[:-10])
    try:
        for _ in range(1000):  # until the sidecar has read what arrived and holds it
            if budget.in_use == len(held) - 10:
                break
            await asyncio.sleep(0.01)
        assert budget.in_use == len(held) - 10
        resp = await client.post(CHAT, data=held, headers=JSON_HEADERS)
        error = await refusal(resp, 503)
        assert resp.headers["Retry-After"] == "1"
        assert "maxInflightBodyBytes" in error["message"], error
        writer.write(held[-10:])
        await writer.drain()
        status = int((await asyncio.wait_for(reader.readline(), 10)).split()[1])
        assert status == 200
    finally:
        writer.close()
    await writer.wait_closed()
    resp = await client.post(CHAT, data=held, headers=JSON_HEADERS)
    assert resp.status == 200, await resp.text()
    assert budget.in_use == 0


async def test_heads_that_declare_big_bodies_and_send_nothing_hold_no_budget(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """Bug prevented: the declared length was held at once, so a few connections that
    declared big bodies and sent none got every other turn a 503 until their deadline."""
    client = await make_sidecar(max_inflight_body_bytes=3000)
    idle = [await open_raw(client, post_head(1000)) for _ in range(3)]
    try:
        resp = await client.post(CHAT, json=chat("hi"))
        assert resp.status == 200, await resp.text()
    finally:
        for _, writer in idle:
            writer.close()


async def test_a_body_larger_than_the_whole_budget_is_a_413_naming_it(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    client = await make_sidecar(max_inflight_body_bytes=100)
    error = await refusal(await client.post(CHAT, json=chat()), 413)
    assert "maxInflightBodyBytes" in error["message"], error
    nothing_reached_an_engine(engines)


# A sidecar's memory for a turn is many times its body (parsed, copied per leg, the
# prompt's token ids as Python ints): the budget follows the container's memory limit.
MiB = 2**20


@pytest.mark.parametrize(
    ("limit", "capacity"),
    [
        (1024 * MiB, (1024 * MiB - limits.MEMORY_RESERVE_BYTES) // limits.MEMORY_PER_BODY_BYTE),
        (4096 * MiB, (4096 * MiB - limits.MEMORY_RESERVE_BYTES) // limits.MEMORY_PER_BODY_BYTE),
        # Below the reserve: still the floor, never 0 (every turn a 413).
        (64 * MiB, limits.MIN_INFLIGHT_BODY_BYTES),
        # No limit on the container: the downward API gives the node's memory.
        (2 * 2**40, limits.MAX_INFLIGHT_BODY_BYTES),
    ],
)
def test_the_in_flight_budget_follows_the_memory_limit(limit: int, capacity: int) -> None:
    assert limits.inflight_capacity(build({"memory_limit_bytes": limit}, env={})) == capacity


def test_the_budget_under_the_default_limit_leaves_half_of_it() -> None:
    """At the CRD's default 1 Gi the bodies in flight may cost at most about half of it
    (the memory attack measured 10-12 bytes of RSS per body byte: docs/performance.md)."""
    capacity = limits.inflight_capacity(build({"memory_limit_bytes": 1024 * MiB}, env={}))
    assert capacity * 12 <= 512 * MiB


def test_a_set_budget_wins_over_the_memory_limit() -> None:
    settings = build({"memory_limit_bytes": 1024 * MiB, "max_inflight_body_bytes": 5}, env={})
    assert limits.inflight_capacity(settings) == 5


def test_without_a_memory_limit_the_budget_is_the_fallback() -> None:
    assert limits.inflight_capacity(build({}, env={})) == limits.FALLBACK_INFLIGHT_BODY_BYTES


async def test_the_sidecar_holds_no_more_body_bytes_than_its_memory_allows(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """The bound the code guarantees: a body past the budget derived from the memory
    limit is a 413 naming the setting; one within it is served."""
    limit = limits.MEMORY_RESERVE_BYTES + limits.MEMORY_PER_BODY_BYTE * 2 * MiB
    client = await make_sidecar(memory_limit_bytes=limit, max_model_len=10**6)
    assert client.app[BODY_BUDGET].capacity == 2 * MiB
    big = chat(" ".join(["word"] * (3 * MiB // 5)))
    error = await refusal(await client.post(CHAT, json=big), 413)
    assert "maxInflightBodyBytes" in error["message"] and str(2 * MiB) in error["message"]
    nothing_reached_an_engine(engines)
    resp = await client.post(CHAT, json=chat(" ".join(["word"] * (MiB // 5))))
    assert resp.status == 200, await resp.text()


# ------------------------------------------------------------------ slow senders


async def test_a_body_that_does_not_arrive_in_time_gets_408(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    client = await make_sidecar(body_timeout_seconds=0.2)
    loop = asyncio.get_running_loop()
    started = loop.time()
    reader, writer = await open_raw(client, post_head(100) + b'{"model"')
    try:
        status, error = await status_of(reader)
    finally:
        writer.close()
    assert status == 408 and "bodyTimeoutSeconds" in error["message"], error
    # 0.2 s asked; the bound leaves room for a loaded machine, far below a hang.
    assert loop.time() - started < 5.0
    nothing_reached_an_engine(engines)
    assert client.app[BODY_BUDGET].in_use == 0


KEEP_ALIVE_HEAD = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: sidecar\r\n"
    b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
)


async def answer_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    """The status and the headers (lower-cased names) of a raw answer, its body read
    by its Content-Length; bounded."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v for k, _, v in (h.partition(": ") for h in lines[1:] if h)}
    await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), 10)
    return int(lines[0].split()[1]), headers


async def closed_by_server(reader: asyncio.StreamReader, within: float) -> bool:
    """Whether the server closes the connection (EOF, or a reset) within ``within``
    seconds, nothing more arriving before."""
    try:
        rest = await asyncio.wait_for(reader.read(), within)
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return rest == b""


async def test_a_408_closes_the_connection_at_once(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """Issue 38 (9): a body that never finishes gets its 408 with ``Connection: close``
    and the server closes the socket as soon as the answer is out. Before, aiohttp
    went on reading the unread body for its lingering time (10 s), and a sender that
    finished it then kept the connection for the keep-alive time (an hour by
    default): each slow sender held a socket that long."""
    client = await make_sidecar(body_timeout_seconds=0.2)
    reader, writer = await open_raw(client, KEEP_ALIVE_HEAD + b'{"model"')
    try:
        status, headers = await answer_head(reader)
        assert status == 408
        assert headers.get("connection", "").lower() == "close", headers
        # The rest of the body, late: it must not buy the connection more time.
        writer.write(b" " * 92)
        # Far below aiohttp's 10 s lingering time.
        assert await closed_by_server(reader, 5.0)
    finally:
        writer.close()
    nothing_reached_an_engine(engines)
    assert client.app[BODY_BUDGET].in_use == 0


async def test_a_refusal_before_the_body_is_read_whole_closes_the_connection(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """A declared length past what may ever be in flight is refused (413) before its
    body is read:
    ``Connection: close``, so the rest of the body is never read as a next request
    and the connection is not kept for the keep-alive time (aiohttp still reads
    what arrives for a moment, so a client still sending gets its answer, not a
    reset). A refusal after the whole body (invalid JSON) keeps the connection."""
    client = await make_sidecar(max_inflight_body_bytes=50)
    reader, writer = await open_raw(client, KEEP_ALIVE_HEAD)
    try:
        status, headers = await answer_head(reader)
        assert status == 413 and headers.get("connection", "").lower() == "close", headers
    finally:
        writer.close()
    head = KEEP_ALIVE_HEAD.replace(b"Content-Length: 100", b"Content-Length: 3")
    reader, writer = await open_raw(client, head + b"{x}")
    try:
        status, headers = await answer_head(reader)
        assert status == 400 and headers.get("connection", "").lower() != "close", headers
    finally:
        writer.close()
    nothing_reached_an_engine(engines)


async def test_a_request_head_that_does_not_arrive_in_time_is_cut(
    make_sidecar: MakeSidecar,
) -> None:
    """A head never finished gets no answer (there is no request to answer), the
    connection is closed at the deadline."""
    client = await make_sidecar(header_timeout_seconds=0.2)
    loop = asyncio.get_running_loop()
    started = loop.time()
    reader, writer = await open_raw(client, b"POST /v1/chat/completions HTTP/1.1\r\nHost: s")
    try:
        rest = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    assert rest == b""
    assert loop.time() - started < 5.0


# ------------------------------------------------------------------ the event loop


async def test_a_big_body_is_parsed_off_the_loop_while_other_turns_flow(
    make_sidecar: MakeSidecar, engines: Engines, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a big body is being parsed, /healthz answers and a whole streamed turn
    runs; then the big body is refused. The parse is held on an event: were it on the
    loop, nothing else could run until the hold timed out, which the test sees."""
    client = await make_sidecar(max_media_bytes=1000)
    entered, release = threading.Event(), threading.Event()
    held_to_the_end: list[bool] = []
    parse = limits.parse_body

    def parse_held(raw: bytes, caps: limits.BodyCaps) -> Any:
        if len(raw) > limits.PARSE_IN_THREAD_BYTES:
            entered.set()
            held_to_the_end.append(not release.wait(10))
        return parse(raw, caps)

    monkeypatch.setattr(limits, "parse_body", parse_held)
    big = json.dumps(chat([media_part("image_url", 2 * limits.PARSE_IN_THREAD_BYTES)]))
    refused = asyncio.create_task(client.post(CHAT, data=big, headers=JSON_HEADERS))
    try:
        assert await asyncio.to_thread(entered.wait, 10)
        assert (await client.get("/healthz")).status == 200
        stream = await client.post(CHAT, json=chat(stream=True))
        assert stream.status == 200 and "fine" in await stream.text()
        assert not refused.done()
    finally:
        release.set()
    error = await refusal(await refused, 413)
    assert "maxMediaBytes" in error["message"]
    assert held_to_the_end == [False]


# ------------------------------------------------------------------ connections per client

HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: sidecar\r\n\r\n"


async def test_one_address_holds_at_most_the_cap_of_client_connections(
    aiohttp_client: Any, engines: Engines, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 38 (9): past ``MAX_CONNECTIONS_PER_CLIENT`` connections open from one
    address on the client port, the next connection's request is a 503 with
    ``Retry-After`` and the connection is closed; the held ones go on being served,
    another address is not counted with it, and a closed connection frees its place.
    Before, one address could hold any number of sockets (each for the keep-alive
    time, an hour by default)."""
    monkeypatch.setattr(limits, "MAX_CONNECTIONS_PER_CLIENT", 2, raising=False)
    port = free_port()
    settings = sidecar_settings(engines, listen_host="127.0.0.1", listen_port=port)
    client = await aiohttp_client(
        app_factory(settings, clock=engines.clock), server_kwargs={"port": port}
    )
    opened: list[Any] = []

    async def connect(source: str = "127.0.0.1") -> tuple[asyncio.StreamReader, int, dict]:
        reader, writer = await asyncio.open_connection(
            client.host, client.port, local_addr=(source, 0)
        )
        opened.append(writer)
        writer.write(HEALTHZ)
        await writer.drain()
        status, headers = await answer_head(reader)
        return reader, status, headers

    try:
        held = []
        for _ in range(2):
            reader, status, _ = await connect()
            assert status == 200
            held.append((reader, opened[-1]))
        reader, status, headers = await connect()
        assert status == 503, headers
        assert headers.get("connection", "").lower() == "close" and "retry-after" in headers
        assert await closed_by_server(reader, 5.0)
        # The held connections are still served.
        held[1][1].write(HEALTHZ)
        assert (await answer_head(held[1][0]))[0] == 200
        # Another address is not counted with this one (127/8 is all loopback).
        _, status, _ = await connect("127.0.0.2")
        assert status == 200
        # A held connection closed (by the server, at the client's asking) frees its place.
        held[0][1].write(HEALTHZ.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n"))
        assert (await answer_head(held[0][0]))[0] == 200
        assert await closed_by_server(held[0][0], 5.0)
        _, status, _ = await connect()
        assert status == 200
    finally:
        for writer in opened:
            writer.close()


async def test_peers_on_the_internal_port_are_not_capped(
    make_sidecar: MakeSidecar, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cap is the client port's: peers' relays (a few pods, each with many turns
    in flight) come in on the internal port, which ``make_sidecar``'s server is."""
    monkeypatch.setattr(limits, "MAX_CONNECTIONS_PER_CLIENT", 1, raising=False)
    client = await make_sidecar()
    opened = []
    try:
        for _ in range(3):
            reader, writer = await open_raw(client, HEALTHZ)
            opened.append(writer)
            assert (await answer_head(reader))[0] == 200
    finally:
        for writer in opened:
            writer.close()
