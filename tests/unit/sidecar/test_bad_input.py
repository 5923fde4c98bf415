"""Bad client input at volume: never a 5xx caused by the input, never a hang, nothing
leaked. Generated requests (hypothesis) against the sidecar and fake engines that
answer bad bodies with a 400 as vLLM does."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import Engines, MakeSidecar, sidecar_of
from .test_turns import releases_done

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool"]) | JSON},
    optional={
        "content": st.text(max_size=40)
        | JSON
        | st.lists(
            st.fixed_dictionaries(
                {"type": st.sampled_from(["text", "image_url", "input_audio"]) | JSON},
                optional={"text": st.text(max_size=20), "image_url": JSON},
            ),
            max_size=3,
        ),
        "tool_calls": JSON,
    },
)
BODY = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from(["m", "adapter"]) | JSON,
        "messages": st.lists(MESSAGE, max_size=5) | JSON,
        "prompt": st.text(max_size=40) | st.lists(st.integers(0, 2**33), max_size=8) | JSON,
        "stream": st.booleans() | JSON,
        "n": st.integers(-1, 3) | JSON,
        "session_id": st.text(max_size=10) | JSON,
        "user": st.text(max_size=10) | JSON,
        "cache_salt": st.text(max_size=5) | JSON,
        "truncate_prompt_tokens": st.integers(-2, 50) | JSON,
        "max_tokens": st.integers(-1, 8) | JSON,
        "return_token_ids": st.booleans() | JSON,
        "kv_transfer_params": JSON,
        "mm_processor_kwargs": JSON,
    },
)
HEADERS = st.dictionaries(
    st.sampled_from(["X-Session-Id", "X-Kvferry-Forwarded-By", "X-Request-Id"]),
    st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=12),
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
    def one(body: dict[str, Any], headers: dict[str, str], raw: bool, path: str) -> None:
        url = "/v1/chat/completions" if path == "chat" else "/v1/completions"
        data = json.dumps(body) if not raw else json.dumps(body)[: len(json.dumps(body)) // 2]

        async def post() -> int:
            resp = await asyncio.wait_for(
                client.post(
                    url, data=data, headers={"Content-Type": "application/json", **headers}
                ),
                timeout=10,
            )
            await resp.read()
            return resp.status

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
