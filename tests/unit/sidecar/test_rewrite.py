"""What each leg is sent, and what the client gets back."""

from __future__ import annotations

import json

from kvferry_sidecar import rewrite
from kvferry_sidecar.types import PREFILL_REQUEST_PARAMS

CLIENT = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "stream": True,
    "stream_options": {"include_usage": True},
    "max_tokens": 64,
    "max_completion_tokens": 64,
    "min_tokens": 4,
    "temperature": 0.7,
}
HANDLE = {
    "do_remote_prefill": False,
    "do_remote_decode": True,
    "remote_block_ids": [[7, 8]],
    "remote_engine_id": "d0",
    "remote_request_id": "r1",
    "remote_host": "10.0.0.2",
    "remote_port": 5601,
    "remote_num_tokens": 8,
    "remote_blocks_expiry_time": 99.5,
}


def test_prefill_body_one_token_no_stream() -> None:
    """P gets stream=false, one token, no stream options or min-token bounds."""
    body = rewrite.prefill_body(CLIENT, None, None)
    assert body["stream"] is False
    assert body["max_tokens"] == 1
    assert body["max_completion_tokens"] == 1
    assert "stream_options" not in body
    assert "min_tokens" not in body
    assert body["temperature"] == 0.7
    assert body["kv_transfer_params"] == PREFILL_REQUEST_PARAMS


def test_prefill_body_carries_handle_whole() -> None:
    """With a handle, P gets every handle field over the plain prefill flags."""
    body = rewrite.prefill_body(CLIENT, HANDLE, None)
    assert body["kv_transfer_params"] == HANDLE


def test_prefill_body_keeps_client_session_id() -> None:
    body = rewrite.prefill_body({**CLIENT, "session_id": "mine"}, None, "kvf-x")
    assert body["session_id"] == "mine"
    assert rewrite.prefill_body(CLIENT, None, "kvf-x")["session_id"] == "kvf-x"


def test_decode_body_restores_client_fields() -> None:
    """D gets the client's stream, limits and min_tokens, P's params, and token ids."""
    p_params = {"do_remote_prefill": True, "remote_block_ids": [[1]]}
    body = rewrite.decode_body(CLIENT, p_params, None)
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 64 and body["min_tokens"] == 4
    assert body["kv_transfer_params"] == p_params
    assert body["return_token_ids"] is True


def test_client_cannot_set_kv_transfer_params() -> None:
    """A client's own kv_transfer_params never reach an engine."""
    # Bug prevented: a client pointing P at arbitrary remote blocks.
    assert "kv_transfer_params" not in rewrite.client_body({**CLIENT, "kv_transfer_params": {}})


def test_client_cannot_set_kv_transfer_params_as_an_extension_argument() -> None:
    """vLLM reads vllm_xargs.kv_transfer_params when the top-level field is empty: it is
    stripped too; the other extension arguments pass."""
    xargs = {"kv_transfer_params": HANDLE, "my_extension": "1"}
    out = rewrite.client_body({**CLIENT, "vllm_xargs": xargs})
    assert out["vllm_xargs"] == {"my_extension": "1"}
    assert xargs["kv_transfer_params"] is HANDLE  # the client's body is not edited


def test_decode_without_params_says_no_transfer_explicitly() -> None:
    """A decode request with no params carries an explicit null of the sidecar's own."""
    body = rewrite.decode_body({**CLIENT, "kv_transfer_params": HANDLE}, None, None)
    assert "kv_transfer_params" in body and body["kv_transfer_params"] is None


def test_tokenize_body_keeps_template_fields() -> None:
    body = {**CLIENT, "tools": [{"type": "function"}], "chat_template_kwargs": {"x": 1}}
    out = rewrite.tokenize_body(body)
    assert out == {
        "model": "m",
        "messages": CLIENT["messages"],
        "tools": [{"type": "function"}],
        "chat_template_kwargs": {"x": 1},
    }


def test_restore_body_nulls_what_client_did_not_ask() -> None:
    """Non-streaming: token ids and kv params come back as null, as vLLM sends them."""
    obj = {
        "choices": [{"index": 0, "token_ids": [1], "message": {"content": "x"}}],
        "prompt_token_ids": [1, 2],
        "kv_transfer_params": HANDLE,
    }
    out = rewrite.restore_body(obj, wants_token_ids=False)
    assert out["prompt_token_ids"] is None
    assert out["kv_transfer_params"] is None
    assert out["choices"][0]["token_ids"] is None


def test_restore_body_keeps_token_ids_when_asked() -> None:
    obj = {"choices": [{"index": 0, "token_ids": [1]}], "prompt_token_ids": [1, 2]}
    out = rewrite.restore_body(obj, wants_token_ids=True)
    assert out["prompt_token_ids"] == [1, 2]
    assert out["choices"][0]["token_ids"] == [1]


