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

``BlockIndex`` is pure; ``Subscriber`` does the socket work (pyzmq asyncio).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from .report import KVEvents

log = logging.getLogger(__name__)

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


# ------------------------------------------------------------------ the index

BlockKey = tuple[str | None, int, Hashable]  # (medium, group_idx, block hash)


@dataclass
class BlockInfo:
    session: str | None
    tokens: int


class Verdict:
    """What ``BlockIndex.check`` says about a batch's sequence number."""

    NEXT = "next"  # in order (or the first batch seen): apply it
    GAP = "gap"  # batches are missing before it: repair, then apply
    DUPLICATE = "duplicate"  # already applied (a replay overlapped the live stream)
    RESTART = "restart"  # the counter went back: the engine's publisher restarted


@dataclass
class BlockIndex:
    """Which blocks the local engine holds and for which sessions, from its events.

    Sequence rules: the first batch sets the baseline (history before it is not
    known); a jump forward is a gap (``missed``; ``repaired`` when the replay socket
    filled it); a batch below the next expected one is a duplicate when it lies in
    the range the last replay covered, else the engine restarted (state dropped).
    ``AllBlocksCleared`` drops the state too. Bounded: beyond ``cap`` blocks the
    oldest entries are forgotten.
    """

    cap: int = 2_000_000
    blocks: dict[BlockKey, BlockInfo] = field(default_factory=dict)
    session_blocks: dict[str, int] = field(default_factory=dict)
    next_seq: int | None = None
    batches: int = 0
    missed: int = 0
    repaired: int = 0
    cleared: int = 0
    _replayed_from: int | None = None

    # -------------------------------------------------------------- sequence

    def check(self, seq: int) -> str:
        if self.next_seq is None or seq == self.next_seq:
            return Verdict.NEXT
        if seq > self.next_seq:
            return Verdict.GAP
        if self._replayed_from is not None and seq >= self._replayed_from:
            return Verdict.DUPLICATE
        return Verdict.RESTART

    def note_gap(self, start: int) -> None:
        """A gap from ``start`` was seen; a replay from there may follow."""
        self.missed += 1
        self._replayed_from = start

    def note_repaired(self) -> None:
        self.repaired += 1

    def caught_up(self) -> None:
        """A live batch followed the replay: no more duplicates can come (SUB is
        in order), so a lower sequence number from now on means a restart."""
        self._replayed_from = None

    def accept(self, seq: int, batch: Batch) -> None:
        """Apply ``batch`` as sequence number ``seq`` (the caller has checked it)."""
        for event in batch.events:
            self.apply(event)
        self.batches += 1
        self.next_seq = seq + 1

    def skip_to(self, seq: int) -> None:
        """Continue after an unrepaired gap: what was missed is unknown, so the
        state is dropped rather than left with blocks that may be long gone."""
        self._drop()
        self.next_seq = seq

    # -------------------------------------------------------------- events

    def apply(self, event: Event) -> None:
        if isinstance(event, Stored):
            per_block = event.block_size or (
                event.num_tokens // max(1, len(event.block_hashes)) if event.block_hashes else 0
            )
            for h in event.block_hashes:
                self._put((event.medium, event.group_idx, h), event.session_id, per_block)
        elif isinstance(event, Removed):
            for h in event.block_hashes:
                self._pop((event.medium, event.group_idx, h))
        elif isinstance(event, Cleared):
            self.reset()

    def reset(self) -> None:
        """AllBlocksCleared or an engine restart: nothing is held any more."""
        self._drop()
        self.cleared += 1

    def restart(self) -> None:
        """The engine restarted: its sequence starts again at 0."""
        self.reset()
        self.next_seq = None
        self._replayed_from = None

    def _drop(self) -> None:
        self.blocks.clear()
        self.session_blocks.clear()

    def _put(self, key: BlockKey, session: str | None, tokens: int) -> None:
        old = self.blocks.pop(key, None)
        if old is not None:
            self._unref(old.session)
        self.blocks[key] = BlockInfo(session, tokens)
        if session is not None:
            self.session_blocks[session] = self.session_blocks.get(session, 0) + 1
        while len(self.blocks) > self.cap:
            oldest = next(iter(self.blocks))
            self._pop(oldest)

    def _pop(self, key: BlockKey) -> None:
        info = self.blocks.pop(key, None)
        if info is not None:
            self._unref(info.session)

    def _unref(self, session: str | None) -> None:
        if session is None:
            return
        left = self.session_blocks.get(session, 0) - 1
        if left > 0:
            self.session_blocks[session] = left
        else:
            self.session_blocks.pop(session, None)

    # -------------------------------------------------------------- figures

    def held_by(self, session: str) -> int:
        return self.session_blocks.get(session, 0)

    def stats(self) -> KVEvents:
        return KVEvents(
            blocks_held=len(self.blocks),
            sessions_held=len(self.session_blocks),
            batches=self.batches,
            missed=self.missed,
            repaired=self.repaired,
            cleared=self.cleared,
        )


