"""Bad client input at volume: never a 5xx caused by the input, never a hang, nothing
leaked. Generated requests (hypothesis) against the sidecar and fake engines that
answer bad bodies with a 400 as vLLM does; text anywhere may hold lone surrogates
and header values bytes that are not UTF-8 (the request goes out as raw HTTP)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import Engines, MakeSidecar, post_raw, sidecar_of
from .test_turns import releases_done

# Every code point, lone surrogates (U+D800..U+DFFF) often: st.text leaves them out.
CHARS = st.characters(codec=None, exclude_categories=()) | st.characters(
    min_codepoint=0xD800, max_codepoint=0xDFFF
)


def text(max_size: int) -> st.SearchStrategy[str]:
    return st.text(alphabet=CHARS, max_size=max_size)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | text(20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text(8), inner, max_size=4),
    max_leaves=12,
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool"]) | JSON},
    optional={
        "content": text(40)
        | JSON
        | st.lists(
            st.fixed_dictionaries(
                {"type": st.sampled_from(["text", "image_url", "input_audio"]) | JSON},
                optional={"text": text(20), "image_url": JSON},
            ),
            max_size=3,
        ),
        "tool_calls": JSON,
    },
)
BODY = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from(["m", "adapter"]) | text(6) | JSON,
        "messages": st.lists(MESSAGE, max_size=5) | JSON,
        "prompt": text(40) | st.lists(st.integers(0, 2**33), max_size=8) | JSON,
        "stream": st.booleans() | JSON,
        "n": st.integers(-1, 3) | JSON,
        "session_id": text(10) | JSON,
        "conversation_id": text(10) | JSON,
        "user": text(10) | JSON,
        "cache_salt": text(5) | JSON,
        "truncate_prompt_tokens": st.integers(-2, 50) | JSON,
        "max_tokens": st.integers(-1, 8) | JSON,
        "return_token_ids": st.booleans() | JSON,
        "kv_transfer_params": JSON,
        "mm_processor_kwargs": JSON,
    },
)
# Header values as bytes: printable ASCII and bytes that are no UTF-8 (0x80..0xFF),
# which the server's parser decodes to lone surrogates.
HEADERS = st.dictionaries(
    st.sampled_from(["X-Session-Id", "X-Kvferry-Forwarded-By", "X-Request-Id"]),
    st.binary(max_size=12).map(lambda b: bytes(33 + c % 94 if c < 128 else c for c in b)),
    max_size=3,
)


async def test_a_thousand_generated_requests_never_5xx_hang_or_leak(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    client = await make_sidecar(skip_prefill_below_tokens=4, handle_store_cap=64)
    sc = sidecar_of(client)
    statuses: dict[int, int] = {}
    loop = asyncio.get_running_loop()

    @settings(
        max_examples=1000,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(body=BODY, headers=HEADERS, raw=st.booleans(), path=st.sampled_from(["chat", "cmpl"]))
    def one(body: dict[str, Any], headers: dict[str, bytes], raw: bool, path: str) -> None:
        url = "/v1/chat/completions" if path == "chat" else "/v1/completions"
        data = json.dumps(body) if not raw else json.dumps(body)[: len(json.dumps(body)) // 2]

        async def post() -> int:
            status, _ = await asyncio.wait_for(post_raw(client, url, headers, data.encode()), 10)
            return status

        status = asyncio.run_coroutine_threadsafe(post(), loop).result(20)
        statuses[status] = statuses.get(status, 0) + 1
        assert status < 500, (status, body, headers)

    await loop.run_in_executor(None, one)
    await releases_done(client)
    assert sum(statuses.values()) >= 1000, statuses
    # Nothing leaked: the handle store stays within its cap, every release finished,
    # and what the report calls pinned is what the store and the ledger hold.
    assert len(sc.store) <= 64
    assert sc.releaser.idle
    now = sc.store.now()
    pinned = sc._pinned()
    assert pinned.handles == len(sc.store) + sc.releaser.ledger.figures(now).handles
    print(f"\nstatuses: {dict(sorted(statuses.items()))}")


# ------------------------------------------------------------------ lone surrogates

CHAT = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "hello there"}]


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"session_id": "s\ud800"}, "session_id"),
        ({"conversation_id": "\udfff"}, "conversation_id"),
        ({"user": "u\udc80"}, "user"),
        ({"model": "\ud800"}, "model"),
        ({"model": "m\ud800", "session_id": "s"}, "model"),
        ({"cache_salt": "t\ud800", "session_id": "s"}, "cache_salt"),
    ],
)
async def test_a_lone_surrogate_in_a_key_or_the_model_is_a_400_naming_the_field(
    make_sidecar: MakeSidecar, engines: Engines, extra: dict[str, str], field: str
) -> None:
    """Bug prevented: session.py encoded the key to hash it and the client got a 500;
    a model that is no Unicode reached the engines."""
    client = await make_sidecar()
    body = json.dumps({"model": "m", "messages": HELLO, **extra})
    resp = await client.post(CHAT, data=body, headers={"Content-Type": "application/json"})
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert error["param"] == field and field in error["message"], error
    assert error["type"] == "invalid_request_error"
    assert engines.decode.seen == [] and engines.prefill_calls() == 0


async def test_a_session_header_that_is_no_utf8_is_a_400_naming_it(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """The server decodes header bytes that are no UTF-8 to lone surrogates."""
    client = await make_sidecar()
    seen = len(engines.decode.seen)
    body = json.dumps({"model": "m", "messages": HELLO}).encode()
    status, answer = await post_raw(client, CHAT, {"X-Session-Id": b"s\xff\xfe"}, body)
    assert status == 400
    error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["param"] == "X-Session-Id" and "X-Session-Id" in error["message"], error
    assert len(engines.decode.seen) == seen


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (CHAT, {"model": "m", "messages": [{"role": "user", "content": "hi \ud800 there"}]}),
        (CHAT, {"model": "m", "user": "u", "messages": [{"role": "user", "content": "\udc00"}]}),
        ("/v1/completions", {"model": "m", "prompt": "hi \ud800 there"}),
    ],
    ids=["chat-content", "user-slot-content", "prompt"],
)
async def test_a_lone_surrogate_in_the_prompt_is_the_engines_business(
    make_sidecar: MakeSidecar, path: str, body: dict[str, Any]
) -> None:
    """The prompt is the engine's to judge (the fakes answer it): the sidecar's digests
    of it never fail. Bug prevented: the fallback key and the slot digest encoded the
    text and the client got a 500."""
    client = await make_sidecar()
    resp = await client.post(
        path, data=json.dumps(body), headers={"Content-Type": "application/json"}
    )
    assert resp.status == 200, await resp.text()
