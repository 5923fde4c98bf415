"""Leader election on a ``coordination.k8s.io`` Lease: one replica reconciles, the
others wait as standbys and take over when it goes.

Why our own and not kopf's peering: peering freezes every operator when it sees
another, elects nobody, and would not pause what runs outside kopf's handlers (the
report endpoint, the publisher, the safety pass). So the election runs *before*
kopf: a standby starts no handler, no loop and no report endpoint (it answers
probes and refuses reports, ``standby.py``) until it holds the Lease.

The rules are client-go's ``leaderelection`` (kube-controller-manager's), on the
same Lease fields, so ``kubectl get lease`` reads as it does for theirs:

- a candidate takes the Lease when it is absent, released (no holder), or expired:
  its record has not changed for ``leaseDurationSeconds`` *by this replica's own
  clock* (the time it last saw the record change, not the record's renewTime: the
  nodes' clocks need not agree);
- the holder renews every ``retry`` seconds; when no renewal has succeeded for
  ``renew_deadline`` (shorter than the lease) it stops leading at once (the caller
  exits the process, as controller-runtime does, and the kubelet restarts it as a
  candidate): it has stopped before any standby may take over. Renewals and the
  deadline run on threads of their own (``Elector.keep``), never on the event loop,
  which a busy operator starves;
- every write is a replace carrying the read's resourceVersion: of two candidates
  racing for an expired Lease one wins, the other gets a 409 and reads again;
- on a clean stop the holder releases the Lease (empty holder), so a standby takes
  over at its next retry instead of waiting out the lease.

Every replica is Ready (alive is enough: a rollout and a disruption budget count
Ready pods, and a standby that is never Ready would stall both). Reports reach the
leader alone by a label instead (``PodMark``, Patroni's way): the leader puts
``LEADER_LABEL`` on its own pod once it holds the Lease, the chart's Service selects
it, and every replica takes it off its own pod before it serves anything (a restarted
container's pod still carries its predecessor's label). A leader killed outright
leaves the label on a pod whose container is not running, which no Service routes to.

The decisions are pure functions; ``Elector`` adds the API calls and the clock.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import random
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger(__name__)

# On the leader's own pod; the chart's Service selects it.
LEADER_LABEL = "kvferry.io/operator-leader"

LEASE_SECONDS = 15.0
RENEW_DEADLINE_SECONDS = 10.0
RETRY_SECONDS = 2.0


@dataclass(frozen=True)
class Record:
    """The Lease's spec as read (``holder`` "" when released or never held)."""

    holder: str
    duration: float
    acquire_time: str | None
    transitions: int
    resource_version: str

    @classmethod
    def of(cls, lease: dict[str, Any]) -> Record:
        spec = lease.get("spec") or {}
        meta = lease.get("metadata") or {}
        return cls(
            holder=spec.get("holderIdentity") or "",
            duration=float(spec.get("leaseDurationSeconds") or LEASE_SECONDS),
            acquire_time=spec.get("acquireTime"),
            transitions=int(spec.get("leaseTransitions") or 0),
            resource_version=str(meta.get("resourceVersion") or ""),
        )


TAKE, RENEW, WAIT = "take", "renew", "wait"


def decide(record: Record | None, me: str, expired: bool) -> str:
    """What a candidate does with the Lease as read: take it (absent, released or
    expired), renew it (ours), or wait (another's, still live)."""
    if record is None or not record.holder or (expired and record.holder != me):
        return TAKE
    if record.holder == me:
        return RENEW
    return WAIT


