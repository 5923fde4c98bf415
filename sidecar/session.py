"""Which session a request belongs to, and which decode pod owns that session.

Key order is configurable (``routing.sessionKeys``); each entry is a body field name
(``session_id``, ``conversation_id``, ``user``, ...) or ``header:<Name>``. A header
that is present wins over every body key (a gateway may set it; the body is always
the client's), then the body keys in their order. When none is present, the key is
a digest of the model and the first messages (or the start of the prompt), so a
client that resends its growing history still lands on one owner.

The owner is chosen by rendezvous (highest-random-weight) hashing over the decode
StatefulSet's ordinals: stable across processes and restarts (no Python ``hash()``),
and scaling from n to n+1 pods moves only the sessions the new pod wins (~1/(n+1)).

Handle slots. A key from ``session_id``, ``conversation_id`` or a header names one
conversation, and its handle is kept under the key. ``user`` and the fallback key
name a person or a shared preamble: several conversations run under them at once,
and with one handle slot each turn would take (and misalign) another conversation's
handle. Under those keys the slot is refined by the conversation so far: a turn looks
up the slot of its history up to the last assistant message, and its answer is kept
under the slot of its messages plus that answer, which is exactly the history the
next turn of the same conversation sends (agent loops with tool results included).
Routing still uses the key, so a conversation keeps its decode pod (and sessions
sharing a preamble share D's prefix cache).

Owners. With the ``owner_header`` setting (``owners.py``) a slot digests the turn's
owner (the client the gateway authenticated) with its key, so the same
``session_id`` sent by another owner names another slot: it finds nothing there and
leaves the first owner's handle alone. Routing still uses the key alone.

Client text. The keys, the model and ``cache_salt`` must be Unicode text: a lone
surrogate (JSON's ``"\ud800"``, or header bytes that are not UTF-8, which the HTTP
parser decodes to surrogates) is no text, and :func:`invalid_text_field` names the
field so the request is refused. The digests of everything else (prompts, message
content) take any ``str`` (``surrogatepass``): what a prompt may hold is the
engine's to judge.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

from .types import Ordinal, SessionKey, SessionTag

# Characters of a completions prompt used for the fallback key.
FALLBACK_PROMPT_CHARS = 512


# Besides the session keys, the text a handle's KV identity matches by (identity.py):
# the model or adapter, and the tenant's prefix-cache salt (the engine hashes it).
TEXT_FIELDS = ("model", "cache_salt")


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


def _digest(*parts: str) -> str:
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        h.update(_utf8(part))
        h.update(b"\x00")
    return h.hexdigest()


def _is_unicode(value: Any) -> bool:
    if not isinstance(value, str):
        return True  # not text at all: str() of it is, and the engine judges the type
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def invalid_text_field(
    body: Mapping[str, Any], headers: Mapping[str, str], order: Iterable[str]
) -> str | None:
    """The first session key source in ``order`` or :data:`TEXT_FIELDS` whose value
    is not Unicode text, named as the client sent it (``session_id``,
    ``X-Session-Id``); None when every one is."""
    for source in (*order, *TEXT_FIELDS):
        if source.startswith("header:"):
            name = source.removeprefix("header:")
            value = headers.get(name)
        else:
            name, value = source, body.get(source)
        if not _is_unicode(value):
            return name
    return None


def _as_key(value: Any) -> str | None:
    if value is None or isinstance(value, (dict, list)):
        return None
    text = str(value).strip()
    return text or None


def conversation_head(messages: list[Any]) -> list[Any]:
    """The messages up to and including the first user message: the system prompt and
    the opening question, which stay the same as the conversation grows."""
    for i, message in enumerate(messages):
        if isinstance(message, dict) and message.get("role") == "user":
            return messages[: i + 1]
    return messages[:1]


def fallback_key(body: Mapping[str, Any]) -> SessionKey:
    model = str(body.get("model") or "")
    messages = body.get("messages")
    if isinstance(messages, list):
        head = json.dumps(conversation_head(messages), sort_keys=True, default=str)
        return "auto:" + _digest(model, head)
    prompt = body.get("prompt")
    text = prompt if isinstance(prompt, str) else json.dumps(prompt, default=str)
    return "auto:" + _digest(model, text[:FALLBACK_PROMPT_CHARS])


def session_key(
    body: Mapping[str, Any], headers: Mapping[str, str], order: Iterable[str]
) -> SessionKey:
    """The session's key, namespaced by its source: the first header key of ``order``
    that is present, else the first body key present, else :func:`fallback_key`.

    Headers first, wherever ``order`` puts them: a header may be a gateway's (set after
    it authenticated the client), a body field is always the client's, so a body key
    must never outrank a header that is there (a ``session_id`` in the body would
    pick any session behind a gateway that sets ``X-Session-Id``). The
    body's key is then ignored, not merged. Where no gateway sets the header the client
    chooses the session either way, so nothing is lost."""
    order = tuple(order)
    for source in order:
        if source.startswith("header:"):
            value = _as_key(headers.get(source.removeprefix("header:")))
            if value is not None:
                return f"{source}={value}"
    for source in order:
        if not source.startswith("header:"):
            value = _as_key(body.get(source))
            if value is not None:
                return f"{source}={value}"
    return fallback_key(body)


def refines_slot(key: SessionKey) -> bool:
    """Keys that name a person or a shared preamble rather than one conversation."""
    return key.startswith(("user=", "auto:"))


def _content_text(content: Any) -> str:
    """A message's content as the slot digest sees it: text with its whitespace
    collapsed, media parts by digest, tool calls and other fields ignored (clients
    echo answers in many shapes, stripped or not; the alignment guard checks the
    tokens anyway)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return " ".join(content.split())
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                out.append(" ".join(part["text"].split()))
            else:
                out.append("\x02" + _digest(json.dumps(part, sort_keys=True, default=str)))
        return "\x03".join(out)
    return json.dumps(content, sort_keys=True, default=str)


