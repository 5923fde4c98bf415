"""kopf registrations. Thin: read inputs, call the pure cores, write through kube.py.

Reconcile, in named steps:
  1. parse the server spec (defaults from the CRD);
  2. render the children (pure);
  3. server-side apply each child under our field manager, but only to an object
     that is absent or ours (``ownership.py``: a name another object holds is a
     conflict, left alone and shown as ``Degraded``); keep going when one fails,
     so an independent child still lands; a server whose apply may land later is
     retried with backoff (``retries.py``, ``backoff.py``);
  4. fold the StatefulSets and pods (from indexes) into status;
  5. write status only when it changed, then emit Events for the changes.

The operator keeps no state on the DisaggregatedServer itself: no kopf
progress annotations, no finalizer (owner references let the garbage
collector delete children). It reacts to watch events of the server and of
its children, with a timer as the safety net. The only thing it writes to a
server is ``status``, so a GitOps tool owning the spec never sees drift.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import enum
import functools
import logging
import random
import time
from collections.abc import Callable, Iterable
from typing import Any

import kopf
from kubernetes.dynamic.exceptions import ResourceNotFoundError

from kvferry_wire.report import TRANSPORT_UNKNOWN

from . import (
    aggregate,
    api,
    backoff,
    drift,
    engine_config,
    held,
    hostpaths,
    metrics,
    ownership,
    policy,
    prerequisites,
    publisher,
    render,
    report_endpoint,
    reports,
    scaler,
    status,
)
from .held import Held
from .kube import ApiException, Kube, api_error_message, is_namespace_terminating, is_transient
from .probe import PrerequisiteProbe
from .retries import ApplyRetries
from .settings import Settings
from .statuswriter import Coalescer, StatusMemory

SERVER = (api.GROUP, api.VERSION, api.SERVER_PLURAL)
SCALERS = (api.GROUP, api.VERSION, api.SCALER_PLURAL)
OURS = {api.LABEL_MANAGED_BY: api.FIELD_MANAGER}

# Event reasons.
EVENT_APPLIED = "Applied"
EVENT_APPLY_FAILED = "ApplyFailed"
EVENT_INVALID = "InvalidSpec"
EVENT_DRIFT = "DriftCorrected"

# Child kinds we watch for drift: (group, version, plural, apiVersion, kind).
CHILD_KINDS = [
    ("apps", "v1", "statefulsets", "apps/v1", "StatefulSet"),
    ("", "v1", "services", "v1", "Service"),
    ("", "v1", "configmaps", "v1", "ConfigMap"),
    ("policy", "v1", "poddisruptionbudgets", "policy/v1", "PodDisruptionBudget"),
    ("networking.k8s.io", "v1", "networkpolicies", "networking.k8s.io/v1", "NetworkPolicy"),
    (api.GROUP, api.VERSION, api.STATUS_PLURAL, api.API_VERSION, api.STATUS_KIND),
]

# ------------------------------------------------------------------ lifecycle


@kopf.on.startup()
async def configure(
    settings: kopf.OperatorSettings, memo: kopf.Memo, logger: logging.Logger, **_: Any
) -> None:
    """Operator-wide settings and shared objects, kept in ``memo`` (main.run puts the
    operator's Settings and watched namespaces there before kopf starts)."""
    # Re-establish watches every 5 min: proxies and load balancers silently drop
    # idle long-polls, and a dead watch would freeze the operator's view.
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = 30
    # Events at INFO and above become Kubernetes Events on the server.
    settings.posting.level = logging.INFO
    # The handlers are sync and wait on the API server, not on the CPU: kopf's default
    # pool (CPU count + 4 threads: 6 on a 2-core node, however idle) queued every
    # event behind a few in-flight requests (docs/performance.md, operator scale).
    settings.execution.max_workers = 32
    memo.executor = settings.execution.executor  # for the coroutine handlers' threads
    memo.held = Held()
    ours: Settings = memo.settings
    memo.kube = Kube()
    api.load_crd(api.SERVER_KIND)  # parse_server's defaults, read before the first burst
    memo.probe = PrerequisiteProbe(memo.kube, ttl=ours.prerequisites_cache_seconds)
    memo.indexes = {}  # filled by the first server event: (statefulsets, pods)
    memo.claims = ownership.Claims()
    kube_for_names: Kube = memo.kube
    # A burst of new servers in a namespace: one list per kind there, not a read per child.
    memo.names = ownership.NameLookup(kube_for_names.get, kube_for_names.list_metadata)
    memo.status_memory = StatusMemory()
    loop = asyncio.get_running_loop()
    memo.status_queue = Coalescer(
        loop,
        lambda key: _refresh_from_index(memo, key),
        quiet=ours.status_quiet_seconds,
        most=ours.status_most_seconds,
    )
    memo.tasks = [loop.create_task(_resync_forever(memo, ours, logger))]
    kube_for_retries: Kube = memo.kube
    claims: ownership.Claims = memo.claims

    def retry(namespace: str, name: str) -> bool:
        try:
            return retry_apply(
                namespace,
                name,
                kube_for_retries,
                ours,
                logger,
                claims,
                _seen(memo),
                memo.held,
                _unreleasable(memo),
            )
        finally:
            # What the retry achieved shows in status (observedGeneration, ApplyFailed)
            # without waiting for a watch event or the safety pass.
            memo.status_queue.request((namespace, name))

    memo.retries = ApplyRetries(loop, retry)
    memo.reports = reports.ReportStore()
    memo.report_runner = None
    residency = publisher.Publisher(
        memo.kube,
        memo.reports,
        stale_after=ours.report_stale_seconds,
        min_write_seconds=ours.min_status_write_seconds,
        emit=memo.kube.create_event,
        prune_after=ours.report_prune_seconds,
        reapply=memo.retries.failed,
    )
    memo.publisher = residency
    if ours.tls_cert_file and ours.tls_key_file:
        kube: Kube = memo.kube
        # Short deadlines: a sidecar retries on its next push, a thread must not wait.
        deadline = (3.0, 5.0)
        app = report_endpoint.app_factory(
            memo.reports,
            review_token=lambda token: kube.review_token(
                token, report_endpoint.REPORT_TOKEN_AUDIENCE, timeout=deadline
            ),
            get_pod=lambda ns, name: kube.get_pod(ns, name, timeout=deadline),
            get_statefulset=lambda ns, name: kube.get(
                "apps/v1", "StatefulSet", ns, name, timeout=deadline
            ),
            # Each server's live policy as the publisher last saw it: no API call.
            policy_for=residency.policy,
        )
        tls = report_endpoint.tls_context(ours.tls_cert_file, ours.tls_key_file)
        memo.report_runner = await report_endpoint.serve(
            app, ours.report_host, ours.report_port, tls
        )
        logger.info("report endpoint on https://%s:%d", ours.report_host, ours.report_port)
    else:
        logger.warning(
            "report endpoint off: set KVFERRY_TLS_CERT_FILE and KVFERRY_TLS_KEY_FILE "
            "(the chart does); KVCacheStatus will show no reports"
        )
    memo.tasks.append(
        loop.create_task(publisher.publish_forever(residency, ours.publish_seconds, logger))
    )
    memo.metrics_runner = None
    if ours.metrics_port:
        registry = metrics.registry_for(lambda: list(residency.decisions.values()))
        try:
            memo.metrics_runner = await report_endpoint.serve(
                metrics.app_factory(registry), ours.metrics_host, ours.metrics_port, None
            )
        except OSError as exc:  # dashboards lose a panel; reconciling must go on
            logger.error("metrics endpoint off: port %d: %s", ours.metrics_port, exc)
        else:
            logger.info("metrics on http://%s:%d/metrics", ours.metrics_host, ours.metrics_port)


@kopf.on.cleanup()
async def close(memo: kopf.Memo, **_: Any) -> None:
    for task in memo.tasks:
        task.cancel()
    await memo.status_queue.close()
    await memo.retries.close()
    if memo.report_runner is not None:
        await memo.report_runner.cleanup()
    if memo.metrics_runner is not None:
        await memo.metrics_runner.cleanup()
    memo.kube.close()


# ------------------------------------------------------------------ indexes


# The indexes and the pod and node handlers are coroutines: kopf runs a plain function
# on its handler threads, and an object's events wait in its queue, each holding its
# whole body, while every thread is busy applying (1,000 new servers). These do no
# I/O and little work, so they run on the event loop and never wait for a thread.


def _metadata(body: kopf.Body) -> dict[str, Any]:
    """The object's metadata without managedFields, which nothing here reads and
    which is most of its size."""
    meta = dict(body.metadata)
    meta.pop("managedFields", None)
    return meta


@kopf.index(*SERVER)
async def servers(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict[Any, Any]:
    return {
        (namespace, name): {
            "metadata": _metadata(body),
            "spec": dict(body.spec),
            "status": dict(body.status),
        }
    }


@kopf.index("apps", "v1", "statefulsets", labels=OURS)
async def statefulsets(
    namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any
) -> dict[Any, Any]:
    return {
        (
            namespace,
            labels.get(api.LABEL_INSTANCE),
            labels.get(api.LABEL_ROLE),
        ): status.role_observed_from(
            {
                "metadata": dict(body.metadata),
                "spec": {"replicas": body.spec.get("replicas")},
                "status": dict(body.status),
            }
        )
    }


@kopf.index(*SCALERS, labels=OURS)
async def rolescalers(
    namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any
) -> dict[Any, Any]:
    """(namespace, server, role) -> the RoleScaler as seen (scaler.py: its spec.replicas
    is the role's count under scaling mode External)."""
    return {
        (namespace, labels.get(api.LABEL_INSTANCE), labels.get(api.LABEL_ROLE)): {
            "metadata": _metadata(body),
            "spec": dict(body.spec),
            "status": dict(body.status),
        }
    }


# (namespace, server) -> the server's RoleScalers by role, as the watch shows them.
Seen = Callable[[tuple[str, str]], dict[str, dict[str, Any]]]
# A server's unreleasable pinned handles as its fresh decode reports say (None: none
# fresh): Publisher.unreleasable, the ceiling gate's input.
Unreleasable = Callable[[tuple[str, str]], int | None]


def _seen(memo: kopf.Memo) -> Seen | None:
    """The RoleScaler index as a lookup, once a server event has handed it over; None
    before (apply_children then reads the RoleScalers it needs)."""
    indexes = getattr(memo, "indexes", None) or {}
    index: kopf.Index | None = indexes.get("rolescalers")
    if index is None:
        return None

    def lookup(key: tuple[str, str]) -> dict[str, dict[str, Any]]:
        # The index is keyed on labels anyone may copy: the server's
        # RoleScaler is the one of its name, <server>-<role>; a look-alike of another
        # name is never it, whatever its labels or controller reference say (it would
        # make the count not known, a ChildConflict, or lend its own replicas).
        out = {}
        for role in api.ROLES:
            name = render.name_for(key[1], role)
            for obj in index.get((*key, role), []):
                if (obj.get("metadata") or {}).get("name") == name:
                    out[role] = obj
                    break
        return out

    return lookup


def _scaled(body: dict[str, Any], seen: Seen | None) -> dict[str, int]:
    """The spec.replicas of the server's own RoleScalers, by role (for api.Server)."""
    if seen is None:
        return {}
    meta = body.get("metadata") or {}
    uid = meta.get("uid") or ""
    out = {}
    for role, obj in seen((meta.get("namespace") or "default", meta.get("name", ""))).items():
        replicas = scaler.replicas_of(obj)
        if replicas is not None and ownership.is_ours(obj, uid):
            out[role] = replicas
    return out


def parse(body: dict[str, Any], seen: Seen | None = None) -> api.Server:
    """The server with its RoleScalers' counts: every path that renders or computes
    status parses through here, so none sees the spec's count where a RoleScaler's
    rules (a drift check that would re-apply on every pass, a Ready that never comes)."""
    return api.parse_server(body, _scaled(body, seen))


@kopf.index("", "v1", "pods", labels={api.LABEL_SERVER: kopf.PRESENT})
async def pods(namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any) -> dict[Any, Any]:
    return {
        (namespace, labels[api.LABEL_SERVER]): status.pod_state_from(
            {
                "metadata": dict(body.metadata),
                "spec": {"nodeName": body.spec.get("nodeName")},
                "status": dict(body.status),
            }
        )
    }


@kopf.index("", "v1", "nodes")
async def nodes(name: str, status: kopf.Status, **_: Any) -> dict[Any, Any]:
    """Node name -> Ready, so status can say when pods sit on a node that is gone."""
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )
    return {name: ready}


def _nodes_seen(nodes: kopf.Index) -> dict[str, bool] | None:
    seen = {name: all(list(nodes.get(name, []))) for name in nodes}
    return seen or None


# ------------------------------------------------------------------ reconcile


class Applied(enum.Enum):
    """What an apply achieved; true only when every child landed."""

    ALL = "all"
    RETRY = "retry"  # something did not land and may on a later try
    NEVER = "never"  # retrying cannot help: an invalid spec, a terminating namespace

    def __bool__(self) -> bool:
        return self is Applied.ALL


def apply_children(
    body: dict[str, Any],
    kube: Kube,
    settings: Settings,
    logger: logging.Logger,
    only: tuple[str, str] | None = None,
    claims: ownership.Claims | None = None,
    post: Callable[[dict[str, Any], str, str, str], None] | None = None,
    seen: Seen | None = None,
    names: ownership.NameLookup | None = None,
    landed: Held | None = None,
    unreleasable: Unreleasable | None = None,
) -> Applied:
    """Steps 1-3. ``only`` = (kind, name) applies just that child. ``claims`` holds the
    children known to be ours and records conflicts and the outcome for status (a
    throwaway one without it: every child is read first). ``post`` posts Events
    outside a kopf handler (the resync loop, the retries), where kopf.warn cannot.
    ``seen``: the RoleScalers as the watch shows them (read by name without it).
    ``names``: what holds a child's name, one list for a burst of new servers
    (``ownership.NameLookup``; a read per child without it). A whole apply is marked
    under way in ``claims`` while it runs (the safety pass leaves it alone).
    ``landed``: each child that lands is recorded there as holding our fields.
    ``unreleasable``: the publisher's count of the server's unreleasable pins, for the
    ceiling gate of a whole apply (``gate_ceiling``; no gate without it)."""
    claims = claims if claims is not None else ownership.Claims()
    args = (body, kube, settings, logger, only, claims, post, seen, names, landed, unreleasable)
    if only is not None:
        return _apply_children(*args)
    meta = body.get("metadata") or {}
    # The key parse_server gives it (the safety pass asks by that key).
    with claims.applying((meta.get("namespace") or "default", meta.get("name", ""))):
        return _apply_children(*args)


def _apply_children(
    body: dict[str, Any],
    kube: Kube,
    settings: Settings,
    logger: logging.Logger,
    only: tuple[str, str] | None,
    claims: ownership.Claims,
    post: Callable[[dict[str, Any], str, str, str], None] | None,
    seen: Seen | None,
    names: ownership.NameLookup | None,
    landed: Held | None = None,
    unreleasable: Unreleasable | None = None,
) -> Applied:
    def warn(reason: str, message: str) -> None:
        if post is None:
            kopf.warn(body, reason=reason, message=message)
            return
        try:
            post(body, "Warning", reason, message)
        except Exception as exc:  # an Event is news, never a reason to stop applying
            logger.warning("event %s not posted: %s", reason, _brief(exc))

    try:
        server = parse(body, seen)
    except api.SpecError as exc:
        warn(EVENT_INVALID, str(exc))
        return Applied.NEVER
    server_key = (server.namespace, server.name)
    ok = Applied.ALL
    refusals: list[str] = []
    # Step 1b: each External role's count, from its RoleScaler (created when absent).
    try:
        server, counted, why = resolve_scalers(server, kube, claims, seen, logger, only is None)
    except Exception as exc:
        if isinstance(exc, ResourceNotFoundError):
            why = (
                f"{api.SCALER_KIND}: the CRD rolescalers.kvferry.io is not installed; apply "
                "crds/kvferry.io_rolescalers.yaml (helm upgrade installs it) or set "
                "spec.<role>.scaling.mode: Static"
            )
            ok = Applied.NEVER
        elif isinstance(exc, ApiException):
            why = f"{api.SCALER_KIND}: {api_error_message(exc)}"
            ok = Applied.RETRY if is_transient(exc) or exc.status == 409 else Applied.NEVER
        elif is_transient(exc):
            logger.warning("apply deferred, API server unreachable: %s", _brief(exc))
            return Applied.RETRY
        else:
            raise
        counted = False
    if why:
        logger.error("apply failed: %s", why)
        warn(EVENT_APPLY_FAILED, why)
        refusals.append(why)
        ok = Applied.RETRY if ok is Applied.RETRY else Applied.NEVER
    last = claims.last_apply(server_key)
    if only is None and unreleasable is not None:
        try:
            ran = last.ceiling if last is not None else None
            server = gate_ceiling(body, server, kube, unreleasable, warn, ran)
        except Exception as exc:
            if not is_transient(exc):
                raise
            logger.warning("apply deferred, API server unreachable: %s", _brief(exc))
            return Applied.RETRY
    elif (
        only is not None
        and last is not None
        and last.ceiling is not None
        and last.generation == server.generation
    ):
        # A one-child re-apply (drift) keeps the ceiling the last whole apply rendered:
        # only a whole apply moves it, through the gate (the owner the drift check saw
        # may come from a watch that has not shown the gate's status write yet).
        wanted = server.spec.cache_tuning.max_retention_seconds
        kept = last.ceiling if last.ceiling < wanted else None
        server = dataclasses.replace(server, ceiling_held=kept)
    refused = settings_refusal(server, settings)
    # Pods start only isolated: a NetworkPolicy that did not land holds the StatefulSets.
    isolated = True
    children = render.render(server, settings.render_context())
    # Only a whole apply's outcome records it (a one-child re-apply is drift).
    rendered = render.digest(children) if only is None else None
    for child in children:
        meta = child["metadata"]
        # A StatefulSet re-applied alone (drift) still goes with the NetworkPolicy
        # (rendered first): its pods must not come back without it if it went too.
        with_policy = only is not None and only[0] == "StatefulSet"
        if (
            only
            and (child["kind"], meta["name"]) != only
            and not (with_policy and child["kind"] == "NetworkPolicy")
        ):
            continue
        key = (child["kind"], meta["namespace"], meta["name"])
        if not counted and child["kind"] in ("StatefulSet", "ConfigMap"):
            # Their replicas and topology would come from the spec where a RoleScaler
            # rules: they keep what they run (the refusal or conflict says why).
            logger.warning("not applied, a role's RoleScaler count is not known: %s", key)
            continue
        if child["kind"] in ("StatefulSet", "ConfigMap") and (refused or not isolated):
            # The ConfigMap too: its topology is read by the pods that run, and a new
            # count in it (a scale in the same edit) would name peers that never come.
            # The status says why (refresh_status): HostPathNotAllowed,
            # PodTemplateNotAllowed, or the NetworkPolicy's ApplyFailed Event.
            logger.warning("not applied: %s %s", key, refused or "its NetworkPolicy did not land")
            # A refusal stays until the spec or the operator's settings change; the
            # NetworkPolicy's failure already set ok.
            if refused and ok is not Applied.RETRY:
                ok = Applied.NEVER
            continue
        if child["kind"] == "StatefulSet" and any(
            ownership.feeds_pods(c, server.name) for c in claims.conflicts(server_key)
        ):
            logger.warning("not applied while its pods' ConfigMap or peers are taken: %s", key)
            ok = Applied.RETRY if ok is Applied.RETRY else Applied.NEVER
            continue
        try:
            taken = _taken(child, server, kube, claims, names)
            if taken is not None:
                claims.record(server_key, key, taken)
                logger.warning("not applied, the name is taken: %s", taken)
                ok = Applied.RETRY if ok is Applied.RETRY else Applied.NEVER
                continue
            applied = kube.apply(child)
        except Exception as exc:
            if not isinstance(exc, ApiException):
                if not is_transient(exc):
                    raise
                # The API server cannot be reached: nothing else would land now either.
                # A retry (retries.py), the resync loop or the next watch event applies
                # everything again.
                logger.warning("apply deferred, API server unreachable: %s", _brief(exc))
                return Applied.RETRY
            # An answer about this child: keep going, one bad child must not block the rest.
            if is_namespace_terminating(exc):
                return Applied.NEVER  # everything here is about to go; nothing to restore
            # A refusal (invalid, forbidden) fails the same way on the next try: the
            # resync tries it again, a backoff would only repeat the Warning.
            retry = is_transient(exc) or exc.status == 409
            ok = Applied.RETRY if retry or ok is Applied.RETRY else Applied.NEVER
            if child["kind"] == "NetworkPolicy":
                isolated = False
            message = f"{child['kind']} {meta['name']}: {api_error_message(exc)}"
            logger.error("apply failed: %s", message)
            warn(EVENT_APPLY_FAILED, message)
            refusals.append(message)
            continue
        claims.remember(key, server.uid)
        claims.record(server_key, key, None)
        if landed is not None and isinstance(applied, dict):
            # Its watch event, and the status updates after it, hold what we just sent.
            landed.record(key, held.fingerprint(applied, body, server.scaled))
        if child["kind"] == api.STATUS_KIND and not applied.get("status"):
            kube.patch_status(
                api.API_VERSION,
                api.STATUS_KIND,
                meta["namespace"],
                meta["name"],
                {**aggregate.NO_REPORTS_STATUS, "lastUpdateTime": api.iso_time()},
            )
    if only is None:
        # What status may call observed: only a generation whose children all landed.
        outcome = ownership.ApplyOutcome(
            server.generation,
            ok is Applied.ALL,
            tuple(refusals),
            refused,
            render=rendered,
            finished=time.monotonic(),
            ceiling=server.retention_ceiling,
        )
        claims.applied(server_key, outcome)
    return ok


def gate_ceiling(
    body: dict[str, Any],
    server: api.Server,
    kube: Kube,
    unreleasable: Unreleasable,
    warn: Callable[[str, str], None],
    ran: int | None = None,
) -> api.Server:
    """The server with its ceiling gate decided (``policy.ceiling_hold``), recorded in
    ``status.retention`` first (``ceilingHeld``, and ``ceiling`` in force), so every
    later render of the server (drift checks, a new leader's) reads the same; the
    publisher lifts a hold once no pin is unreleasable. The body is left as it came.

    What decode runs is ``ran`` (this process's last whole apply rendered it), else
    what its StatefulSet carries (read once: a process's first apply of the server),
    never status's ``ceiling`` alone: a publisher pass that read the spec's raise
    before this apply writes it there, and a raise taken from there would skip the
    gate."""
    retention = (body.get("status") or {}).get("retention") or {}
    recorded = retention.get("ceiling")
    if not isinstance(recorded, int) or isinstance(recorded, bool) or recorded <= 0:
        recorded = None
    if ran is None:
        if recorded is None:
            return server  # nobody reported yet: no pin is known, nothing to hold for
        ran = running_decode_ceiling(kube, server) or recorded
    wanted = server.spec.cache_tuning.max_retention_seconds
    # Counted only for a raise: the count may cost a read (Publisher.unreleasable).
    count = unreleasable((server.namespace, server.name)) if wanted > ran else None
    hold = policy.ceiling_hold(wanted, ran, count)
    gated = dataclasses.replace(server, ceiling_held=hold)
    want = {"ceiling": gated.retention_ceiling, "ceilingHeld": hold}
    if (recorded is not None or hold is not None) and want != {
        "ceiling": recorded,
        "ceilingHeld": server.ceiling_held,
    }:
        kube.patch_status(
            api.API_VERSION, api.SERVER_KIND, server.namespace, server.name, {"retention": want}
        )
        if hold is not None and server.ceiling_held != hold:
            warn(publisher.EVENT_CEILING_HELD, policy.hold_message(wanted, hold, count or 0))
    return gated


def running_decode_ceiling(kube: Kube, server: api.Server) -> int | None:
    """The ``decoder_kv_blocks_ttl`` the server's decode StatefulSet carries; None when
    it has none of ours."""
    sts = kube.get("apps/v1", "StatefulSet", server.namespace, render.child_name(server, "decode"))
    if sts is None or not ownership.is_ours(sts, server.uid):
        return None
    return engine_config.decoder_ttl_of(sts)


def settings_refusal(server: api.Server, settings: Settings) -> str | None:
    """Why the operator's settings refuse the server (its hostPath, a podTemplate field):
    the StatefulSets and the ConfigMap are not applied while they do. None: not refused."""
    return hostpaths.refusal(server, settings.host_path_prefixes) or (
        settings.pod_template_refusal(server)
    )


# What a settings refusal holds back (apply_children): not drift while it does.
HELD_KINDS = ("StatefulSet", "ConfigMap")


def resolve_scalers(
    server: api.Server,
    kube: Kube,
    claims: ownership.Claims,
    seen: Seen | None,
    logger: logging.Logger,
    prune: bool = True,
) -> tuple[api.Server, bool, str]:
    """The server with each External role's count from its RoleScaler, whether every
    such count is known, and why not (a refusal for the Event; "" when none). Creates
    a missing RoleScaler seeded at the role's current count and, with ``prune``,
    deletes the server's RoleScalers of roles back in Static (scaler.py's rules)."""
    key = (server.namespace, server.name)
    found = seen(key) if seen is not None else {}
    scaled: dict[str, int] = {}
    counted, why = True, ""
    external = scaler.external_roles(server)
    for role in api.ROLES:
        name = scaler.scaler_name(server, role)
        child = (api.SCALER_KIND, server.namespace, name)
        if role not in external:
            claims.record(key, child, None)  # a conflict of a role no longer External
            continue
        obj = found.get(role) or kube.get(api.API_VERSION, api.SCALER_KIND, server.namespace, name)
        if obj is None:
            sts = kube.get(
                "apps/v1", "StatefulSet", server.namespace, render.child_name(server, role)
            )
            ours = sts if sts is not None and ownership.is_ours(sts, server.uid) else None
            seed = scaler.seed_replicas(server, role, ours)
            obj = kube.create(scaler.build_role_scaler(server, role, seed))
            if obj is None:  # created meanwhile (another pass): read what is there
                obj = kube.get(api.API_VERSION, api.SCALER_KIND, server.namespace, name)
            else:
                logger.info("created %s %s at %d replicas", api.SCALER_KIND, name, seed)
        taken = ownership.conflict(obj, api.SCALER_KIND, name, server.uid)
        claims.record(key, child, taken)
        replicas = scaler.replicas_of(obj) if obj is not None and taken is None else None
        if replicas is None:
            counted = False
            if obj is not None and taken is None:
                why = (
                    f"{api.SCALER_KIND} {name}: spec.replicas is missing or out of range; "
                    f"set it (kubectl scale rolescaler {name} --replicas N)"
                )
            continue
        scaled[role] = replicas
    if prune:
        for role in scaler.stale(
            server, {r: o for r, o in found.items() if ownership.is_ours(o, server.uid)}
        ):
            meta = found[role]["metadata"]
            kube.delete(
                api.API_VERSION, api.SCALER_KIND, server.namespace, meta["name"], meta["uid"]
            )
            logger.info("deleted %s %s: %s is Static again", api.SCALER_KIND, meta["name"], role)
    return dataclasses.replace(server, scaled=scaled), counted, why


def _taken(
    child: dict[str, Any],
    server: api.Server,
    kube: Kube,
    claims: ownership.Claims,
    names: ownership.NameLookup | None = None,
) -> ownership.Conflict | None:
    """The conflict when an object we do not control holds the child's name. A child
    known to be ours costs no read; any other is looked up once (a forced apply to it
    would take it over, and the garbage collector would delete it with the server):
    read by name, or from ``names``' list of its kind in a burst."""
    meta = child["metadata"]
    if server.uid and claims.owner((child["kind"], meta["namespace"], meta["name"])) == server.uid:
        return None
    where = (child["apiVersion"], child["kind"], meta["namespace"], meta["name"])
    existing = names.holder(*where, server.uid) if names is not None else kube.get(*where)
    return ownership.conflict(existing, child["kind"], meta["name"], server.uid)


def apply_or_retry(
    body: dict[str, Any],
    memo: kopf.Memo,
    logger: logging.Logger,
    only: tuple[str, str] | None = None,
) -> Applied:
    """apply_children, and a bounded retry of the whole server when it may land later."""
    claims: ownership.Claims | None = getattr(memo, "claims", None)
    result = apply_children(
        body,
        memo.kube,
        memo.settings,
        logger,
        only,
        claims,
        seen=_seen(memo),
        names=getattr(memo, "names", None),
        landed=getattr(memo, "held", None),
        unreleasable=_unreleasable(memo),
    )
    retries: ApplyRetries | None = getattr(memo, "retries", None)
    if result is Applied.RETRY and retries is not None:
        meta = body["metadata"]
        retries.failed(meta.get("namespace") or "default", meta["name"])
    return result


def retry_apply(
    namespace: str,
    name: str,
    kube: Kube,
    settings: Settings,
    logger: logging.Logger,
    claims: ownership.Claims | None = None,
    seen: Seen | None = None,
    landed: Held | None = None,
    unreleasable: Unreleasable | None = None,
) -> bool:
    """One retry of a server's apply, on its current object: True when done (all
    landed, the server is gone or being deleted, or retrying cannot help)."""
    body = kube.get(api.API_VERSION, api.SERVER_KIND, namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return True
    applied = apply_children(
        body,
        kube,
        settings,
        logger,
        None,
        claims,
        kube.create_event,
        seen=seen,
        landed=landed,
        unreleasable=unreleasable,
    )
    return applied is not Applied.RETRY


def check_prerequisites(
    server: api.Server,
    roles: dict[str, status.RoleObserved],
    probe: PrerequisiteProbe | None,
    settings: Settings | None,
) -> tuple[prerequisites.Finding, ...] | None:
    """Missing prerequisites, looked for only while some pod is not ready (a server
    whose pods all run lacks nothing, and needs no node list)."""
    if probe is None or status.settled(server, roles):
        return None
    ctx = settings.render_context() if settings else render.Context()
    pods = [
        o["spec"]["template"]["spec"]
        for o in render.render(server, ctx)
        if o["kind"] == "StatefulSet"
    ]
    return tuple(prerequisites.check(server, probe.facts(server), pods))


def refresh_status(
    body: dict[str, Any],
    kube: Kube,
    statefulsets: kopf.Index,
    pods: kopf.Index,
    probe: PrerequisiteProbe | None = None,
    settings: Settings | None = None,
    post: Callable[[dict[str, Any], str, str, str], None] | None = None,
    nodes: kopf.Index | None = None,
    claims: ownership.Claims | None = None,
    transports: Callable[[tuple[str, str]], tuple[str, str] | None] | None = None,
    memory: StatusMemory | None = None,
    fresh: bool = False,
    seen: Seen | None = None,
) -> bool:
    """Steps 4-5; False when the status could not be written (the API server is
    unavailable: the caller tries again). ``post(body, type, reason, message)``
    emits an Event where no kopf handler runs (kopf.info/warn need one); ``claims``
    has the conflicts the last apply found; ``transports`` the publisher's latest
    transport per server; ``memory`` what this operator wrote last (``body`` may
    predate it), unless the body was just read from the API server (``fresh``);
    ``seen`` the RoleScalers (their counts, and their status is written here too)."""
    try:
        server = parse(body, seen)
    except api.SpecError:
        return True
    key = (server.namespace, server.name)
    roles = {}
    for role in api.ROLES:
        found = list(statefulsets.get((*key, role), []))
        roles[role] = found[0] if found else status.RoleObserved()
    if seen is not None:
        write_scaler_status(server, roles, seen(key), kube)
    with memory.lock(key) if memory is not None else contextlib.nullcontext():
        observed_status = body.get("status") or {}
        old = (
            memory.base(key, server.uid, observed_status)
            if memory is not None and not fresh
            else observed_status
        )
        # The transport is what the sidecars reported: the publisher's own figure when
        # it has one, since ``body`` may predate its last write (a child event carries
        # the server from the index), and a status built on that wrote the transport back.
        reported = transports(key) if transports is not None else None
        transport, transport_reason = reported or (
            old.get("transport", TRANSPORT_UNKNOWN),
            old.get("transportReason", ""),
        )
        observed = status.Observed(
            roles=roles,
            pods=list(pods.get(key, [])),
            transport=transport,
            transport_reason=transport_reason,
            prerequisites=check_prerequisites(server, roles, probe, settings),
            nodes=_nodes_seen(nodes) if nodes is not None else None,
            conflicts=claims.conflicts(key) if claims is not None else (),
            last_apply=claims.last_apply(key) if claims is not None else None,
            host_path_refused=hostpaths.refusal(server, settings.host_path_prefixes)
            if settings
            else None,
            pod_template_refused=settings.pod_template_refusal(server) if settings else None,
        )
        new, changes = status.compute_status(server, observed, old, api.iso_time())
        patch = status.status_patch(old, new)
        if memory is not None and fresh:
            # What was just listed is the truth from here on (someone may have
            # changed status since our last write); the patch below lands on it.
            memory.reset(
                key, server.uid, {k: v for k, v in observed_status.items() if k != "retention"}
            )
        if not patch:
            return True
        try:
            kube.patch_status(
                api.API_VERSION, api.SERVER_KIND, server.namespace, server.name, patch
            )
        except Exception as exc:
            if not is_transient(exc):
                raise
            # No Events for a status that did not land; the next event, a retry or
            # the safety pass writes it.
            logging.getLogger(__name__).warning(
                "status of %s/%s deferred, API server unavailable: %s",
                server.namespace,
                server.name,
                _brief(exc),
            )
            return False
        if memory is not None:
            memory.wrote(key, server.uid, patch)
    for change in changes:
        if not status.worth_an_event(change):
            continue
        if claims is not None and not claims.first_post(
            key, change.type, change.status, change.reason
        ):
            continue
        kind = status.event_type(change)
        message = f"{change.type}={change.status}: {change.message}"
        if post is not None:
            try:
                post(body, kind, change.reason, message)
            except Exception as exc:  # an Event is news: the status has landed anyway
                logging.getLogger(__name__).warning(
                    "event %s not posted: %s", change.reason, _brief(exc)
                )
        else:
            (kopf.info if kind == "Normal" else kopf.warn)(
                body, reason=change.reason, message=message
            )
    return True


def write_scaler_status(
    server: api.Server,
    roles: dict[str, status.RoleObserved],
    found: dict[str, dict[str, Any]],
    kube: Kube,
) -> None:
    """Each of the server's own RoleScalers' status from its role's StatefulSet: only
    what changed (the index shows our last write), so at rest nothing is written."""
    for role in scaler.external_roles(server):
        obj = found.get(role)
        if obj is None or not ownership.is_ours(obj, server.uid):
            continue
        obs = roles[role]
        new = scaler.build_scaler_status(server, role, obs.replicas, obs.ready_replicas)
        patch = scaler.status_patch(obj.get("status"), new)
        if patch:
            kube.patch_status(
                api.API_VERSION, api.SCALER_KIND, server.namespace, obj["metadata"]["name"], patch
            )


def _status_queue(memo: kopf.Memo) -> Coalescer | None:
    """The status queue once it can refresh from the watch (the server index is in);
    None before, when a status is refreshed directly."""
    queue: Coalescer | None = getattr(memo, "status_queue", None)
    return queue if queue is not None and memo.indexes.get("servers") is not None else None


def _plain(body: kopf.Body) -> dict[str, Any]:
    return {
        "apiVersion": body.get("apiVersion"),
        "kind": body.get("kind"),
        "metadata": dict(body.metadata),
        "spec": dict(body.spec),
        "status": dict(body.status),
    }


@kopf.on.event(*SERVER)
def server_changed(
    type: str | None,
    body: kopf.Body,
    memo: kopf.Memo,
    logger: logging.Logger,
    statefulsets: kopf.Index,
    pods: kopf.Index,
    nodes: kopf.Index,
    servers: kopf.Index | None = None,
    rolescalers: kopf.Index | None = None,
    **_: Any,
) -> None:
    # Live views, for the resync loop and the status queue. Per-object memos are
    # shallow copies of the operator's, so the shared dict (made at start-up) is the
    # way back to it.
    memo.indexes.setdefault("live", (statefulsets, pods, nodes))
    if rolescalers is not None:
        memo.indexes.setdefault("rolescalers", rolescalers)
    if servers is not None:
        memo.indexes.setdefault("servers", servers)
    claims: ownership.Claims | None = getattr(memo, "claims", None)
    if type == "DELETED" or body.metadata.get("deletionTimestamp"):
        if type == "DELETED":
            key = (body.metadata["namespace"], body.metadata["name"])
            if claims is not None:
                claims.drop_server(key)
            memory: StatusMemory | None = getattr(memo, "status_memory", None)
            if memory is not None:
                memory.forget(key)
        return  # the garbage collector removes the children
    memory = getattr(memo, "status_memory", None)
    if memory is not None:
        # The watch shows our last write: from here on the body's status is the truth
        # (a status someone else changes later is seen and written back).
        memory.confirm(
            (body.metadata["namespace"], body.metadata["name"]),
            body.metadata.get("uid") or "",
            dict(body.status),
        )
    plain = _plain(body)
    generation = body.metadata.get("generation")
    # Status-only updates (our own writes) need no re-apply; a new generation,
    # the initial listing (type None, e.g. after an operator restart) do. "New" is
    # against our own last whole apply, not status.observedGeneration: a status written
    # while the first apply was still running has none, and each such write came back
    # as an event that re-applied every child (2.4 times per server on the way to Ready).
    last = (
        claims.last_apply((body.metadata["namespace"], body.metadata["name"])) if claims else None
    )
    new_generation = (
        last.generation != generation
        if last is not None
        else body.status.get("observedGeneration") != generation
    )
    # The initial listing (a standby taking over, a restart) applies no server whose
    # status shows its generation landed and that this process has not applied: its
    # children are as that apply left them, unless they changed since, which the child
    # watches' own listing re-applies (edited ones) and the first safety pass soon after
    # start (deleted ones: no event comes for those). Thousands of requests at takeover
    # otherwise, for hundreds of servers whose children have not changed.
    landed = (
        type is None
        and last is None
        and status.generation_landed(dict(body.status), generation, _render_digest(plain, memo))
    )
    first_sight = type == "ADDED" or (type is None and not landed)
    # The ceiling gate's hold was lifted (or set by another writer) since our last
    # whole apply rendered decode: re-render it.
    ceiling_moved = (
        last is not None and last.ceiling is not None and last.ceiling != _ceiling_of(plain)
    )
    if (first_sight or new_generation or ceiling_moved) and apply_or_retry(plain, memo, logger):
        logger.info("applied children generation=%s", generation)
    if getattr(memo, "status_queue", None) is not None and servers is not None:
        memo.status_queue.request((body.metadata["namespace"], body.metadata["name"]))
        return
    refresh_status(
        plain,
        memo.kube,
        statefulsets,
        pods,
        memo.probe,
        memo.settings,
        nodes=nodes,
        claims=claims,
        transports=_transports(memo),
        memory=getattr(memo, "status_memory", None),
        seen=_seen(memo),
    )


def _ceiling_of(body: dict[str, Any]) -> int | None:
    try:
        return api.parse_server(body).retention_ceiling
    except api.SpecError:
        return None


def _render_digest(body: dict[str, Any], memo: kopf.Memo) -> str | None:
    """This process's render.digest of the server; None for a spec that does not parse
    (its apply posts why) or before start-up made the settings."""
    settings: Settings | None = getattr(memo, "settings", None)
    if settings is None:
        return None
    try:
        return render.digest(render.render(parse(body, _seen(memo)), settings.render_context()))
    except api.SpecError:
        return None


def _refresh_from_index(memo: kopf.Memo, key: tuple[str, str]) -> bool:
    """The status queue's refresh of one server, from the live indexes (the freshest
    server the watch has shown, with what we last wrote laid over its status)."""
    servers = memo.indexes.get("servers")
    live = memo.indexes.get("live")
    if servers is None or live is None:
        return True
    found = list(servers.get(key, []))
    if not found or found[0]["metadata"].get("deletionTimestamp"):
        return True
    statefulsets, pods, nodes = live
    try:
        return refresh_status(
            {"apiVersion": api.API_VERSION, "kind": api.SERVER_KIND, **found[0]},
            memo.kube,
            statefulsets,
            pods,
            memo.probe,
            memo.settings,
            memo.kube.create_event,
            nodes,
            memo.claims,
            _transports(memo),
            memo.status_memory,
            seen=_seen(memo),
        )
    except Exception as exc:  # one line, not the client's header dump
        logging.getLogger(__name__).warning("status of %s/%s failed: %s", *key, _brief(exc))
        return not is_transient(exc)  # a refusal would fail the same way again


def _brief(exc: BaseException) -> str:
    if isinstance(exc, ApiException):
        return api_error_message(exc)
    return f"{type(exc).__name__}: {str(exc)[:200]}"


# The first safety pass comes this long after start (+-1/3 at random: 10-20 s), not a
# whole interval later: the initial listing applies no server whose generation has
# landed (server_changed), and a child deleted while no operator ran (a takeover, a
# restart) has no event to restore it; this pass does. Not at once: kopf's listing and
# the child watches' first events come first (a pass racing them would re-apply what
# they are restoring), and replicas started together drift apart.
FIRST_PASS_SECONDS = 15.0
FIRST_PASS_SPREAD = 1 / 3


def first_pass_delay(resync_seconds: float, rand: float) -> float:
    """Seconds from start to the first safety pass: ``FIRST_PASS_SECONDS`` +-1/3, or
    one interval (+-20 %) when ``resync_seconds`` is shorter."""
    if resync_seconds <= FIRST_PASS_SECONDS:
        return backoff.jittered(resync_seconds, rand)
    return backoff.jittered(FIRST_PASS_SECONDS, rand, FIRST_PASS_SPREAD)


async def _resync_forever(memo: kopf.Memo, settings: Settings, logger: logging.Logger) -> None:
    """The safety pass, every ``resync_seconds`` +-20 % (``backoff.jittered``), the first
    soon after start (``first_pass_delay``): for
    missed watch events, and for what changes without an event on our objects (a
    device plugin installed, a namespace relabelled, a network created: status).

    Drift and spec changes are applied from the watches, so this pass writes nothing
    when nothing changed: it lists the servers and each child kind (a few requests
    whatever the number of servers), and re-applies only a server whose children no
    longer hold our fields (``drift.covers``) or whose generation has not landed.

    A kopf timer would do this too, but kopf guards timers with a finalizer on
    every server, and a finalizer would block deleting servers whenever the
    operator is down.
    """
    delay = first_pass_delay(settings.resync_seconds, random.random())
    completed = False
    while True:
        await asyncio.sleep(delay)
        delay = backoff.jittered(settings.resync_seconds, random.random())
        try:
            done = await asyncio.to_thread(safety_pass, memo, settings, logger)
        except Exception as exc:  # the loop must outlive any trouble of one pass
            logger.warning("safety pass failed: %s", _brief(exc))
            if not completed:
                # The first pass is what restores children deleted while no operator
                # ran: an API hiccup at takeover must not put it off a whole interval.
                delay = first_pass_delay(settings.resync_seconds, random.random())
            continue
        completed = True
        memo.indexes["passes"] = memo.indexes.get("passes", 0) + 1
        logger.info(
            "safety pass done: %d servers, %d re-applied, %d status written",
            done.servers,
            done.applied,
            done.statuses,
        )


@dataclasses.dataclass
class PassDone:
    servers: int = 0
    applied: int = 0  # servers whose children were re-applied
    statuses: int = 0  # status refreshes run (each writes only what changed)


# Servers per listing of their children in a safety pass: the pass holds one batch's
# children at a time. Listing every child at once held 9,000 whole objects at 1,000
# servers (about 120 MB, the operator's peak); a batch is a few lists more per pass.
SAFETY_BATCH = 100


def _children_by_key(
    kube: Kube, namespaces: list[str] | None, servers: Iterable[str]
) -> dict[tuple[str, str, str], Any]:
    """Every child the operator labels as its own of the servers so named (in any
    namespace listed), by (kind, namespace, name). Without their status and
    managedFields, which no drift check reads."""
    names = ",".join(sorted(set(servers)))
    selector = f"{api.LABEL_MANAGED_BY}={api.FIELD_MANAGER},{api.LABEL_INSTANCE} in ({names})"
    out: dict[tuple[str, str, str], Any] = {}
    for _group, _version, _plural, api_version, kind in CHILD_KINDS:
        for obj in kube.list_labelled(api_version, kind, selector, namespaces):
            obj.pop("status", None)
            meta = obj.get("metadata") or {}
            meta.pop("managedFields", None)
            out[(kind, meta.get("namespace", ""), meta.get("name", ""))] = obj
    return out


def needs_apply(
    server: api.Server,
    wanted: list[dict[str, Any]],
    children: dict[tuple[str, str, str], Any],
    last: ownership.ApplyOutcome | None,
    listed_at: float = 0.0,
    held: str | None = None,
    running: bool = False,
    landed: bool = False,
) -> bool:
    """Whether the safety pass re-applies a server: its generation has not landed
    whole, or some child is missing or lost one of our fields. Landed is by this
    process's last whole apply (``last``); without one, by the server's status
    (``landed``: status.generation_landed), so that the first pass after a takeover
    or a restart re-applies only a server whose children changed. Not a server whose
    apply ended after the children were listed (``listed_at``, monotonic): the list
    may lack some of its children, and that apply has its own retries. Nor a server
    the settings refuse (``held``, settings_refusal) as they did at its last apply of
    this generation: that apply landed what the refusal lets land (checked for drift
    like any child), and another would be held the same way. Nor a server whose whole
    apply is ``running`` (a new server's first one, slow on a loaded API server): the
    list may predate its children, and it has its own retries."""
    if running or (last is not None and last.finished > listed_at):
        return False
    if last is None:
        # Not applied by this process (a standby that took over, a restart): a
        # generation the status shows landed (``landed``) is checked for drift as one
        # it applied, where a child deleted while no operator ran shows as missing.
        if not landed:
            return True
        held_as_before = False
    elif last.generation != server.generation:
        return True
    else:
        held_as_before = held is not None and last.held == held and not last.refusals
        if not last.applied and not held_as_before:
            return True
    return not all(
        drift.covers(
            children.get((c["kind"], c["metadata"]["namespace"], c["metadata"]["name"])), c
        )
        for c in wanted
        if not (held_as_before and c["kind"] in HELD_KINDS)
    )


def _policy_still_refused(
    server: api.Server,
    wanted: list[dict[str, Any]],
    last: ownership.ApplyOutcome | None,
    held: str | None,
    kube: Kube,
    claims: ownership.Claims | None,
    logger: logging.Logger,
) -> bool:
    """For a server whose last apply of this generation failed only on its NetworkPolicy
    (which holds the StatefulSets), the safety pass's try of that policy alone: True
    when the API server refuses it as it did (nothing else would land: no whole apply,
    no Event for a refusal already reported). False otherwise: the whole server is
    applied (the policy landed, or the answer is news)."""
    if (
        last is None
        or last.generation != server.generation
        or last.applied
        or held is not None
        or not last.refusals
        or not all(r.startswith("NetworkPolicy ") for r in last.refusals)
        or claims is None
    ):
        return False
    policy = next((c for c in wanted if c["kind"] == "NetworkPolicy"), None)
    if policy is None or _taken(policy, server, kube, claims) is not None:
        return False
    try:
        kube.apply(policy)
    except ApiException as exc:
        message = f"NetworkPolicy {policy['metadata']['name']}: {api_error_message(exc)}"
        if message in last.refusals:
            logger.info("safety pass: %s/%s still held: %s", server.namespace, server.name, message)
            return True
        return False
    except Exception as exc:
        if not is_transient(exc):
            raise
        return True  # the API server cannot be reached: the next pass tries again
    claims.remember(("NetworkPolicy", server.namespace, policy["metadata"]["name"]), server.uid)
    return False


def _drifted_besides_the_hold(
    wanted: list[dict[str, Any]], children: dict[tuple[str, str, str], dict[str, Any]]
) -> bool:
    """A child other than the held ones and the refused policy lost our fields (deleted,
    edited): the whole server is applied again even while its policy stays refused."""
    return not all(
        drift.covers(
            children.get((c["kind"], c["metadata"]["namespace"], c["metadata"]["name"])), c
        )
        for c in wanted
        if c["kind"] not in (*HELD_KINDS, "NetworkPolicy")
    )


def safety_pass(memo: kopf.Memo, settings: Settings, logger: logging.Logger) -> PassDone:
    kube: Kube = memo.kube
    claims: ownership.Claims | None = getattr(memo, "claims", None)
    listed = kube.list_servers(memo.namespaces)
    indexes = memo.indexes.get("live")
    done = PassDone()
    batches = [listed[i : i + SAFETY_BATCH] for i in range(0, len(listed), SAFETY_BATCH)]
    del listed
    for batch in batches:
        listed_at = time.monotonic()
        children = _children_by_key(
            kube, memo.namespaces, (b["metadata"].get("name", "") for b in batch)
        )
        for body in batch:
            _safety_check(
                body, memo, settings, logger, kube, claims, children, listed_at, indexes, done
            )
    return done


def _safety_check(
    body: dict[str, Any],
    memo: kopf.Memo,
    settings: Settings,
    logger: logging.Logger,
    kube: Kube,
    claims: ownership.Claims | None,
    children: dict[tuple[str, str, str], Any],
    listed_at: float,
    indexes: Any,
    done: PassDone,
) -> None:
    """One server of a safety pass: re-apply it if it needs it, refresh its status."""
    if body["metadata"].get("deletionTimestamp"):
        return
    done.servers += 1
    name = body["metadata"].get("name")
    try:
        server = parse(body, _seen(memo))
        wanted = render.render(server, settings.render_context())
    except api.SpecError:
        return  # its InvalidSpec Event was posted when the spec came
    key = (server.namespace, server.name)
    try:
        running, last = claims.apply_state(key) if claims else (False, None)
        held = settings_refusal(server, settings)
        landed = status.generation_landed(
            body.get("status"), server.generation, render.digest(wanted)
        )
        if needs_apply(server, wanted, children, last, listed_at, held, running, landed) and not (
            _policy_still_refused(server, wanted, last, held, kube, claims, logger)
            and not _drifted_besides_the_hold(wanted, children)
        ):
            done.applied += 1
            logger.info("safety pass: re-applying %s/%s", *key)
            applied = apply_children(
                body,
                kube,
                settings,
                logger,
                None,
                claims,
                kube.create_event,
                _seen(memo),
                landed=getattr(memo, "held", None),
                unreleasable=_unreleasable(memo),
            )
            retries: ApplyRetries | None = getattr(memo, "retries", None)
            if applied is Applied.RETRY and retries is not None:
                retries.failed(*key)
    except Exception as exc:  # the next pass, or a retry, tries again
        logger.warning("safety pass: apply of %s failed: %s", name, _brief(exc))
    done.statuses += 1
    if (queue := _status_queue(memo)) is not None:
        # From the watch's latest server (the list may be seconds old by now) and
        # our own last write; the refresh writes only what changed.
        queue.request(key)
        return
    if indexes is None:
        return
    statefulsets, pods, nodes = indexes
    try:
        refresh_status(
            body,
            kube,
            statefulsets,
            pods,
            memo.probe,
            settings,
            kube.create_event,
            nodes,
            claims,
            _transports(memo),
            getattr(memo, "status_memory", None),
            fresh=True,  # listed just now: truer than what we remember writing
            seen=_seen(memo),
        )
    except Exception as exc:  # the next pass tries again
        logger.warning("safety pass: status of %s failed: %s", name, _brief(exc))


def _holds_ours(
    owner: dict[str, Any],
    kind: str,
    name: str,
    body: kopf.Body,
    settings: Settings,
    seen: Seen | None = None,
) -> bool:
    """The observed child still has every field we render for it (drift.covers)."""
    try:
        children = render.render(parse(owner, seen), settings.render_context())
    except api.SpecError:
        return False
    wanted = next(
        (c for c in children if c["kind"] == kind and c["metadata"]["name"] == name), None
    )
    return wanted is not None and drift.covers(dict(body), wanted)


def _owner(namespace: str, labels: kopf.Labels, servers: kopf.Index) -> dict[str, Any] | None:
    found = list(servers.get((namespace, labels.get(api.LABEL_INSTANCE)), []))
    return found[0] if found else None


def _refresh(
    owner: dict[str, Any],
    memo: kopf.Memo,
    statefulsets: kopf.Index,
    pods: kopf.Index,
    nodes: kopf.Index,
) -> None:
    """Step 4-5 for a server found through one of its children, pods or nodes: every
    caller passes the same inputs (prerequisites and nodes too), so no event path
    computes a status that another path would then flip back. Through the status
    queue when it runs: a burst of events is one write."""
    if (queue := _status_queue(memo)) is not None:
        queue.request((owner["metadata"]["namespace"], owner["metadata"]["name"]))
        return
    refresh_status(
        {"apiVersion": api.API_VERSION, "kind": api.SERVER_KIND, **owner},
        memo.kube,
        statefulsets,
        pods,
        memo.probe,
        memo.settings,
        nodes=nodes,
        claims=getattr(memo, "claims", None),
        transports=_transports(memo),
        memory=getattr(memo, "status_memory", None),
        seen=_seen(memo),
    )


def _unreleasable(memo: kopf.Memo) -> Unreleasable | None:
    residency: publisher.Publisher | None = getattr(memo, "publisher", None)
    return residency.unreleasable if residency is not None else None


def _transports(memo: kopf.Memo) -> Callable[[tuple[str, str]], tuple[str, str] | None] | None:
    residency: publisher.Publisher | None = getattr(memo, "publisher", None)
    return residency.transport if residency is not None else None


def _to_apply(
    kind: str,
    type: str | None,
    name: str,
    namespace: str,
    labels: kopf.Labels,
    body: kopf.Body,
    owner: dict[str, Any],
    memo: kopf.Memo,
    logger: logging.Logger,
    statefulsets: kopf.Index,
) -> tuple[bool, tuple[str, str] | None]:
    """Whether a child's event applies anything, and what: (True, (kind, name)) that
    child alone, (True, None) the whole server, (False, None) nothing."""
    if kind == api.SCALER_KIND:
        # An autoscaler changed spec.replicas, or the RoleScaler was deleted: the whole
        # server, its StatefulSet and topology from the new count (kopf updates the
        # index before the handler runs). Deleted under External it is created again,
        # seeded at the count running now; under Static the apply deletes a left-over
        # one. Our own status writes change no count: nothing is applied for those.
        role = labels.get(api.LABEL_ROLE)
        instance = labels.get(api.LABEL_INSTANCE)
        if role not in api.ROLES or name != render.name_for(instance or "", role):
            # A look-alike (another name, the server's labels): never the server's count.
            return False, None
        found = list(statefulsets.get((namespace, instance, role), []))
        running = found[0].spec_replicas if found else None
        count = scaler.replicas_of(dict(body))
        if type != "DELETED" and count == running:
            return False, None
        logger.info("%s %s: replicas %s, running %s", kind, name, count, running)
        return True, None
    # Re-apply this one child when someone edited or deleted it. A deleted child
    # comes back; an edited one gets our fields back, while fields we never set
    # (another manager's) stay as they are. Its own creation and the status its
    # controller writes change none of our fields: no request for those.
    if type == "DELETED":
        logger.info("child deleted, restoring kind=%s name=%s", kind, name)
        kopf.info(owner, reason=EVENT_DRIFT, message=f"restored deleted {kind} {name}")
        return True, (kind, name)
    if _holds_ours(owner, kind, name, body, memo.settings, _seen(memo)):
        return False, None
    return True, (kind, name)


def _on_child_event(kind: str):
    """The handler of one watched child kind (WATCHED_KINDS): the rendered children
    and the RoleScalers, one code path. A coroutine: the bookkeeping and the check of a
    child whose fingerprint was last found holding our fields (held.py: a status
    update) run on the event loop; only a render or an apply waits for a thread."""

    async def child_changed(
        type: str | None,
        name: str,
        namespace: str,
        labels: kopf.Labels,
        body: kopf.Body,
        memo: kopf.Memo,
        logger: logging.Logger,
        servers: kopf.Index,
        statefulsets: kopf.Index,
        pods: kopf.Index,
        nodes: kopf.Index,
        rolescalers: kopf.Index | None = None,
        **_: Any,
    ) -> None:
        if rolescalers is not None:
            memo.indexes.setdefault("rolescalers", rolescalers)
        owner = _owner(namespace, labels, servers)
        if owner is None or owner["metadata"].get("deletionTimestamp"):
            return
        owner = {"apiVersion": api.API_VERSION, "kind": api.SERVER_KIND, **owner}
        key = (kind, namespace, name)
        claims: ownership.Claims | None = getattr(memo, "claims", None)
        if claims is not None and kind != api.SCALER_KIND:
            # What the watch shows is the freshest word on whose the child is: a deleted
            # child's name is read again before it is recreated. (A RoleScaler's owner
            # is read from the index each time: resolve_scalers.)
            uid = owner["metadata"].get("uid") or ""
            if type != "DELETED" and ownership.is_ours(dict(body), uid):
                claims.remember(key, uid)
            else:
                claims.forget(key)
        seen: Held | None = getattr(memo, "held", None)
        print_ = None
        if seen is not None and kind != api.SCALER_KIND:
            if type == "DELETED":
                seen.forget(key)
            else:
                print_ = held.fingerprint(body, owner, _scaled(owner, _seen(memo)))
        if print_ is None or seen is None or not seen.still(key, print_):
            decide = functools.partial(
                _to_apply, kind, type, name, namespace, labels, body, owner, memo, logger,
                statefulsets,
            )  # fmt: skip
            await _in_handler_thread(memo, _check_child, decide, key, print_, owner, memo, logger)
        # Their status is the server's (StatefulSets), or written with it (RoleScalers).
        if kind in ("StatefulSet", api.SCALER_KIND):
            await _refresh_soon(owner, memo, statefulsets, pods, nodes)

    return child_changed


def _check_child(
    decide: Callable[[], tuple[bool, tuple[str, str] | None]],
    key: held.Key,
    print_: bytes | None,
    owner: dict[str, Any],
    memo: kopf.Memo,
    logger: logging.Logger,
) -> None:
    """The child's event on a thread: re-apply it (or its server) when ``decide``
    (_to_apply) says it no longer holds our fields, else remember that it held at
    this fingerprint."""
    apply, only = decide()
    seen: Held | None = getattr(memo, "held", None)
    if apply:
        if seen is not None:
            seen.forget(key)
        apply_or_retry(owner, memo, logger, only=only)
    elif seen is not None and print_ is not None:
        seen.record(key, print_)


async def _in_handler_thread(memo: kopf.Memo, fn: Callable[..., Any], *args: Any) -> Any:
    """fn on kopf's handler threads (the pool a plain handler runs on), with the
    context kopf's event posting reads."""
    ctx = contextvars.copy_context()
    pool = getattr(memo, "executor", None)
    return await asyncio.get_running_loop().run_in_executor(
        pool, functools.partial(ctx.run, fn, *args)
    )


# Every kind whose objects the operator owns, watched through one handler.
WATCHED_KINDS = [
    *CHILD_KINDS,
    (api.GROUP, api.VERSION, api.SCALER_PLURAL, api.API_VERSION, api.SCALER_KIND),
]
for _group, _version, _plural, _api_version, _kind in WATCHED_KINDS:
    kopf.on.event(_group, _version, _plural, labels=OURS, id=f"child-{_plural}")(
        _on_child_event(_kind)
    )


async def _refresh_soon(
    owner: dict[str, Any],
    memo: kopf.Memo,
    statefulsets: kopf.Index,
    pods: kopf.Index,
    nodes: kopf.Index,
) -> None:
    """_refresh from a coroutine: a request to the status queue when it runs (no I/O),
    else the refresh itself on a thread."""
    if _status_queue(memo) is not None:
        _refresh(owner, memo, statefulsets, pods, nodes)
    else:
        await asyncio.to_thread(_refresh, owner, memo, statefulsets, pods, nodes)


@kopf.on.event("", "v1", "pods", labels={api.LABEL_SERVER: kopf.PRESENT})
async def pod_changed(
    namespace: str,
    labels: kopf.Labels,
    memo: kopf.Memo,
    servers: kopf.Index,
    statefulsets: kopf.Index,
    pods: kopf.Index,
    nodes: kopf.Index,
    **_: Any,
) -> None:
    owner = _owner(namespace, {api.LABEL_INSTANCE: labels[api.LABEL_SERVER]}, servers)
    if owner is not None and not owner["metadata"].get("deletionTimestamp"):
        await _refresh_soon(owner, memo, statefulsets, pods, nodes)


@kopf.on.event("", "v1", "nodes")
async def node_changed(
    type: str | None,
    name: str,
    memo: kopf.Memo,
    logger: logging.Logger,
    servers: kopf.Index,
    statefulsets: kopf.Index,
    pods: kopf.Index,
    nodes: kopf.Index,
    **_: Any,
) -> None:
    """A node went away or changed readiness: refresh the servers with pods on it."""
    affected = {key for key in pods for p in pods.get(key, []) if p.node == name}
    for namespace, server in sorted(affected):
        owner = _owner(namespace, {api.LABEL_INSTANCE: server}, servers)
        if owner is None or owner["metadata"].get("deletionTimestamp"):
            continue
        if type == "DELETED":
            logger.warning("node %s deleted with pods of %s/%s on it", name, namespace, server)
        await _refresh_soon(owner, memo, statefulsets, pods, nodes)
