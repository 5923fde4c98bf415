"""What one request, and every request in progress together, may cost the sidecar.

A turn's body is read whole, parsed, walked and copied for each engine leg, so the
sidecar's memory for it is many times its size; the CRD's default sidecar memory
limit is 1 Gi, and an OOM kill loses every handle and cuts every stream on the pod.
So, before any engine sees a request:

- **Size by what the model can take.** A prompt longer than the context is refused
  by the engine anyway: the text of a body may be ``body_bytes_per_token`` bytes per
  token of the context (``max_model_len``: the setting, else the engine's own from
  its ``/v1/models``, else ``UNKNOWN_MAX_MODEL_LEN``) plus ``body_overhead_bytes``
  for the fields that are no prompt. 16 bytes a token: a token of text is ~4 bytes of
  English, up to ~12 where each character is sent as a JSON ``\\uXXXX`` escape (CJK,
  emoji with ``ensure_ascii``); whole prompts average far less than that. Media (the
  strings in content parts that are no text: data URLs, base64 audio) have their own
  cap, ``max_media_bytes``: their size says nothing about tokens.
- **Counts.** ``max_messages`` messages, ``max_content_parts`` content parts in all:
  each costs Python objects far beyond its bytes.
- **Bytes in flight.** Every body held by a turn in progress counts against
  ``max_inflight_body_bytes`` until the turn is over (its parsed body lives that
  long). Unset, it follows the container's memory limit (``inflight_capacity``): a
  turn's memory is many times its body (the body raw and parsed, each engine leg's
  copy, the prompt's token ids from ``/tokenize`` and from D's answer as Python ints:
  the memory attack of ``bench/hostile.py`` measured 10-12 bytes of RSS per body byte in
  flight), so the bodies may hold the limit less ``MEMORY_RESERVE_BYTES`` over
  ``MEMORY_PER_BODY_BYTE``: at the default 1 Gi, 37 MiB, which costs about half the
  limit. A body that would exceed it gets 503 with ``Retry-After`` at once rather
  than a wait: a waiting request still holds its connection and adds its wait to
  every request behind it, and clients and gateways retry a 503 with backoff anyway
  (the operator's report endpoint answers its own excess the same way).
- **Time** (``app.py``, ``relay.py``): a request head must arrive within
  ``header_timeout_seconds``, its body within ``body_timeout_seconds`` (408). A
  refusal before the body was read whole says ``Connection: close``; after a 408 the
  connection is closed as soon as the answer is out (nothing is arriving: aiohttp
  would go on reading for its lingering time, and a sender that finished the body
  then would keep the connection for the keep-alive time).
- **Connections per client** (``ClientConnections``, ``app.py``): one address holds
  at most ``MAX_CONNECTIONS_PER_CLIENT`` connections open on the client port,
  counted from their first request to their close; the first request of one more is
  a 503 with ``Retry-After`` and its connection is closed.

Each refusal is a ``Refusal``: status, a message that names the limit and the
setting (by its file key), and the request field at fault where there is one.
Parsing and checking a body is ``parse_body``, pure, which the relay runs in the
heavy-work thread (``offload.py``) for bodies above ``PARSE_IN_THREAD_BYTES`` so the
event loop keeps serving.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from kvferry_wire.jsondepth import nested_deeper_than
from kvferry_wire.settings import SidecarSettings, file_key

from .identity import TEXT_PARTS

# The context assumed when neither the setting nor the engine says (vLLM's default
# for most current models; the operator's tuner assumes the same).
UNKNOWN_MAX_MODEL_LEN: Final = 131072
# Bodies larger than this are parsed off the event loop (offload.py), and their turn's
# engine legs' JSON with them: json.loads of 256 KiB takes a few
# milliseconds, of 16 MiB of messages about a second on a busy core.
PARSE_IN_THREAD_BYTES: Final = 256 * 1024
# The Retry-After of a 503 for bytes in flight: turns end in seconds.
RETRY_AFTER_SECONDS: Final = 1
# The bytes-in-flight budget from the memory limit (inflight_capacity): what the
# sidecar holds besides bodies (its code, handles, the residency model, connections:
# ~50 MiB idle, more with a full handle store), and the bytes of memory budgeted per
# body byte, twice the 10-12 measured under the memory attack (allocator slack, copies
# the benchmark's shapes miss).
MEMORY_RESERVE_BYTES: Final = 128 * 2**20
MEMORY_PER_BODY_BYTE: Final = 24
# Never less: a limit below the reserve still serves small turns.
MIN_INFLIGHT_BODY_BYTES: Final = 2**20
# Without a known memory limit (a sidecar run by hand).
FALLBACK_INFLIGHT_BODY_BYTES: Final = 64 * 2**20
# Never more: a container without a memory limit gets the node's allocatable memory
# from the downward API (2 TiB would afford ~85 GiB of bodies).
MAX_INFLIGHT_BODY_BYTES: Final = 2**30


# Connections one address (the peer's IP) may hold open on the client port. Not a
# setting, and not small: behind a gateway every client is the gateway's address, and
# over HTTP/1.1 a gateway holds one connection per turn in flight to this pod, which
# may run as many turns as vLLM's max_num_seqs (1024 on large GPUs). It bounds what
# one host alone can hold (each socket up to the keep-alive time), not a crowd.
MAX_CONNECTIONS_PER_CLIENT: Final = 1024


class ClientConnections:
    """The connections each address holds open on the client port, to cap them.

    A connection counts from its first request (the middleware sees no connection
    before that: aiohttp offers no hook at accept, and under uvloop the accept is
    libuv's) until it closes (``closed``: aiohttp's task that serves it, done when
    the connection is). A connection that never sends a whole head is not counted;
    ``header_timeout_seconds`` alone bounds it."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._open: dict[str, set[object]] = {}

    def admit(self, address: str | None, connection: object, closed: asyncio.Future[Any]) -> bool:
        """Whether a request on ``connection`` from ``address`` is served: always on a
        connection already counted, else while the address holds fewer than the cap."""
        if address is None:
            return True
        held = self._open.get(address)
        if held is not None and connection in held:
            return True
        if held is not None and len(held) >= self.cap:
            return False
        self._open.setdefault(address, set()).add(connection)
        closed.add_done_callback(lambda _: self._release(address, connection))
        return True

    def _release(self, address: str, connection: object) -> None:
        held = self._open.get(address)
        if held is not None:
            held.discard(connection)
            if not held:
                del self._open[address]

    def held(self, address: str) -> int:
        return len(self._open.get(address, ()))