def micro_time(now: float) -> str:
    """A Lease's MicroTime (RFC 3339 with microseconds, UTC)."""
    return datetime.datetime.fromtimestamp(now, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%f") + "Z"


def spec_for(record: Record | None, me: str, duration: float, now: float, action: str) -> dict:
    """The Lease spec a candidate writes for ``action`` (take or renew)."""
    stamp = micro_time(now)
    if action == RENEW and record is not None:
        return {
            "holderIdentity": me,
            "leaseDurationSeconds": int(duration),
            "acquireTime": record.acquire_time or stamp,
            "renewTime": stamp,
            "leaseTransitions": record.transitions,
        }
    # A change of holder counts a transition (client-go's leaderTransitions).
    changed = record is not None and bool(record.holder) and record.holder != me
    return {
        "holderIdentity": me,
        "leaseDurationSeconds": int(duration),
        "acquireTime": stamp,
        "renewTime": stamp,
        "leaseTransitions": (record.transitions if record else 0) + (1 if changed else 0),
    }


class Observed:
    """When this replica last saw the record change: the clock expiry is judged by."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._key: tuple[Any, ...] | None = None
        self._at = 0.0

    def expired(self, record: Record) -> bool:
        # The resourceVersion changes with every renewal; the holder alone would not.
        key = (record.holder, record.resource_version)
        now = self._clock()
        if key != self._key:
            self._key, self._at = key, now
            return False
        return now - self._at > record.duration


class LeaseApi(Protocol):
    def get_lease(self, namespace: str, name: str) -> dict[str, Any] | None: ...

    def create_lease(self, namespace: str, name: str, spec: dict[str, Any]) -> bool: ...

    def replace_lease(
        self, namespace: str, name: str, spec: dict[str, Any], resource_version: str
    ) -> bool: ...


def identity(pod_name: str) -> str:
    """The holder identity: the pod, and a per-process suffix (client-go's
    hostname_uuid), so a restarted container never mistakes its predecessor's
    Lease for its own."""
    return f"{pod_name}_{uuid.uuid4().hex[:8]}"


def check_timings(retry: float, renew_deadline: float, lease: float) -> None:
    """A holder must give up (renew deadline) before a standby may take over (lease),
    and try more than once before it gives up. Raises ValueError naming the settings."""
    if not 0 < retry < renew_deadline < lease:
        raise ValueError(
            "KVFERRY_LEADER_RETRY_SECONDS < KVFERRY_LEADER_RENEW_SECONDS < "
            f"KVFERRY_LEADER_LEASE_SECONDS is needed (got {retry:g}, {renew_deadline:g}, "
            f"{lease:g})"
        )


class Elector:
    def __init__(
        self,
        kube: LeaseApi,
        namespace: str,
        name: str,
        me: str,
        lease_seconds: float = LEASE_SECONDS,
        renew_deadline: float = RENEW_DEADLINE_SECONDS,
        retry_seconds: float = RETRY_SECONDS,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        check_timings(retry_seconds, renew_deadline, lease_seconds)
        self.kube = kube
        self.namespace = namespace
        self.name = name
        self.me = me
        self.lease_seconds = lease_seconds
        self.renew_deadline = renew_deadline
        self.retry_seconds = retry_seconds
        self._clock = clock
        self._wall = wall
        self._observed = Observed(clock)
        self.holder = ""  # the holder as last read, for the standby's log
        # When the last write that kept the Lease was sent (this clock): the deadline
        # counts from the request, not from its answer, as client-go's does.
        self.renewed_at: float | None = None
        # Its own thread for the standby's tries (acquire): never behind kopf's handlers.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvferry-lease")

    def try_once(self) -> bool:
        """One read and, when due, one write; True when this replica holds the Lease
        afterwards (``renewed_at`` then says when the read was sent). API trouble is
        False (the deadline decides what it costs)."""
        sent = self._clock()
        held = self._attempt()
        if held:
            self.renewed_at = sent
        return held

    def _attempt(self) -> bool:
        try:
            lease = self.kube.get_lease(self.namespace, self.name)
            record = Record.of(lease) if lease is not None else None
            if record is None:
                spec = spec_for(None, self.me, self.lease_seconds, self._wall(), TAKE)
                return self.kube.create_lease(self.namespace, self.name, spec)
            self.holder = record.holder
            action = decide(record, self.me, self._observed.expired(record))
            if action == WAIT:
                return False
            spec = spec_for(record, self.me, self.lease_seconds, self._wall(), action)
            return self.kube.replace_lease(self.namespace, self.name, spec, record.resource_version)
        except Exception as exc:  # the API server is away: the next try, or the deadline
            log.warning("lease %s/%s: %s", self.namespace, self.name, str(exc)[:200])
            return False

    async def _try(self) -> bool:
        return await asyncio.get_running_loop().run_in_executor(self._executor, self.try_once)

    def _pause(self) -> float:
        # client-go's jitter: standbys started together do not ask together.
        return self.retry_seconds * (1 + 0.2 * random.random())

    async def acquire(self) -> None:
        """Return once this replica holds the Lease."""
        logged = ""
        while not await self._try():
            if self.holder != logged:
                logged = self.holder
                log.info("standby: lease %s/%s held by %s", self.namespace, self.name, logged)
            await asyncio.sleep(self._pause())
        log.info("leading: lease %s/%s acquired as %s", self.namespace, self.name, self.me)

    def _left(self) -> float:
        renewed = self.renewed_at if self.renewed_at is not None else self._clock()
        return renewed + self.renew_deadline - self._clock()

    def renew_forever(self, stop: threading.Event) -> bool:
        """Blocking: renew every ``retry`` seconds until ``stop`` is set (False) or the
        Lease is lost (True): another holder seen, or no renewal for the deadline."""
        while not stop.wait(self.retry_seconds):
            if self.try_once():
                continue
            if self.holder and self.holder != self.me:
                log.error("lost lease %s/%s to %s", self.namespace, self.name, self.holder)
                return True
            if self._left() <= 0:
                log.error(
                    "lost lease %s/%s: not renewed for %.0fs",
                    self.namespace,
                    self.name,
                    self.renew_deadline,
                )
                return True
        return False

    def keep(self, on_lost: Callable[[], None], period: float | None = None) -> threading.Event:
        """Hold the Lease from threads of its own, not the event loop: a busy operator
        starves its loop (at 1,000 servers a renewal on the loop waited 30 s, and the
        standby had held the Lease for 31 s when the old leader noticed). One thread
        renews; a watchdog beside it calls ``on_lost`` once the last renewal is older
        than the deadline, also while a renewal call hangs (a slow API server's
        timeouts and the client's own retries can outlast the lease). ``on_lost``
        runs on one of those threads. Set the returned event to stop both (a clean
        stop, before the Lease is released)."""
        stop = threading.Event()
        if self.renewed_at is None:
            self.renewed_at = self._clock()
        fired = threading.Lock()

        def lost_once() -> None:
            if fired.acquire(blocking=False):
                # The renewer stops first: once the watchdog has called the Lease lost,
                # a renewal that works again (the API server back) must not hold it on.
                stop.set()
                on_lost()

        def renew() -> None:
            if self.renew_forever(stop):
                lost_once()

        pause = period if period is not None else self.retry_seconds / 2

        def watch() -> None:
            while not stop.wait(pause):
                if self._left() <= 0:
                    log.error(
                        "lost lease %s/%s: not renewed for %.0fs (watchdog)",
                        self.namespace,
                        self.name,
                        self.renew_deadline,
                    )
                    lost_once()
                    return

        for target, name in ((renew, "kvferry-lease-renew"), (watch, "kvferry-lease-watchdog")):
            threading.Thread(target=target, name=name, daemon=True).start()
        return stop

    def release(self) -> None:
        """Give the Lease up (a clean stop): a standby takes over at its next try."""
        try:
            lease = self.kube.get_lease(self.namespace, self.name)
            record = Record.of(lease) if lease is not None else None
            if record is None or record.holder != self.me:
                return
            spec = {
                "holderIdentity": None,
                "leaseDurationSeconds": 1,
                "acquireTime": record.acquire_time,
                "renewTime": micro_time(self._wall()),
                "leaseTransitions": record.transitions,
            }
            if self.kube.replace_lease(self.namespace, self.name, spec, record.resource_version):
                log.info("released lease %s/%s", self.namespace, self.name)
        except Exception as exc:  # it expires on its own
            log.warning("lease %s/%s not released: %s", self.namespace, self.name, exc)


class PodApi(Protocol):
    def label_pod(self, namespace: str, name: str, labels: dict[str, str | None]) -> bool: ...


class PodMark:
    """``LEADER_LABEL`` on this replica's own pod: on (leading) or off."""

    def __init__(self, kube: PodApi, namespace: str, pod: str, max_pause: float = 10.0) -> None:
        self.kube = kube
        self.namespace = namespace
        self.pod = pod
        self.max_pause = max_pause
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvferry-mark")

    def set_once(self, leading: bool) -> bool:
        """One patch; True when it landed or the pod is gone (nothing left to mark)."""
        value = "true" if leading else None
        try:
            if not self.kube.label_pod(self.namespace, self.pod, {LEADER_LABEL: value}):
                log.warning("pod %s/%s not found: not labelled", self.namespace, self.pod)
            return True
        except Exception as exc:
            if getattr(exc, "status", None) == 403:
                log.error(
                    "pod %s/%s: may not patch its own labels (the chart's Role "
                    "<release>-kvferry-leader-election grants patch on pods): %s",
                    self.namespace,
                    self.pod,
                    str(exc)[:200],
                )
                # Without the right the label was never set: nothing to take off.
                return not leading
            log.warning(
                "pod %s/%s: %s %s: %s",
                self.namespace,
                self.pod,
                "labelling" if leading else "unlabelling",
                LEADER_LABEL,
                str(exc)[:200],
            )
            return False

    async def set_once_in_order(self, leading: bool) -> bool:
        """One patch, after any still running (one thread: they land in order)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self.set_once, leading)

    async def set(self, leading: bool) -> None:
        """Patch until it lands, pausing 1, 2, 4 ... ``max_pause`` s between tries:
        until then reports go nowhere (leading) or may reach a standby (not)."""
        pause = 1.0
        while not await self.set_once_in_order(leading):
            await asyncio.sleep(pause)
            pause = min(pause * 2, self.max_pause)
        if leading:
            log.info("pod %s/%s labelled %s=true", self.namespace, self.pod, LEADER_LABEL)
