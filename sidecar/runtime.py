"""The sidecar's long-lived state and its background loops.

One ``Sidecar`` per app: settings, the HTTP client session, the local engine, the
prefill pool, the handle store, the releaser (``release.Releaser``, given the
one-token release request to send), metrics, the residency model. ``start`` opens
clients and probes once (so a test or a warm pod serves its first request with
capabilities known). Background loops (``background``): ``run`` keeps probing,
scrapes the engine's metrics, purges expired handles and re-reads the topology
file; ``run_kv_events`` follows the engine's KV events; ``run_push`` sends the
residency report to the operator.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any

import aiohttp

from kvferry_wire import costfit, protocol, report, retention
from kvferry_wire import policy as wire_policy

from . import config, enginemetrics, owners, placement, plan, transport
from .blockhash import HASH_ALGO, prefix_block_hashes
from .blockindex import BlockIndex
from .config import ROLE_DECODE, Settings
from .drain import Drainer
from .drain import Result as DrainResult
from .handles import Clock, HandleStore
from .identity import KVIdentity, plain_text
from .kvsubscriber import Subscriber
from .metrics import Metrics
from .pinjournal import Pin, PinJournal
from .policy import InForce, LivePolicy
from .push import Pusher
from .release import (
    PINNED_EXPIRING,
    PINNED_NO_PREFILL,
    PINNED_PULL_FAILED,
    PINNED_RELEASE_FAILED,
    Releaser,
    ledger_key,
    release_body,
)
from .residency import Identity, PinnedFigures, Residency
from .types import (
    K_REMOTE_REQUEST_ID,
    PATH_COMPLETIONS,
    PATH_METRICS,
    HandleFate,
    KVHandle,
    TurnInput,
    TurnReport,
    token_array,
)
from .upstream import EngineClient, LocalEngine, PrefillPool, UpstreamError

log = logging.getLogger(__name__)

# How long a stopping sidecar waits for the releases of the handles it held.
SHUTDOWN_RELEASE_SECONDS = 5.0
# The retention policy's block size until the engine tells its own (vLLM's default).
DEFAULT_BLOCK_TOKENS = 16
# Why a handle stays pinned on D to its deadline although no turn will read it (the
# ledger's reasons less releasing and expiring): what a higher ceiling makes costlier.
UNRELEASABLE = (PINNED_NO_PREFILL, PINNED_RELEASE_FAILED, PINNED_PULL_FAILED)
# The session tag of a handle an earlier process held (it belongs to no session now).
ORPHAN_SESSION = "orphan"


class Sidecar:
    http: aiohttp.ClientSession
    local: LocalEngine
    pool: PrefillPool

    def __init__(self, settings: Settings, *, clock: Clock = time.perf_counter) -> None:
        self.settings = settings
        self.metrics = Metrics()
        # Owners on: each handle is bound to the client the gateway authenticated, and
        # each owner has its own caps (owners.py).
        header = settings.owner_header
        self.owner_rule = owners.Rule.new(header) if header else None  # "" = off, as unset
        # Retention, recompute threshold and skip-prefill in force: the settings file's
        # until the operator's report answer carries its server's policy (policy.py).
        self.policy = LivePolicy(
            retention_seconds=settings.retention_seconds,
            recompute_threshold=settings.recompute_threshold,
            skip_prefill_below_tokens=settings.skip_prefill_below_tokens,
            ceiling_seconds=settings.retention_ceiling,
            prefill_placement=settings.prefill_placement,
            on_change=self._on_policy,
        )
        # Which handle is kept, which goes first and when (kvferry_wire.retention): built
        # from the settings as the simulator builds it (retention.Wiring).
        self.retention = retention.build(settings, settings.block_size or DEFAULT_BLOCK_TOKENS)
        # D's preemptions the policy has seen (None: none looked at yet; those before
        # the first look are not this sidecar's to answer for).
        self._preemptions_seen: int | None = None
        self._engine_figures: enginemetrics.EngineFigures | None = None
        self.store = HandleStore(
            cap=settings.handle_store_cap,
            margin_s=protocol.HANDLE_EXPIRY_MARGIN_SECONDS,
            engine_build=settings.engine_build,
            clock=clock,
            on_drop=self._on_drop,
            on_evict=self._on_evict,
            owner_caps=self.owner_caps if self.owner_rule is not None else None,
            # A handle is offered until the ceiling, the retention in force the policy's
            # floor (retention.Wiring says why); until D's size is known (no admission,
            # no KV pressure) the retention in force ends it, as before.
            retention=self._offered_seconds,
            policy=self.retention,
        )
        self.decode_sidecars: tuple[str, ...] = settings.decode_sidecars
        self._topology = (
            config.TopologyWatch(settings.topology_path) if settings.topology_path else None
        )
        if self._topology is not None:
            self._topology.last = (settings.prefill_engines, settings.decode_sidecars)
        self.kv_index = BlockIndex()
        # D legs in flight (decoding()) and the cost fits last solved (costs()).
        self._decoding = 0
        self._arrivals = placement.Arrivals(clock=time.monotonic)
        self._costs: placement.Costs | None = None
        self._costs_seen = 0
        # The turns in flight and the drain that waits for them when the pod stops.
        self.drainer = Drainer()
        self._drain_task: asyncio.Task[DrainResult] | None = None
        self._released_on_drain = False
        # The engine's /metrics text of the last good scrape ("" after a failed one).
        self.engine_metrics_text = ""
        # What D pins for this sidecar, on the pod's emptyDir (decode only: a prefill
        # sidecar holds no handle), and the keys of what an earlier process left.
        journal = settings.pin_journal_path if self.is_decode else None
        self.journal = (
            PinJournal(Path(journal), on_error=self.metrics.pin_journal_errors.inc)
            if journal
            else None
        )
        self._orphans: set[str] = set()
        # Handles pinned on D that no turn will read, and how they are let go.
        self.releaser = Releaser(
            send=self._send_release,
            clock=self.store.now,
            # D's own deadline decides what is worth releasing: a handle the policy
            # let go early is still pinned on D until then.
            expired=self.store.engine_expiring,
            count=self._count_release,
            retention_s=settings.retention_ceiling,
            after_s=settings.release_after_seconds,
            on_freed=self._freed,
        )
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
        self.metrics.bind_policy(self.policy.current)

    def _offered_seconds(self) -> float:
        if self.retention.share_blocks() is None:
            return self.policy.retention_seconds
        return self.policy.ceiling_seconds

    def _on_policy(self, in_force: InForce) -> None:
        self.metrics.bind_policy(in_force)
        # The handles held now are judged by the new floor (and, while D's size is
        # unknown, end by the new retention).
        self.retention.set_floor(in_force.retention_seconds, self.store.now())
        self.store.rebound()

    def engine_pressure(self) -> retention.Pressure:
        """D's KV pressure as of its last scrape, and its preemptions since the last
        look (each look consumes them: one release per preemption)."""
        total = self.residency.preemptions
        seen = total if self._preemptions_seen is None else self._preemptions_seen
        new, self._preemptions_seen = total - seen, total
        figures = self._engine_figures
        if figures is None:
            return retention.Pressure(preemptions=max(0, new))
        return retention.Pressure.of_engine(
            figures.kv_usage, figures.num_gpu_blocks, new, figures.stalled
        )

    def release_due(self) -> int:
        """Let go the handles the retention policy releases now (handles.release_due)."""
        local = getattr(self, "local", None)  # None until start()
        block_size = local.block_size if local is not None else None
        if block_size and block_size != self.retention.costs.block_tokens:
            # The policy counts blocks as D does (pressure is met in D's blocks).
            self.retention.costs = retention.nominal_costs(block_size)
        return self.store.release_due(self.engine_pressure())

    def on_report_answer(self, answer: Any) -> None:
        """The operator's answer to a report push: its server's policy, if it sent one."""
        if isinstance(answer, dict) and wire_policy.RESPONSE_KEY in answer:
            self.policy.offer(answer[wire_policy.RESPONSE_KEY])

    def _on_drop(self, fate: HandleFate, handle: KVHandle) -> None:
        self.residency.on_handle_drop(fate, handle.session)
        if fate in (HandleFate.SUPERSEDED, HandleFate.EVICTED):
            self.releaser.release(handle)  # D still pins it; nobody will ask for it again
        elif fate is HandleFate.EXPIRED:
            if handle.engine_build == self.settings.engine_build:
                # The retention in force let it go: released, unless D's own deadline is
                # within the margin (then the releaser pins it until D frees it).
                self.releaser.release(handle)
            else:
                # Another engine build's blocks: nothing this D can release.
                self.releaser.pin_until_expiry(handle, PINNED_EXPIRING)

    def _on_evict(self, reason: str, handle: KVHandle) -> None:
        # Released through the drop hook (fate evicted); counted here by its cap.
        self.residency.on_eviction(reason)

    # ------------------------------------------------------------ the pin journal

    def note_pinned(self, handle: KVHandle) -> None:
        """D returned ``handle``: it pins the blocks until read, released or its
        deadline. Noted in the journal so that a restarted sidecar can release it."""
        if self.journal is None or not handle.params.get(K_REMOTE_REQUEST_ID):
            return  # no journal, or nothing a release request could name
        wall, now = time.time(), self.store.now()
        left = (
            handle.expires_at - now
            if handle.expires_at is not None
            else self.settings.retention_ceiling
        )
        self.journal.pinned(
            Pin(
                key=ledger_key(handle),
                blocks=handle.blocks,
                deadline=wall + left,
                params=dict(handle.params),
                token=int(handle.token_ids[0]) if len(handle.token_ids) else 0,
                model=handle.identity.model,
                engine=self._engine_started_at(),
            )
        )

    def _freed(self, handle: KVHandle) -> None:
        key = ledger_key(handle)
        if self.journal is not None:
            self.journal.gone(key)
        if key in self._orphans:
            self._orphans.discard(key)
            self.residency.orphans.released += 1

    def _engine_started_at(self) -> float | None:
        local = getattr(self, "local", None)  # None until start()
        return local.info.started_at if local is not None else None

    def recover_orphans(self) -> int:
        """Release what an earlier process of this sidecar left pinned on D (its
        journal's live pins); returns how many. Each goes as any handle dropped
        unread (release.py), counted apart until D freed it."""
        if self.journal is None:
            return 0
        found = self.journal.recover(self._engine_started_at())
        wall, now = time.time(), self.store.now()
        for pin in found.orphans:
            handle = KVHandle(
                session=ORPHAN_SESSION,
                params=pin.params,
                token_ids=token_array([pin.token]),
                num_tokens=1,
                engine_build=self.settings.engine_build,
                created_at=now,
                expires_at=now + (pin.deadline - wall),
                identity=KVIdentity(model=pin.model),
            )
            self._orphans.add(pin.key)
            self.releaser.release(handle)
        orphans = self.residency.orphans
        orphans.found += len(found.orphans)
        orphans.found_blocks += sum(p.blocks for p in found.orphans)
        orphans.void += found.void
        if found.orphans or found.void or found.bad_lines:
            log.warning(
                "pin journal read back: releasing what an earlier process held "
                "orphans=%s blocks=%s void=%s expired=%s bad_lines=%s",
                len(found.orphans),
                orphans.found_blocks,
                found.void,
                found.expired,
                found.bad_lines,
            )
        return len(found.orphans)

    def owner_caps(self) -> owners.Caps:
        """One owner's caps as of now: unset ones follow D's KV size, read from the
        engine (known once it is ready)."""
        s = self.settings
        local = getattr(self, "local", None)
        return owners.caps(
            s.handle_store_cap,
            s.owner_max_handles,
            s.owner_max_pinned_tokens,
            local.kv_capacity_tokens if local is not None else None,
            local.info.max_model_len if local is not None else None,
        )

    def _pinned(self) -> PinnedFigures:
        handles = self.store.values()
        local = getattr(self, "local", None)
        unused = self.releaser.figures()
        now = self.store.now()
        orphaned = self.releaser.ledger.figures_of(self._orphans, now)
        reasons = self.releaser.ledger.by_reason(now)
        return PinnedFigures(
            handles=len(handles) + unused.handles,
            blocks=sum(h.blocks for h in handles) + unused.blocks,
            oldest_age_seconds=max(max(self.store.ages(), default=0.0), unused.oldest_age_seconds),
            block_size=local.block_size if local is not None else self.settings.block_size,
            unused_handles=unused.handles,
            unused_blocks=unused.blocks,
            orphaned_handles=orphaned.handles,
            orphaned_blocks=orphaned.blocks,
            unreleasable_handles=sum(reasons.get(r, 0) for r in UNRELEASABLE),
        )

    # ------------------------------------------------------------ releasing handles

    def _count_release(self, kind: str) -> None:
        self.metrics.releases.labels(kind).inc()
        self.residency.on_release(kind)

    async def _send_release(self, handle: KVHandle) -> str | None:
        """The one-token release request to the least-loaded P (release.py): None when
        P took it, else why the handle stays pinned."""
        engine = self.pool.choose(set()) if self.is_decode else None
        if engine is None:
            return PINNED_NO_PREFILL
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
            return PINNED_RELEASE_FAILED
        if status != 200:
            log.warning("handle release refused engine=%s status=%s", engine.url, status)
            return PINNED_RELEASE_FAILED
        return None

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
        measured = self.policy.prefill_placement == wire_policy.PLACEMENT_MEASURED
        return plan.Rules(
            bidirectional=s.bidirectional,
            streaming_handles=self.local.streaming_handles,
            block_size=self.local.block_size,
            recompute_threshold=self.policy.recompute_threshold,
            skip_prefill_below_tokens=self.policy.skip_prefill_below_tokens,
            diagnostic_headers=s.diagnostic_headers,
            media_urls_immutable=s.media_urls_immutable,
            prefill_placement=self.policy.prefill_placement,
            costs=self.costs() if measured else None,
            running_on_decode=self._decoding,
            decode_arrivals=self._arrivals.rate() if measured else 0.0,
        )

    def costs(self) -> placement.Costs:
        """The legs' costs as measured so far, refitted when enough new legs came in
        (one in 16 more than the last fit saw, so the work per turn stays small)."""
        seen = self.residency.costs_observed()
        if self._costs is None or seen - self._costs_seen >= max(1, self._costs_seen // 16):
            r = self.residency
            self._costs = placement.Costs(
                costfit.solve(r.prefill_leg, costfit.PREFILL_LEG, placement.PREFILL_NEEDS),
                costfit.solve(r.decode_leg, costfit.DECODE_LEG, placement.DECODE_NEEDS),
            )
            self._costs_seen = seen
        return self._costs

    @contextlib.contextmanager
    def decoding(self) -> Iterator[None]:
        """A turn's D leg in flight: D's load, as placement.py weighs it."""
        self._decoding += 1
        self._arrivals.note()
        try:
            yield
        finally:
            self._decoding -= 1

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
        # After the first probe and scrape: P's readiness and D's start time known.
        self.recover_orphans()

    # ------------------------------------------------------------ stopping

    async def drain(self) -> DrainResult:
        """Stop taking turns, wait for those in flight (``drain_seconds`` at most), then
        release the handles held while the engine still runs: after the engine stops,
        P's empty pull for them would only fail. Every caller (the preStop hook, the
        sidecar's own SIGTERM, a retried hook) joins the one drain."""
        return await asyncio.shield(self.begin_drain())

    def begin_drain(self) -> asyncio.Task[DrainResult]:
        """Start the drain (or find the one under way): from now on no turn is taken."""
        if self._drain_task is None:
            self.drainer.begin(self.settings.drain_seconds)
            log.info(
                "draining inflight=%s grace_s=%s",
                self.drainer.inflight,
                self.settings.drain_seconds,
            )
            self._drain_task = asyncio.ensure_future(self._drain())
        return self._drain_task

    async def _drain(self) -> DrainResult:
        generation = self.drainer.generation
        result = await self.drainer.wait()
        if result.left:
            log.warning(
                "drain grace over; turns in flight will be cut inflight=%s waited_s=%.1f "
                "engine_down=%s",
                result.left,
                result.waited_s,
                result.engine_down,
            )
        if (
            self.is_decode
            and getattr(self, "pool", None) is not None
            and generation == self.drainer.generation
        ):
            await self.releaser.release_all(self.store.values(), SHUTDOWN_RELEASE_SECONDS)
            self._released_on_drain = True
        log.info("drained inflight=%s waited_s=%.1f", result.left, result.waited_s)
        return result

    async def close(self) -> None:
        if self._drain_task is not None and not self._drain_task.done():
            self._drain_task.cancel()
            await asyncio.gather(self._drain_task, return_exceptions=True)
        if (
            self.is_decode
            and getattr(self, "pool", None) is not None
            and not self._released_on_drain
        ):
            # The handles die with this process: let D free them now, not at their
            # deadline (best effort, bounded: a pod's grace period is short).
            await self.releaser.release_all(self.store.values(), SHUTDOWN_RELEASE_SECONDS)
        await self.releaser.cancel()
        if self.journal is not None:
            self.journal.close()
        await self.http.close()

    def engine_restarted(self) -> None:
        """The local engine is a new one: its pinned blocks and its cache are gone."""
        cleared = self.store.clear()
        if self.journal is not None:
            self.journal.clear()  # what the old engine pinned went with it
        self._orphans.clear()
        self._engine_figures = None  # its KV usage was the old engine's
        log.warning("engine restarted; handles cleared count=%s", cleared)
        if self.drainer.reset():
            # The kubelet ran the engine's preStop before restarting it (a liveness
            # failure): the pod stays, so the sidecar serves the new engine.
            self._drain_task = None
            self._released_on_drain = False
            log.warning("engine restarted after a drain; taking turns again")
        # Its prefix cache is empty and its event sequence starts again at 0.
        self.kv_index.restart()
        self.residency.engine_restarted()

    async def probe(self) -> None:
        self.rdma_devices = transport.read_rdma_devices(self.settings.rdma_sysfs)
        if await self.local.probe():
            self.engine_restarted()
        self.residency.engine_healthy = self.local.ready
        # A drain waits for nothing an engine that is down could finish (drain.py).
        if self.local.ready:
            self.drainer.engine_up()
        else:
            self.drainer.engine_down()
        self.metrics.engine_ready.set(1 if self.local.ready else 0)
        if self.is_decode:
            await self.pool.probe()
            self.metrics.prefill_ready.set(self.pool.ready_count())

    async def scrape_engine(self) -> bool:
        """Read the local engine's /metrics into the residency model."""
        self._engine_figures = None  # no pressure known unless this scrape tells it
        if not self.local.ready:
            self.engine_metrics_text = ""
            return False
        try:
            status, body, _ = await self.local.client.get(PATH_METRICS)
        except UpstreamError as exc:
            log.debug("engine metrics scrape failed err=%s", exc)
            self.engine_metrics_text = ""
            return False
        text = body.decode("utf-8", "replace") if status == 200 else ""
        figures = enginemetrics.parse_or_none(text) if text else None
        if figures is None:
            self.engine_metrics_text = ""
            return False
        # Re-served on the metrics port until the next scrape (app.py).
        self.engine_metrics_text = text
        if self.local.observe_identity(figures.started_at):
            self.engine_restarted()
        self.residency.observe_engine(figures)
        self._engine_figures = figures
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
            try:
                released = self.release_due()
            except Exception:  # a policy bug must not stop the expiry rules below
                log.exception("retention policy failed")
            else:
                if released:
                    log.debug("handles the retention policy let go count=%s", released)
            purged = self.store.purge_expired()
            if purged:
                log.debug("expired handles dropped count=%s", purged)
            self.releaser.purge()
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
            on_answer=self.on_report_answer,
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
