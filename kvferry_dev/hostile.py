"""Hostile clients against a running decode sidecar: a seeded generator of raw HTTP
requests, a driver that sends them beside well-behaved streams and ``/healthz``
probes, and the checks every answer must pass.

Used by ``tests/unit/sidecar/test_hostile_process.py`` (1,000+ requests against the
real ``kvferry-sidecar`` process and the fake engines, timeouts set low) and
``bench/hostile.py`` (10,000 at the default caps, with the figures).

The generator (``attacks``: seeded, so a failure names the request that caused it
and reruns the same) mixes, per request, one family:

- **wrong types** in every field the sidecar reads (``fields.py``, ``allowlist.py``,
  ``session.py``, ``plan.py``, ``identity.py``, ``rewrite.py``): ``stream``,
  ``return_token_ids``, ``n``, ``best_of``, ``use_beam_search``, the session keys,
  ``messages`` and their roles, contents and parts, ``model``, ``cache_salt``,
  ``kv_transfer_params`` and ``vllm_xargs`` (engine-shaped ones too), ... ;
- **lone surrogates** (as JSON ``\\udXXX`` escapes, and bytes that are no UTF-8) in
  text, keys and headers;
- **deep nesting** (40 to 100,000 levels) inside a field;
- **huge and many parts**: text, ``data:`` URL media, parts, messages, around and
  past the caps (``BodyCaps``);
- **headers**: ``X-Session-Id`` and ``X-Request-Id`` that are no text or huge,
  ``Content-Type`` wrong or missing, ``Content-Length`` lies (more or less than
  sent), chunked bodies (good, bad sizes, with a ``Content-Length`` too);
- **slow senders**: a head or body trickled, a head or body that stops, a client
  that reads nothing and leaves.

What an answer may be (``problems``): any 2xx/4xx, a 503 only with ``Retry-After``
(the in-flight budget), never another 5xx; a connection closed without an answer
only for the families whose request never completes or is no HTTP; never a hang
(every request answered or closed within the deadline the caller gives, which covers
the sidecar's own timeouts); never an engine detail in an answer (the engines' URLs
and hosts, engine ids, ``kv_transfer_params``, block ids, and token ids the client
did not ask for). What D still holds afterwards is ``held_by_decode`` (the fakes'
records), which the caller compares with the sidecar's ledger.
"""

from __future__ import annotations

import asyncio
import base64
import json
import random
import re
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .fakeengines import BadRequest, FakeEngine, vllm_flag

CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
MODEL = "tiny-llama"


@dataclass(frozen=True)
class Caps:
    """The caps the sidecar under test runs with (its settings), so the generator can
    aim around them."""

    text_bytes: int
    media_bytes: int
    parts: int
    messages: int


@dataclass(frozen=True)
class Attack:
    """One hostile request, as bytes on the wire and how they are sent."""

    seq: int
    kind: str  # family:detail, for the figures
    head: bytes  # request line and headers, through the blank line
    body: bytes
    piece: int = 0  # bytes per write (0: all at once)
    pause: float = 0.0  # seconds between writes
    stop_after: int | None = None  # bytes sent in all, then nothing more (stays open)
    read: bool = True  # False: the client leaves once its answer starts
    may_close: bool = False  # the request never completes or is no HTTP: a close is fine
    asks_token_ids: bool = False  # the client asked for token ids (they may come back)


@dataclass
class Answer:
    attack: Attack
    status: int | None  # None: closed without a status line
    headers: dict[str, str]
    body: bytes
    seconds: float  # to the end of the answer (the connection closed)
    hung: bool = False
    # To the status line: the answer. aiohttp reads the rest of a body it did not
    # consume for up to 10 s (its lingering time) before it closes the connection.
    answered_s: float | None = None


# ---------------------------------------------------------------------------- values


