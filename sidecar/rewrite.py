"""Request and response bodies as each leg needs them. Pure: dicts and bytes in, out.

Prefill leg (P): the client's body, non-streaming, one token, no stream options or
min-token bounds (P stops after one token), ``kv_transfer_params`` asking P to keep
its KV for a remote decode, plus D's handle when it is reused.

Decode leg (D): the client's body as sent, plus P's ``kv_transfer_params`` and
``return_token_ids: true`` (the next turn's alignment needs the ids). A streamed turn
on an engine that streams no handle (vLLM 0.32, ``anchor.py``) adds two one-token
requests to D: ``anchor_body`` (D reads P's KV and returns a handle) before the
answer, which then streams with no transfer, and ``reanchor_body`` (the turn's ids
as a prefill-side completions request) after it.

No leg carries a client's KV parameters: ``client_body`` strips the top-level
``kv_transfer_params`` and the one inside ``vllm_xargs`` (vLLM reads that one when
the top-level field is empty), and every engine request sets the top-level field
itself: the prefill request's, P's for D, D's own for a turn D prefills alone, or an
explicit null (no transfer) for a turn that keeps no handle.

Responses: whatever the sidecar added is taken out again before the client sees it
(token ids it did not ask for, every ``kv_transfer_params``: they name engine hosts
and blocks). Non-streaming bodies keep the key as ``null``, as vLLM would have sent
it; stream chunks drop it, as vLLM omits unset fields there.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .types import (
    F_KV_PARAMS,
    F_MAX_COMPLETION_TOKENS,
    F_MAX_TOKENS,
    F_PROMPT_TOKEN_IDS,
    F_RETURN_TOKEN_IDS,
    F_SESSION_ID,
    F_STREAM,
    F_STREAM_OPTIONS,
    F_TOKEN_IDS,
    F_VLLM_XARGS,
    JSON,
    LOCAL_HANDLE_PARAMS,
    PREFILL_REQUEST_PARAMS,
)

# Fields P must not get: it generates exactly one token.
_PREFILL_DROPPED = ("min_tokens", "min_completion_tokens", F_STREAM_OPTIONS, F_RETURN_TOKEN_IDS)
# Chat fields that change how the prompt is rendered, sent to /tokenize as the engine
# gets them. vLLM 0.32's /tokenize ignores the last three (TOKENIZE_IGNORES): a turn
# carrying documents or reasoning_effort does not reuse (allowlist.py), and
# mm_processor_kwargs is part of the KV identity instead.
TEMPLATE_FIELDS = (
    "messages",
    "tools",
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "documents",
    "mm_processor_kwargs",
    "reasoning_effort",
)
TOKENIZE_IGNORES = frozenset({"documents", "mm_processor_kwargs", "reasoning_effort"})


def client_body(body: Mapping[str, Any]) -> JSON:
    """The client's body minus what only the sidecar may set: KV transfer parameters,
    top-level or as an extension argument."""
    out = {k: v for k, v in body.items() if k != F_KV_PARAMS}
    xargs = out.get(F_VLLM_XARGS)
    if isinstance(xargs, Mapping) and F_KV_PARAMS in xargs:
        out[F_VLLM_XARGS] = {k: v for k, v in xargs.items() if k != F_KV_PARAMS}
    return out


def tokenize_body(body: Mapping[str, Any]) -> JSON | None:
    """The /tokenize request that renders the same prompt, or None if not possible."""
    out: JSON = {}
    if body.get("model") is not None:
        out["model"] = body["model"]
    if isinstance(body.get("messages"), list):
        out.update({k: body[k] for k in TEMPLATE_FIELDS if k in body})
        return out
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        out["prompt"] = prompt
        if "add_special_tokens" in body:
            out["add_special_tokens"] = body["add_special_tokens"]
        return out
    return None


def prompt_ids_in_body(body: Mapping[str, Any]) -> list[int] | None:
    """A completions prompt given as token ids needs no /tokenize."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    return None


