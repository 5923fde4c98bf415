"""The aiohttp application: routes, middleware and lifecycle. No protocol logic here.

Routes (both roles): ``/healthz`` (the process is up), ``/readyz`` (the local engine
answers /health: the status alone on the public port, the engine's URL, version,
block size and the handle count on the internal one), ``/metrics``, ``/v1/models``
(the local engine's),
``/v1/residency`` (the residency report, ``report.Report`` as JSON). Decode role:
``/v1/chat/completions`` and ``/v1/completions`` run the turn protocol
(``relay.serve_turn``), which reads the body within its caps (``limits.py``) and
against the app's budget of body bytes in flight (``BODY_BUDGET``).

Slow senders: a request head must arrive within ``header_timeout_seconds`` of the
connection opening or of the last answer (aiohttp's keep-alive deadline, which
closes the connection: there is no request yet to answer); a body within
``body_timeout_seconds`` (408, ``relay.serve_turn``).

A body not read whole (a refusal before its end) closes its connection after the
answer, a 408's at once (``relay.refuse_unread``); one address holds at most
``limits.MAX_CONNECTIONS_PER_CLIENT`` connections on the client port
(``client_connections_middleware``: 503 and close past it).

Three ports. ``listen_port`` is what the entry Service exposes to clients: turns,
models and probes. ``internal_port`` is for peers only: ``/metrics`` and
``/v1/residency`` answer there alone, and a turn carrying ``X-Kvferry-Forwarded-By``
is taken as a peer's relay only there (a client sending that header to the public
port is routed like any other). With ``internal_port: 0`` one port serves everything
(a sidecar run by hand). ``metrics_port`` (when set) answers GET ``/metrics`` and
nothing else, the sidecar's series and the engine's: what Prometheus is admitted to.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

from kvferry_wire.protocol import DRAIN_PATH, HDR_DRAINING, HDR_REQUEST_ID

from . import drain, httplog, limits, logfmt, relay
from .config import ROLE_DECODE, Settings
from .handles import Clock
from .limits import InflightBudget
from .promtext import only_families
from .runtime import Sidecar
from .types import PATH_CHAT, PATH_COMPLETIONS, PATH_MODELS, PATH_RESIDENCY, Api
from .upstream import UpstreamError

log = logging.getLogger(__name__)

SIDECAR = web.AppKey("sidecar", Sidecar)
# The sidecar's own id of a request: the engines see this one, never a client's.
REQUEST_ID = web.RequestKey("request_id", str)
# What every response echoes as X-Request-Id: the client's, or REQUEST_ID without one.
CLIENT_REQUEST_ID = web.RequestKey("client_request_id", str)
# Whether the request came in on the internal port (peers, monitoring).
INTERNAL = web.RequestKey("internal", bool)

# The engine container's preStop hook asks this (drain.py): it answers once the turns
# in flight are done or the grace is over, and the kubelet stops the engine after it.
PATH_DRAIN = DRAIN_PATH

# Answered on the internal port only.
INTERNAL_PATHS = frozenset({"/metrics", PATH_RESIDENCY, PATH_DRAIN})

# Drain on SIGTERM before stopping (the program sets it; in-process tests do not).
DRAIN_ON_SIGTERM = web.AppKey("drain_on_sigterm", bool)

# Request bodies held by the turns in progress (limits.InflightBudget).
BODY_BUDGET = web.AppKey("body_budget", InflightBudget)
# The connections each address holds on the client port (limits.ClientConnections).
CLIENT_CONNECTIONS = web.AppKey("client_connections", limits.ClientConnections)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _local_port(request: web.Request) -> int | None:
    sockname = request.transport.get_extra_info("sockname") if request.transport else None
    return sockname[1] if isinstance(sockname, tuple) and len(sockname) >= 2 else None


def on_metrics_port(request: web.Request, settings: Settings) -> bool:
    return bool(settings.metrics_port) and _local_port(request) == settings.metrics_port


def came_in_internally(request: web.Request, settings: Settings) -> bool:
    """True on the internal port; also when this server listens on one port only (a
    sidecar run by hand, or a test server on an ephemeral port). Never on the metrics
    port."""
    if on_metrics_port(request, settings):
        return False
    if not settings.internal_port:
        return True
    return _local_port(request) != settings.listen_port


# The engine's series the metrics port re-serves: vLLM's own. Its process_* and
# python_* series are left out: the sidecar exports its own under those names, and a
# family twice in one scrape makes Prometheus refuse the scrape.
ENGINE_SERIES_PREFIX = "vllm:"


@web.middleware
async def metrics_port_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The metrics port answers GET /metrics and nothing else (404, 405), before any
    other middleware or route sees the request: a scraper admitted to it gets no peer's
    rights (relayed turns, the residency report, readiness detail, the engine)."""
    sc = request.app[SIDECAR]
    if not on_metrics_port(request, sc.settings):
        return await handler(request)
    if request.path != "/metrics":
        raise web.HTTPNotFound(text="the metrics port serves GET /metrics only")
    if request.method not in ("GET", "HEAD"):
        raise web.HTTPMethodNotAllowed(request.method, ["GET", "HEAD"])
    return scrape(sc)


