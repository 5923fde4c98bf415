"""The report endpoint: sidecars POST residency reports here over HTTPS.

A report is accepted only when
1. it carries a bearer token the API server's TokenReview accepts for the
   ``kvferry`` audience, bound to a pod (projected ServiceAccount tokens carry
   the pod's name and uid);
2. that pod exists with that uid, is the report's pod, carries the report's
   server and role in its labels, and is a member of the operator's own
   StatefulSet ``<server>-<role>`` (controller owner reference with that
   StatefulSet's uid; the StatefulSet carries our labels and is owned by the
   DisaggregatedServer). A pod someone made by copying ours (``kubectl debug
   --copy-to``) or labelled like ours cannot report;
3. the body is a well-formed report of a version this operator reads, within
   the size limit, every field checked (``kvferry_wire.report.decode``).

Anything else gets a 4xx naming the reason and changes nothing. An accepted report
older than the pod's last (by ``startedAt``, then ``generatedAt``: ``reports.newer``)
is answered the same but not kept: the newest report per pod stands.

An accepted report is answered 202 with ``{"accepted": true}`` and, once the
publisher has passed over the server, ``"policy"``: the live policy of the server the
checks above proved the pod is a member of (``kvferry_wire.policy``; ``policy_for``
gives it). The report's server is the pod's own (its label, its StatefulSet's owner),
so a sidecar can learn no other server's policy, whatever its report says.

Bounded under load (a flood of forged or valid reports must not starve the
operator or grow its memory; ``Limits`` holds the numbers):
- requests in progress are capped; beyond that a 503 with Retry-After;
- the body is read whole (not a partial read), within the size limit and a time;
- a string that is not a ServiceAccount token for our audience is refused before
  any API call; TokenReviews run on their own small thread pool, a few at once,
  with a timeout; identical tokens in flight share one review; too many waiting
  -> 503;
- reviews are cached by the token's hash: accepted ones in a size-bound LRU for a
  minute, refused ones separately and briefly;
- each pod may land a few reports a second (a sidecar sends one every 15 s);
- the pod and StatefulSet lookups are cached for seconds, and looked up again
  when the token's pod uid differs from the cached pod's (a replaced pod).
API server trouble is a 503 (retry), never a 500.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import ssl
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import jwt
from aiohttp import web
from cachetools import TTLCache

from kvferry_wire.policy import RESPONSE_KEY as POLICY_KEY
from kvferry_wire.protocol import REPORT_PATH, REPORT_TOKEN_AUDIENCE
from kvferry_wire.report import MAX_REPORT_BYTES, Report, ReportError, decode

from . import api
from .render import name_for
from .reports import Received, ReportStore
from .serving_cert import ReloadingCert

log = logging.getLogger(__name__)

POD_NAME_EXTRA = "authentication.kubernetes.io/pod-name"
POD_UID_EXTRA = "authentication.kubernetes.io/pod-uid"
SA_PREFIX = "system:serviceaccount:"


@dataclass(frozen=True)
class Limits:
    # Requests being handled at once (each may hold a body of up to 256 KiB).
    max_in_flight: int = 128
    # The whole body must arrive within this (a trickling client holds no slot long).
    read_timeout: float = 10.0
    # TokenReviews at once (their own threads: the publisher and resync keep theirs),
    # how many may wait for one, and how long one may take.
    review_concurrency: int = 4
    review_queue: int = 64
    review_timeout: float = 5.0
    # Accepted tokens: reused a minute (projected tokens live an hour), LRU-bound.
    review_ttl: float = 60.0
    review_cache_size: int = 4096
    # Refused tokens: remembered briefly and apart, so a flood of them cannot evict
    # the good ones, and a token the API server refused by mistake recovers soon.
    refused_ttl: float = 5.0
    refused_cache_size: int = 4096
    # Pod and StatefulSet lookups.
    lookup_ttl: float = 30.0
    lookup_cache_size: int = 4096
    lookup_timeout: float = 5.0
    # Per pod: a sustained rate and a burst (a sidecar pushes every 15 s; restarts
    # and retries may bunch a few).
    pod_reports_per_second: float = 1.0
    pod_report_burst: int = 10


class Unauthorized(Exception):
    pass


class Forbidden(Exception):
    pass


class Unavailable(Exception):
    """The operator cannot decide now (API server slow or down, too busy): retry."""


class TooMany(Exception):
    pass


@dataclass(frozen=True)
class Identity:
    namespace: str
    pod_name: str
    pod_uid: str


# (token) -> TokenReview status dict; (namespace, name) -> object dict or None.
ReviewToken = Callable[[str], dict[str, Any]]
GetPod = Callable[[str, str], dict[str, Any] | None]
GetStatefulSet = Callable[[str, str], dict[str, Any] | None]
# (namespace, server) -> the server's encoded live policy, None while unknown.
PolicyFor = Callable[[str, str], dict[str, Any] | None]


def no_policy(namespace: str, server: str) -> dict[str, Any] | None:
    return None


# ------------------------------------------------------------------ pure checks


MAX_TOKEN_CHARS = 16384
NOT_A_TOKEN = "not a ServiceAccount token (use the pod's projected kvferry token)"


def token_claims(token: str, now: float) -> dict[str, Any]:
    """The unverified claims of a projected ServiceAccount token, or :class:`Unauthorized`.

    Only a filter, so garbage costs no TokenReview: the TokenReview alone decides.
    """
    # PyJWT reads an unsigned token (empty third segment, alg "none"); a projected
    # token is always signed.
    if len(token) > MAX_TOKEN_CHARS or not token.rsplit(".", 1)[-1]:
        raise Unauthorized(NOT_A_TOKEN)
    try:
        jwt.get_unverified_header(token)  # three segments and a readable header
    except jwt.InvalidTokenError as exc:
        raise Unauthorized(NOT_A_TOKEN) from exc
    try:
        # The signature is not what we check: the API server's TokenReview is, and it
        # runs next. Expiry and audience are checked below against the injected clock.
        claims = jwt.decode(token, options={"verify_signature": False})
    except jwt.InvalidTokenError as exc:
        raise Unauthorized("not a ServiceAccount token (unreadable claims)") from exc
    aud = claims.get("aud")
    if REPORT_TOKEN_AUDIENCE not in (aud if isinstance(aud, list) else [aud]):
        raise Unauthorized(f"token is not for audience {REPORT_TOKEN_AUDIENCE!r}")
    exp = claims.get("exp")
    if isinstance(exp, (int, float)) and exp < now:
        raise Unauthorized("token has expired")
    bound = claims.get("kubernetes.io")
    pod = bound.get("pod") if isinstance(bound, dict) else None
    if not isinstance(pod, dict) or not pod.get("name"):
        raise Unauthorized("token is not bound to a pod (use a projected ServiceAccount token)")
    return claims


def identity_from_review(review_status: dict[str, Any]) -> Identity:
    """The pod a reviewed token is bound to, or :class:`Unauthorized`."""
    if not review_status.get("authenticated"):
        raise Unauthorized(review_status.get("error") or "token not authenticated")
    if REPORT_TOKEN_AUDIENCE not in (review_status.get("audiences") or []):
        raise Unauthorized(f"token is not for audience {REPORT_TOKEN_AUDIENCE!r}")
    user = review_status.get("user") or {}
    username = user.get("username", "")
    if not username.startswith(SA_PREFIX):
        raise Unauthorized("token does not belong to a ServiceAccount")
    namespace = username[len(SA_PREFIX) :].split(":", 1)[0]
    extra = user.get("extra") or {}
    pod_name = (extra.get(POD_NAME_EXTRA) or [None])[0]
    pod_uid = (extra.get(POD_UID_EXTRA) or [None])[0]
    if not pod_name or not pod_uid:
        raise Unauthorized("token is not bound to a pod (use a projected ServiceAccount token)")
    return Identity(namespace, pod_name, pod_uid)


def controller_of(meta: dict[str, Any]) -> dict[str, Any] | None:
    return next((r for r in meta.get("ownerReferences") or [] if r.get("controller")), None)


def check_pod(ident: Identity, pod: dict[str, Any] | None, server: str, report_pod: str) -> None:
    """The token's pod must be the report's pod and carry the report's server label."""
    if pod is None:
        raise Forbidden(f"pod {ident.namespace}/{ident.pod_name} does not exist")
    meta = pod.get("metadata") or {}
    if meta.get("uid") != ident.pod_uid:
        raise Forbidden(f"pod {ident.pod_name} was replaced; its token is no longer valid")
    if report_pod != ident.pod_name:
        raise Forbidden(f"token of pod {ident.pod_name} cannot report for pod {report_pod}")
    owner = (meta.get("labels") or {}).get(api.LABEL_SERVER)
    if owner != server:
        raise Forbidden(f"pod {ident.pod_name} belongs to server {owner!r}, not {server!r}")