# ------------------------------------------------------------------ the subscriber

REPLAY_TIMEOUT_S = 2.0  # per reply frame; the replay is a memory copy on the engine
DECODE_LOG_EVERY_S = 60.0


class Subscriber:
    """SUB to the local engine's KV events; repairs gaps through the replay socket.

    ``run`` loops until cancelled; a missing engine is not an error (ZMQ connects
    lazily and reconnects by itself).
    """

    def __init__(
        self,
        index: BlockIndex,
        endpoint: str,
        replay_endpoint: str | None,
        *,
        replay_timeout_s: float = REPLAY_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.index = index
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint or None
        self.replay_timeout_s = replay_timeout_s
        self._clock = clock
        self._last_decode_log = -DECODE_LOG_EVERY_S
        self.decode_errors = 0

    async def run(self) -> None:
        import zmq
        import zmq.asyncio

        ctx = zmq.asyncio.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.connect(self.endpoint)
        log.info("kv events subscribed endpoint=%s replay=%s", self.endpoint, self.replay_endpoint)
        try:
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3:
                    self._decode_failed(f"{len(frames)} frames, expected 3")
                    continue
                await self.handle(frames[1], frames[2])
        finally:
            sub.close(linger=0)
            ctx.term()

    async def handle(self, seq_raw: bytes, payload: bytes) -> None:
        """One live message: check its sequence, repair a gap, apply."""
        try:
            seq = seq_from_bytes(seq_raw)
        except EventDecodeError as exc:
            self._decode_failed(str(exc))
            return
        verdict = self.index.check(seq)
        if verdict == Verdict.DUPLICATE:
            return
        if verdict == Verdict.RESTART:
            log.warning("kv event sequence went back; engine restarted seq=%s", seq)
            self.index.restart()
        elif verdict == Verdict.GAP:
            start = self.index.next_seq
            assert start is not None
            self.index.note_gap(start)
            repaired = await self.repair(start, seq)
            if repaired:
                self.index.note_repaired()
            else:
                log.warning("kv event gap not repaired from=%s to=%s", start, seq)
                self.index.skip_to(seq)
            if self.index.check(seq) == Verdict.DUPLICATE:
                return  # the replay already carried it
        self._apply(seq, payload)
        self.index.caught_up()

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except EventDecodeError as exc:
            self._decode_failed(str(exc))
            batch = Batch(0.0, ())
        self.index.accept(seq, batch)

    async def repair(self, start: int, until: int) -> bool:
        """Replay from ``start``; True when every batch below ``until`` arrived."""
        if self.replay_endpoint is None:
            return False
        import zmq
        import zmq.asyncio

        ctx = zmq.asyncio.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        try:
            await dealer.send_multipart((b"", seq_to_bytes(start)))
            async for seq, payload in self._replies(dealer):
                expected = self.index.next_seq
                if expected is None or seq < expected:
                    continue  # already applied
                if seq > expected:
                    break  # the engine's buffer no longer holds what we need
                self._apply(seq, payload)
        except (zmq.ZMQError, EventDecodeError) as exc:
            log.warning("kv event replay failed endpoint=%s err=%s", self.replay_endpoint, exc)
        finally:
            dealer.close(linger=0)
            ctx.term()
        return self.index.next_seq is not None and self.index.next_seq >= until

    async def _replies(self, dealer: Any) -> AsyncIterator[tuple[int, bytes]]:
        while True:
            try:
                frames = await asyncio.wait_for(dealer.recv_multipart(), self.replay_timeout_s)
            except TimeoutError:
                log.warning("kv event replay timed out endpoint=%s", self.replay_endpoint)
                return
            if frames and frames[0] == b"":
                frames = frames[1:]
            if len(frames) == 3:  # 0.32: topic, seq, payload
                seq_raw, payload = frames[1], frames[2]
            elif len(frames) == 2:  # older builds: seq, payload
                seq_raw, payload = frames
            else:
                raise EventDecodeError(f"replay reply of {len(frames)} frames")
            seq = seq_from_bytes(seq_raw)
            if seq == END_SEQ:
                return
            yield seq, payload

    def _decode_failed(self, why: str) -> None:
        self.decode_errors += 1
        now = self._clock()
        if now - self._last_decode_log >= DECODE_LOG_EVERY_S:
            self._last_decode_log = now
            log.warning("kv event batch undecodable errors=%s err=%s", self.decode_errors, why)