def surrogate_text(rng: random.Random, size: int) -> str:
    """Code points of every plane, lone surrogates (U+D800..U+DFFF) often."""
    out = []
    for _ in range(size):
        kind = rng.randrange(4)
        if kind == 0:
            out.append(chr(rng.randrange(0xD800, 0xE000)))
        elif kind == 1:
            out.append(chr(rng.randrange(0x20, 0x7F)))
        else:
            out.append(chr(rng.randrange(0x110000)))
    return "".join(out)


# Values vLLM's lax reading takes or refuses, and ones of every other type.
SCALARS: tuple[Any, ...] = (
    None,
    True,
    False,
    0,
    1,
    2,
    -1,
    2**70,
    2.0,
    2.5,
    1e308,
    "",
    "false",
    "true",
    "0",
    "1",
    "2",
    "2.0",
    " 1 ",
    "yes",
    "off",
    "1_000",
    "x" * 300,
)
ENGINE_LIKE = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "client-chosen-engine",
    "remote_block_ids": [[1, 2, 3]],
    "remote_host": "192.0.2.7",
    "remote_port": 5601,
    "remote_request_id": "client-chosen-request",
    "remote_num_tokens": 12,
}


def junk(rng: random.Random, depth: int = 0) -> Any:
    """One value of any JSON type, a fresh object every time."""
    kind = rng.randrange(9 if depth < 2 else 5)
    if kind <= 1:
        return rng.choice(SCALARS)
    if kind == 2:
        return surrogate_text(rng, rng.randrange(1, 12))
    if kind == 3:
        return rng.randint(-(2**63), 2**63)
    if kind == 4:
        return rng.uniform(-1e9, 1e9)
    if kind == 5:
        return [junk(rng, depth + 1) for _ in range(rng.randrange(4))]
    if kind == 6:
        return {surrogate_text(rng, 3): junk(rng, depth + 1) for _ in range(rng.randrange(4))}
    if kind == 7:
        return dict(ENGINE_LIKE)
    return {"kv_transfer_params": dict(ENGINE_LIKE), "x": junk(rng, depth + 1)}


# A string put where a deep value goes, replaced in the dumped text (json.dumps cannot
# write values nested past its own stack).
def _deep_mark(depth: int) -> str:
    return f"\x00deep:{depth}\x00"


def _dump(body: Any) -> bytes:
    text = json.dumps(body)
    while "\\u0000deep:" in text:
        start = text.index('"\\u0000deep:')
        end = text.index('\\u0000"', start) + len('\\u0000"')
        depth = int(text[start + len('"\\u0000deep:') : end - len('\\u0000"')])
        text = text[:start] + "[" * depth + "1" + "]" * depth + text[end:]
    return text.encode()


# ---------------------------------------------------------------------------- bodies

FIELDS_CHAT = (
    "stream",
    "return_token_ids",
    "n",
    "best_of",
    "use_beam_search",
    "session_id",
    "conversation_id",
    "user",
    "messages",
    "model",
    "cache_salt",
    "kv_transfer_params",
    "vllm_xargs",
    "ec_transfer_params",
    "truncate_prompt_tokens",
    "mm_processor_kwargs",
    "media_io_kwargs",
    "stream_options",
    "max_tokens",
    "tools",
    "tool_choice",
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "documents",
    "prompt_embeds",
    "temperature",
    "logprobs",
    "response_format",
)
FIELDS_CMPL = (*FIELDS_CHAT[:8], "prompt", "model", "cache_salt", "kv_transfer_params")


def good_chat(rng: random.Random, sid: str) -> dict[str, Any]:
    history: list[dict[str, Any]] = []
    for i in range(rng.randrange(1, 4)):
        history.append({"role": "user", "content": f"question {i} about {sid} here"})
        history.append({"role": "assistant", "content": "fine thanks"})
    history.append({"role": "user", "content": f"and now {rng.randrange(10**6)} more"})
    return {"model": MODEL, "messages": history, "session_id": sid, "max_tokens": 4}


def good_completion(rng: random.Random, sid: str) -> dict[str, Any]:
    return {"model": MODEL, "prompt": f"tell me {rng.randrange(10**6)} things", "user": sid}