def scrape(sc: Sidecar) -> web.Response:
    """The sidecar's series and the engine's vLLM series of the sidecar's last scrape of
    it (every probe interval). Re-served rather than fetched per scrape: a scrape never
    makes the engine work or waits on it, and a failed scrape of the engine leaves its
    series out (absent, not frozen) until the next good one."""
    engine = only_families(sc.engine_metrics_text, ENGINE_SERIES_PREFIX)
    return web.Response(
        body=sc.metrics.render() + engine.encode(), content_type="text/plain", charset="utf-8"
    )


@web.middleware
async def client_connections_middleware(
    request: web.Request, handler: Handler
) -> web.StreamResponse:
    """One address holds at most ``limits.MAX_CONNECTIONS_PER_CLIENT`` connections on
    the client port (``listen_port``; peers and scrapers come in on the others). The
    first request of one more is a 503 with ``Retry-After`` and ``Connection: close``
    rather than a reset at accept: aiohttp has no hook there (under uvloop libuv
    accepts), and an HTTP answer is one a client or a gateway retries, where a reset
    reads as the pod failing."""
    settings = request.app[SIDECAR].settings
    if _local_port(request) != settings.listen_port or request.app[CLIENT_CONNECTIONS].admit(
        request.remote, request.protocol, request.task
    ):
        return await handler(request)
    cap = request.app[CLIENT_CONNECTIONS].cap
    message = (
        f"this address holds {cap} connections to the sidecar already, the most one may "
        "hold open; reuse them, or retry once one is closed"
    )
    response = web.json_response(
        relay.error_body(message, "server_busy", 503),
        status=503,
        headers={"Retry-After": str(limits.RETRY_AFTER_SECONDS)},
    )
    response.force_close()
    return response


@web.middleware
async def port_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    internal = came_in_internally(request, request.app[SIDECAR].settings)
    request[INTERNAL] = internal
    if request.path in INTERNAL_PATHS and not internal:
        raise web.HTTPNotFound(text="served on the sidecar's internal port only")
    return await handler(request)