def prefill_body(
    body: Mapping[str, Any], handle_params: Mapping[str, Any] | None, session_id: str | None
) -> JSON:
    out = {k: v for k, v in body.items() if k not in _PREFILL_DROPPED}
    out[F_STREAM] = False
    out[F_MAX_TOKENS] = 1
    if F_MAX_COMPLETION_TOKENS in out:
        out[F_MAX_COMPLETION_TOKENS] = 1
    # D's handle already says do_remote_decode=true, do_remote_prefill=false; it fills
    # the remote_* fields the plain prefill request leaves None.
    out[F_KV_PARAMS] = {**PREFILL_REQUEST_PARAMS, **(handle_params or {})}
    if session_id and F_SESSION_ID not in out:
        out[F_SESSION_ID] = session_id
    return out


# Fields that ask for more than one sequence (the stream asks for them itself).
_ONE_SEQUENCE_DROPPED = ("n", "best_of", "use_beam_search")


def anchor_body(
    body: Mapping[str, Any], prefill_params: Mapping[str, Any], session_id: str | None
) -> JSON:
    """The one-token request that makes D read P's KV and return a handle for it,
    before a streamed answer on an engine that streams no handle (vLLM 0.32: only a
    non-streamed answer carries ``kv_transfer_params``). Like the prefill request
    (non-streaming, one token, no stream options or token bounds), but with P's params
    and the token ids the handle needs."""
    out = prefill_body(body, None, session_id)
    out[F_KV_PARAMS] = dict(prefill_params)
    out[F_RETURN_TOKEN_IDS] = True
    # One sequence: one request reads P's KV and leaves one handle (n copies would
    # each pin the prompt).
    for key in _ONE_SEQUENCE_DROPPED:
        out.pop(key, None)
    return out


def reanchor_body(body: Mapping[str, Any], token_ids: list[int], session_id: str | None) -> JSON:
    """The one-token prefill-side completions request over a streamed turn's ids
    (prompt + answer): D computes only what its prefix cache lacks (the last partial
    block) and returns a handle it tracks and frees (``LOCAL_HANDLE_PARAMS``). It
    carries what the KV depends on besides the ids: the model (or adapter) and
    ``cache_salt``; turns with media are never re-anchored (their KV is not the
    ids')."""
    out: JSON = {
        "prompt": list(token_ids),
        F_MAX_TOKENS: 1,
        "temperature": 0,
        F_STREAM: False,
        F_RETURN_TOKEN_IDS: True,
        F_KV_PARAMS: dict(LOCAL_HANDLE_PARAMS),
    }
    for key in ("model", "cache_salt"):
        if body.get(key) is not None:
            out[key] = body[key]
    if session_id:
        out[F_SESSION_ID] = session_id
    return out


def decode_body(
    body: Mapping[str, Any], params: Mapping[str, Any] | None, session_id: str | None
) -> JSON:
    out = dict(body)
    out[F_RETURN_TOKEN_IDS] = True
    # None: no transfer, said explicitly (the client's own were stripped).
    out[F_KV_PARAMS] = dict(params) if params is not None else None
    if session_id and F_SESSION_ID not in out:
        out[F_SESSION_ID] = session_id
    return out


# ------------------------------------------------------------------ responses


def _strip(obj: JSON, *, wants_token_ids: bool, keep_as_null: bool) -> JSON:
    def clear(d: dict[str, Any], key: str) -> None:
        if key in d:
            if keep_as_null:
                d[key] = None
            else:
                del d[key]

    clear(obj, F_KV_PARAMS)
    if not wants_token_ids:
        clear(obj, F_PROMPT_TOKEN_IDS)
        for choice in obj.get("choices") or ():
            if isinstance(choice, dict):
                clear(choice, F_TOKEN_IDS)
                clear(choice, F_PROMPT_TOKEN_IDS)
    return obj


def restore_body(obj: JSON, *, wants_token_ids: bool) -> JSON:
    """A non-streaming response as the client would have got it without the sidecar."""
    return _strip(obj, wants_token_ids=wants_token_ids, keep_as_null=True)