def check_membership(
    pod: dict[str, Any], sts: dict[str, Any] | None, server: str, role: str
) -> None:
    """The pod is a member of the operator's StatefulSet for (server, role)."""
    meta = pod.get("metadata") or {}
    name = meta.get("name", "")
    labels = meta.get("labels") or {}
    if labels.get(api.LABEL_ROLE) != role:
        raise Forbidden(
            f"pod {name} has role {labels.get(api.LABEL_ROLE)!r}; its report says {role!r}"
        )
    want = name_for(server, role)
    ref = controller_of(meta)
    if ref is None or ref.get("kind") != "StatefulSet" or ref.get("name") != want:
        raise Forbidden(f"pod {name} is not a pod of StatefulSet {want} (its controller)")
    if not re.fullmatch(rf"{re.escape(want)}-(0|[1-9][0-9]*)", name):
        raise Forbidden(f"pod {name} is not named as a member of StatefulSet {want}")
    if sts is None:
        raise Forbidden(f"StatefulSet {want} does not exist")
    sts_meta = sts.get("metadata") or {}
    if sts_meta.get("uid") != ref.get("uid"):
        raise Forbidden(f"pod {name} names another StatefulSet {want} (uid) than the one there")
    sts_labels = sts_meta.get("labels") or {}
    ours = {
        api.LABEL_MANAGED_BY: api.FIELD_MANAGER,
        api.LABEL_INSTANCE: server,
        api.LABEL_ROLE: role,
    }
    sts_owner = controller_of(sts_meta) or {}
    if any(sts_labels.get(k) != v for k, v in ours.items()) or (
        sts_owner.get("kind"),
        sts_owner.get("name"),
    ) != (api.SERVER_KIND, server):
        raise Forbidden(f"StatefulSet {want} is not the operator's for server {server}")