@web.middleware
async def request_id_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Give the request an id of the sidecar's own (uuid4 hex, as vLLM's own ids) for
    the engines, and keep the client's X-Request-Id to echo (``echo_request_id``).

    A client's id never reaches an engine: vLLM keys a request by it, so two clients
    sending the same one would meet in an engine, and a client could name another's
    request. A client id that is no text (header bytes that are no UTF-8) cannot be
    echoed: 400 naming the header."""
    ours = uuid.uuid4().hex
    theirs = request.headers.get(HDR_REQUEST_ID)
    request[REQUEST_ID] = ours
    request[CLIENT_REQUEST_ID] = theirs or ours
    if theirs is not None and not theirs.isprintable():
        request[CLIENT_REQUEST_ID] = ours
        message = f"{HDR_REQUEST_ID} must be printable UTF-8 text"
        return web.json_response(
            relay.error_body(message, "invalid_request_error", 400, param=HDR_REQUEST_ID),
            status=400,
        )
    started = time.monotonic()
    response = await handler(request)
    # What the client sent is one field each, whatever it holds (logfmt.value).
    log.debug(
        "access method=%s path=%s status=%s request_id=%s client_request_id=%s seconds=%.4f",
        logfmt.value(request.method),
        logfmt.value(request.path),
        response.status,
        ours,
        logfmt.value(theirs),
        time.monotonic() - started,
    )
    return response


async def echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """Every response, streamed, relayed from a peer or an error, echoes the client's
    X-Request-Id (on_response_prepare: just before its headers go out)."""
    client_id = request.get(CLIENT_REQUEST_ID)
    if client_id is not None:
        response.headers[HDR_REQUEST_ID] = client_id


def _drain_then_exit(sc: Sidecar) -> None:
    """SIGTERM: drain, then stop as aiohttp's own handler would (GracefulExit). With
    native sidecars the kubelet sends it after the engine has exited, once the preStop
    drain is over, so this drain returns at once; it matters when the sidecar alone
    is stopped (a liveness restart) or runs outside Kubernetes."""

    def graceful_exit() -> None:
        raise web.GracefulExit()

    async def run() -> None:
        try:
            await sc.drain()
        except Exception:
            # A stop that cannot drain still stops: the kubelet's SIGKILL would be worse.
            log.exception("drain failed; stopping anyway")
        finally:
            asyncio.get_running_loop().call_soon(graceful_exit)

    task = asyncio.ensure_future(run())
    _SIGNAL_TASKS.add(task)
    task.add_done_callback(_SIGNAL_TASKS.discard)


_SIGNAL_TASKS: set[asyncio.Future[None]] = set()


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    sc = app[SIDECAR]
    await sc.start()
    if app[DRAIN_ON_SIGTERM]:
        # Replaces aiohttp's SIGTERM handler (installed before startup), which would
        # close the listeners at once: a stopping pod must still answer 503 + Retry-After
        # and let the turns in flight finish.
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, _drain_then_exit, sc)
    tasks = [
        asyncio.create_task(loop, name=f"kvferry-sidecar-{loop.__name__}")
        for loop in sc.background()
    ]
    yield
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task
    await sc.close()


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """Ready or not. On the public port that is all (the kubelet reads the status
    code; a client has no business with the engine's URL or the handle count); the
    internal port adds what peers and operators need to tell why."""
    sc = request.app[SIDECAR]
    if sc.drainer.draining:
        # Not ready from the first moment of a drain: the endpoint controller marks a
        # terminating pod not ready anyway, but it may still count as serving.
        return web.json_response({"status": "draining"}, status=503)
    if not request[INTERNAL]:
        if sc.local.ready:
            return web.json_response({"status": "ready"})
        return web.json_response({"status": "not-ready"}, status=503)
    body = {
        "role": sc.settings.role,
        "engine": sc.settings.engine_url,
        "engine_version": sc.local.info.version,
        "streaming_handles": sc.local.streaming_handles,
        "block_size": sc.local.block_size,
    }
    if sc.is_decode:
        body["prefill_engines_ready"] = sc.pool.ready_count()
        body["prefill_engines"] = len(sc.pool.engines)
        body["handles"] = len(sc.store)
    if sc.local.ready:
        return web.json_response({"status": "ready", **body})
    return web.json_response(
        {"status": "not-ready", "reason": sc.local.last_error, **body}, status=503
    )


async def metrics(request: web.Request) -> web.Response:
    sc = request.app[SIDECAR]
    return web.Response(body=sc.metrics.render(), content_type="text/plain", charset="utf-8")


async def residency(request: web.Request) -> web.Response:
    sc = request.app[SIDECAR]
    return web.Response(body=sc.report_body(), content_type="application/json")


async def models(request: web.Request) -> web.Response:
    sc = request.app[SIDECAR]
    try:
        status, body, content_type = await sc.local.client.get(PATH_MODELS)
    except UpstreamError as exc:
        return relay.not_ready(sc, request[REQUEST_ID], exc.reason)
    return web.Response(status=status, body=body, content_type=content_type or "application/json")


async def drain_endpoint(request: web.Request) -> web.Response:
    """The engine's preStop hook (GET, as the kubelet's httpGet sends it): stop taking
    turns, wait for those in flight within ``drain_seconds``, release the handles held,
    then answer; the kubelet stops the engine after the answer."""
    result = await request.app[SIDECAR].drain()
    return web.json_response(result.as_json())


def draining(request: web.Request) -> web.Response:
    """A turn that arrives while the pod stops: retryable. A client retries after
    Retry-After and reaches another pod (the Service no longer lists this one); a peer
    that forwarded it reads X-Kvferry-Draining and serves it itself (forward.py). The
    connection is closed, so a client's pool opens its next one elsewhere."""
    message = "this decode pod is stopping and takes no new turns; retry (another pod serves it)"
    response = web.json_response(
        relay.error_body(message, "draining", 503),
        status=503,
        headers={"Retry-After": str(drain.RETRY_AFTER_SECONDS), HDR_DRAINING: "true"},
    )
    response.force_close()
    return response