def _history_digest(messages: Iterable[Any]) -> str:
    parts = []
    for m in messages:
        if isinstance(m, dict):
            parts += [str(m.get("role") or ""), _content_text(m.get("content"))]
    return _digest(*parts)


def _until_last_assistant(messages: list[Any]) -> list[Any]:
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        if isinstance(m, dict) and m.get("role") == "assistant":
            return messages[: i + 1]
    return []


def _owned(key: SessionKey, owner: str | None) -> str:
    """The key a slot digests: bound to the handle's owner when there is one, so
    another owner sending the same key digests another slot (owners.py)."""
    return key if owner is None else f"{owner}|{key}"


def handle_slot(key: SessionKey, body: Mapping[str, Any], owner: str | None = None) -> SessionTag:
    """Where this turn looks for its conversation's handle."""
    messages = body.get("messages")
    if not refines_slot(key) or not isinstance(messages, list):
        return session_tag(_owned(key, owner))
    history = _history_digest(_until_last_assistant(messages))
    return session_tag(f"{_owned(key, owner)}|{history}")


def next_handle_slot(
    key: SessionKey, body: Mapping[str, Any], answer: str, owner: str | None = None
) -> SessionTag:
    """Where this turn's handle is kept: the slot the next turn will look up."""
    messages = body.get("messages")
    if not refines_slot(key) or not isinstance(messages, list):
        return session_tag(_owned(key, owner))
    history = [*messages, {"role": "assistant", "content": answer}]
    return session_tag(f"{_owned(key, owner)}|{_history_digest(history)}")


def session_tag(key: SessionKey) -> SessionTag:
    """A short, stable digest of the key: safe for logs, metrics and engine session_id."""
    return "kvf-" + _digest(key)[:16]


def _weight(key: SessionKey, ordinal: Ordinal) -> int:
    digest = hashlib.blake2b(_utf8(f"{ordinal}\x00{key}"), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def owner(key: SessionKey, ring_size: int) -> Ordinal:
    """Rendezvous hashing: the ordinal with the highest weight for this key."""
    if ring_size < 1:
        raise ValueError("ring_size must be >= 1")
    return max(range(ring_size), key=lambda ordinal: _weight(key, ordinal))
