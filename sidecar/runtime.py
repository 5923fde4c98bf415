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
from collections import OrderedDict
from collections.abc import Coroutine
from typing import Any

import aiohttp

from kvferry_wire import report

from . import config, enginemetrics, plan, transport
from .blockhash import HASH_ALGO, prefix_block_hashes
from .blockindex import BlockIndex
from .config import ROLE_DECODE, Settings
from .handles import Clock, HandleStore
from .identity import plain_text
from .kvsubscriber import Subscriber
from .metrics import Metrics
from .push import Pusher
from .release import (
    PINNED_EXPIRING,
    PINNED_NO_PREFILL,
    PINNED_PULL_FAILED,
    PINNED_RELEASE_FAILED,
    PINNED_RELEASING,
    RELEASE_FAILED,
    RELEASE_REQUEST,
    RELEASE_RIDER,
    RELEASE_UNRELEASABLE,
    Ledger,
    ledger_key,
    release_body,
)
from .residency import Identity, PinnedFigures, Residency
from .types import PATH_COMPLETIONS, PATH_METRICS, HandleFate, KVHandle, TurnInput, TurnReport
from .upstream import EngineClient, LocalEngine, PrefillPool, UpstreamError

log = logging.getLogger(__name__)

# Release requests in flight at once: a burst of evictions must not flood P.
RELEASE_CONCURRENCY = 4
# How long a stopping sidecar waits for the releases of the handles it held.
SHUTDOWN_RELEASE_SECONDS = 5.0


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
        self.decode_sidecars: tuple[str, ...] = settings.decode_sidecars
        self._topology = (
            config.TopologyWatch(settings.topology_path) if settings.topology_path else None
        )
        if self._topology is not None:
            self._topology.last = (settings.prefill_engines, settings.decode_sidecars)
        self.kv_index = BlockIndex()
        # Handles pinned on D that no turn will read (release.py), and the release
        # requests in flight.
        self.ledger = Ledger()
        # Handles waiting for a ride on a prefill (release.py), oldest first.
        self._pending: OrderedDict[str, KVHandle] = OrderedDict()
        self._releases: set[asyncio.Task[None]] = set()
        self._release_slots = asyncio.Semaphore(RELEASE_CONCURRENCY)
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
        self.residency.on_handle_drop(fate, handle.session)
        if fate in (HandleFate.SUPERSEDED, HandleFate.EVICTED):
            self.release(handle)  # D still pins it, and nobody will ask for it again
        elif fate is HandleFate.EXPIRED:
            # Dropped a margin before D frees it: pinned until then.
            self.pin_until_expiry(handle, PINNED_EXPIRING)

    def _pinned(self) -> PinnedFigures:
        handles = self.store.values()
        local = getattr(self, "local", None)
        now = self.store.now()
        unused = self.ledger.figures(now)
        return PinnedFigures(
            handles=len(handles) + unused.handles,
            blocks=sum(h.blocks for h in handles) + unused.blocks,
            oldest_age_seconds=max(max(self.store.ages(), default=0.0), unused.oldest_age_seconds),
            block_size=local.block_size if local is not None else self.settings.block_size,
            unused_handles=unused.handles,
            unused_blocks=unused.blocks,
        )

    # ------------------------------------------------------------ releasing handles

    def release(self, handle: KVHandle) -> None:
        """Let D free a handle no turn will read, through a prefill engine (release.py).

        Returns at once. The handle first waits ``release_after_seconds`` for a ride
        on a prefill request this sidecar sends anyway (free); then a one-token
        release request of its own carries it (which costs P one block until its KV
        lease ends). It counts as pinned until released or, failing that, until D's
        deadline."""
        if self.store.is_expired(handle, self.store.now()):
            self.pin_until_expiry(handle, PINNED_EXPIRING)
            return
        self.ledger.add_handle(
            handle, PINNED_RELEASING, retention_s=self.settings.retention_seconds
        )
        key = ledger_key(handle)
        self._pending[key] = handle
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a synchronous caller in a test): stays pinned
            self._pending.pop(key)
            self._released(handle, PINNED_RELEASE_FAILED)
            return
        loop.call_later(self.settings.release_after_seconds, self._release_now, key)

    def _release_now(self, key: str) -> None:
        handle = self._pending.pop(key, None)
        if handle is None:
            return  # it rode on a prefill meanwhile
        task = asyncio.get_running_loop().create_task(self._send_release(handle))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    def take_rider(self) -> KVHandle | None:
        """The handle waiting longest for release, to ride on a prefill request that
        carries none of its own (``rider_done`` says how it went)."""
        now = self.store.now()
        while self._pending:
            _, handle = self._pending.popitem(last=False)
            if not self.store.is_expired(handle, now):
                return handle
            self.pin_until_expiry(handle, PINNED_EXPIRING)
        return None

    def rider_done(self, handle: KVHandle, *, freed: bool) -> None:
        """A waiting handle rode on a prefill: P notified D (``freed``), or the request
        broke off and nobody knows (pinned in the figures until D's deadline)."""
        if freed:
            self.ledger.remove(handle)
            self._count_release(RELEASE_RIDER)
        else:
            self.pin_until_expiry(handle, PINNED_PULL_FAILED)

    def pin_until_expiry(self, handle: KVHandle, reason: str) -> None:
        """A handle D keeps that will not be released: in the figures until its
        deadline (counted as unreleasable unless it is merely expiring)."""
        self.ledger.add_handle(handle, reason, retention_s=self.settings.retention_seconds)
        if reason != PINNED_EXPIRING:
            self._count_release(RELEASE_UNRELEASABLE)

    def pin_unreturned(self, request_id: str, tokens: int) -> None:
        """D pinned a turn's KV but never said where (vLLM 0.32 streaming)."""
        now = self.store.now()
        self.ledger.add_unreturned(
            request_id, tokens, self.local.block_size, now, self.settings.retention_seconds
        )
        self._count_release(RELEASE_UNRELEASABLE)

    def _count_release(self, kind: str) -> None:
        self.metrics.releases.labels(kind).inc()
        self.residency.on_release(kind)

    def released_by_rider(self) -> None:
        """A handle rode on a turn's own prefill request and P notified D."""
        self._count_release(RELEASE_RIDER)

    def _released(self, handle: KVHandle, failure: str | None) -> None:
        if failure is None:
            self.ledger.remove(handle)
            self._count_release(RELEASE_REQUEST)
            return
        self.ledger.add_handle(handle, failure, retention_s=self.settings.retention_seconds)
        failed = failure == PINNED_RELEASE_FAILED
        self._count_release(RELEASE_FAILED if failed else RELEASE_UNRELEASABLE)

    async def _send_release(self, handle: KVHandle) -> None:
        async with self._release_slots:
            engine = self.pool.choose(set()) if self.is_decode else None
            if engine is None:
                self._released(handle, PINNED_NO_PREFILL)
                return
            body = release_body(handle, handle.identity.model or self.settings.model)
            try:
                with self.pool.in_flight(engine):
                    status, _ = await engine.client.post_json(
                        PATH_COMPLETIONS,
                        body,
                        request_id=f"kvferry-release-{handle.request_id or handle.session}",
                        timeout=self.settings.connect_timeout_seconds * 10,
                    )
            except UpstreamError as exc:
                log.warning("handle release failed engine=%s err=%s", engine.url, exc)
                self._released(handle, PINNED_RELEASE_FAILED)
                return
            if status != 200:
                log.warning("handle release refused engine=%s status=%s", engine.url, status)
                self._released(handle, PINNED_RELEASE_FAILED)
                return
            self._released(handle, None)

    # ------------------------------------------------------------ D's prefix cache

    def cached_on_decode(self, turn: TurnInput, prompt_ids: list[int] | None) -> int:
        """Prompt tokens D's prefix cache holds, from its KV events (0 when unknown):
        whole blocks of the prompt but its last token, as vLLM's cache lookup finds."""
        block_size = self.local.block_size
        if (
            prompt_ids is None
            or not block_size
            or self.local.info.prefix_hash_algo != HASH_ALGO
            or self.kv_index.next_seq is None  # no event seen: nothing known
            or not plain_text(turn.identity, self.settings.model)
        ):
            return 0
        hashes = prefix_block_hashes(prompt_ids[: len(prompt_ids) - 1], block_size)
        return self.kv_index.held_prefix(hashes) * block_size

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
            diagnostic_headers=s.diagnostic_headers,
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
        if self.is_decode and getattr(self, "pool", None) is not None:
            # The handles die with this process: let D free them now, not at their
            # deadline (best effort, bounded: a pod's grace period is short).
            for handle in self.store.values():
                self.release(handle)
            for key in list(self._pending):
                self._release_now(key)
            if self._releases:
                await asyncio.wait(list(self._releases), timeout=SHUTDOWN_RELEASE_SECONDS)
        for task in list(self._releases):
            task.cancel()
        await asyncio.gather(*self._releases, return_exceptions=True)
        await self.http.close()

    def engine_restarted(self) -> None:
        """The local engine is a new one: its pinned blocks and its cache are gone."""
        cleared = self.store.clear()
        log.warning("engine restarted; handles cleared count=%s", cleared)
        # Its prefix cache is empty and its event sequence starts again at 0.
        self.kv_index.restart()
        self.residency.engine_restarted()

    async def probe(self) -> None:
        self.rdma_devices = transport.read_rdma_devices(self.settings.rdma_sysfs)
        if await self.local.probe():
            self.engine_restarted()
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
        if self.local.observe_identity(figures.started_at):
            self.engine_restarted()
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
            self.ledger.purge(self.store.now())
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
