"""What a turn's KV depends on besides its token ids: the handle's KV identity.

Token ids alone do not fix the KV. The same ids give other KV when they are
computed under another model or LoRA adapter (``model``), another
``cache_salt`` (vLLM's per-tenant prefix-cache isolation: a handle must never cross
salts), other media (an image placeholder tokenizes the same whatever the image),
other media processing (``mm_processor_kwargs``), or when the engine truncates the
prompt (``truncate_prompt_tokens``: ``/tokenize`` sees the whole prompt while the
engine drops its head, so every position shifts).

Media are known by their bytes only where the request carries them (``data:``
URLs, inline audio, embeddings): the digest of the part covers them. A part that
names its media by a URL (``https://``, ``file://``, ...) is digested by the URL
alone, and the bytes behind it may change between turns: such a turn is marked
``remote_media`` and the plan uses and keeps no handle for it unless the sidecar is
told URLs are immutable (``mediaUrlsImmutable``).

A handle records the identity of the turn that left it; a later turn may use it
only when :func:`compatible` says the identities agree. Media are compared as an
ordered list of digests: the handle's list must be a prefix of the new turn's (a
conversation appends images, it does not change earlier ones); the alignment guard
then checks the placeholders' token positions.

Truncating turns neither use nor leave handles: with the head cut off, positions
of a later turn are not those of the handle (no rule makes that provable).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Content parts that carry text; every other part type (image_url, input_audio,
# video_url, image_embeds, file, ...) is media and goes into the identity.
TEXT_PARTS = frozenset({"text", "input_text", "output_text", "refusal"})
# A URL with an authority or path of its own ("scheme://"): not a data: URL, whose
# bytes are in the request.
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")

# Why a handle may not serve a turn (reported in logs; the outcome is kv-mismatch).
MISMATCH_MODEL = "model"
MISMATCH_SALT = "cache-salt"
MISMATCH_MEDIA = "media"
MISMATCH_MEDIA_OPTIONS = "media-options"
MISMATCH_TRUNCATION = "truncation"


def _digest(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


@dataclass(frozen=True)
class KVIdentity:
    model: str | None = None
    cache_salt: str | None = None
    media: tuple[str, ...] = ()  # digests of the prompt's media parts, in order
    media_options: str | None = None  # digest of mm_processor_kwargs
    truncates: bool = False
    remote_media: bool = False  # a media part names its bytes by URL (not data:)


def _is_text(part: Any) -> bool:
    kind = part.get("type") if isinstance(part, Mapping) else None
    return isinstance(kind, str) and kind in TEXT_PARTS


def media_parts(body: Mapping[str, Any]) -> list[Any]:
    """The media content parts of a chat request's messages, in prompt order (any
    JSON is taken: the engine rejects what it cannot read, the sidecar must not)."""
    parts: list[Any] = []
    messages = body.get("messages")
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, list):
            parts += [p for p in content if not _is_text(p)]
    return parts


def names_remote_media(part: Any) -> bool:
    """Some string in the media part is a URL whose bytes the request does not carry."""
    stack = [part]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            if _URL.match(value.strip()):
                return True
        elif isinstance(value, Mapping):
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return False


def kv_identity(body: Mapping[str, Any]) -> KVIdentity:
    model = body.get("model")
    salt = body.get("cache_salt")
    options = body.get("mm_processor_kwargs")
    parts = media_parts(body)
    return KVIdentity(
        model=None if model is None else str(model),
        cache_salt=None if salt is None else str(salt),
        media=tuple(_digest(p) for p in parts),
        media_options=None if options is None else _digest(options),
        truncates=body.get("truncate_prompt_tokens") is not None,
        remote_media=any(names_remote_media(p) for p in parts),
    )


def compatible(handle: KVIdentity, turn: KVIdentity) -> str | None:
    """None when a handle of identity ``handle`` may serve a turn of identity
    ``turn``; else what differs (one of the ``MISMATCH_*`` names)."""
    if handle.truncates or turn.truncates:
        return MISMATCH_TRUNCATION
    if handle.model != turn.model:
        return MISMATCH_MODEL
    if handle.cache_salt != turn.cache_salt:
        return MISMATCH_SALT
    if handle.media_options != turn.media_options:
        return MISMATCH_MEDIA_OPTIONS
    if turn.media[: len(handle.media)] != handle.media:
        return MISMATCH_MEDIA
    return None


def plain_text(identity: KVIdentity, base_model: str | None) -> bool:
    """The turn's prompt hashes in vLLM's prefix cache exactly as its token ids do
    (no salt, no media, no LoRA adapter): only then can the sidecar recompute D's
    block hashes to see what D holds."""
    return (
        identity.cache_salt is None
        and not identity.media
        and identity.media_options is None
        and not identity.truncates
        and (base_model is None or identity.model in (None, base_model))
    )
