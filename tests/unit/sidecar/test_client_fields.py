"""Request fields through the sidecar, against fakes that read them as vLLM does:
the sidecar and the engine agree on what a request asks (issue 20, item 1)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from aiohttp import web

from .conftest import Engines, MakeSidecar
from .test_turns import (
    CHAT,
    LONG_QUESTION,
    Conversation,
    kv,
    outcome,
    prefill_bodies,
    releases_done,
)


def engine_bodies(engines: Engines) -> list[dict[str, Any]]:
    """Every completion request any engine received, in arrival order."""
    seen = [s for e in [*engines.prefill, engines.decode] for s in e.completions()]
    return [s.body for s in sorted(seen, key=lambda s: s.seq)]


# ------------------------------------------------------------------ stream, read as vLLM does


@pytest.mark.parametrize("flag", ["false", "0", "no", "OFF"])
async def test_a_false_stream_string_gets_plain_json_with_no_engine_detail_and_keeps_the_handle(
    make_sidecar: MakeSidecar, engines: Engines, flag: str
) -> None:
    """``"stream": "false"`` is false for vLLM: D answers plain JSON. The client gets
    it without D's kv_transfer_params or token ids, and the handle is kept."""
    # Bug prevented: bool("false") made the sidecar relay D's JSON through the SSE
    # rewriter unchanged: D's engine id, host, port and blocks reached the client and
    # the sidecar kept no handle (D's blocks pinned, untracked, until its TTL).
    client = await make_sidecar()
    messages = [{"role": "user", "content": LONG_QUESTION}]
    resp = await client.post(
        CHAT, json={"model": "m", "messages": messages, "session_id": "s", "stream": flag}
    )
    assert resp.status == 200
    assert resp.content_type == "application/json"
    raw = await resp.read()
    answer = json.loads(raw)
    assert answer["kv_transfer_params"] is None
    assert answer["prompt_token_ids"] is None
    assert answer["choices"][0]["token_ids"] is None
    assert b"remote_block_ids" not in raw and b"10.0.0.2" not in raw
    assert "X-Kvferry-Handle" not in resp.headers
    handle = engines.decode.handles[-1]
    assert handle is not None

    # The next turn pulls the handle the first one left.
    messages += [
        {"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
        {"role": "user", "content": "and then"},
    ]
    resp = await client.post(
        CHAT, json={"model": "m", "messages": messages, "session_id": "s", "stream": flag}
    )
    assert resp.status == 200
    assert outcome(resp) == "reused"
    assert kv(prefill_bodies(engines)[-1]) == handle
    await releases_done(client)


async def test_a_true_stream_string_streams_and_keeps_the_handle(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """``"stream": "True"`` streams, as vLLM reads it; the stream carries no handle and
    the next turn pulls the one D returned."""
    conv = Conversation(await make_sidecar(), session_id="s", stream="True")
    resp, raw = await conv.ask(LONG_QUESTION)
    assert resp.status == 200
    assert resp.content_type == "text/event-stream"
    assert "data: [DONE]" in raw
    assert "kv_transfer_params" not in raw and "token_ids" not in raw
    handle = engines.decode.handles[-1]
    assert handle is not None
    resp, _ = await conv.ask("and then")
    assert outcome(resp) == "reused"
    assert kv(prefill_bodies(engines)[-1]) == handle


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("stream", "maybe"),
        ("stream", 2),
        ("stream", {"on": True}),
        ("return_token_ids", "sure"),
        ("n", "two"),
        ("use_beam_search", None),
    ],
)
async def test_a_value_vllm_refuses_is_a_400_naming_the_field_and_reaches_no_engine(
    make_sidecar: MakeSidecar, engines: Engines, field: str, value: Any
) -> None:
    """The sidecar refuses what vLLM would, before any engine works on the request."""
    client = await make_sidecar()
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], field: value}
    resp = await client.post(CHAT, json=body)
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == field
    assert f"'{field}'" in error["message"]
    assert engine_bodies(engines) == []


async def test_a_json_answer_where_a_stream_was_asked_is_parsed_and_stripped(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """The relay follows D's Content-Type: a JSON answer to a streamed request is
    parsed and stripped as any JSON answer, never passed through as SSE."""
    client = await make_sidecar()
    d = engines.decode

    original = d._decode_answer

    async def answers_json(request: Any, body: dict[str, Any], *args: Any) -> Any:
        return await original(request, {**body, "stream": False}, *args)

    d._decode_answer = answers_json  # type: ignore[method-assign]
    body = {"model": "m", "messages": [{"role": "user", "content": LONG_QUESTION}]}
    resp = await client.post(CHAT, json={**body, "session_id": "s", "stream": True})
    assert resp.status == 200
    raw = await resp.read()
    answer = json.loads(raw)
    assert answer["kv_transfer_params"] is None and answer["prompt_token_ids"] is None
    assert b"remote_block_ids" not in raw
    assert d.handles[-1] is not None


async def test_a_body_the_sidecar_cannot_parse_is_never_relayed(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """A 200 from D that is not a JSON object (nor an event stream) is a 502 with no
    engine bytes in it."""
    client = await make_sidecar()
    d = engines.decode

    async def garbage(request: Any, body: dict[str, Any], *args: Any) -> Any:
        return web.Response(text='{"kv_transfer_params": {"remote_host": "10.0.0.2"', status=200)

    d._decode_answer = garbage  # type: ignore[method-assign]
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    resp = await client.post(CHAT, json=body)
    assert resp.status == 502
    raw = await resp.read()
    assert b"10.0.0.2" not in raw and b"kv_transfer_params" not in raw
