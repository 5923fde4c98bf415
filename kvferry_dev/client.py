"""HTTP to engines and sidecars from the dev harness (standard library urllib):
``Reply``, greedy chat bodies, deterministic filler text, and ``HttpServer``, the
helpers engines and sidecar processes share."""

from __future__ import annotations

import json
import random
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvferry_sidecar.promtext import Scrape
from kvferry_wire.protocol import HDR_OUTCOME, HDR_REQUEST_ID, HDR_REUSED_TOKENS, HDR_ROUTE

from .configs import SERVED_MODEL_NAME
from .procs import EngineError

REQUEST_TIMEOUT = 300.0


@dataclass(frozen=True)
class Reply:
    """An HTTP answer: status, parsed JSON (or text), headers, wall seconds."""

    status: int
    body: Any
    headers: Mapping[str, str]
    seconds: float

    @property
    def choice(self) -> dict[str, Any]:
        return self.body["choices"][0]

    @property
    def text(self) -> str:
        c = self.choice
        return c["message"]["content"] if "message" in c else c["text"]

    @property
    def token_ids(self) -> list[int] | None:
        return self.choice.get("token_ids")

    @property
    def outcome(self) -> str | None:
        return self.headers.get(HDR_OUTCOME)

    @property
    def route(self) -> str | None:
        return self.headers.get(HDR_ROUTE)

    @property
    def reused_tokens(self) -> int:
        return int(self.headers.get(HDR_REUSED_TOKENS) or 0)

    @property
    def prompt_tokens(self) -> int:
        return int(self.body["usage"]["prompt_tokens"])


def chat_body(
    messages: Sequence[Mapping[str, Any]],
    *,
    max_tokens: int,
    session_id: str | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """A greedy, non-streaming chat request that returns token ids (``stream_chat``
    streams it).

    ``ignore_eos`` keeps answers at ``max_tokens`` (random weights emit EOS at random).
    """
    body: dict[str, Any] = {
        "model": SERVED_MODEL_NAME,
        "messages": [dict(m) for m in messages],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": False,
        "return_token_ids": True,
    }
    if session_id is not None:
        body["session_id"] = session_id
    body.update(extra)
    return body


_WORDS_TEXT = """
the of and to in is that for it with as was on be by this are from or an at which but
not have all were when there can more one if their will would so no what out about up
into time only other some could them these two may then first any like new over such our
than been most made after also did many before must through years where much your way
well down should because each just those people how too little state good very make
world still own see men work long get here between both life being under never day same
another know while last might us great old year off come since against go came right
used take three
"""
WORDS = _WORDS_TEXT.split()


def filler_text(seed: int | str, words: int) -> str:
    """`words` deterministic pseudo-English words (about one token each here)."""
    rnd = random.Random(seed)
    return " ".join(rnd.choice(WORDS) for _ in range(words))


class HttpServer:
    """HTTP helpers shared by engines and sidecars (``url`` and ``what`` set by them)."""

    url: str
    what: str

    def request(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        *,
        headers: Mapping[str, str] | None = None,
        timeout: float = REQUEST_TIMEOUT,
        check: bool = True,
        base: str | None = None,
    ) -> Reply:
        """``base``: another address of the same server (default ``url``)."""
        return http(
            method,
            (base or self.url) + path,
            body,
            headers=headers,
            timeout=timeout,
            check=check,
            what=self.what,
        )

    def post(
        self,
        path: str,
        body: Mapping[str, Any] | None = None,
        *,
        headers: Mapping[str, str] | None = None,
        timeout: float = REQUEST_TIMEOUT,
        check: bool = True,
    ) -> tuple[int, Any]:
        """POST JSON; returns (status, parsed JSON or text). Raises on non-2xx if check."""
        r = self.request("POST", path, body, headers=headers, timeout=timeout, check=check)
        return r.status, r.body

    def get(self, path: str, *, timeout: float = 30.0, check: bool = True) -> tuple[int, Any]:
        r = self.request("GET", path, None, timeout=timeout, check=check)
        return r.status, r.body

    def metrics(self) -> Scrape:
        """/metrics, parsed."""
        _, text = self.get("/metrics")
        return Scrape(text)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        max_tokens: int = 32,
        session_id: str | None = None,
        request_id: str | None = None,
        timeout: float = REQUEST_TIMEOUT,
        check: bool = True,
        stream: bool = False,
        **extra: Any,
    ) -> Reply:
        """``stream``: read as ``stream_chat`` reads it (``seconds`` is then the time
        to the first token); errors raise whatever ``check`` says."""
        body = chat_body(messages, max_tokens=max_tokens, session_id=session_id, **extra)
        headers = {HDR_REQUEST_ID: request_id} if request_id else None
        if stream:
            return stream_chat(
                self.url + "/v1/chat/completions", body, headers=headers, timeout=timeout
            )
        return self.request(
            "POST", "/v1/chat/completions", body, headers=headers, timeout=timeout, check=check
        )


def stream_chat(
    url: str,
    body: Mapping[str, Any],
    *,
    headers: Mapping[str, str] | None = None,
    timeout: float = REQUEST_TIMEOUT,
) -> Reply:
    """POST a chat body with ``stream: true`` (and ``stream_options.include_usage``),
    read the SSE answer as a client does: the deltas joined into the non-streamed
    shape (``choices[0].message.content``, ``token_ids``, ``usage``); ``seconds`` is
    the time to the first chunk with content, the streamed time to first token."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    t0 = time.monotonic()
    first: float | None = None
    text, ids, usage = "", [], None
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, hdrs = r.status, dict(r.headers.items())
            for line in r:
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or ():
                    delta = (choice.get("delta") or {}).get("content") or ""
                    if (delta or choice.get("token_ids")) and first is None:
                        first = time.monotonic() - t0
                    text += delta
                    ids += choice.get("token_ids") or []
    except urllib.error.HTTPError as e:
        raise EngineError(f"POST {url} -> HTTP {e.code}: {e.read()[:2000]!r}") from e
    except (urllib.error.URLError, OSError, TimeoutError) as e:
        raise EngineError(f"POST {url} (streamed) failed: {e}") from e
    payload = {"choices": [{"message": {"content": text}, "token_ids": ids}], "usage": usage}
    return Reply(status, payload, hdrs, first if first is not None else time.monotonic() - t0)


def http(
    method: str,
    url: str,
    body: Mapping[str, Any] | None,
    *,
    headers: Mapping[str, str] | None = None,
    timeout: float,
    check: bool = True,
    what: str = "server",
) -> Reply:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw, hdrs = r.status, r.read(), dict(r.headers.items())
    except urllib.error.HTTPError as e:
        status, raw, hdrs = e.code, e.read(), dict(e.headers.items())
    except (urllib.error.URLError, OSError, TimeoutError) as e:
        raise EngineError(f"{method} {url} to the {what} failed: {e}") from e
    seconds = time.monotonic() - t0
    text = raw.decode(errors="replace")
    try:
        payload: Any = json.loads(text)
    except ValueError:
        payload = text
    if check and not 200 <= status < 300:
        raise EngineError(f"{method} {url} -> HTTP {status}: {text[:2000]}")
    return Reply(status, payload, hdrs, seconds)