def _event(obj: dict) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


STREAM = [
    {"choices": [{"index": 0, "delta": {"role": "assistant"}}], "prompt_token_ids": [1, 2]},
    {"choices": [{"index": 0, "delta": {"content": "a"}, "token_ids": [5]}]},
    {
        "choices": [{"index": 0, "delta": {}, "token_ids": [6], "finish_reason": "stop"}],
        "kv_transfer_params": HANDLE,
    },
]


def test_sse_rewriter_captures_and_strips() -> None:
    """The relay learns the handle and ids; the client sees neither."""
    sse = rewrite.SSERewriter(wants_token_ids=False)
    raw = b"".join(_event(o) for o in STREAM) + b"data: [DONE]\n\n"
    out = b""
    for i in range(0, len(raw), 7):  # arbitrary network chunking
        out += sse.feed(raw[i : i + 7])
    out += sse.flush()
    assert sse.capture.prompt_ids == [1, 2]
    assert sse.capture.output_ids == [5, 6]
    assert sse.capture.params == HANDLE
    assert sse.capture.finish_reason == "stop"
    assert b"token_ids" not in out and b"kv_transfer_params" not in out
    assert out.endswith(b"data: [DONE]\n\n")
    assert out.count(b"data: ") == 4


def test_sse_rewriter_drops_params_only_chunk() -> None:
    """A chunk that only carried the handle is not sent to the client."""
    sse = rewrite.SSERewriter(wants_token_ids=False)
    out = sse.feed(_event({"choices": [], "kv_transfer_params": HANDLE}))
    assert out == b""
    assert sse.capture.params == HANDLE


def test_sse_rewriter_keeps_usage_chunk() -> None:
    sse = rewrite.SSERewriter(wants_token_ids=False)
    out = sse.feed(_event({"choices": [], "usage": {"prompt_tokens": 3}}))
    assert b'"usage"' in out


def test_sse_rewriter_passes_comments_and_drops_unparsable_events() -> None:
    """A comment passes unchanged; data that does not parse is not relayed."""
    sse = rewrite.SSERewriter(wants_token_ids=False)
    assert sse.feed(b": keep-alive\n\n") == b": keep-alive\n\n"
    assert sse.feed(b"data: {oops\n\n") == b""


def test_sse_rewriter_never_relays_an_event_it_could_not_parse() -> None:
    """An event whose data is not a JSON object is dropped: it may hold what the
    rewriter strips. Comments and [DONE] pass."""
    sse = rewrite.SSERewriter(wants_token_ids=False)
    broken = b'data: {"kv_transfer_params": {"remote_host": "10.0.0.2"}, "choices": [\n\n'
    assert sse.feed(broken) == b""
    assert sse.feed(b'data: ["kv_transfer_params", "10.0.0.2"]\n\n') == b""
    assert sse.feed(b": keep-alive\n\n") == b": keep-alive\n\n"
    assert sse.feed(b"data: [DONE]\n\n") == b"data: [DONE]\n\n"


def test_sse_rewriter_strips_an_event_with_other_fields_or_several_data_lines() -> None:
    """An ``event:`` line before the data, or the data split over lines (SSE joins
    them), is still parsed and stripped."""
    sse = rewrite.SSERewriter(wants_token_ids=False)
    named = b"event: chunk\n" + _event({"choices": [], "usage": {}, "kv_transfer_params": HANDLE})
    out = sse.feed(named)
    assert b"kv_transfer_params" not in out and out.startswith(b"event: chunk\ndata: {")
    assert sse.capture.params == HANDLE
    split = b'data: {"choices": [],\ndata: "usage": {}, "prompt_token_ids": [1, 2]}\n\n'
    out = sse.feed(split)
    assert b"prompt_token_ids" not in out and out.startswith(b"data: {")
    assert sse.capture.prompt_ids == [1, 2]


def test_sse_rewriter_escapes_a_lone_surrogate_instead_of_failing_mid_stream() -> None:
    """Bug prevented: a lone surrogate in D's streamed text raised UnicodeEncodeError
    while re-encoding the chunk, and the client's stream died."""
    sse = rewrite.SSERewriter(wants_token_ids=False)
    out = sse.feed(b'data: {"choices":[{"index":0,"delta":{"content":"\\ud800"}}]}\n\n')
    assert out.startswith(b"data: ")
    chunk = json.loads(out.decode("utf-8")[len("data: ") :])
    assert chunk["choices"][0]["delta"]["content"] == "\ud800"
