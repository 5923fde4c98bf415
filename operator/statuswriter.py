"""One status write per burst of changes, from what this operator last wrote.

Two things made the operator write a server's status and post its Events more than
once per change (docs/performance.md, operator scale):

- a status refresh starts from the server as the watch last showed it; a pod or
  StatefulSet event that comes before the watch shows our own status patch starts
  from the status before it, sees the same change again, and writes it again;
- P's and D's StatefulSets and pods each change a few times on the way to Ready,
  close together, and every one of those events was a write of its own.

:class:`StatusMemory` keeps, per server (by uid), the status fields this operator
wrote last, until the watch shows them, and one lock per server so two refreshes of
one server never run at once: a refresh starts from the body's status with our own
last write laid over it.
:class:`Coalescer` runs a server's refresh once its events have been quiet for
``quiet`` seconds (at most ``most`` seconds after the first), so a burst is one write.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any

from . import backoff

log = logging.getLogger(__name__)

Key = tuple[str, str]  # namespace, name


class StatusMemory:
    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[Key, threading.Lock] = {}
        self._written: dict[Key, tuple[str, dict[str, Any]]] = {}

    def lock(self, key: Key) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(key, threading.Lock())

    def base(self, key: Key, uid: str, observed: dict[str, Any]) -> dict[str, Any]:
        """The status to compare against: ``observed`` (the body's, possibly older than
        our last write) with the fields we wrote last laid over it."""
        with self._guard:
            mine = self._written.get(key)
        if mine is None or mine[0] != uid:
            return dict(observed)
        return {**observed, **mine[1]}

    def wrote(self, key: Key, uid: str, fields: dict[str, Any]) -> None:
        with self._guard:
            old = self._written.get(key)
            merged = {**old[1], **fields} if old is not None and old[0] == uid else dict(fields)
            self._written[key] = (uid, merged)

    def confirm(self, key: Key, uid: str, observed: dict[str, Any]) -> None:
        """The watch shows a status holding all we wrote: forget it (the body is no
        longer older than our write)."""
        with self._guard:
            mine = self._written.get(key)
            if mine is not None and (
                mine[0] != uid or all(observed.get(k) == v for k, v in mine[1].items())
            ):
                del self._written[key]

    def reset(self, key: Key, uid: str, fields: dict[str, Any]) -> None:
        """What the API server just showed (the safety pass's list), replacing what we
        remembered writing."""
        with self._guard:
            self._written[key] = (uid, dict(fields))

    def forget(self, key: Key) -> None:
        with self._guard:
            self._written.pop(key, None)
            self._locks.pop(key, None)


class Coalescer:
    """Per server, ``run(key)`` on a thread once requests stopped for ``quiet`` seconds,
    or ``most`` seconds after the first request of a burst. A request that comes while
    ``run`` runs makes it run once more after; a run that returns False (the status
    did not land) is requested again on ``backoff``'s schedule, until one lands.
    ``request`` is safe from any thread."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        run: Callable[[Key], bool],
        quiet: float,
        most: float,
    ) -> None:
        self.loop, self.run, self.quiet, self.most = loop, run, quiet, max(most, quiet)
        self._last: dict[Key, float] = {}
        self._tasks: dict[Key, asyncio.Task[None]] = {}
        self._failures: dict[Key, int] = {}
        self.runs = 0  # refreshes run (for tests and logs)

    def request(self, key: Key) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self._mark, key)

    def _mark(self, key: Key) -> None:
        self._last[key] = self.loop.time()
        if key not in self._tasks:
            self._tasks[key] = self.loop.create_task(self._drain(key))

    async def _drain(self, key: Key) -> None:
        try:
            while key in self._last:
                first = self.loop.time()
                while True:
                    due = min(self._last[key] + self.quiet, first + self.most)
                    wait = due - self.loop.time()
                    if wait <= 0:
                        break
                    await asyncio.sleep(wait)
                del self._last[key]  # requests from here on make another run
                self.runs += 1
                try:
                    landed = await asyncio.to_thread(self.run, key)
                except Exception as exc:
                    log.warning("status of %s/%s not refreshed: %s", *key, exc)
                    landed = False
                if landed:
                    self._failures.pop(key, None)
                    continue
                tries = self._failures.get(key, 0)
                self._failures[key] = tries + 1
                self.loop.call_later(backoff.delay(tries), self._mark, key)
        finally:
            self._tasks.pop(key, None)

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