# ------------------------------------------------------------------ state


class _RateLimit:
    """A token bucket per key, the keys in a bounded LRU."""

    def __init__(self, rate: float, burst: int, clock: Callable[[], float], size: int) -> None:
        self.rate, self.burst, self.clock, self.size = rate, burst, clock, size
        self._buckets: OrderedDict[Any, tuple[float, float]] = OrderedDict()

    def allow(self, key: Any) -> bool:
        now = self.clock()
        tokens, last = self._buckets.pop(key, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - last) * self.rate)
        allowed = tokens >= 1.0
        self._buckets[key] = (tokens - 1.0 if allowed else tokens, now)
        while len(self._buckets) > self.size:
            self._buckets.popitem(last=False)
        return allowed


class Reviewer:
    """TokenReviews, bounded and cached (see the module docstring)."""

    def __init__(
        self,
        review: ReviewToken,
        limits: Limits,
        clock: Callable[[], float],
        executor: ThreadPoolExecutor,
    ) -> None:
        self.review, self.limits, self.clock, self.executor = review, limits, clock, executor
        # Size-bound LRUs whose entries expire; one event loop uses them, no lock.
        self.accepted: TTLCache[str, dict[str, Any]] = TTLCache(
            maxsize=limits.review_cache_size, ttl=limits.review_ttl, timer=clock
        )
        self.refused: TTLCache[str, dict[str, Any]] = TTLCache(
            maxsize=limits.refused_cache_size, ttl=limits.refused_ttl, timer=clock
        )
        self._slots = asyncio.Semaphore(limits.review_concurrency)
        self._waiting = 0
        self._in_flight: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self.reviews = 0  # TokenReviews sent (for tests and the flood figures)
        self.shared = 0  # callers that joined a review already in flight

    async def __call__(self, token: str) -> dict[str, Any]:
        key = hashlib.sha256(token.encode()).hexdigest()  # never keep tokens themselves
        hit = self.accepted.get(key) or self.refused.get(key)
        if hit is not None:
            return hit
        shared = self._in_flight.get(key)
        if shared is not None:
            self.shared += 1
            return await asyncio.shield(shared)
        if self._waiting >= self.limits.review_queue:
            raise Unavailable("too many reports waiting for authentication; retry")
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._in_flight[key] = future
        try:
            result = await self._bounded_review(token)
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: callers sharing it re-raise it themselves
            raise
        else:
            cache = self.accepted if result.get("authenticated") is True else self.refused
            cache[key] = result
            future.set_result(result)
            return result
        finally:
            self._in_flight.pop(key, None)

    async def _bounded_review(self, token: str) -> dict[str, Any]:
        self._waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self._waiting -= 1
        try:
            return await self._review(token)
        finally:
            self._slots.release()

    async def _review(self, token: str) -> dict[str, Any]:
        self.reviews += 1
        loop = asyncio.get_running_loop()
        try:
            result = await asyncio.wait_for(
                loop.run_in_executor(self.executor, self.review, token),
                self.limits.review_timeout,
            )
        except TimeoutError as exc:
            raise Unavailable(
                f"TokenReview took longer than {self.limits.review_timeout:.0f}s; retry"
            ) from exc
        except Exception as exc:
            log.warning("TokenReview failed: %s", exc)
            raise Unavailable("the API server did not answer the TokenReview; retry") from exc
        if not isinstance(result, dict):
            raise Unavailable("the TokenReview answer was not understood; retry")
        return result