@dataclass
class Capture:
    """What a decode response says about the handle it left on D."""

    prompt_ids: list[int] | None = None
    output_ids: list[int] = field(default_factory=list)
    params: JSON | None = None
    finish_reason: str | None = None
    # The answer's text as the client got it: the next turn echoes it in its history
    # (session.next_handle_slot).
    text: str = ""

    def add(self, obj: Mapping[str, Any]) -> None:
        params = obj.get(F_KV_PARAMS)
        if isinstance(params, dict):
            self.params = params
        prompt = obj.get(F_PROMPT_TOKEN_IDS)
        if isinstance(prompt, list):
            self.prompt_ids = prompt
        for choice in obj.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            if choice.get("index", 0) != 0:
                continue
            if self.prompt_ids is None and isinstance(choice.get(F_PROMPT_TOKEN_IDS), list):
                self.prompt_ids = choice[F_PROMPT_TOKEN_IDS]
            ids = choice.get(F_TOKEN_IDS)
            if isinstance(ids, list):
                self.output_ids.extend(ids)
            for part in (choice.get("message"), choice.get("delta")):
                if isinstance(part, dict) and isinstance(part.get("content"), str):
                    self.text += part["content"]
            if isinstance(choice.get("text"), str):
                self.text += choice["text"]
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]


def capture_body(obj: Mapping[str, Any]) -> Capture:
    capture = Capture()
    capture.add(obj)
    return capture


# ------------------------------------------------------------------ server-sent events


def _dump(obj: Any) -> str:
    text = json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    try:
        text.encode()
    except UnicodeEncodeError:  # a lone surrogate from the engine: escape it as JSON does
        return json.dumps(obj, separators=(",", ":"))
    return text


class SSERewriter:
    """Feeds D's SSE bytes through: captures the handle fields, strips them, re-emits.

    Events are blocks of lines separated by a blank line; an event's ``data:`` lines
    joined are its payload (the SSE rule). A payload that is not a JSON object (nor
    ``[DONE]``) is dropped, never relayed: it may hold what the rewriter strips. An
    event without data (a comment) passes unchanged.
    """

    def __init__(self, *, wants_token_ids: bool, hold_done: bool = False) -> None:
        self.capture = Capture()
        self._wants_token_ids = wants_token_ids
        self._buffer = b""
        # hold_done: the ``[DONE]`` event is kept back (``done`` says it came) so the
        # relay can finish the turn's handle before the client's stream ends.
        self._hold_done = hold_done
        self.done = False

    @property
    def pending(self) -> int:
        """Bytes of an event not yet complete."""
        return len(self._buffer)

    def feed(self, data: bytes) -> bytes:
        self._buffer += data.replace(b"\r\n", b"\n")
        out: list[bytes] = []
        while True:
            end = self._buffer.find(b"\n\n")
            if end < 0:
                break
            event, self._buffer = self._buffer[: end + 2], self._buffer[end + 2 :]
            out.append(self._event(event))
        return b"".join(out)

    def flush(self) -> bytes:
        rest, self._buffer = self._buffer, b""
        return self._event(rest) if rest.strip() else rest

    def _event(self, event: bytes) -> bytes:
        lines = event.decode("utf-8", errors="replace").strip().split("\n")
        data = [line[len("data:") :] for line in lines if line.startswith("data:")]
        if not data:
            return event
        payload = "\n".join(d.removeprefix(" ") for d in data).strip()
        if payload == "[DONE]":
            self.done = True
            return b"" if self._hold_done else event
        try:
            obj = json.loads(payload)
        except (ValueError, RecursionError):
            return b""
        if not isinstance(obj, dict):
            return b""
        self.capture.add(obj)
        had_params = obj.get(F_KV_PARAMS) is not None
        _strip(obj, wants_token_ids=self._wants_token_ids, keep_as_null=False)
        if had_params and not obj.get("choices") and obj.get("usage") is None:
            return b""  # a chunk that only carried the handle
        fields = "".join(f"{line}\n" for line in lines if not line.startswith("data:"))
        return f"{fields}data: {_dump(obj)}\n\n".encode()
