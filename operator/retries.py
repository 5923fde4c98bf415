"""Bounded retries of a failed apply, one task per server (see ``backoff.py``).

Handlers run on kopf's threads and report a failure with :meth:`ApplyRetries.failed`;
the retry task runs on the operator's event loop, waits out each delay of the
schedule, and asks ``retry(namespace, name)`` (run on a thread) whether the server
is done: True when everything landed or retrying cannot help. A server has at
most one retry task; a failure reported while one runs joins it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

from . import backoff

log = logging.getLogger(__name__)

Key = tuple[str, str]


class ApplyRetries:
    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        retry: Callable[[str, str], bool],
        delays: Sequence[float] = backoff.schedule(),
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.loop, self.retry, self.delays, self.sleep = loop, retry, tuple(delays), sleep
        self.tasks: dict[Key, asyncio.Task[None]] = {}
        self.tries = 0  # retries run (for tests and logs)

    def failed(self, namespace: str, name: str) -> None:
        """A server's apply did not land: retry it (safe from any thread)."""
        if self.loop.is_closed():
            return  # shutting down: the next operator's first pass applies everything
        self.loop.call_soon_threadsafe(self._start, (namespace, name))

    def _start(self, key: Key) -> None:
        if key not in self.tasks:
            self.tasks[key] = self.loop.create_task(self._run(key))

    async def _run(self, key: Key) -> None:
        try:
            for attempt, wait in enumerate(self.delays):
                await self.sleep(wait)
                self.tries += 1
                try:
                    if await asyncio.to_thread(self.retry, *key):
                        return
                except Exception as exc:  # the next try, or the resync, goes again
                    log.warning("retry %d of %s/%s failed: %s", attempt + 1, *key, exc)
            log.warning(
                "apply of %s/%s still failing after %d retries; the safety pass tries again",
                *key,
                len(self.delays),
            )
        finally:
            self.tasks.pop(key, None)

    async def close(self) -> None:
        """Cancel every retry and wait until none runs (an apply already on its thread
        finishes first: a thread cannot be cancelled)."""
        tasks = list(self.tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
