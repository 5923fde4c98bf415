"""vLLM's KV-event stream: decode it, index what the engine holds, keep it gap-free.

Wire format (read from vLLM 0.32's ``vllm/distributed/kv_events.py``):

- PUB socket (``--kv-events-config endpoint``, ``tcp://*:5557``): multipart
  ``(topic, seq, payload)``; ``seq`` is an unsigned 8-byte big-endian counter that
  starts at 0 when the engine starts; ``payload`` is msgpack.
- ``payload``: ``EventBatch`` is a msgspec Struct with ``array_like=True``, so
  ``[ts, [events...], data_parallel_rank]`` (the rank may be absent or nil). We also
  accept a map ``{ts, events, data_parallel_rank}``.
- Each event is a ``KVCacheEvent`` with ``tag=True``. In 0.32 it is *not*
  array_like, so a map tagged under ``"type"``:
  ``{"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids",
  "block_size", "lora_id", "medium", "lora_name", ...optional: "extra_keys",
  "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "locality",
  "ownership", "session_id"}``, ``{"type": "BlockRemoved", "block_hashes", "medium",
  "group_idx"?...}``, ``{"type": "AllBlocksCleared"}``. Optional fields are left out
  when unset (``omit_defaults``). Before vLLM PR #42892 events were positional
  arrays: ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium?, ...]``, ``["BlockRemoved", block_hashes, medium?]``,
  ``["AllBlocksCleared"]``. Both are decoded. Block hashes are ints (the low 64 bits
  of the digest, ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``, the default) or bytes.
- Replay ROUTER (``replay_endpoint``, ``tcp://*:5558``): a DEALER sends
  ``(b"", start_seq as 8-byte big-endian)``; the publisher answers every buffered
  batch with ``seq >= start_seq`` as ``(b"", topic, seq, payload)`` (0.32; older
  builds sent ``(b"", seq, payload)``), then the end marker
  ``(b"", b"", seq=-1 signed, b"")`` (older: ``(b"", -1, b"")``). The buffer holds
  the last 10,000 batches by default.

This module decodes (pure); ``blockindex.BlockIndex`` keeps what the engine holds
(pure); ``kvsubscriber.Subscriber`` does the socket work (pyzmq asyncio).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import msgspec

STORED = "BlockStored"
REMOVED = "BlockRemoved"
CLEARED = "AllBlocksCleared"
END_SEQ = -1

# Positions in the pre-#42892 array layout (index 0 is the tag).
_A_HASHES, _A_PARENT, _A_TOKENS, _A_BLOCK_SIZE, _A_LORA_ID, _A_MEDIUM = 1, 2, 3, 4, 5, 6
_A_REMOVED_MEDIUM = 2


class EventDecodeError(ValueError):
    """A payload that is not a vLLM KV-event batch."""


@dataclass(frozen=True)
class Stored:
    block_hashes: tuple[Hashable, ...]
    num_tokens: int  # len(token_ids): tokens covered by these blocks
    block_size: int
    medium: str | None = None
    group_idx: int = 0
    session_id: str | None = None
    parent_block_hash: Hashable | None = None


@dataclass(frozen=True)
class Removed:
    block_hashes: tuple[Hashable, ...]
    medium: str | None = None
    group_idx: int = 0


@dataclass(frozen=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


@dataclass(frozen=True)
class Batch:
    ts: float
    events: tuple[Event, ...]
    dp_rank: int | None = None


def _hashes(value: Any) -> tuple[Hashable, ...]:
    if not isinstance(value, list) or not all(isinstance(h, (int, bytes)) for h in value):
        raise EventDecodeError("block_hashes must be a list of ints or bytes")
    return tuple(value)


def _opt_str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _opt_int(value: Any, default: int = 0) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _stored(
    hashes: Any, parent: Any, tokens: Any, block_size: Any, medium: Any, group: Any, session: Any
) -> Stored:
    if not isinstance(tokens, list):
        raise EventDecodeError("BlockStored.token_ids must be a list")
    return Stored(
        block_hashes=_hashes(hashes),
        num_tokens=len(tokens),
        block_size=_opt_int(block_size),
        medium=_opt_str(medium),
        group_idx=_opt_int(group),
        session_id=_opt_str(session),
        parent_block_hash=parent if isinstance(parent, (int, bytes)) else None,
    )


def _event_from_map(raw: dict[str, Any]) -> Event | None:
    kind = raw.get("type")
    if kind == STORED:
        return _stored(
            raw.get("block_hashes"),
            raw.get("parent_block_hash"),
            raw.get("token_ids"),
            raw.get("block_size"),
            raw.get("medium"),
            raw.get("group_idx"),
            raw.get("session_id"),
        )
    if kind == REMOVED:
        return Removed(
            _hashes(raw.get("block_hashes")),
            _opt_str(raw.get("medium")),
            _opt_int(raw.get("group_idx")),
        )
    if kind == CLEARED:
        return Cleared()
    return None  # a newer event type: skip it, keep the rest of the batch


def _event_from_array(raw: list[Any]) -> Event | None:
    kind = raw[0] if raw else None

    def at(i: int) -> Any:
        return raw[i] if len(raw) > i else None

    if kind == STORED:
        if len(raw) <= _A_BLOCK_SIZE:
            raise EventDecodeError("BlockStored array too short")
        # Positions after medium moved between versions (lora_name, extra_keys,
        # group_idx, ...): read none of them, and no session_id.
        return _stored(
            at(_A_HASHES), at(_A_PARENT), at(_A_TOKENS), at(_A_BLOCK_SIZE), at(_A_MEDIUM), 0, None
        )
    if kind == REMOVED:
        if len(raw) <= _A_HASHES:
            raise EventDecodeError("BlockRemoved array too short")
        return Removed(_hashes(at(_A_HASHES)), _opt_str(at(_A_REMOVED_MEDIUM)))
    if kind == CLEARED:
        return Cleared()
    return None


def decode_event(raw: Any) -> Event | None:
    """One event in either layout; None for an unknown event type."""
    if isinstance(raw, dict):
        return _event_from_map(raw)
    if isinstance(raw, list):
        return _event_from_array(raw)
    raise EventDecodeError(f"event is a {type(raw).__name__}, not a map or array")


def decode_batch(payload: bytes) -> Batch:
    """A msgpack ``EventBatch`` payload; raises :class:`EventDecodeError`."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise EventDecodeError(f"not msgpack: {exc}") from exc
    if isinstance(raw, list) and len(raw) >= 2:
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    elif isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    else:
        raise EventDecodeError("batch is neither [ts, events, dp_rank] nor a map")
    if not isinstance(ts, (int, float)) or not isinstance(events, list):
        raise EventDecodeError("batch needs a numeric ts and a list of events")
    decoded = tuple(e for e in (decode_event(r) for r in events) if e is not None)
    return Batch(float(ts), decoded, rank if isinstance(rank, int) else None)


def seq_from_bytes(raw: bytes) -> int:
    """The 8-byte big-endian sequence number (signed: the replay end marker is -1)."""
    if len(raw) != 8:
        raise EventDecodeError(f"sequence frame of {len(raw)} bytes, expected 8")
    return int.from_bytes(raw, "big", signed=True)


def seq_to_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")
