"""The turn protocol end to end: a sidecar app against fake P and D engines.

Each test drives the real aiohttp app in-process and asserts what each engine
received and what the client got back.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any

import pytest
from aiohttp import ClientResponse
from aiohttp.test_utils import TestClient

from kvferry_dev.fakeengines import EOS, chat_ids, ids
from kvferry_sidecar import relay
from kvferry_sidecar.types import LOCAL_HANDLE_PARAMS, PREFILL_REQUEST_PARAMS
from kvferry_sidecar.upstream import FAILURES_BEFORE_NOT_READY
from kvferry_wire import protocol

from .conftest import Engines, MakeSidecar, post_raw, sidecar_of

CHAT = "/v1/chat/completions"
LONG_QUESTION = "one two three four five six seven eight nine ten"
# A media message: its KV is not its ids', so a streamed turn on vLLM 0.32 carrying it
# cannot be re-anchored and keeps no handle.
IMAGE_MESSAGE = {
    "role": "user",
    "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}],
}


class Conversation:
    """A client that keeps its history and resends it each turn, as chat clients do."""

    def __init__(self, client: TestClient, **fields: Any) -> None:
        self.client = client
        self.fields = fields
        self.messages: list[dict[str, Any]] = []

    async def ask(self, text: str, *, headers: dict[str, str] | None = None, **extra: Any):
        self.messages.append({"role": "user", "content": text})
        body = {"model": "m", "messages": list(self.messages), **self.fields, **extra}
        resp = await self.client.post(CHAT, json=body, headers=headers or {})
        raw = await resp.text()
        answer = _answer_text(raw, bool(body.get("stream"))) if resp.status == 200 else ""
        self.messages.append({"role": "assistant", "content": answer.strip()})
        return resp, raw


def _answer_text(raw: str, stream: bool) -> str:
    if not stream:
        return json.loads(raw)["choices"][0]["message"]["content"]
    text = ""
    for line in raw.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:]).get("choices", []):
                text += choice.get("delta", {}).get("content") or ""
    return text


def kv(seen_body: dict[str, Any]) -> dict[str, Any] | None:
    return seen_body.get("kv_transfer_params")


def outcome(resp: ClientResponse) -> str:
    return resp.headers["X-Kvferry-Outcome"]


def rider(handle: dict[str, Any]) -> dict[str, Any]:
    """kv_transfer_params that release ``handle``: its coordinates, nothing to pull."""
    return {**PREFILL_REQUEST_PARAMS, **handle, "remote_num_tokens": 0}


async def releases_done(client: TestClient) -> None:
    """Wait for the release requests the sidecar sends in the background."""
    sc = sidecar_of(client)
    for _ in range(100):
        await asyncio.sleep(0)  # let call_later(0) fire
        if sc.releaser.idle:
            return
        await sc.releaser.sent()
    raise AssertionError("releases did not finish")


def prefill_bodies(engines: Engines) -> list[dict[str, Any]]:
    """Bodies the prefill engines received, in arrival order."""
    seen = sorted((s for p in engines.prefill for s in p.completions()), key=lambda s: s.seq)
    return [s.body for s in seen]


# ------------------------------------------------------------------ the two legs


async def test_turn_first_turn_prefills_on_p_then_decodes_on_d(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """Turn 1: P gets the plain prefill request, D gets P's params and token ids."""
    conv = Conversation(await make_sidecar())
    resp, _ = await conv.ask("hello there")
    assert resp.status == 200
    assert outcome(resp) == "no-handle"
    (p_body,) = prefill_bodies(engines)
    assert kv(p_body) == PREFILL_REQUEST_PARAMS
    assert p_body["stream"] is False and p_body["max_tokens"] == 1
    d_body = engines.decode.last().body
    assert kv(d_body)["do_remote_prefill"] is True
    assert kv(d_body)["remote_engine_id"] in {"prefill-0", "prefill-1"}
    assert d_body["return_token_ids"] is True