def _part(rng: random.Random) -> Any:
    kind = rng.randrange(7)
    if kind == 0:
        return {"type": "text", "text": junk(rng)}
    if kind == 1:
        return {"type": "image_url", "image_url": junk(rng)}
    if kind == 2:
        return {"type": "image_url", "image_url": {"url": data_url(rng.randrange(64))}}
    if kind == 3:
        return {"type": "input_audio", "input_audio": {"data": junk(rng), "format": junk(rng)}}
    if kind == 4:
        return {"type": junk(rng), "text": "hi"}
    if kind == 5:
        return {"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}}
    return junk(rng)


def data_url(size: int, kind: str = "image/png") -> str:
    return f"data:{kind};base64," + base64.b64encode(b"\x89PNG" + b"\0" * size).decode()


def wrong_message(rng: random.Random) -> Any:
    kind = rng.randrange(5)
    if kind == 0:
        return junk(rng)
    if kind == 1:
        return {"role": junk(rng), "content": "hi"}
    if kind == 2:
        return {"role": "user", "content": junk(rng)}
    if kind == 3:
        return {"role": "user", "content": [_part(rng) for _ in range(rng.randrange(1, 5))]}
    return {"role": "assistant", "content": None, "tool_calls": junk(rng)}


def asks_token_ids(body: Any) -> bool:
    """Whether vLLM reads ``return_token_ids`` as true (then token ids come back)."""
    if not isinstance(body, dict):
        return False
    try:
        return vllm_flag(body, "return_token_ids")
    except BadRequest:
        return False


# ---------------------------------------------------------------------------- requests


def head(
    path: str,
    length: int | None,
    extra: Sequence[tuple[bytes, bytes]] = (),
    *,
    content_type: bytes | None = b"application/json",
    method: bytes = b"POST",
) -> bytes:
    lines = [b"%s %s HTTP/1.1" % (method, path.encode()), b"Host: sidecar", b"Connection: close"]
    if content_type is not None:
        lines.append(b"Content-Type: " + content_type)
    if length is not None:
        lines.append(b"Content-Length: %d" % length)
    lines += [k + b": " + v for k, v in extra]
    return b"\r\n".join(lines) + b"\r\n\r\n"


def chunked(data: bytes, size: int) -> bytes:
    out = b""
    for i in range(0, len(data), size):
        piece = data[i : i + size]
        out += b"%x\r\n%s\r\n" % (len(piece), piece)
    return out + b"0\r\n\r\n"


class Generator:
    """``attacks(n)``: ``n`` hostile requests from ``seed`` (the same ones each time)."""

    def __init__(self, caps: Caps, *, seed: int = 20, slow_s: float = 1.0) -> None:
        self.caps = caps
        self.rng = random.Random(seed)
        # How long a slow sender takes in all: past the sidecar's timeouts in tests.
        self.slow_s = slow_s
        self.seq = 0

    def attacks(self, n: int) -> list[Attack]:
        families = [
            (self.wrong_type, 30),
            (self.wrong_messages, 10),
            (self.surrogates, 10),
            (self.deep, 8),
            (self.huge, 10),
            (self.headers, 14),
            (self.framing, 10),
            (self.slow, 8),
        ]
        makers = [m for m, _ in families]
        weights = [w for _, w in families]
        out = []
        for _ in range(n):
            maker = self.rng.choices(makers, weights)[0]
            out.append(maker())
            self.seq += 1
        return out

    # -- helpers

    def _sid(self) -> str:
        return f"h{self.seq}"

    def _json(self, kind: str, body: Any, path: str = CHAT, **kw: Any) -> Attack:
        data = _dump(body)
        extra = kw.pop("extra", ())
        return Attack(
            self.seq,
            kind,
            head(path, len(data), extra),
            data,
            asks_token_ids=asks_token_ids(body),
            **kw,
        )

    def _good(self) -> tuple[str, dict[str, Any]]:
        if self.rng.randrange(4) == 0:
            return CMPL, good_completion(self.rng, self._sid())
        return CHAT, good_chat(self.rng, self._sid())

    # -- families

    def wrong_type(self) -> Attack:
        path, body = self._good()
        names = FIELDS_CHAT if path == CHAT else FIELDS_CMPL
        for name in self.rng.sample(names, self.rng.randint(1, 3)):
            body[name] = junk(self.rng)
        if self.rng.randrange(3) == 0:
            body["stream"] = self.rng.choice([True, "true", "1", 1, "yes"])
        return self._json(f"wrong-type:{name}", body, path)

    def wrong_messages(self) -> Attack:
        body = good_chat(self.rng, self._sid())
        at = self.rng.randrange(len(body["messages"]) + 1)
        body["messages"].insert(at, wrong_message(self.rng))
        return self._json("messages", body)

    def surrogates(self) -> Attack:
        path, body = self._good()
        rng = self.rng
        where = rng.choice(["content", "session_id", "model", "user", "cache_salt", "key"])
        text = surrogate_text(rng, rng.randrange(1, 20))
        if where == "content" and path == CHAT:
            body["messages"][-1]["content"] = text
        elif where == "content":
            body["prompt"] = text
        elif where == "key":
            body[text] = junk(rng)
        else:
            body[where] = text
        return self._json(f"surrogate:{where}", body, path)

    def deep(self) -> Attack:
        body = good_chat(self.rng, self._sid())
        depth = self.rng.choice([40, 63, 64, 65, 200, 1_000, 100_000])
        where = self.rng.choice(["vllm_xargs", "tools", "content", "kv_transfer_params"])
        if where == "content":
            body["messages"][-1]["content"] = [{"type": "text", "text": _deep_mark(depth)}]
        else:
            body[where] = _deep_mark(depth)
        return self._json(f"deep:{depth}", body)

    def huge(self) -> Attack:
        rng, caps = self.rng, self.caps
        body = good_chat(rng, self._sid())
        kind = rng.choice(["text", "media", "parts", "messages", "session", "model"])
        near = rng.choice([0.5, 0.99, 1.01, 2.0])
        if kind == "text":
            body["messages"][-1]["content"] = "word " * int(caps.text_bytes * near / 5)
        elif kind == "media":
            size = int(caps.media_bytes * near * 3 / 4)
            url = data_url(size)
            body["messages"][-1]["content"] = [
                {"type": "text", "text": "what is this"},
                {"type": "image_url", "image_url": {"url": url}},
            ]
        elif kind == "parts":
            count = int(caps.parts * near) + 1
            body["messages"][-1]["content"] = [{"type": "text", "text": "p"}] * count
        elif kind == "messages":
            count = int(caps.messages * near) + 1
            body["messages"] = [{"role": "user", "content": "m"}] * count
        elif kind == "session":
            body["session_id"] = "s" * int(caps.text_bytes * near)
        else:
            body["model"] = "m" * int(caps.text_bytes * near)
        return self._json(f"huge:{kind}", body)

    def headers(self) -> Attack:
        rng = self.rng
        path, body = self._good()
        data = _dump(body)
        kind = rng.choice(
            ["session-bytes", "session-huge", "request-id", "request-id-huge", "content-type"]
        )
        extra: list[tuple[bytes, bytes]] = []
        content_type: bytes | None = b"application/json"
        if kind == "session-bytes":
            value = rng.choice([b"s\xff\xfe", b"\xed\xa0\x80", b"\xc3", b"ok\x80x"])
            extra.append((b"X-Session-Id", value))
        elif kind == "session-huge":
            extra.append((b"X-Session-Id", b"s" * rng.choice([100, 4000, 7000])))
        elif kind == "request-id":
            extra.append((b"X-Request-Id", rng.choice([b"\xff\xfe", b"a\x7fb", b"", b"\xe2\x80"])))
        elif kind == "request-id-huge":
            extra.append((b"X-Request-Id", b"r" * rng.choice([200, 7000])))
        else:
            content_type = rng.choice(
                [None, b"text/plain", b"multipart/form-data; boundary=x", b"application/json; x"]
            )
        return Attack(
            self.seq,
            f"header:{kind}",
            head(path, len(data), extra, content_type=content_type),
            data,
            asks_token_ids=asks_token_ids(body),
        )

    def framing(self) -> Attack:
        rng = self.rng
        path, body = self._good()
        data = _dump(body)
        kind = rng.choice(
            [
                "length-short",
                "length-long",
                "chunked",
                "chunked-bad-size",
                "chunked-huge-size",
                "chunked-and-length",
                "two-lengths",
                "garbage",
                "header-too-long",
            ]
        )
        te = (b"Transfer-Encoding", b"chunked")
        if kind == "length-short":  # declares less: the rest is a second "request"
            return Attack(self.seq, f"framing:{kind}", head(path, len(data) // 2), data)
        if kind == "length-long":  # declares more than it sends, then waits
            return Attack(
                self.seq, f"framing:{kind}", head(path, len(data) + 100), data, may_close=True
            )
        if kind == "chunked":
            raw = chunked(data, rng.choice([1, 7, 100, 4096]))
            return Attack(
                self.seq,
                f"framing:{kind}",
                head(path, None, [te]),
                raw,
                asks_token_ids=asks_token_ids(body),
            )
        if kind == "chunked-bad-size":
            raw = b"zz\r\n" + data + b"\r\n0\r\n\r\n"
            return Attack(self.seq, f"framing:{kind}", head(path, None, [te]), raw, may_close=True)
        if kind == "chunked-huge-size":
            raw = b"7fffffffffffffff\r\n" + data
            return Attack(self.seq, f"framing:{kind}", head(path, None, [te]), raw, may_close=True)
        if kind == "chunked-and-length":
            raw = chunked(data, 50)
            return Attack(
                self.seq, f"framing:{kind}", head(path, len(raw), [te]), raw, may_close=True
            )
        if kind == "two-lengths":
            extra = [(b"Content-Length", b"%d" % (len(data) + 5))]
            return Attack(
                self.seq, f"framing:{kind}", head(path, len(data), extra), data, may_close=True
            )
        if kind == "garbage":
            raw = rng.randbytes(rng.randrange(1, 300))
            return Attack(self.seq, f"framing:{kind}", b"", raw, may_close=True)
        extra = [(b"X-Long", b"a" * 20_000)]
        return Attack(
            self.seq, f"framing:{kind}", head(path, len(data), extra), data, may_close=True
        )

    def slow(self) -> Attack:
        rng = self.rng
        path, body = self._good()
        data = _dump(body)
        h = head(path, len(data))
        kind = rng.choice(["head-trickle", "body-trickle", "head-stops", "body-stops", "leaves"])
        if kind == "head-trickle":  # the head, a byte at a time, past the head deadline
            pause = self.slow_s / len(h) * 2
            return Attack(self.seq, f"slow:{kind}", h, data, 1, pause, may_close=True)
        if kind == "body-trickle":  # the body, slower than the body deadline allows
            piece = max(1, len(data) // 20)
            pause = self.slow_s / 20 * 2
            return Attack(self.seq, f"slow:{kind}", h, data, piece, pause, may_close=True)
        if kind == "head-stops":
            return Attack(self.seq, f"slow:{kind}", h, data, stop_after=len(h) // 2, may_close=True)
        if kind == "body-stops":
            return Attack(
                self.seq,
                f"slow:{kind}",
                h,
                data,
                stop_after=len(h) + len(data) // 2,
                may_close=True,
            )
        body["stream"] = True
        data = _dump(body)
        return Attack(self.seq, f"slow:{kind}", head(path, len(data)), data, read=False)


# ---------------------------------------------------------------------------- driver


def _parse(raw: bytes) -> tuple[int | None, dict[str, str], bytes]:
    line, _, rest = raw.partition(b"\r\n")
    parts = line.split()
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
        return None, {}, raw
    status = int(parts[1])
    head_bytes, _, body = rest.partition(b"\r\n\r\n")
    headers: dict[str, str] = {}
    for h in head_bytes.split(b"\r\n"):
        k, _, v = h.partition(b":")
        headers[k.strip().lower().decode("latin-1")] = v.strip().decode("latin-1")
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = _dechunk(body)
    return status, headers, body


def _dechunk(data: bytes) -> bytes:
    out, i = b"", 0
    while i < len(data):
        end = data.find(b"\r\n", i)
        if end < 0:
            break
        try:
            size = int(data[i:end].split(b";")[0], 16)
        except ValueError:
            break
        if size == 0:
            break
        out += data[end + 2 : end + 2 + size]
        i = end + 2 + size + 2
    return out


async def send(host: str, port: int, attack: Attack, deadline: float) -> Answer:
    """Send ``attack`` as planned and read the answer to the end (``Connection:
    close``), within ``deadline`` seconds; ``hung`` when neither came."""
    started = time.monotonic()
    reader, writer = await asyncio.open_connection(host, port)
    wire = attack.head + attack.body
    if attack.stop_after is not None:
        wire = wire[: attack.stop_after]

    async def write() -> None:
        piece = attack.piece or len(wire) or 1
        for i in range(0, len(wire), piece):
            writer.write(wire[i : i + piece])
            await writer.drain()
            if attack.pause:
                await asyncio.sleep(attack.pause)

    sender = asyncio.create_task(write())
    raw = b""
    hung = False
    answered: float | None = None
    try:
        async with asyncio.timeout(deadline):
            if not attack.read:
                raw = await reader.readuntil(b"\r\n\r\n")
                took = time.monotonic() - started
                return Answer(attack, *_parse(raw), took, answered_s=took)
            while chunk := await reader.read(65536):
                if not raw:
                    answered = time.monotonic() - started
                raw += chunk
    except TimeoutError:
        hung = True
    except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
        if isinstance(exc, asyncio.IncompleteReadError):
            raw = exc.partial
    finally:
        sender.cancel()
        await asyncio.gather(sender, return_exceptions=True)
        writer.close()
    status, headers, body = _parse(raw)
    took = time.monotonic() - started
    return Answer(attack, status, headers, body, took, hung, answered if status else None)


async def run_attacks(
    host: str, port: int, attacks: Sequence[Attack], *, concurrency: int, deadline: float
) -> list[Answer]:
    limit = asyncio.Semaphore(concurrency)

    async def one(attack: Attack) -> Answer:
        async with limit:
            return await send(host, port, attack, deadline)

    return list(await asyncio.gather(*(one(a) for a in attacks)))


# ---------------------------------------------------------------------------- checks


def leak_markers(engines: Sequence[FakeEngine]) -> list[bytes]:
    """What must never reach a client: each engine's address and id, and D's vocabulary
    of a handle (the fakes' hosts are 10.0.0.1 and 10.0.0.2)."""
    out = [b"10.0.0.1", b"10.0.0.2", b"remote_block_ids"]
    out += [b"remote_engine_id", b"remote_request_id", b"remote_host"]
    for e in engines:
        out += [e.url.split("//", 1)[-1].encode(), e.name.encode()]
    return out


_KV_PARAMS_VALUE = re.compile(rb'"kv_transfer_params":(?!\s*null)')
_TOKEN_IDS_VALUE = re.compile(rb'"(?:prompt_)?token_ids":(?!\s*null)')


def problems(answer: Answer, markers: Sequence[bytes]) -> list[str]:
    """Why ``answer`` breaks the rules in the module docstring (empty: it does not)."""
    a, out = answer.attack, []
    if answer.hung:
        out.append("hung: neither answered nor closed")
    if answer.status is None and not a.may_close and a.read and not answer.hung:
        out.append("closed without an answer")
    retryable = answer.status == 503 and "retry-after" in answer.headers
    if answer.status is not None and answer.status >= 500 and not retryable:
        out.append(f"status {answer.status}")
    text = answer.body + "\n".join(f"{k}: {v}" for k, v in answer.headers.items()).encode()
    for marker in markers:
        if marker in text:
            out.append(f"leaks {marker!r}")
    # The answer's own shape keeps the field as null (as vLLM answers without a
    # transfer); any value is D's.
    if _KV_PARAMS_VALUE.search(text):
        out.append("leaks kv_transfer_params")
    if not a.asks_token_ids and _TOKEN_IDS_VALUE.search(text):
        out.append("token ids the client did not ask for")
    return out


def held_by_decode(
    decode: FakeEngine, prefills: Sequence[FakeEngine], *, local_lease_s: float
) -> set[str]:
    """D's handles still pinned (by D's request id): returned by D, not aborted by
    their caller (vLLM frees an aborted request's blocks), never carried to a P (a
    pull or a release frees them), and within D's deadline (a decode-side handle's
    ``remote_blocks_expiry_time``; ``local_lease_s`` for one D prefilled alone, its
    KV lease)."""
    now = time.perf_counter()
    aborted = {f"{decode.name}-{rid}" for rid in decode.aborted_ids}
    returned = set()
    for h, at in zip(decode.handles, decode.handles_at, strict=True):
        if h is None or not h.get("remote_request_id"):
            continue
        deadline = h.get("remote_blocks_expiry_time") or at + local_lease_s
        if now < deadline:
            returned.add(str(h["remote_request_id"]))
    carried = set()
    for p in prefills:
        for seen in p.completions():
            params = seen.body.get("kv_transfer_params") or {}
            if isinstance(params, dict) and params.get("remote_engine_id") == decode.name:
                carried.add(str(params.get("remote_request_id")))
    return returned - aborted - carried


# ---------------------------------------------------------------------------- the others


@dataclass
class Steady:
    """Well-behaved streamed conversations beside the attack: their worst gap between
    two chunks (first chunk: since the request was sent), turns, refusals."""

    turns: int = 0
    worst_gap_s: float = 0.0
    busy: int = 0  # 503 + Retry-After (the budget was full): retried
    errors: list[str] = field(default_factory=list)


async def steady_streams(url: str, streams: int, stop: asyncio.Event) -> Steady:
    import aiohttp

    out = Steady()
    timeout = aiohttp.ClientTimeout(total=60)
    connector = aiohttp.TCPConnector(force_close=True, limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:

        async def conversation(i: int) -> None:
            history: list[dict[str, str]] = []
            k = 0
            while not stop.is_set():
                history.append({"role": "user", "content": f"steady {i} turn {k} asks again"})
                body = {"model": MODEL, "messages": history, "session_id": f"steady-{i}"}
                body["stream"] = True
                sent = last = time.monotonic()
                async with http.post(f"{url}{CHAT}", json=body) as resp:
                    if resp.status == 503 and "Retry-After" in resp.headers:
                        out.busy += 1
                        await resp.read()
                        history.pop()
                        continue
                    if resp.status != 200:
                        out.errors.append(f"steady {i}: {resp.status} {await resp.text()}")
                        return
                    async for _ in resp.content.iter_any():
                        now = time.monotonic()
                        out.worst_gap_s = max(out.worst_gap_s, now - last)
                        last = now
                out.turns += 1
                k += 1
                history.append({"role": "assistant", "content": "fine thanks"})
                if len(history) > 12:
                    history = history[-4:]
                del sent

        await asyncio.gather(*(conversation(i) for i in range(streams)))
    return out


async def healthz_worst(url: str, stop: asyncio.Event) -> tuple[float, int]:
    """The slowest ``/healthz`` of those sent one after another until ``stop``."""
    import aiohttp

    worst, count = 0.0, 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        while not stop.is_set():
            started = time.monotonic()
            async with http.get(f"{url}/healthz") as resp:
                await resp.read()
            worst = max(worst, time.monotonic() - started)
            count += 1
            await asyncio.sleep(0.01)  # a probe, not a load
    return worst, count


def _watch(url: str, streams: int, stop: Any, out: Any) -> None:
    async def main() -> None:
        done = asyncio.Event()
        loop = asyncio.get_running_loop()
        # The parent's multiprocessing.Event, waited for in a thread: this loop stays free.
        waiter = loop.run_in_executor(None, stop.wait)
        waiter.add_done_callback(lambda _: done.set())
        steady = asyncio.create_task(steady_streams(url, streams, done))
        probes = asyncio.create_task(healthz_worst(url, done))
        flowing, (worst, count) = await steady, await probes
        out.put((flowing, worst, count))

    asyncio.run(main())


class Watcher:
    """``steady_streams`` and ``healthz_worst`` in a process of their own, so that what
    they measure is the sidecar's latency, not this process's (whose event loop also
    runs the fake engines and the hostile clients). ``stop()`` returns
    (Steady, /healthz worst seconds, probes sent)."""

    def __init__(self, url: str, streams: int) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self._stop = ctx.Event()
        self._out = ctx.Queue()
        self._proc = ctx.Process(target=_watch, args=(url, streams, self._stop, self._out))
        self._proc.start()

    def stop(self, timeout: float = 120.0) -> tuple[Steady, float, int]:
        self._stop.set()
        try:
            return self._out.get(timeout=timeout)
        finally:
            self._proc.join(timeout)
            if self._proc.is_alive():
                self._proc.kill()


def rss_peak_bytes(pid: int) -> int:
    """The process's peak resident memory (VmHWM): read once, it misses no spike."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM for {pid}")


def slowest_answer(answers: Sequence[Answer]) -> tuple[float, str]:
    """The longest wait for a status line, and the family it was."""
    timed = [(a.answered_s, a.attack.kind) for a in answers if a.answered_s is not None]
    return max(timed, default=(0.0, "-"))


def by_status(answers: Sequence[Answer]) -> dict[str, int]:
    counts = Counter("closed" if a.status is None else str(a.status) for a in answers)
    return dict(sorted(counts.items()))


def by_family(answers: Sequence[Answer]) -> dict[str, dict[str, int]]:
    out: dict[str, Counter[str]] = {}
    for a in answers:
        family = a.attack.kind.split(":", 1)[0]
        out.setdefault(family, Counter())["closed" if a.status is None else str(a.status)] += 1
    return {k: dict(sorted(v.items())) for k, v in sorted(out.items())}


# ---------------------------------------------------------------------------- the sidecar


def sidecar_for_fakes(
    prefill_url: str,
    decode_url: str,
    log_dir: Any,
    overrides: dict[str, Any] | None = None,
    *,
    name: str = "hostile",
) -> Any:
    """The real sidecar process (not started) with the operator's settings for the
    tiny server, in front of fake engines (their block size; no KV-event socket)."""
    from pathlib import Path

    from kvferry_operator.render import build_sidecar_settings

    from .configs import tiny_server
    from .procs import free_port
    from .sidecars import SidecarProcess

    settings = dict(build_sidecar_settings(tiny_server()))
    settings.pop("enginePort", None)
    internal, port = free_port(), free_port()
    settings.update(
        {
            "role": "decode",
            "listenHost": "127.0.0.1",
            "listenPort": port,
            "internalPort": internal,
            # No scrape-only port: several harness sidecars share this machine.
            "metricsPort": 0,
            "engineUrl": decode_url,
            "ordinal": 0,
            "blockSize": 4,
            "kvEvents": "",
            "kvEventsReplay": "",
            "diagnosticHeaders": False,  # as rendered
            **(overrides or {}),
        }
    )
    topology = {
        "version": 1,
        "prefillEngines": [prefill_url],
        "decodeSidecars": [f"http://127.0.0.1:{internal}"],
    }
    return SidecarProcess(
        name=name, settings=settings, topology=topology, log_dir=Path(log_dir), port=port
    )