class Lookups:
    """Pod and StatefulSet lookups, cached briefly (a pod reports every 15 s)."""

    def __init__(
        self,
        get_pod: GetPod,
        get_statefulset: GetStatefulSet,
        limits: Limits,
        clock: Callable[[], float],
        executor: ThreadPoolExecutor,
    ) -> None:
        self.get_pod, self.get_statefulset = get_pod, get_statefulset
        self.limits, self.executor = limits, executor
        self.pods: TTLCache[tuple[str, str], dict[str, Any] | None] = TTLCache(
            maxsize=limits.lookup_cache_size, ttl=limits.lookup_ttl, timer=clock
        )
        self.sets: TTLCache[tuple[str, str], dict[str, Any] | None] = TTLCache(
            maxsize=limits.lookup_cache_size, ttl=limits.lookup_ttl, timer=clock
        )
        self.calls = 0

    async def _fetch(self, fn: Callable[[str, str], Any], namespace: str, name: str) -> Any:
        self.calls += 1
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(
                loop.run_in_executor(self.executor, fn, namespace, name),
                self.limits.lookup_timeout,
            )
        except Exception as exc:
            log.warning("lookup of %s/%s failed: %s", namespace, name, exc)
            raise Unavailable("the API server did not answer; retry") from exc

    async def pod(self, ident: Identity) -> dict[str, Any] | None:
        key = (ident.namespace, ident.pod_name)
        cached = self.pods.get(key)
        uid = ((cached or {}).get("metadata") or {}).get("uid")
        if cached is None or uid != ident.pod_uid:  # unknown, or replaced since
            cached = await self._fetch(self.get_pod, *key)
            self.pods[key] = cached
        return cached

    async def statefulset(self, namespace: str, name: str, uid: str | None) -> Any:
        key = (namespace, name)
        cached = self.sets.get(key)
        if cached is None or ((cached.get("metadata") or {}).get("uid")) != uid:
            cached = await self._fetch(self.get_statefulset, namespace, name)
            self.sets[key] = cached
        return cached


# ------------------------------------------------------------------ the app


STORE_KEY = web.AppKey("store", ReportStore)
REVIEWER_KEY = web.AppKey("reviewer", Reviewer)
LOOKUPS_KEY = web.AppKey("lookups", Lookups)