def _turn(api: Api) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        sc = request.app[SIDECAR]
        if sc.drainer.draining:
            return draining(request)
        with sc.drainer.turn():
            return await relay.serve_turn(
                sc,
                request,
                api,
                request[REQUEST_ID],
                client_request_id=request[CLIENT_REQUEST_ID],
                from_peer=request[INTERNAL],
                budget=request.app[BODY_BUDGET],
            )

    return handler


def app_factory(
    settings: Settings, *, clock: Clock | None = None, drain_on_sigterm: bool = False
) -> web.Application:
    """The sidecar app for ``settings.role``; ``clock`` replaces the handle clock in tests;
    ``drain_on_sigterm``: SIGTERM drains before the app stops (the program's own)."""
    sc = Sidecar(settings) if clock is None else Sidecar(settings, clock=clock)
    for reason in httplog.REASONS:
        sc.metrics.malformed.labels(reason)
    app = web.Application(
        middlewares=[
            metrics_port_middleware,
            request_id_middleware,
            client_connections_middleware,
            port_middleware,
        ],
        # A turn's body is read by relay.serve_turn within its own caps (limits.py);
        # other routes take aiohttp's default (1 MiB).
        handler_args={
            # aiohttp closes a connection that has not sent a whole request head this
            # long after it opened or after the last answer: the head's deadline, and
            # the keep-alive idle time with it.
            "keepalive_timeout": settings.header_timeout_seconds,
            # A malformed request is counted and one rate-limited line, not a
            # traceback per connection; our own errors stay loud (httplog.py).
            "logger": httplog.ServerLog(
                logging.getLogger("aiohttp.server"),
                lambda reason: sc.metrics.malformed.labels(reason).inc(),
            ),
        },
    )
    app[SIDECAR] = sc
    app[BODY_BUDGET] = InflightBudget(limits.inflight_capacity(settings))
    app[CLIENT_CONNECTIONS] = limits.ClientConnections(limits.MAX_CONNECTIONS_PER_CLIENT)
    app[DRAIN_ON_SIGTERM] = drain_on_sigterm
    app.cleanup_ctx.append(_lifecycle)
    app.on_response_prepare.append(echo_request_id)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get(PATH_MODELS, models)
    app.router.add_get(PATH_RESIDENCY, residency)
    app.router.add_get(PATH_DRAIN, drain_endpoint)
    if settings.role == ROLE_DECODE:
        app.router.add_post(PATH_CHAT, _turn(Api.CHAT))
        app.router.add_post(PATH_COMPLETIONS, _turn(Api.COMPLETIONS))
    return app
