"""Who a handle belongs to: the client the gateway authenticated, and its caps.

A ``session_id`` is the client's to choose, so it cannot protect a handle: anyone who
sends another user's id would take (and spoil) that user's handle. With the setting
``owner_header`` the sidecar reads the owner from a request header the gateway sets
after authenticating the client (overwriting whatever the client sent), and files each
handle under (owner, key) (``session.handle_slot``): another owner computes another
slot and finds nothing.

Rules:
- owners off (no ``owner_header``, the default): every client is one owner, no
  per-owner caps, as before.
- a turn whose header is missing, sent twice, empty, longer than
  ``MAX_OWNER_CHARS`` or not printable ASCII has no owner: it neither uses nor keeps
  a handle (outcome ``no-owner``), rather than a 400, so a gateway route that forgot
  the header degrades to recompute instead of failing its clients; it can reach no
  one's handle either way.
- the raw value is never logged and never sent to an engine: past ``read_owner``
  the owner is its ``owner_tag``, a digest keyed with a per-process random key (so a
  log line does not let a reader confirm a guessed identity by hashing it; tags of
  one owner agree within one sidecar process, which is as long as its handles live).
  Only the header itself travels on, unchanged, when a turn is relayed to the
  session's decode pod (``forward.py``), which reads it the same way.
- caps: an owner keeps at most ``max_handles`` handles pinning at most
  ``max_pinned_tokens`` tokens; by default an eighth of the store's cap and an eighth
  of D's KV (``caps``), so at least eight owners fit before one crowds out another.
  Past a cap the owner loses its own lowest-value handle (``handles.first_to_evict``).
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

OwnerTag = str  # "own-" + a keyed digest of the authenticated identity: safe to log

# Longer identities are no gateway's (a JWT subject, an email, a tenant id are short).
MAX_OWNER_CHARS: Final = 256
# An owner's share of the store and of D's KV, by default: 1/8.
DEFAULT_SHARE: Final = 8
# The slot owner of a turn with no valid owner: never a tag (tags start "own-"), and
# such a turn keeps no handle, so nothing is ever filed under it.
NO_OWNER: Final = "-"

# Why a handle was evicted (metric label; report.Evictions has one field each).
EVICT_STORE_CAP: Final = "store-cap"  # handleStoreCap, the whole store's
EVICT_OWNER_HANDLES: Final = "owner-handles"  # ownerMaxHandles
EVICT_OWNER_TOKENS: Final = "owner-tokens"  # ownerMaxPinnedTokens
EVICTION_REASONS: Final = (EVICT_STORE_CAP, EVICT_OWNER_HANDLES, EVICT_OWNER_TOKENS)


@dataclass(frozen=True)
class Rule:
    """How a turn's owner is read: the header, and the key its tag is digested with."""

    header: str
    key: bytes

    @classmethod
    def new(cls, header: str) -> Rule:
        return cls(header, secrets.token_bytes(16))


def owner_tag(identity: str, key: bytes) -> OwnerTag:
    return "own-" + hashlib.blake2b(identity.encode(), key=key, digest_size=8).hexdigest()


def _valid(value: str) -> bool:
    return 0 < len(value) <= MAX_OWNER_CHARS and all(" " <= c <= "~" for c in value)


def read_owner(headers: Mapping[str, str], rule: Rule) -> OwnerTag | None:
    """The turn's owner, or None when the header is missing, sent more than once or
    no valid identity. Twice is refused because a gateway that appends its value
    instead of overwriting leaves the client's first, and ``get`` would read that."""
    getall = getattr(headers, "getall", None)  # a multidict (aiohttp's request headers)
    values = getall(rule.header, []) if getall is not None else [headers.get(rule.header)]
    raw = values[0] if len(values) == 1 else None
    value = raw.strip() if isinstance(raw, str) else ""
    return owner_tag(value, rule.key) if _valid(value) else None


@dataclass(frozen=True)
class Caps:
    """What one owner may keep; None = no cap of that kind."""

    max_handles: int
    max_pinned_tokens: int | None


def caps(
    store_cap: int,
    max_handles: int | None,
    max_pinned_tokens: int | None,
    kv_capacity_tokens: int | None,
    max_model_len: int | None = None,
) -> Caps:
    """The settings' caps, unset ones derived: an eighth of the store's cap, and an
    eighth of D's KV when the engine reports it (else no token cap: only handles), but
    never less than one conversation at the model's full length: with a small KV an
    eighth of it is shorter than an agent loop, and every long turn would keep nothing."""
    handles = max_handles if max_handles is not None else max(1, store_cap // DEFAULT_SHARE)
    tokens = max_pinned_tokens
    if tokens is None and kv_capacity_tokens:
        tokens = max(1, kv_capacity_tokens // DEFAULT_SHARE, max_model_len or 0)
    return Caps(handles, tokens)
