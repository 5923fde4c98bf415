"""vLLM KV events: both layouts decode, the index follows them, gaps are repaired.

Payloads are built with msgspec Structs declared exactly as vLLM declares them
(0.32: ``EventBatch`` array_like, events tagged maps; before #42892: events tagged
arrays too), so the bytes are what the engine puts on the wire. The publisher is a
real PUB + ROUTER pair on loopback that answers replays as vLLM 0.32's
``ZmqEventPublisher._service_replay`` does.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from kvferry_sidecar.blockindex import BlockIndex, Verdict
from kvferry_sidecar.kvevents import (
    Batch,
    Cleared,
    EventDecodeError,
    Removed,
    Stored,
    decode_batch,
    seq_to_bytes,
)
from kvferry_sidecar.kvsubscriber import Subscriber

# ------------------------------------------------------------------ vLLM's types


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """0.32: tagged maps."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class OldEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Before vLLM #42892: tagged arrays."""


class OldBlockStored(OldEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class OldBlockRemoved(OldEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class OldAllBlocksCleared(OldEvent, tag="AllBlocksCleared"):
    pass


ENC = msgspec.msgpack.Encoder()
BIG_HASH = 2**64 - 5  # int block hashes are the low 64 bits of the digest


def stored(hashes: list[int], session: str | None = "sess-a", block_size: int = 16) -> Any:
    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=None,
        token_ids=list(range(block_size * len(hashes))),
        block_size=block_size,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        group_idx=0,
        kv_cache_spec_kind="full_attention",
        session_id=session,
    )


def payload(*events: Any, rank: int | None = 0) -> bytes:
    return ENC.encode(EventBatch(ts=1.0, events=list(events), data_parallel_rank=rank))


# ------------------------------------------------------------------ decoding


def test_decodes_the_map_layout_of_vllm_032() -> None:
    raw = payload(stored([1, BIG_HASH]), BlockRemoved([1], "GPU"), AllBlocksCleared())
    assert msgspec.msgpack.decode(raw)[1][0]["type"] == "BlockStored"  # the shape under test
    batch = decode_batch(raw)
    assert batch.ts == 1.0
    assert batch.dp_rank == 0
    assert batch.events == (
        Stored((1, BIG_HASH), 32, 16, "GPU", 0, "sess-a"),
        Removed((1,), "GPU", 0),
        Cleared(),
    )


def test_decodes_the_array_layout_of_older_vllm() -> None:
    events = [
        OldBlockStored([7, 8], 6, list(range(32)), 16, None, "GPU"),
        OldBlockRemoved([7], "GPU"),
        OldAllBlocksCleared(),
    ]
    raw = ENC.encode(EventBatch(ts=2.0, events=events))
    assert msgspec.msgpack.decode(raw)[1][0][0] == "BlockStored"  # the shape under test
    batch = decode_batch(raw)
    assert batch.events == (
        Stored((7, 8), 32, 16, "GPU", 0, None, parent_block_hash=6),
        Removed((7,), "GPU"),
        Cleared(),
    )


def test_batch_without_dp_rank_decodes() -> None:
    """Older publishers sent [ts, events] only."""
    raw = msgspec.msgpack.encode([3.0, [{"type": "AllBlocksCleared"}]])
    assert decode_batch(raw) == Batch(3.0, (Cleared(),), None)


def test_map_encoded_batch_decodes() -> None:
    raw = msgspec.msgpack.encode({"ts": 4.0, "events": [], "data_parallel_rank": 1})
    assert decode_batch(raw) == Batch(4.0, (), 1)


def test_bytes_block_hashes_decode() -> None:
    """VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 publishes the digest bytes."""
    batch = decode_batch(payload(BlockRemoved([b"\x01" * 32], "GPU")))
    assert batch.events == (Removed((b"\x01" * 32,), "GPU", 0),)


def test_unknown_event_types_are_skipped_not_fatal() -> None:
    raw = msgspec.msgpack.encode(
        [1.0, [{"type": "BlockPinned", "x": 1}, {"type": "AllBlocksCleared"}]]
    )
    assert decode_batch(raw).events == (Cleared(),)


@pytest.mark.parametrize("raw", [b"\xc1", msgspec.msgpack.encode("x"), msgspec.msgpack.encode([1])])
def test_garbage_is_a_decode_error(raw: bytes) -> None:
    with pytest.raises(EventDecodeError):
        decode_batch(raw)


# ------------------------------------------------------------------ the index


def apply(index: BlockIndex, seq: int, *events: Any) -> None:
    assert index.check(seq) == Verdict.NEXT
    index.accept(seq, decode_batch(payload(*events)))


def test_index_counts_blocks_and_sessions_held() -> None:
    index = BlockIndex()
    apply(index, 0, stored([1, 2, 3], "a"), stored([4], "b"), stored([5], None))
    apply(index, 1, BlockRemoved([4, 99], "GPU"))  # 99: never seen, ignored
    stats = index.stats()
    assert (stats.blocks_held, stats.sessions_held, stats.batches) == (4, 1, 2)
    assert index.held_by("a") == 3


def test_a_block_stored_again_is_attributed_to_the_last_session() -> None:
    index = BlockIndex()
    apply(index, 0, stored([1], "a"))
    apply(index, 1, stored([1], "b"))
    assert (index.held_by("a"), index.held_by("b"), len(index.blocks)) == (0, 1, 1)


def test_all_blocks_cleared_drops_the_state() -> None:
    index = BlockIndex()
    apply(index, 0, stored([1, 2], "a"))
    apply(index, 1, AllBlocksCleared())
    stats = index.stats()
    assert (stats.blocks_held, stats.sessions_held, stats.cleared) == (0, 0, 1)


def test_index_is_bounded() -> None:
    index = BlockIndex(cap=2)
    apply(index, 0, stored([1, 2, 3], "a"))
    assert list(index.blocks) == [("GPU", 0, 2), ("GPU", 0, 3)]
    assert index.held_by("a") == 2


def test_sequence_verdicts() -> None:
    """First batch: baseline; +1: next; a jump: gap; back: restart."""
    index = BlockIndex()
    assert index.check(41) == Verdict.NEXT
    index.accept(41, Batch(0.0, ()))
    assert index.check(42) == Verdict.NEXT
    assert index.check(45) == Verdict.GAP
    assert index.check(0) == Verdict.RESTART


# ------------------------------------------------------------------ sockets


class Publisher:
    """vLLM 0.32's ZmqEventPublisher, reduced: PUB + replay ROUTER on loopback."""

    def __init__(self, ctx: zmq.asyncio.Context, *, old_replay: bool = False) -> None:
        self.pub = ctx.socket(zmq.PUB)
        self.router = ctx.socket(zmq.ROUTER)
        pub_port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{pub_port}"
        self.replay_endpoint = f"tcp://127.0.0.1:{replay_port}"
        self.buffer: list[tuple[int, bytes]] = []
        self.topic = b"kv"
        self.old_replay = old_replay
        self.replays: list[int] = []

    def record(self, seq: int, raw: bytes) -> bytes:
        self.buffer.append((seq, raw))
        return raw

    async def publish(self, seq: int, raw: bytes) -> None:
        self.record(seq, raw)
        await self.pub.send_multipart((self.topic, seq_to_bytes(seq), raw))

    async def serve_replay(self) -> None:
        while True:
            client_id, _, start_raw = await self.router.recv_multipart()
            start = int.from_bytes(start_raw, "big")
            self.replays.append(start)
            for seq, buf in self.buffer:
                if seq >= start:
                    if self.old_replay:
                        frames = (client_id, b"", seq_to_bytes(seq), buf)
                    else:
                        frames = (client_id, b"", self.topic, seq_to_bytes(seq), buf)
                    await self.router.send_multipart(frames)
            end = (-1).to_bytes(8, "big", signed=True)
            tail = (end, b"") if self.old_replay else (b"", end, b"")
            await self.router.send_multipart((client_id, b"", *tail))

    def close(self) -> None:
        self.pub.close(linger=0)
        self.router.close(linger=0)


@contextlib.asynccontextmanager
async def publisher(**kwargs: Any) -> AsyncIterator[Publisher]:
    ctx = zmq.asyncio.Context()
    pub = Publisher(ctx, **kwargs)
    task = asyncio.create_task(pub.serve_replay())
    try:
        yield pub
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        pub.close()
        ctx.term()


@pytest.mark.parametrize("old_replay", [False, True], ids=["vllm-0.32", "older-replay"])
async def test_gap_is_repaired_through_the_replay_socket(old_replay: bool) -> None:
    """Missed batches are fetched from the ROUTER and applied in order; the live
    copies that arrive afterwards are recognised as duplicates."""
    async with publisher(old_replay=old_replay) as pub:
        batches = [payload(stored([i], f"s{i}")) for i in range(5)]
        for seq, raw in enumerate(batches):
            pub.record(seq, raw)
        index = BlockIndex()
        sub = Subscriber(index, pub.endpoint, pub.replay_endpoint, replay_timeout_s=2.0)
        await sub.handle(seq_to_bytes(0), batches[0])
        await sub.handle(seq_to_bytes(3), batches[3])  # 1 and 2 never arrived
        await sub.handle(seq_to_bytes(4), batches[4])  # the replay already carried it
        assert pub.replays == [1]
        stats = index.stats()
        assert (stats.missed, stats.repaired, stats.batches) == (1, 1, 5)
        assert (stats.blocks_held, stats.sessions_held) == (5, 5)
        assert index.next_seq == 5


async def test_unrepaired_gap_drops_the_state() -> None:
    """The engine's buffer no longer holds the missing batches: what was missed is
    unknown, so the index starts over from the live batch."""
    async with publisher() as pub:
        pub.record(9, payload(stored([9], "late")))  # the buffer starts at 9
        index = BlockIndex()
        sub = Subscriber(index, pub.endpoint, pub.replay_endpoint, replay_timeout_s=2.0)
        await sub.handle(seq_to_bytes(0), payload(stored([1], "early")))
        await sub.handle(seq_to_bytes(9), payload(stored([9], "late")))
        stats = index.stats()
        assert (stats.missed, stats.repaired) == (1, 0)
        assert (stats.blocks_held, index.held_by("early"), index.held_by("late")) == (1, 0, 1)


async def test_gap_without_replay_endpoint_is_counted_not_repaired() -> None:
    index = BlockIndex()
    sub = Subscriber(index, "tcp://127.0.0.1:1", None)
    await sub.handle(seq_to_bytes(0), payload())
    await sub.handle(seq_to_bytes(5), payload(stored([5])))
    assert (index.missed, index.repaired, index.next_seq, len(index.blocks)) == (1, 0, 6, 1)


async def test_after_a_repair_a_lower_sequence_is_a_restart_again() -> None:
    """Duplicates are only expected until the live stream has caught up."""
    async with publisher() as pub:
        for seq in range(3):
            pub.record(seq, payload(stored([seq])))
        index = BlockIndex()
        sub = Subscriber(index, pub.endpoint, pub.replay_endpoint, replay_timeout_s=2.0)
        await sub.handle(seq_to_bytes(0), payload(stored([0])))
        await sub.handle(seq_to_bytes(2), payload(stored([2])))  # repaired: 1 replayed
        await sub.handle(seq_to_bytes(3), payload(stored([3])))  # live again
        await sub.handle(seq_to_bytes(0), payload(stored([9])))  # a new publisher
        assert (index.repaired, index.cleared, len(index.blocks)) == (1, 1, 1)


async def test_first_live_batch_is_preceded_by_the_replay_buffer() -> None:
    """A sidecar that starts next to a running engine (or whose subscription
    propagated late) learns what the engine's replay buffer still holds."""
    async with publisher() as pub:
        for seq in range(3, 7):  # the buffer's oldest is 3
            pub.record(seq, payload(stored([seq], "before")))
        index = BlockIndex()
        sub = Subscriber(index, pub.endpoint, pub.replay_endpoint, replay_timeout_s=2.0)
        await sub.handle(seq_to_bytes(6), pub.buffer[-1][1])  # the first live batch
        await sub.handle(seq_to_bytes(7), payload(stored([7], "after")))
        assert pub.replays == [0]
        assert (index.batches, index.missed, index.next_seq) == (5, 0, 8)
        assert (index.held_by("before"), index.held_by("after")) == (4, 1)


async def test_first_live_batch_without_replay_is_the_baseline() -> None:
    """The replay buffer answers nothing below the live batch: it is the baseline."""
    async with publisher() as pub:
        index = BlockIndex()
        sub = Subscriber(index, pub.endpoint, pub.replay_endpoint, replay_timeout_s=2.0)
        await sub.handle(seq_to_bytes(4), payload(stored([4])))
        await sub.handle(seq_to_bytes(5), payload(stored([5])))
        assert pub.replays == [0]
        assert (index.batches, index.missed, len(index.blocks)) == (2, 0, 2)


async def test_sequence_going_back_means_the_engine_restarted() -> None:
    index = BlockIndex()
    sub = Subscriber(index, "tcp://127.0.0.1:1", None)
    await sub.handle(seq_to_bytes(0), payload(stored([1, 2])))
    await sub.handle(seq_to_bytes(1), payload(stored([3])))
    await sub.handle(seq_to_bytes(0), payload(stored([7])))  # a new publisher
    stats = index.stats()
    assert (stats.cleared, stats.blocks_held, stats.missed) == (1, 1, 0)


async def test_subscriber_follows_the_live_stream() -> None:
    """A real SUB socket: batches published on PUB reach the index."""
    async with publisher() as pub:
        index = BlockIndex()
        sub = Subscriber(index, pub.endpoint, pub.replay_endpoint)
        task = asyncio.create_task(sub.run())
        try:
            seq = 0
            # PUB drops messages until the subscription has propagated: keep
            # publishing (in sequence) until three batches were applied. Bounded.
            async with asyncio.timeout(5.0):
                while index.batches < 3:
                    await pub.publish(seq, payload(stored([seq])))
                    seq += 1
                    await asyncio.sleep(0.02)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        assert index.missed == 0
        assert index.stats().blocks_held == index.batches
