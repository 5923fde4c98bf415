"""The engine tier's OpenAI SDK client: turns through the sidecar as users send them
(the official ``openai`` package, streamed with usage chunks or not), read back into
the harness's ``Reply`` so the turn checks of ``helpers.py`` apply unchanged."""

from __future__ import annotations

import copy
import time
from typing import Any

import openai

from kvferry_dev.client import Reply
from kvferry_dev.configs import SERVED_MODEL_NAME
from kvferry_dev.engines import Engine
from kvferry_dev.figures import PrefillFigures
from kvferry_dev.sidecars import SidecarProcess
from kvferry_wire.protocol import HDR_REQUEST_ID
from tests.engine.helpers import ANSWER_TOKENS, Turn, rid

# Greedy, ANSWER_TOKENS long (random weights emit EOS at random), token ids returned:
# the answers are compared token by token with the references.
EXTRA = {"ignore_eos": True, "return_token_ids": True}


def client(sc: SidecarProcess, *, timeout: float = 300.0) -> openai.OpenAI:
    return openai.OpenAI(base_url=sc.url + "/v1", api_key="unused", timeout=timeout, max_retries=0)


def chat(
    sc: SidecarProcess,
    messages: list[dict[str, Any]],
    session: str | None,
    *,
    stream: bool,
    **kwargs: Any,
) -> Reply:
    """One chat turn through the SDK. Streamed: ``stream_options.include_usage``, the
    deltas joined; the reply's body has the non-streamed shape either way."""
    extra_body = {**EXTRA, **({"session_id": session} if session else {})}
    started = time.monotonic()
    create = client(sc).chat.completions.with_streaming_response.create
    with create(
        model=SERVED_MODEL_NAME,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=kwargs.pop("max_tokens", ANSWER_TOKENS),
        temperature=0,
        stream=stream,
        extra_body=extra_body,
        extra_headers={HDR_REQUEST_ID: rid(session or "nosession")},
        **({"stream_options": {"include_usage": True}} if stream else {}),
        **kwargs,
    ) as resp:
        headers = resp.headers  # case-insensitive, as Reply reads it
        if not stream:
            done = resp.parse()
            body = done.model_dump()
            return Reply(resp.status_code, body, headers, time.monotonic() - started)
        text, ids, usage, finish = "", [], None, None
        for chunk in resp.parse():
            if chunk.usage is not None:
                usage = chunk.usage.model_dump()
            for choice in chunk.choices:
                text += choice.delta.content or ""
                ids += getattr(choice, "token_ids", None) or []
                finish = choice.finish_reason or finish
    body = {
        "choices": [{"message": {"content": text}, "token_ids": ids, "finish_reason": finish}],
        "usage": usage,
    }
    return Reply(resp.status_code, body, headers, time.monotonic() - started)


def turn(
    sc: SidecarProcess,
    prefill: Engine,
    messages: list[dict[str, Any]],
    session: str | None,
    *,
    stream: bool = True,
) -> Turn:
    """One turn as ``helpers.send`` sends it (P's /metrics read around it), through
    the SDK. P's prefix cache is not reset: the tier's P has none, and a reset waits
    while P holds the block of a release request (its lease, 30 s)."""
    before = prefill.metrics()
    reply = chat(sc, messages, session, stream=stream)
    t = Turn(copy.deepcopy(messages), reply, PrefillFigures.between(before, prefill.metrics()))
    assert reply.status == 200, t.why()
    assert reply.token_ids and len(reply.token_ids) == ANSWER_TOKENS, t.why()
    assert reply.body["usage"]["completion_tokens"] == ANSWER_TOKENS, t.why()
    return t


def reference(prefill: Engine, messages: list[dict[str, Any]]) -> list[int]:
    """The answer of the P engine alone computing everything (it has no prefix cache:
    no reset needed, see ``turn``)."""
    r = prefill.chat(messages, max_tokens=ANSWER_TOKENS, request_id=rid("reference"))
    assert r.token_ids and len(r.token_ids) == ANSWER_TOKENS, r.body
    return r.token_ids