def app_factory(
    store: ReportStore,
    review_token: ReviewToken,
    get_pod: GetPod,
    get_statefulset: GetStatefulSet,
    clock: Callable[[], float] = time.time,
    limits: Limits = Limits(),
    policy_for: PolicyFor = no_policy,
) -> web.Application:
    # The endpoint's own threads: a flood of reports never takes the default
    # executor's threads, which the publisher and the resync loop run on.
    executor = ThreadPoolExecutor(
        max_workers=limits.review_concurrency + 2, thread_name_prefix="kvferry-report"
    )
    reviewer = Reviewer(review_token, limits, clock, executor)
    lookups = Lookups(get_pod, get_statefulset, limits, clock, executor)
    per_pod = _RateLimit(
        limits.pod_reports_per_second, limits.pod_report_burst, clock, limits.lookup_cache_size
    )
    in_flight = 0

    async def authorize(request: web.Request) -> tuple[Report, Identity, str]:
        if request.content_length is not None and request.content_length > MAX_REPORT_BYTES:
            raise web.HTTPRequestEntityTooLarge(MAX_REPORT_BYTES, request.content_length)
        auth = request.headers.get("Authorization", "")
        token = auth[7:].strip() if auth.startswith("Bearer ") else ""
        if not token:
            raise Unauthorized("missing bearer token (the pod's projected kvferry token)")
        try:
            async with asyncio.timeout(limits.read_timeout):
                body = await request.read()  # whole, up to client_max_size
        except TimeoutError as exc:
            raise web.HTTPRequestTimeout(text=_json_error("report body too slow")) from exc
        token_claims(token, clock())
        ident = identity_from_review(await reviewer(token))
        report = decode(body)
        if report.namespace != ident.namespace:
            raise Forbidden(
                f"token of namespace {ident.namespace} cannot report for {report.namespace}"
            )
        if not per_pod.allow((ident.namespace, ident.pod_name)):
            raise TooMany(f"pod {ident.pod_name} reports too often; retry later")
        pod = await lookups.pod(ident)
        check_pod(ident, pod, report.server, report.pod)
        assert pod is not None
        ref = controller_of(pod.get("metadata") or {}) or {}
        sts = None
        if ref.get("kind") == "StatefulSet" and ref.get("name") == name_for(
            report.server, report.role
        ):
            sts = await lookups.statefulset(ident.namespace, ref["name"], ref.get("uid"))
        check_membership(pod, sts, report.server, report.role)
        return report, ident, (pod.get("metadata") or {}).get("uid", "")

    async def post_report(request: web.Request) -> web.Response:
        nonlocal in_flight
        if in_flight >= limits.max_in_flight:
            return _error(503, "too many reports at once; retry", retry_after=5)
        in_flight += 1
        try:
            report, _, uid = await authorize(request)
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"report larger than {MAX_REPORT_BYTES} bytes")
        except web.HTTPRequestTimeout:
            return _error(408, "the report body did not arrive in time")
        except Unauthorized as exc:
            return _error(401, str(exc))
        except Forbidden as exc:
            log.warning("report refused: %s", exc)
            return _error(403, str(exc))
        except ReportError as exc:
            return _error(400, str(exc))
        except TooMany as exc:
            return _error(429, str(exc), retry_after=5)
        except Unavailable as exc:
            return _error(503, str(exc), retry_after=5)
        finally:
            in_flight -= 1
        if not store.put(Received(report, clock(), uid)):
            # Out of order (two pushes in flight, a retry) or an earlier process's:
            # the newer report stays (reports.newer); the sidecar need not retry.
            log.debug(
                "report older than the one kept pod=%s startedAt=%s generatedAt=%s",
                report.pod,
                report.started_at,
                report.generated_at,
            )
        answer: dict[str, Any] = {"accepted": True}
        # report.server passed check_pod and check_membership: the pod's own server.
        live = policy_for(report.namespace, report.server)
        if live is not None:
            answer[POLICY_KEY] = live
        return web.json_response(answer, status=202)

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def close_executor(_: web.Application) -> None:
        executor.shutdown(wait=False, cancel_futures=True)

    app = web.Application(client_max_size=MAX_REPORT_BYTES)
    app[STORE_KEY] = store
    app[REVIEWER_KEY] = reviewer
    app[LOOKUPS_KEY] = lookups
    app.router.add_post(REPORT_PATH, post_report)
    app.router.add_get("/healthz", healthz)
    # Served only by the replica that holds the Lease (a standby serves standby.py's).
    app.router.add_get("/readyz", healthz)
    app.on_cleanup.append(close_executor)
    return app


def _json_error(message: str) -> str:
    return json.dumps({"error": message})


def _error(status: int, message: str, retry_after: int | None = None) -> web.Response:
    headers = {"Retry-After": str(retry_after)} if retry_after else None
    return web.json_response({"error": message}, status=status, headers=headers)


def tls_context(
    cert_file: str, key_file: str, clock: Callable[[], float] = time.monotonic
) -> ssl.SSLContext:
    """The endpoint's TLS context; it follows the files when the Secret is rotated
    (looked at once per ``serving_cert.CHECK_SECONDS`` of ``clock``)."""
    return ReloadingCert(cert_file, key_file, clock=clock).context


async def serve(
    app: web.Application, host: str, port: int, ssl_context: ssl.SSLContext | None
) -> web.AppRunner:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port, ssl_context=ssl_context).start()
    return runner