def key(name: str) -> str:
    """A setting as an operator writes it (the settings-file key)."""
    return file_key(name)


@dataclass(frozen=True)
class Refusal:
    """A request the sidecar will not take: the client's answer."""

    status: int
    message: str
    param: str | None = None


@dataclass(frozen=True)
class BodyCaps:
    """The bounds on one request's body, as of now."""

    max_model_len: int
    from_engine: bool  # max_model_len is the engine's (the setting is unset)
    bytes_per_token: int
    overhead_bytes: int
    media_bytes: int
    messages: int
    content_parts: int

    @property
    def text_bytes(self) -> int:
        return self.max_model_len * self.bytes_per_token + self.overhead_bytes

    @property
    def total_bytes(self) -> int:
        return self.text_bytes + self.media_bytes

    def context(self) -> str:
        where = "the engine's max_model_len" if self.from_engine else key("max_model_len")
        return (
            f"{where} {self.max_model_len} x {key('body_bytes_per_token')} "
            f"{self.bytes_per_token} + {key('body_overhead_bytes')} {self.overhead_bytes}"
        )


def body_caps(settings: SidecarSettings, engine_max_model_len: int | None) -> BodyCaps:
    """The caps for ``settings``; ``engine_max_model_len`` is the engine's own context
    (``None`` when it has not said)."""
    if settings.max_model_len is not None:
        context, from_engine = settings.max_model_len, False
    elif engine_max_model_len is not None:
        context, from_engine = engine_max_model_len, True
    else:
        context, from_engine = UNKNOWN_MAX_MODEL_LEN, False
    return BodyCaps(
        max_model_len=context,
        from_engine=from_engine,
        bytes_per_token=settings.body_bytes_per_token,
        overhead_bytes=settings.body_overhead_bytes,
        media_bytes=settings.max_media_bytes,
        messages=settings.max_messages,
        content_parts=settings.max_content_parts,
    )


def too_large(size: int, caps: BodyCaps) -> Refusal | None:
    """A body of ``size`` bytes (declared or read so far) past every allowance."""
    if size <= caps.total_bytes:
        return None
    return Refusal(
        413,
        f"request body of {size} bytes or more is larger than this server takes: "
        f"{caps.total_bytes} bytes, text ({caps.context()}) plus media "
        f"({key('max_media_bytes')} {caps.media_bytes})",
    )


