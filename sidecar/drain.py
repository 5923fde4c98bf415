"""Stopping without cutting turns: the turns in flight, and the drain that waits for them.

Rules (one test each in ``tests/unit/sidecar/test_drain.py``):

1. Every turn the sidecar serves or relays is counted from its first byte read to its
   last byte written (``turn``), and so is work a turn leaves running after its client
   went (a streamed turn's re-anchor).
2. Once the drain has begun (``begin``) it never ends in this process but for rule 5:
   the sidecar takes no new turn (503 + ``Retry-After``, ``X-Kvferry-Draining``) and
   its readiness fails, so the pod leaves the Service's endpoints even where the
   endpoint controller still counts a terminating pod as serving.
3. ``wait`` returns as soon as no turn is in flight (an event, not a poll), or at the
   grace deadline with the turns still in flight left to be cut, or as soon as the
   local engine is down (``engine_down``): its turns cannot finish, and a liveness
   restart of a wedged engine must not wait the whole grace.
4. One drain per process: a second ``begin`` (the preStop hook, then the sidecar's
   own SIGTERM) joins the first and keeps its deadline.
5. A drain the engine outlives ends when the engine is seen to restart (``reset``):
   the kubelet runs the engine's preStop before a liveness restart too, and the
   sidecar, which stays, must serve the new engine's turns.

Pure asyncio (no aiohttp): the app and the runtime call it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

# What a client waits before it retries a turn refused while draining: the Service
# has already dropped this pod, so a retry reaches another one.
RETRY_AFTER_SECONDS = 1


@dataclass(frozen=True)
class Result:
    """How a drain ended: ``left`` turns still in flight (cut), after ``waited_s``."""

    left: int
    waited_s: float
    engine_down: bool = False

    def as_json(self) -> dict[str, object]:
        return {
            "drained": self.left == 0,
            "inflight": self.left,
            "waitedSeconds": round(self.waited_s, 3),
            "engineDown": self.engine_down,
        }


class Drainer:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._down = asyncio.Event()
        self._began_at: float | None = None
        self._deadline: float | None = None
        self.generation = 0  # bumped by reset: a drain of an older engine is over

    @property
    def draining(self) -> bool:
        return self._began_at is not None

    @property
    def inflight(self) -> int:
        return self._inflight

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        """Rule 1: count the work inside as in flight."""
        self._inflight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.set()

    def begin(self, grace_s: float) -> None:
        """Rules 2 and 4: stop taking turns; the first call sets the deadline."""
        if self._began_at is None:
            self._began_at = self._clock()
            self._deadline = self._began_at + max(grace_s, 0.0)

    def engine_down(self) -> None:
        self._down.set()

    def engine_up(self) -> None:
        self._down.clear()

    def reset(self) -> bool:
        """Rule 5: the engine restarted; True when a drain was on."""
        was = self.draining
        self._began_at = self._deadline = None
        self._down.clear()
        self.generation += 1
        return was

    async def wait(self) -> Result:
        """Rule 3: until idle, the deadline or the engine down (``begin`` first)."""
        assert self._began_at is not None and self._deadline is not None, "begin() first"
        began = self._began_at
        remaining = self._deadline - self._clock()
        idle = asyncio.ensure_future(self._idle.wait())
        down = asyncio.ensure_future(self._down.wait())
        try:
            if remaining > 0 and self._inflight:
                await asyncio.wait({idle, down}, timeout=remaining, return_when="FIRST_COMPLETED")
        finally:
            idle.cancel()
            down.cancel()
        return Result(self._inflight, self._clock() - began, self._down.is_set())