async def test_turn_second_turn_reuses_handle_whole(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """Turn 2: P gets D's turn-1 handle exactly as D returned it, expiry included."""
    # Bug prevented: a handle whose remote_blocks_expiry_time was dropped let P read
    # D's freed blocks without any error (seen with vLLM 0.32).
    conv = Conversation(await make_sidecar())
    await conv.ask(LONG_QUESTION)
    resp, _ = await conv.ask("and then")
    assert outcome(resp) == "reused"
    handle = engines.decode.handles[0]
    assert handle is not None
    p_body = prefill_bodies(engines)[-1]
    assert kv(p_body) == handle
    assert kv(p_body)["remote_blocks_expiry_time"] == handle["remote_blocks_expiry_time"]
    assert resp.headers["X-Kvferry-Reused-Tokens"] == str(handle["remote_num_tokens"])


async def test_turn_handle_token_ids_are_prompt_plus_answer(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """The stored handle's ids are turn 1's prompt ids followed by the generated ids."""
    client = await make_sidecar()
    await Conversation(client).ask("hello there")
    (handle,) = sidecar_of(client).store._items.values()
    prompt = chat_ids([{"role": "user", "content": "hello there"}])
    assert list(handle.token_ids) == [*prompt, *ids(["fine", "thanks", EOS])]
    assert handle.num_tokens == len(prompt) + 2
    assert handle.params == engines.decode.handles[0]


SIDECAR_ID = re.compile(r"[0-9a-f]{32}")  # uuid4 hex, as vLLM's own request ids


def engine_request_ids(engines: Engines) -> list[str]:
    """The X-Request-Id of every request any engine received (tokenize, P, D)."""
    seen = [s for e in (*engines.prefill, engines.decode) for s in e.seen]
    return [s.headers.get("X-Request-Id", "") for s in seen]


@pytest.mark.parametrize("stream", [False, True])
async def test_engines_get_the_sidecars_request_id_and_the_client_its_own(
    make_sidecar: MakeSidecar, engines: Engines, stream: bool
) -> None:
    """One id of the sidecar's own reaches /tokenize, P and D; the client's
    X-Request-Id never does (vLLM keys requests by it: two clients sending the same
    one must not meet in an engine), and comes back to the client."""
    conv = Conversation(await make_sidecar())
    resp, _ = await conv.ask("hello", headers={"X-Request-Id": "rid-42"}, stream=stream)
    assert resp.status == 200
    assert resp.headers["X-Request-Id"] == "rid-42"
    assert len(engines.p0.completions() + engines.p1.completions()) == 1
    ours = set(engine_request_ids(engines))
    assert len(ours) == 1 and SIDECAR_ID.fullmatch(ours.pop())
    assert len(engines.decode.seen) >= 2  # /tokenize and the decode leg


async def test_a_client_without_a_request_id_gets_the_one_the_engines_saw(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    resp, _ = await Conversation(await make_sidecar()).ask("hello")
    assert set(engine_request_ids(engines)) == {resp.headers["X-Request-Id"]}


async def test_the_turn_log_line_carries_both_request_ids(
    make_sidecar: MakeSidecar, engines: Engines, caplog: pytest.LogCaptureFixture
) -> None:
    """The client's id is logged beside the sidecar's, JSON-quoted (it is the client's
    text: tests/unit/sidecar/test_log_injection.py)."""
    caplog.set_level(logging.INFO, logger="kvferry_sidecar.turn")
    await Conversation(await make_sidecar()).ask("hello", headers={"X-Request-Id": "a b=c"})
    (ours,) = set(engine_request_ids(engines))
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("turn ")]
    assert f"request_id={ours} " in line and 'client_request_id="a b=c" ' in line


async def test_every_answer_echoes_the_clients_request_id(make_sidecar: MakeSidecar) -> None:
    """Answers the sidecar makes itself too (test_ports: a route refused)."""
    client = await make_sidecar()
    headers = {"X-Request-Id": "rid-7"}
    bad = await client.post(CHAT, data=b"[", headers=headers)
    health = await client.get("/healthz", headers=headers)
    assert (bad.status, bad.headers["X-Request-Id"]) == (400, "rid-7")
    assert health.headers["X-Request-Id"] == "rid-7"


async def test_a_request_id_that_is_no_text_is_a_400_naming_it(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """Header bytes that are no UTF-8 (lone surrogates once parsed) cannot be echoed."""
    client = await make_sidecar()
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    status, answer = await post_raw(client, CHAT, {"X-Request-Id": b"r\xff"}, body.encode())
    head, payload = answer.split(b"\r\n\r\n", 1)
    assert status == 400 and b"X-Request-Id: " in head
    assert json.loads(payload)["error"]["param"] == "X-Request-Id"
    assert engine_request_ids(engines) == []


async def test_x_request_id_generated_and_echoed(make_sidecar: MakeSidecar) -> None:
    """Without a client id the sidecar makes one and echoes it, streaming or not."""
    client = await make_sidecar()
    plain = await client.post(CHAT, json={"model": "m", "messages": [{"role": "user"}]})
    stream = await client.post(
        CHAT, json={"model": "m", "stream": True, "messages": [{"role": "user"}]}
    )
    health = await client.get("/healthz")
    ids = [r.headers.get("X-Request-Id") for r in (plain, stream, health)]
    assert all(ids) and len(set(ids)) == 3


async def test_invalid_body_is_400_with_request_id(make_sidecar: MakeSidecar) -> None:
    """A body that is not a JSON object is refused before any engine is asked."""
    client = await make_sidecar()
    resp = await client.post(CHAT, data=b"[1, 2", headers={"X-Request-Id": "bad"})
    assert resp.status == 400
    assert resp.headers["X-Request-Id"] == "bad"
    assert (await resp.json())["error"]["type"] == "invalid_request_error"


# ------------------------------------------------------------------ client's view


async def test_nonstreaming_response_restores_client_view(make_sidecar: MakeSidecar) -> None:
    """Token ids the client did not ask for and kv params come back as null."""
    conv = Conversation(await make_sidecar())
    _, raw = await conv.ask("hello")
    body = json.loads(raw)
    assert body["prompt_token_ids"] is None
    assert body["kv_transfer_params"] is None
    assert body["choices"][0]["token_ids"] is None
    assert body["choices"][0]["message"]["content"] == "fine thanks"


async def test_nonstreaming_token_ids_kept_when_client_asks(make_sidecar: MakeSidecar) -> None:
    conv = Conversation(await make_sidecar())
    _, raw = await conv.ask("hello", return_token_ids=True)
    body = json.loads(raw)
    assert body["prompt_token_ids"] == chat_ids([{"role": "user", "content": "hello"}])
    assert body["kv_transfer_params"] is None


async def test_streaming_response_strips_ids_and_params(make_sidecar: MakeSidecar) -> None:
    """Streamed chunks reach the client without token ids or kv params, [DONE] last."""
    conv = Conversation(await make_sidecar(), stream=True)
    resp, raw = await conv.ask("hello")
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    assert "token_ids" not in raw and "kv_transfer_params" not in raw
    assert raw.rstrip().endswith("data: [DONE]")
    assert conv.messages[-1]["content"] == "fine thanks"


async def test_streaming_033_keeps_handle_from_final_chunk(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """vLLM 0.33 streams the handle on the final chunk: turn 2 reuses it."""
    conv = Conversation(await make_sidecar(), stream=True)
    first, _ = await conv.ask(LONG_QUESTION)
    assert "X-Kvferry-Handle" not in first.headers
    resp, _ = await conv.ask("and then")
    assert outcome(resp) == "reused"
    assert kv(prefill_bodies(engines)[-1]) == engines.decode.handles[0]


@pytest.mark.parametrize("path", [CHAT, "/v1/completions"])
async def test_streaming_033_handle_is_read_from_the_finish_chunk_and_forwarded_whole(
    make_sidecar: MakeSidecar, engines: Engines, path: str
) -> None:
    """vLLM 0.33 sets kv_transfer_params on every chunk (null until the chunk with
    finish_reason): the handle on the finish chunk, remote_registration_generation
    and all, is what P gets next turn; the client sees neither the handle nor the
    nulls, and gets the finish chunk and the usage chunk."""
    engines.decode.registration_generation = 7
    client = await make_sidecar()
    chat = path == CHAT
    first: dict[str, Any] = (
        {"messages": [{"role": "user", "content": LONG_QUESTION}]}
        if chat
        else {"prompt": LONG_QUESTION}
    )
    body = {"model": "m", "stream": True, "stream_options": {"include_usage": True}}
    resp = await client.post(path, json={**body, **first, "session_id": "s"})
    raw = await resp.text()
    assert resp.status == 200 and "kv_transfer_params" not in raw
    events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "stop"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3
    handle = engines.decode.handles[0]
    assert handle["remote_registration_generation"] == 7
    if chat:
        follow = {"messages": [*first["messages"], {"role": "assistant", "content": "fine thanks"}]}
        follow["messages"].append({"role": "user", "content": "and then"})
    else:
        follow = {"prompt": f"{LONG_QUESTION} fine thanks {EOS} and then"}
    resp = await client.post(path, json={**body, **follow, "session_id": "s"})
    assert outcome(resp) == "reused"
    assert kv(prefill_bodies(engines)[-1]) == handle  # whole: every field D set


async def test_streaming_032_reanchors_the_turn_and_turn_2_reuses(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """vLLM 0.32 streams no handle: D reads P's KV in a one-token request that returns
    one, streams without kv_transfer_params (nothing pinned), then a one-token
    prefill-side request over the turn's ids re-anchors it; turn 2 reuses that."""
    engines.decode.version = "0.32.0"
    conv = Conversation(await make_sidecar(), stream=True)
    first, raw = await conv.ask(LONG_QUESTION)
    assert first.status == 200 and "X-Kvferry-Handle" not in first.headers
    assert "kv_transfer_params" not in raw and "token_ids" not in raw
    assert raw.rstrip().endswith("data: [DONE]")
    anchor, stream, reanchor = (s.body for s in engines.decode.completions())
    p_params = engines.p0.last().body  # P's request; its answer's params went to D
    assert anchor["stream"] is False and anchor["max_tokens"] == 1
    assert kv(anchor)["do_remote_prefill"] is True and kv(anchor)["remote_block_ids"]
    assert "stream_options" not in anchor and anchor["return_token_ids"] is True
    assert stream["stream"] is True and kv(stream) is None
    prompt = chat_ids(conv.messages[:1])
    answer = [*ids(["fine", "thanks"]), ids([EOS])[0]]
    assert reanchor["prompt"] == [*prompt, *answer] and reanchor["max_tokens"] == 1
    assert kv(reanchor) == dict(LOCAL_HANDLE_PARAMS) and reanchor["stream"] is False
    assert reanchor["model"] == "m" and p_params["stream"] is False
    resp, _ = await conv.ask("and then")
    assert outcome(resp) == "reused"
    pulled = kv(prefill_bodies(engines)[-1])
    assert pulled["remote_request_id"] == engines.decode.handles[2]["remote_request_id"]
    # Each turn's anchor (D's first request of the turn) was released through P.
    await releases_done(conv.client)
    released = [kv(b) for b in prefill_bodies(engines) if kv(b).get("remote_num_tokens") == 0]
    handles = engines.decode.handles
    assert [h is None for h in handles] == [False, True, False] * 2
    assert sorted(r["remote_request_id"] for r in released) == sorted(
        handles[i]["remote_request_id"] for i in (0, 3)
    )


async def test_streaming_032_broken_stream_releases_the_anchor(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """A streamed turn on vLLM 0.32 whose stream breaks off keeps no handle and
    re-anchors nothing; the anchor's handle (D's read of P's KV) is released through
    P, never left pinned."""
    engines.decode.version = "0.32.0"
    engines.decode.stall = 5.0
    client = await make_sidecar(stream_idle_timeout_seconds=0.3)
    conv = Conversation(client, stream=True)
    _first, raw = await conv.ask(LONG_QUESTION)
    assert "upstream_error" in raw and "[DONE]" not in raw
    assert len(engines.decode.completions()) == 2  # the anchor and the stream
    await releases_done(client)
    (released,) = [kv(b) for b in prefill_bodies(engines) if kv(b).get("remote_num_tokens") == 0]
    assert released == rider(engines.decode.handles[0])
    rep = sidecar_of(client).releaser.figures()
    assert rep.handles == 0


async def test_local_handle_lives_for_decodes_lease_not_the_retention(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """A handle D prefilled alone is a prefill-side request on D: vLLM frees it at
    D's kv_lease_duration whatever decoder_kv_blocks_ttl is (request_finished), so
    that is its deadline on D (a shorter guess had the releaser treat it as freed
    while D still pinned it). The retention in force may let it go sooner: it is then
    released through a P (test_policy_live)."""
    client = await make_sidecar(
        retention_seconds=45, local_handle_seconds=90, skip_prefill_below_tokens=100
    )
    resp, _ = await Conversation(client).ask(LONG_QUESTION)
    assert resp.headers["X-Kvferry-Route"] == "skip"
    (handle,) = sidecar_of(client).store.values()
    assert handle.expires_at is not None
    assert handle.expires_at - handle.created_at == pytest.approx(90)


async def test_streaming_032_with_media_states_no_handle_is_kept(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """A streamed turn with media cannot be re-anchored from its ids (the media's KV
    is not in them): on vLLM 0.32 the response says no handle is kept."""
    engines.decode.version = "0.32.0"
    conv = Conversation(await make_sidecar(), stream=True)
    conv.messages.append(IMAGE_MESSAGE)
    first, _ = await conv.ask(LONG_QUESTION)
    assert first.headers["X-Kvferry-Handle"].startswith("not-kept; reason=engine-streams-no-handle")
    assert "0.32.0" in first.headers["X-Kvferry-Handle"]


async def test_nonstreaming_032_keeps_handle(make_sidecar: MakeSidecar, engines: Engines) -> None:
    """vLLM 0.32 returns the handle in non-streaming responses: turn 2 reuses it."""
    engines.decode.version = "0.32.0"
    conv = Conversation(await make_sidecar())
    await conv.ask(LONG_QUESTION)
    resp, _ = await conv.ask("and then")
    assert outcome(resp) == "reused"


async def test_client_kv_transfer_params_never_reach_engines(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """A client-supplied kv_transfer_params is dropped before either leg."""
    conv = Conversation(await make_sidecar())
    await conv.ask("hello", kv_transfer_params={"remote_host": "evil"})
    bodies = [*prefill_bodies(engines), engines.decode.last().body]
    assert all(kv(b).get("remote_host") != "evil" for b in bodies)


async def test_completions_api_reuses_handle(make_sidecar: MakeSidecar, engines: Engines) -> None:
    """/v1/completions: a prompt that extends prompt + answer reuses the handle."""
    client = await make_sidecar()
    first = await client.post(
        "/v1/completions", json={"model": "m", "prompt": LONG_QUESTION, "session_id": "c1"}
    )
    assert outcome(first) == "no-handle"
    assert (await first.json())["choices"][0]["token_ids"] is None
    second = await client.post(
        "/v1/completions",
        json={
            "model": "m",
            "prompt": f"{LONG_QUESTION} fine thanks <eos> more",
            "session_id": "c1",
        },
    )
    assert outcome(second) == "reused"


# ------------------------------------------------------------------ alignment


async def test_alignment_rewritten_history_pulls_aligned_prefix_only(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """An edited answer: P is told 12 tokens (3 blocks) instead of the whole handle."""
    conv = Conversation(await make_sidecar(), session_id="s")
    await conv.ask(LONG_QUESTION)  # prompt: 13 tokens; handle: 16 ids, 15 with KV
    conv.messages[-1]["content"] = "something else entirely"
    resp, _ = await conv.ask("and then")
    assert outcome(resp) == "reused"
    handle = engines.decode.handles[0]
    sent = kv(prefill_bodies(engines)[-1])
    assert sent["remote_num_tokens"] == 12
    assert sent["remote_block_ids"] == [handle["remote_block_ids"][0][:3]]
    assert sent["remote_blocks_expiry_time"] == handle["remote_blocks_expiry_time"]


async def test_alignment_early_divergence_recomputes(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """History rewritten from its first words: nothing of the handle is pulled; it
    only rides along with nothing to pull, so P tells D to free it."""
    conv = Conversation(await make_sidecar(), session_id="s")
    await conv.ask(LONG_QUESTION)
    conv.messages[0]["content"] = "completely different words here"
    resp, _ = await conv.ask("and then")
    assert outcome(resp) == "misaligned"
    assert kv(prefill_bodies(engines)[-1]) == rider(engines.decode.handles[0])


async def test_alignment_below_threshold_recomputes(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """A handle shorter than the recompute threshold is not pulled (it rides along with
    nothing to pull, to be released)."""
    conv = Conversation(await make_sidecar(recompute_threshold=64))
    await conv.ask(LONG_QUESTION)
    resp, _ = await conv.ask("and then")
    assert outcome(resp) == "below-threshold"
    assert kv(prefill_bodies(engines)[-1]) == rider(engines.decode.handles[0])


async def test_expired_handle_is_not_sent(make_sidecar: MakeSidecar, engines: Engines) -> None:
    """Past expiry - margin the handle is dropped and turn 2 recomputes."""
    conv = Conversation(await make_sidecar())
    await conv.ask(LONG_QUESTION)
    engines.clock.advance(engines.decode.ttl - protocol.HANDLE_EXPIRY_MARGIN_SECONDS)
    resp, _ = await conv.ask("and then")
    assert outcome(resp) == "expired"
    assert kv(prefill_bodies(engines)[-1]) == PREFILL_REQUEST_PARAMS


async def test_handle_single_use_across_turns(make_sidecar: MakeSidecar, engines: Engines) -> None:
    """A retried turn (same prompt) after the handle was used does not resend it."""
    client = await make_sidecar()
    conv = Conversation(client, session_id="s")
    await conv.ask(LONG_QUESTION)
    body = {"model": "m", "session_id": "s", "messages": [*conv.messages, {"role": "user"}]}
    first = await client.post(CHAT, json=body)
    assert outcome(first) == "reused"
    sidecar_of(client).store.clear()  # as if the new handle were lost
    second = await client.post(CHAT, json=body)
    assert outcome(second) == "no-handle"


# ------------------------------------------------------------------ skip prefill


async def test_skip_prefill_short_tail_decodes_locally(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """Turn 2's uncached tail (9 tokens) is below skipPrefillBelowTokens: P is skipped.
    D prefills it as a prefill-side request, so it keeps a handle vLLM can free, and
    turn 3 (a long tail) pulls that handle through P."""
    client = await make_sidecar(skip_prefill_below_tokens=10)
    conv = Conversation(client)
    await conv.ask(LONG_QUESTION)  # 13 tokens, nothing held: goes to P
    assert engines.prefill_calls() == 1
    resp, _ = await conv.ask("and you")  # 21 tokens, D holds 12 (3 blocks)
    assert outcome(resp) == "skipped-prefill"
    assert resp.headers["X-Kvferry-Reused-Tokens"] == "12"
    # Not the "no transfer" flags: vLLM 0.32 returns a handle for those but never
    # frees its blocks. A prefill-side request is tracked and freed.
    assert kv(engines.decode.last().body) == LOCAL_HANDLE_PARAMS
    assert "X-Kvferry-Handle" not in resp.headers  # kept
    local = engines.decode.handles[-1]
    assert local["do_remote_prefill"] and not local["do_remote_decode"]
    # P computed nothing of turn 2: its only other request is the one-token release
    # of turn 1's handle, superseded by turn 2's.
    await releases_done(client)
    (release,) = prefill_bodies(engines)[1:]
    assert release["max_tokens"] == 1 and len(release["prompt"]) == 1
    assert kv(release) == rider(engines.decode.handles[0])
    # Turn 3, a long tail: P pulls D's local handle as it pulls any decode handle.
    resp, _ = await conv.ask(LONG_QUESTION)
    assert outcome(resp) == "reused", resp.headers
    pulled = kv(prefill_bodies(engines)[-1])
    assert pulled is not None
    assert pulled["remote_block_ids"] == local["remote_block_ids"]
    assert pulled["do_remote_decode"] and not pulled["do_remote_prefill"]


async def test_skip_prefill_short_first_turn(make_sidecar: MakeSidecar, engines: Engines) -> None:
    """A first prompt shorter than skipPrefillBelowTokens is prefilled on D."""
    conv = Conversation(await make_sidecar(skip_prefill_below_tokens=256))
    resp, _ = await conv.ask("hi")
    assert outcome(resp) == "skipped-prefill"
    assert engines.prefill_calls() == 0


async def test_multiple_sequences_skip_prefill_and_keep_no_handle(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """n > 1 is served by D alone, with no transfer (kv params an explicit null, the
    sidecar's own), and says no handle is kept."""
    conv = Conversation(await make_sidecar())
    resp, _ = await conv.ask("hello", n=2)
    assert outcome(resp) == "skipped-prefill"
    assert resp.headers["X-Kvferry-Handle"] == "not-kept; reason=multiple-sequences"
    assert engines.prefill_calls() == 0
    d_body = engines.decode.last().body
    assert "kv_transfer_params" in d_body and d_body["kv_transfer_params"] is None


# ------------------------------------------------------------------ prefill choice


async def test_prefill_choice_round_robins_idle_engines(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """With nothing outstanding, successive turns go to alternating engines."""
    client = await make_sidecar()
    for i in range(4):
        await Conversation(client, session_id=f"s{i}").ask("hello")
    assert [len(p.completions()) for p in engines.prefill] == [2, 2]


async def test_prefill_retry_other_engine_on_error(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """A prefill engine answering 503 is left for the other one; the client sees 200."""
    engines.p0.fail_statuses = [503]
    conv = Conversation(await make_sidecar())
    resp, _ = await conv.ask("hello")
    assert resp.status == 200
    assert resp.headers["X-Kvferry-Route"] == "remote"
    assert [len(p.completions()) for p in engines.prefill] == [1, 1]
    assert kv(engines.decode.last().body)["remote_engine_id"] == "prefill-1"


async def test_prefill_engine_refusing_connection_keeps_handle_for_next_engine(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """A prefill engine that cannot be connected to never saw the handle: the next gets it."""
    dead = "http://127.0.0.1:9"
    client = await make_sidecar(prefill_engines=(dead, engines.p0.url))
    conv = Conversation(client)
    await conv.ask(LONG_QUESTION)
    sidecar_of(client).pool.engines[dead].ready = True  # as if it had just died
    sidecar_of(client).pool.engines[engines.p0.url].outstanding = 1  # so `dead` is chosen
    resp, _ = await conv.ask("and then")
    assert outcome(resp) == "reused"
    assert kv(engines.p0.last().body) == engines.decode.handles[0]
    assert not sidecar_of(client).pool.engines[dead].ready


async def test_prefill_engine_lost_mid_request_drops_handle(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """P broke off after receiving the handle: the handle is not sent again."""
    # Bug prevented: P may have completed the read (D then frees the blocks) before
    # dying; a second P reading the same handle would load freed memory.
    conv = Conversation(await make_sidecar())
    await conv.ask(LONG_QUESTION)  # went to prefill-0 (first in order)
    engines.p1.drop_connections = 1  # turn 2 goes to prefill-1 first
    resp, _ = await conv.ask("and then")
    assert resp.status == 200
    assert outcome(resp) == "pull-failed"
    assert kv(engines.p0.last().body) == PREFILL_REQUEST_PARAMS


async def test_prefill_not_ready_engine_is_skipped(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """An engine failing /health at startup gets no requests."""
    engines.p0.healthy = False
    client = await make_sidecar()
    for i in range(3):
        await Conversation(client, session_id=f"s{i}").ask("hello")
    assert [len(p.completions()) for p in engines.prefill] == [0, 3]


async def test_pull_failed_retries_at_once_without_handle(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """P answers 500 to the handle (failed pull): retried without it, outcome pull-failed."""
    # Bug prevented: under kv_load_failure_policy=fail the client would get P's 500.
    conv = Conversation(await make_sidecar())
    await conv.ask(LONG_QUESTION)
    for p in engines.prefill:
        p.fail_with_handle = 500
    resp, _ = await conv.ask("and then")
    assert resp.status == 200
    assert outcome(resp) == "pull-failed"
    assert resp.headers["X-Kvferry-Reused-Tokens"] == "0"
    with_handle, without = prefill_bodies(engines)[-2:]
    assert kv(with_handle) == engines.decode.handles[0]
    assert kv(without) == PREFILL_REQUEST_PARAMS
    assert kv(engines.decode.last().body)["do_remote_prefill"] is True


async def test_all_prefill_engines_failing_falls_back_to_decode(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """No prefill engine can serve: D prefills itself and the client sees 200."""
    for p in engines.prefill:
        p.fail_statuses = [500, 500]
    conv = Conversation(await make_sidecar())
    resp, _ = await conv.ask("hello")
    assert resp.status == 200
    assert resp.headers["X-Kvferry-Route"] == "fallback"
    # D prefills alone and keeps a handle for the next turn (a prefill-side request).
    assert kv(engines.decode.last().body) == LOCAL_HANDLE_PARAMS


async def test_prefill_client_error_lets_decode_answer(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """A 400 from P is not retried on other engines: D answers the request."""
    engines.p0.fail_statuses = [400]
    conv = Conversation(await make_sidecar())
    resp, _ = await conv.ask("hello")
    assert resp.status == 200
    assert resp.headers["X-Kvferry-Route"] == "fallback"
    assert engines.prefill_calls() == 1


async def test_decode_failed_pull_from_prefill_recomputes_on_decode(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """D answering 500 to P's params (P's blocks gone): retried as a local prefill."""
    engines.decode.fail_with_prefill_params = 500
    conv = Conversation(await make_sidecar())
    resp, _ = await conv.ask("hello")
    assert resp.status == 200
    assert resp.headers["X-Kvferry-Route"] == "fallback"
    assert kv(engines.decode.last().body) == LOCAL_HANDLE_PARAMS


async def test_decode_client_error_is_passed_through(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """D's own 400 reaches the client unchanged."""
    engines.decode.fail_statuses = [400]
    conv = Conversation(await make_sidecar())
    resp, raw = await conv.ask("hello")
    assert resp.status == 400
    assert json.loads(raw)["error"]["code"] == 400


# ------------------------------------------------------------------ readiness


async def test_upstream_not_ready_is_502_with_message(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """The local engine failing /health: 502, request id echoed, no engine address."""
    engines.decode.healthy = False
    client = await make_sidecar()
    resp = await client.post(
        CHAT, json={"model": "m", "messages": []}, headers={"X-Request-Id": "r9"}
    )
    assert resp.status == 502
    assert resp.headers["X-Request-Id"] == "r9"
    error = (await resp.json())["error"]
    assert error["type"] == "upstream_not_ready"
    assert "not ready" in error["message"]
    assert engines.decode.url not in error["message"]
    assert engines.decode.url.rsplit(":", 1)[-1] not in error["message"]  # the port
    assert (await client.get("/readyz")).status == 503


async def test_upstream_unreachable_is_502(make_sidecar: MakeSidecar) -> None:
    """No engine listening at all: 502, not a crash."""
    client = await make_sidecar(engine_url="http://127.0.0.1:9")
    resp = await client.post(CHAT, json={"model": "m", "messages": []})
    assert resp.status == 502


async def test_readyz_reports_engine_capabilities(make_sidecar: MakeSidecar) -> None:
    body = await (await (await make_sidecar()).get("/readyz")).json()
    assert body["status"] == "ready"
    assert body["engine_version"] == "0.33.0"
    assert body["streaming_handles"] is True
    assert body["block_size"] == 4
    assert body["prefill_engines_ready"] == 2


async def test_models_proxied_from_engine(make_sidecar: MakeSidecar) -> None:
    resp = await (await make_sidecar()).get("/v1/models")
    assert (await resp.json())["data"][0]["id"] == "fake"


async def test_engine_restart_clears_handles(make_sidecar: MakeSidecar, engines: Engines) -> None:
    """D down, then back as another process: its pinned blocks are gone, so are our
    handles."""
    client = await make_sidecar()
    await Conversation(client).ask(LONG_QUESTION)
    sc = sidecar_of(client)
    assert len(sc.store) == 1
    engines.decode.healthy = False
    for _ in range(FAILURES_BEFORE_NOT_READY):
        await sc.probe()
    assert not sc.local.ready
    engines.decode.restart()
    engines.decode.healthy = True
    await sc.probe()
    assert len(sc.store) == 0


async def test_engine_restart_seen_in_metrics_clears_handles(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """A restart quicker than the probes (never seen down) shows in the process start
    time the metrics scrape reads."""
    client = await make_sidecar()
    await Conversation(client).ask(LONG_QUESTION)
    sc = sidecar_of(client)
    engines.decode.restart()
    await sc.scrape_engine()
    assert len(sc.store) == 0


async def test_slow_health_is_not_a_restart(make_sidecar: MakeSidecar, engines: Engines) -> None:
    """A missed /health (a busy engine) neither stops serving nor drops handles; nor
    does a longer outage of the same engine process."""
    # Bug prevented: one missed 6 s probe cleared every handle and the KV-event index
    # and answered 502 until the next probe, while D still pinned the blocks.
    client = await make_sidecar()
    conv = Conversation(client, session_id="s")
    await conv.ask(LONG_QUESTION)
    sc = sidecar_of(client)
    engines.decode.healthy = False
    for _ in range(FAILURES_BEFORE_NOT_READY - 1):
        await sc.probe()
    assert sc.local.ready and len(sc.store) == 1
    await sc.probe()
    assert not sc.local.ready
    engines.decode.healthy = True
    await sc.probe()
    assert sc.local.ready and len(sc.store) == 1
    resp, _ = await conv.ask("and then")
    assert outcome(resp) == "reused"


async def test_prefill_role_serves_no_turns(make_sidecar: MakeSidecar) -> None:
    """role=prefill: health, readiness and metrics only."""
    client = await make_sidecar(role="prefill")
    assert (await client.get("/readyz")).status == 200
    assert (await client.post(CHAT, json={})).status in (404, 405)


# ------------------------------------------------------------------ metrics


async def test_metrics_recorded_per_outcome(make_sidecar: MakeSidecar) -> None:
    """Turn outcomes, TTFT stages, gaps and pinned handles show up on /metrics."""
    client = await make_sidecar()
    conv = Conversation(client, stream=True)
    await conv.ask(LONG_QUESTION)
    await conv.ask("and then")
    text = await (await client.get("/metrics")).text()
    assert 'kvferry_turns_total{outcome="no-handle",route="remote"} 1.0' in text
    assert 'kvferry_turns_total{outcome="reused",route="remote"} 1.0' in text
    for stage in ("queue", "prefill", "p_to_d", "first_token"):
        assert f'kvferry_ttft_stage_seconds_count{{outcome="reused",stage="{stage}"}} 1.0' in text
    assert "kvferry_inter_turn_gap_seconds_count 1.0" in text
    # Turn 2 holds its handle for a next turn; none is pinned unused.
    assert "kvferry_pinned_handles 1.0" in text
    assert "kvferry_pinned_unused_handles 0.0" in text
    # The handle turn 2 took, by the fate its pull gave it.
    assert 'kvferry_handle_fates_total{fate="consumed"} 1.0' in text
    assert 'kvferry_reused_tokens_by_index_total{turn="2"} 15.0' in text


async def test_metrics_count_pull_failures_and_not_kept(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    engines.decode.version = "0.32.0"
    client = await make_sidecar()
    conv = Conversation(client, stream=True)
    conv.messages.append(IMAGE_MESSAGE)
    await conv.ask("hello")
    text = await (await client.get("/metrics")).text()
    assert 'kvferry_handles_not_kept_total{reason="engine-streams-no-handle"} 1.0' in text


@pytest.mark.parametrize("stream", [False, True])
async def test_turn_log_line_is_key_value(
    make_sidecar: MakeSidecar, caplog: pytest.LogCaptureFixture, stream: bool
) -> None:
    """One INFO line per turn, key=value, with the session tag, never the raw key."""
    conv = Conversation(await make_sidecar(), user="alice@example.com", stream=stream)
    with caplog.at_level("INFO", logger="kvferry_sidecar.turn"):
        await conv.ask("hello")
    (line,) = [r.getMessage() for r in caplog.records if r.name == "kvferry_sidecar.turn"]
    assert "outcome=no-handle" in line and "route=remote" in line
    assert "session=kvf-" in line and "alice" not in line


@pytest.mark.parametrize(
    ("status", "raw", "expected"),
    [
        # A refusal keeps vLLM's words: the client must learn what to change.
        (
            400,
            b'{"error": {"message": "max_tokens too large", "type": "BadRequestError",'
            b' "param": "max_tokens", "code": 400, "engine": "nixl@10.0.0.1"}}',
            {
                "message": "max_tokens too large",
                "type": "BadRequestError",
                "code": 400,
                "param": "max_tokens",
            },
        ),
        (
            400,
            b'{"object": "error", "message": "bad", "type": "BadRequestError", "code": 400}',
            {"message": "bad", "type": "BadRequestError", "code": 400},
        ),
        (
            422,
            b"<html>not json</html>",
            {
                "message": "the engine refused the request (422)",
                "type": "invalid_request_error",
                "code": 422,
            },
        ),
        # A failure's text is the engine's internals: only the status reaches the client.
        (
            500,
            b'{"error": {"message": "Remote NIXL agent engine ID mismatch 10.0.0.1:5600"}}',
            {
                "message": "the engine failed (500); retry shortly",
                "type": "engine_error",
                "code": 500,
            },
        ),
    ],
)
def test_an_engine_error_is_rebuilt_never_relayed_as_sent(
    status: int, raw: bytes, expected: dict
) -> None:
    assert relay.engine_error(status, raw) == {"error": expected}


async def _stream_closed_at_the_finish_chunk(aiohttp_client: Any, engines: Engines) -> Any:
    """A streamed turn whose client reads up to the chunk with finish_reason and closes
    (before the usage chunk and [DONE]), on a sidecar with aiohttp's handler
    cancellation on, as it runs; returns the sidecar once it saw the client leave."""
    from kvferry_sidecar.app import app_factory

    from .conftest import sidecar_settings

    app = app_factory(sidecar_settings(engines), clock=engines.clock)
    client = await aiohttp_client(app, server_kwargs={"handler_cancellation": True})
    sc = sidecar_of(client)
    gone = asyncio.Event()
    record = sc.record_turn

    def recorded(report: Any) -> None:
        record(report)
        if report.status == 499:
            gone.set()

    sc.record_turn = recorded  # type: ignore[method-assign]
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": LONG_QUESTION}],
        "stream": True,
        "session_id": "s",
    }
    resp = await client.post(CHAT, json=body)
    async for line in resp.content:
        if line.startswith(b"data: {") and json.loads(line[6:])["choices"][0].get("finish_reason"):
            break
    resp.close()  # before the usage chunk and [DONE]
    await asyncio.wait_for(gone.wait(), 10)  # the sidecar saw the client leave
    return sc


async def test_streaming_033_a_client_that_closes_at_the_finish_chunk_keeps_the_handle(
    aiohttp_client: Any, engines: Engines
) -> None:
    """vLLM 0.33 puts the handle on the finish chunk and D pins it whatever the client
    does next. A client that closes there (handler cancellation on, as the sidecar
    runs) left that handle neither kept nor released: pinned on D, untracked, until
    its TTL."""
    engines.decode.hold_after_finish = asyncio.Event()
    sc = await _stream_closed_at_the_finish_chunk(aiohttp_client, engines)
    engines.decode.hold_after_finish.set()
    (handle,) = sc.store.values()
    assert handle.params == engines.decode.handles[0]


async def test_streaming_032_a_client_that_closes_at_the_finish_chunk_still_keeps_a_handle(
    aiohttp_client: Any, engines: Engines
) -> None:
    """Clients that stop reading at finish_reason (a break in a `with` block) close
    before [DONE]: with aiohttp's handler cancellation on, as the sidecar runs, that
    aborted the re-anchor and released the anchor, so the turn kept nothing."""
    engines.decode.version = "0.32.0"
    engines.decode.hold_reanchor = asyncio.Event()
    sc = await _stream_closed_at_the_finish_chunk(aiohttp_client, engines)
    engines.decode.hold_reanchor.set()
    await asyncio.gather(*getattr(relay, "_KEEPING", ()))  # the keeping, if any, done
    (handle,) = sc.store.values()
    assert handle.session is not None
    assert not [i for i in engines.decode.aborted_ids if i]  # the re-anchor was not aborted
