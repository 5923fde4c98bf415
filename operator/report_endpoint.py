"""The report endpoint: sidecars POST residency reports here over HTTPS.

A report is accepted only when
1. it carries a bearer token the API server's TokenReview accepts for the
   ``kvferry`` audience, bound to a pod (projected ServiceAccount tokens carry
   the pod's name and uid);
2. that pod exists, has that uid, and belongs (label ``kvferry.io/server``) to
   the DisaggregatedServer the report names, in the token's namespace, and the
   report's pod name is that pod;
3. the body is a well-formed report of a version this operator reads, within
   the size limit.

Anything else gets a 4xx naming the reason and changes nothing.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from kvferry_wire.protocol import REPORT_PATH, REPORT_TOKEN_AUDIENCE
from kvferry_wire.report import MAX_REPORT_BYTES, ReportError, decode

from . import api
from .aggregate import Received
from .serving_cert import ReloadingCert

log = logging.getLogger(__name__)

POD_NAME_EXTRA = "authentication.kubernetes.io/pod-name"
POD_UID_EXTRA = "authentication.kubernetes.io/pod-uid"
SA_PREFIX = "system:serviceaccount:"
# TokenReview answers are reused this long; projected tokens live an hour.
TOKEN_CACHE_SECONDS = 60.0


@dataclass(frozen=True)
class Identity:
    namespace: str
    pod_name: str
    pod_uid: str


class Unauthorized(Exception):
    pass


class Forbidden(Exception):
    pass


# (token) -> TokenReview status dict; (namespace, pod) -> pod dict or None.
ReviewToken = Callable[[str], dict[str, Any]]
GetPod = Callable[[str, str], dict[str, Any] | None]


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


def check_pod(ident: Identity, pod: dict[str, Any] | None, server: str, report_pod: str) -> None:
    """The token's pod must be the report's pod and belong to the report's server."""
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


class ReportStore:
    """Latest report per pod, keyed (namespace, server) -> pod -> Received."""

    def __init__(self) -> None:
        self._by_server: dict[tuple[str, str], dict[str, Received]] = {}

    def put(self, received: Received) -> None:
        rep = received.report
        self._by_server.setdefault((rep.namespace, rep.server), {})[rep.pod] = received

    def servers(self) -> list[tuple[str, str]]:
        return list(self._by_server)

    def get(self, namespace: str, server: str) -> list[Received]:
        return list(self._by_server.get((namespace, server), {}).values())

    def forget(self, namespace: str, server: str) -> None:
        self._by_server.pop((namespace, server), None)


class _TokenCache:
    def __init__(self, review: ReviewToken, clock: Callable[[], float]) -> None:
        self.review = review
        self.clock = clock
        self._cache: dict[str, tuple[float, dict[str, Any]]] = {}

    def __call__(self, token: str) -> dict[str, Any]:
        key = hashlib.sha256(token.encode()).hexdigest()  # never keep tokens themselves
        now = self.clock()
        hit = self._cache.get(key)
        if hit and now - hit[0] < TOKEN_CACHE_SECONDS:
            return hit[1]
        result = self.review(token)
        if len(self._cache) > 10000:
            self._cache.clear()
        self._cache[key] = (now, result)
        return result


STORE_KEY = web.AppKey("store", ReportStore)


def app_factory(
    store: ReportStore,
    review_token: ReviewToken,
    get_pod: GetPod,
    clock: Callable[[], float] = time.time,
) -> web.Application:
    cached_review = _TokenCache(review_token, clock)

    async def post_report(request: web.Request) -> web.Response:
        if request.content_length is not None and request.content_length > MAX_REPORT_BYTES:
            return _error(413, f"report larger than {MAX_REPORT_BYTES} bytes")
        auth = request.headers.get("Authorization", "")
        if not auth.startswith("Bearer ") or not auth[7:].strip():
            return _error(401, "missing bearer token (the pod's projected kvferry token)")
        try:
            body = await request.content.read(MAX_REPORT_BYTES + 1)
            if len(body) > MAX_REPORT_BYTES:
                return _error(413, f"report larger than {MAX_REPORT_BYTES} bytes")
            review = await asyncio.to_thread(cached_review, auth[7:].strip())
            ident = identity_from_review(review)
            report = decode(body)
            if report.namespace != ident.namespace:
                raise Forbidden(
                    f"token of namespace {ident.namespace} cannot report for {report.namespace}"
                )
            pod = await asyncio.to_thread(get_pod, ident.namespace, ident.pod_name)
            check_pod(ident, pod, report.server, report.pod)
        except Unauthorized as exc:
            return _error(401, str(exc))
        except Forbidden as exc:
            log.warning("report refused: %s", exc)
            return _error(403, str(exc))
        except ReportError as exc:
            return _error(400, str(exc))
        store.put(Received(report, clock()))
        return web.json_response({"accepted": True}, status=202)

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application(client_max_size=MAX_REPORT_BYTES + 1024)
    app[STORE_KEY] = store
    app.router.add_post(REPORT_PATH, post_report)
    app.router.add_get("/healthz", healthz)
    return app


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def tls_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    """The endpoint's TLS context; it follows the files when the Secret is rotated."""
    return ReloadingCert(cert_file, key_file).context


async def serve(
    app: web.Application, host: str, port: int, ssl_context: ssl.SSLContext | None
) -> web.AppRunner:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port, ssl_context=ssl_context).start()
    return runner
