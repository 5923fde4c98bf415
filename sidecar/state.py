"""The sidecar's long-lived state and its background loops.

One ``Sidecar`` per app: settings, the HTTP client session, the local engine, the
prefill pool, the handle store, metrics. ``start`` opens clients and probes once (so
a test or a warm pod serves its first request with capabilities known); ``run``
keeps probing, purges expired handles and re-reads the topology file.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp

from . import config
from .config import ROLE_DECODE, Settings
from .handles import Clock, HandleStore
from .metrics import Metrics
from .types import HandleFate, KVHandle
from .upstream import EngineClient, LocalEngine, PrefillPool

log = logging.getLogger(__name__)


class Sidecar:
    http: aiohttp.ClientSession
    local: LocalEngine
    pool: PrefillPool

    def __init__(self, settings: Settings, *, clock: Clock = time.perf_counter) -> None:
        self.settings = settings
        self.metrics = Metrics()
        self.store = HandleStore(
            cap=settings.handle_store_cap,
            margin_s=settings.expiry_margin_seconds,
            engine_build=settings.engine_build,
            clock=clock,
            on_drop=self._on_drop,
        )
        self.metrics.bind_store(lambda: len(self.store), self.store.ages)
        self.decode_sidecars: tuple[str, ...] = settings.decode_sidecars
        self._topology = (
            config.TopologyWatch(settings.topology_path) if settings.topology_path else None
        )
        if self._topology is not None:
            self._topology.last = (settings.prefill_engines, settings.decode_sidecars)

    def _on_drop(self, fate: HandleFate, handle: KVHandle) -> None:
        self.metrics.on_drop(fate)

    @property
    def is_decode(self) -> bool:
        return self.settings.role == ROLE_DECODE

    async def start(self) -> None:
        s = self.settings
        # No pool limit: concurrency is bounded by the engines, not by the sidecar.
        self.http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=30),
            timeout=aiohttp.ClientTimeout(total=None, connect=s.connect_timeout_seconds),
        )
        self.local = LocalEngine(
            EngineClient(self.http, s.engine_url, s.connect_timeout_seconds),
            streaming_override=s.streaming_handles,
            block_size_override=s.block_size,
        )
        self.pool = PrefillPool(self.http, s.connect_timeout_seconds)
        self.pool.update(s.prefill_engines)
        await self.probe()

    async def close(self) -> None:
        await self.http.close()

    async def probe(self) -> None:
        if await self.local.probe():
            cleared = self.store.clear()
            log.warning("engine restarted; handles cleared count=%s", cleared)
        self.metrics.engine_ready.set(1 if self.local.ready else 0)
        if self.is_decode:
            await self.pool.probe()
            self.metrics.prefill_ready.set(self.pool.ready_count())

    def reload_topology(self) -> bool:
        if self._topology is None:
            return False
        changed = self._topology.poll()
        if changed is None:
            return False
        prefill, decode = changed
        self.pool.update(prefill)
        self.decode_sidecars = decode
        log.info("topology reloaded prefill_engines=%s decode_ring=%s", len(prefill), len(decode))
        return True

    async def run(self) -> None:
        """Background duties until cancelled."""
        s = self.settings
        next_topology = time.monotonic() + s.topology_reload_seconds
        while True:
            await asyncio.sleep(s.probe_interval_seconds)
            try:
                await self.probe()
            except Exception:  # a probe bug must not stop purging and reloading
                log.exception("probe failed")
            purged = self.store.purge_expired()
            if purged:
                log.debug("expired handles dropped count=%s", purged)
            if time.monotonic() >= next_topology:
                next_topology = time.monotonic() + s.topology_reload_seconds
                self.reload_topology()
