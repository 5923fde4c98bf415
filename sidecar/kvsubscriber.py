"""Follow the local engine's KV events over ZMQ and keep the block index gap-free.

Live batches arrive on a SUB socket; a sequence gap is repaired through the
engine's replay ROUTER socket (see ``kvevents`` for both wire formats). The first
live batch is preceded by a replay of what the engine still buffers (vLLM keeps
``buffer_steps``, 10,000 batches): a sidecar that (re)starts next to a running engine
learns what it holds, and the batches PUB drops until the subscription has
propagated (ZMQ's slow joiner) are not lost. pyzmq is
imported inside the socket methods, so this module loads without it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from .blockindex import BlockIndex, Verdict
from .kvevents import (
    END_SEQ,
    Batch,
    EventDecodeError,
    decode_batch,
    seq_from_bytes,
    seq_to_bytes,
)

log = logging.getLogger(__name__)

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
        if self.index.next_seq is None and seq > 0:
            await self.catch_up(seq)
            if self.index.check(seq) == Verdict.DUPLICATE:
                return  # the replay already carried it
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

    async def catch_up(self, until: int) -> None:
        """Before the first live batch (``until``): apply what the engine's replay
        buffer holds from its oldest batch on, so the index starts from there."""
        if self.replay_endpoint is None:
            return
        self.index.replaying(0)
        if await self.repair(0, until):
            log.info("kv events caught up from the replay buffer batches=%s", self.index.batches)
        elif self.index.next_seq is not None:
            # Replayed, but not up to the live batch: what is between is unknown.
            log.warning("kv event catch-up incomplete from=%s to=%s", self.index.next_seq, until)
            self.index.skip_to(until)

    async def repair(self, start: int, until: int) -> bool:
        """Replay from ``start``; True when every batch below ``until`` arrived. With
        no baseline yet (``catch_up``), the first batch replayed becomes it."""
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
                if expected is not None and seq < expected:
                    continue  # already applied
                if expected is not None and seq > expected:
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