def _strings_size(value: Any) -> int:
    """The characters of every string inside ``value`` (iterative: any depth)."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return total


def _parts(body: Mapping[str, Any]) -> list[list[Any]]:
    messages = body.get("messages")
    out: list[list[Any]] = []
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, list):
            out.append(content)
    return out


def _is_media(part: Any) -> bool:
    kind = part.get("type") if isinstance(part, Mapping) else None
    return not (isinstance(kind, str) and kind in TEXT_PARTS)


def media_bytes(body: Mapping[str, Any]) -> int:
    """The size of the media a chat body carries: the strings of its content parts that
    are no text (image_url, audio_url, video_url, input_audio, image_embeds, ...)."""
    return sum(_strings_size(p) for parts in _parts(body) for p in parts if _is_media(p))


def check_body(body: Mapping[str, Any], size: int, caps: BodyCaps) -> Refusal | None:
    """A parsed body of ``size`` bytes against the counts and the two allowances."""
    messages = body.get("messages")
    if isinstance(messages, list) and len(messages) > caps.messages:
        return Refusal(
            400,
            f"messages holds {len(messages)} messages; this server takes at most "
            f"{caps.messages} ({key('max_messages')})",
            "messages",
        )
    parts = sum(len(p) for p in _parts(body))
    if parts > caps.content_parts:
        return Refusal(
            400,
            f"messages hold {parts} content parts; this server takes at most "
            f"{caps.content_parts} ({key('max_content_parts')})",
            "messages",
        )
    media = media_bytes(body)
    if media > caps.media_bytes:
        return Refusal(
            413,
            f"request carries {media} bytes of media; this server takes at most "
            f"{caps.media_bytes} ({key('max_media_bytes')})",
            "messages",
        )
    text = size - media
    if text > caps.text_bytes:
        return Refusal(
            413,
            f"request body holds {text} bytes besides media; this server takes at most "
            f"{caps.text_bytes} ({caps.context()}): more than the model's context",
        )
    return None


NOT_AN_OBJECT: Final = Refusal(400, "request body must be a JSON object")
# Deeper than any request vLLM takes (a tool's JSON schema nests a few dozen levels at
# most), far below what the parser and the engine legs' re-encoding survive.
MAX_DEPTH: Final = 64
TOO_DEEP: Final = Refusal(
    400, f"request body must be a JSON object nested no deeper than {MAX_DEPTH} levels"
)


def parse_body(raw: bytes, caps: BodyCaps) -> dict[str, Any] | Refusal:
    """The body as a JSON object, or why it is refused."""
    if nested_deeper_than(raw, MAX_DEPTH):
        return TOO_DEEP
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: JSON nested past the stack
        return NOT_AN_OBJECT
    if not isinstance(body, dict):
        return NOT_AN_OBJECT
    return check_body(body, len(raw), caps) or body


def inflight_capacity(settings: SidecarSettings) -> int:
    """The bytes of request body every turn in progress may hold together: the setting,
    else what the memory limit affords (module docstring), else the fallback."""
    if settings.max_inflight_body_bytes is not None:
        return settings.max_inflight_body_bytes
    if settings.memory_limit_bytes is None:
        return FALLBACK_INFLIGHT_BODY_BYTES
    affordable = (settings.memory_limit_bytes - MEMORY_RESERVE_BYTES) // MEMORY_PER_BODY_BYTE
    return min(MAX_INFLIGHT_BODY_BYTES, max(MIN_INFLIGHT_BODY_BYTES, affordable))


class InflightBudget:
    """Bytes of request body held across every turn in progress (one event loop: no
    lock). ``take`` refuses what would pass ``capacity``; ``give`` returns it."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.in_use = 0

    def refusal(self, size: int) -> Refusal:
        name = key("max_inflight_body_bytes")
        if size > self.capacity:
            return Refusal(
                413,
                f"request body of {size} bytes is larger than every body this server "
                f"holds at once: {self.capacity} bytes ({name})",
            )
        return Refusal(
            503,
            f"the server holds {self.in_use} bytes of request bodies; {size} more would "
            f"pass {self.capacity} ({name}); retry shortly",
        )

    def take(self, size: int) -> bool:
        if self.in_use + size > self.capacity:
            return False
        self.in_use += size
        return True

    def give(self, size: int) -> None:
        self.in_use -= size

    def hold(self) -> Hold:
        return Hold(self)


class Hold:
    """One request's share of the budget, grown as its body arrives; a context
    manager that gives it all back on exit."""

    def __init__(self, budget: InflightBudget) -> None:
        self.budget = budget
        self.size = 0

    def fits(self, size: int) -> Refusal | None:
        """A 413 when ``size`` bytes are more than the whole budget ever holds."""
        return self.budget.refusal(size) if size > self.budget.capacity else None

    def grow(self, size: int) -> Refusal | None:
        """Cover ``size`` bytes; a refusal when the budget cannot."""
        if size <= self.size:
            return None
        if not self.budget.take(size - self.size):
            return self.budget.refusal(size)
        self.size = size
        return None

    def __enter__(self) -> Hold:
        return self

    def __exit__(self, *_: object) -> None:
        self.budget.give(self.size)
        self.size = 0
