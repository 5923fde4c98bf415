"""The sidecar's long-lived state and its background loops.

One ``Sidecar`` per app: settings, the HTTP client session, the local engine, the
prefill pool, the handle store, metrics, the residency model. ``start`` opens
clients and probes once (so a test or a warm pod serves its first request with
capabilities known). Background loops (``background``): ``run`` keeps probing,
scrapes the engine's metrics, purges expired handles and re-reads the topology
file; ``run_kv_events`` follows the engine's KV events; ``run_push`` sends the
residency report to the operator.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Coroutine
from typing import Any

import aiohttp

from kvferry_wire import report

from . import config, enginemetrics, plan, transport
from .blockindex import BlockIndex
from .config import ROLE_DECODE, Settings
from .handles import Clock, HandleStore
from .kvsubscriber import Subscriber
from .metrics import Metrics
from .push import Pusher
from .residency import Identity, PinnedFigures, Residency, handle_blocks
from .types import PATH_METRICS, HandleFate, KVHandle, TurnReport
from .upstream import EngineClient, LocalEngine, PrefillPool, UpstreamError

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
        self.kv_index = BlockIndex()
        # RDMA devices come and go only with the pod; re-read on every probe anyway
        # (cheap: a few sysfs files) so a late device plugin shows.
        self.rdma_devices = transport.read_rdma_devices(settings.rdma_sysfs)
        self.residency = Residency(
            Identity(
                server=settings.server or "",
                namespace=settings.namespace or "",
                pod=settings.pod_name or socket.gethostname(),
                role=settings.role,
                engine_build=settings.engine_build,
            ),
            clock=clock,
            pinned=self._pinned,
            kv_events=self.kv_index.stats,
            transport=self._transport,
        )
        self.metrics.bind_report(self.snapshot)
        self.metrics.bind_settings(settings)

    def _on_drop(self, fate: HandleFate, handle: KVHandle) -> None:
        self.metrics.on_drop(fate)
        self.residency.on_handle_drop(fate, handle.session)

    def _pinned(self) -> PinnedFigures:
        handles = self.store.values()
        local = getattr(self, "local", None)
        return PinnedFigures(
            handles=len(handles),
            blocks=sum(handle_blocks(h.params) for h in handles),
            oldest_age_seconds=max(self.store.ages(), default=0.0),
            block_size=local.block_size if local is not None else self.settings.block_size,
        )

    def _transport(self) -> tuple[str, str]:
        s = self.settings
        verdict = transport.classify(
            transport.Evidence(
                requested=s.requested_transport,
                rdma_enabled=s.rdma_enabled,
                ucx_tls=s.engine_ucx_tls,
                ucx_net_devices=s.engine_ucx_net_devices,
                rdma_devices=self.rdma_devices,
            )
        )
        return verdict.transport, verdict.reason

    def record_turn(self, turn: TurnReport) -> None:
        """A finished turn: Prometheus series, the log line, the residency model."""
        self.metrics.record(turn)
        self.residency.observe_turn(turn)

    def snapshot(self) -> report.Report:
        return self.residency.snapshot(time.time())

    def report_body(self) -> bytes:
        return report.encode(self.snapshot())

    def rules(self) -> plan.Rules:
        """What the turn plan needs to know, as of now (the engine's capabilities are
        re-read when it restarts)."""
        s = self.settings
        return plan.Rules(
            bidirectional=s.bidirectional,
            streaming_handles=self.local.streaming_handles,
            block_size=self.local.block_size,
            recompute_threshold=s.recompute_threshold,
            skip_prefill_below_tokens=s.skip_prefill_below_tokens,
        )

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
        await self.scrape_engine()

    async def close(self) -> None:
        await self.http.close()

    async def probe(self) -> None:
        self.rdma_devices = transport.read_rdma_devices(self.settings.rdma_sysfs)
        if await self.local.probe():
            cleared = self.store.clear()
            log.warning("engine restarted; handles cleared count=%s", cleared)
            # Its prefix cache is empty and its event sequence starts again at 0.
            self.kv_index.restart()
            self.residency.engine_restarted()
        self.residency.engine_healthy = self.local.ready
        self.metrics.engine_ready.set(1 if self.local.ready else 0)
        if self.is_decode:
            await self.pool.probe()
            self.metrics.prefill_ready.set(self.pool.ready_count())

    async def scrape_engine(self) -> bool:
        """Read the local engine's /metrics into the residency model."""
        if not self.local.ready:
            return False
        try:
            status, body, _ = await self.local.client.get(PATH_METRICS)
        except UpstreamError as exc:
            log.debug("engine metrics scrape failed err=%s", exc)
            return False
        figures = (
            enginemetrics.parse_or_none(body.decode("utf-8", "replace")) if status == 200 else None
        )
        if figures is None:
            return False
        self.residency.observe_engine(figures)
        return True

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
            try:
                await self.scrape_engine()
            except Exception:
                log.exception("engine metrics scrape failed")
            purged = self.store.purge_expired()
            if purged:
                log.debug("expired handles dropped count=%s", purged)
            if time.monotonic() >= next_topology:
                next_topology = time.monotonic() + s.topology_reload_seconds
                self.reload_topology()

    async def run_kv_events(self) -> None:
        """Follow the local engine's KV events until cancelled (restarts on a bug)."""
        s = self.settings
        subscriber = Subscriber(self.kv_index, s.kv_events, s.kv_events_replay or None)
        while True:
            try:
                await subscriber.run()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("kv event subscriber failed; restarting")
                await asyncio.sleep(s.probe_interval_seconds)

    async def run_push(self) -> None:
        s = self.settings
        pusher = Pusher(
            s.operator_url,
            self.report_body,
            token_file=s.token_file,
            ca_file=s.operator_ca_file,
            interval_s=s.report_interval_seconds,
            on_result=self.metrics.on_push,
        )
        await pusher.run(self.http)

    def background(self) -> list[Coroutine[Any, Any, None]]:
        """The loops to run for this pod's settings."""
        loops = [self.run()]
        if self.settings.kv_events:
            loops.append(self.run_kv_events())
        if self.settings.operator_url:
            loops.append(self.run_push())
        return loops
