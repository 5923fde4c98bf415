"""A TCP balancer that hands each new connection to the next backend in turn, as a
Service does without readiness (kwok routes no Services): the operator's replicas
behind one address, for the failover tests."""

from __future__ import annotations

import asyncio
import contextlib
import threading


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


class RoundRobin:
    """Listens on ``port`` (0: any free one); ``connections[i]``: how many went to
    backend i. ``set_backends`` before the first connection (ports known later)."""

    def __init__(self, backends: list[tuple[str, int]]) -> None:
        self.backends = backends
        self.connections = [0] * len(backends)
        self._turns = 0
        self._server: asyncio.base_events.Server | None = None

    def set_backends(self, backends: list[tuple[str, int]]) -> None:
        self.backends = backends
        self.connections = [0] * len(backends)

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        self._server = await asyncio.start_server(self._serve, host, port)
        return self._server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        i = self._turns % len(self.backends)
        self._turns += 1
        self.connections[i] += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.backends[i])
        except OSError:
            writer.close()  # a backend that is down: the client sees a reset and retries
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


class RoundRobinThread:
    """The balancer on a loop of its own, for synchronous tests."""

    def __init__(self, backends: list[tuple[str, int]]) -> None:
        self.balancer = RoundRobin(backends)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.port = 0

    def __enter__(self) -> RoundRobinThread:
        self._thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self.balancer.start(), self._loop).result(10)
        return self

    def __exit__(self, *_: object) -> None:
        asyncio.run_coroutine_threadsafe(self.balancer.close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
