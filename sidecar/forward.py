"""One hop to the session's owner: the decode pod whose D holds the session's KV.

The Service spreads clients over every decode sidecar; a sidecar that is not the
session's owner relays the request, unchanged, to the owner's sidecar and streams the
answer back. The relayed request carries ``X-Kvferry-Forwarded-By``; a sidecar serves
such a request itself whatever its own view of the ring, so a request is forwarded at
most once even while two pods disagree about the topology (a scale-up in progress).
An owner that cannot be reached, or answers 5xx before anything was streamed, is
skipped: this pod serves the turn (without the handle: a recompute). So is an owner
that is draining (its pod stops: 503 with ``X-Kvferry-Draining``), counted apart as
``owner-draining``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from kvferry_wire.protocol import HDR_DRAINING, HDR_FORWARDED_BY, HDR_REQUEST_ID

from . import session
from .runtime import Sidecar
from .types import Ordinal, TurnInput

log = logging.getLogger(__name__)

# Not relayed: hop-by-hop headers, and those aiohttp recomputes. Accept-Encoding is
# dropped so the owner's body can be relayed as is (the client session decompresses).
_HOP_HEADERS = frozenset(
    h.lower()
    for h in (
        "Host",
        "Connection",
        "Keep-Alive",
        "Proxy-Authenticate",
        "Proxy-Authorization",
        "TE",
        "Trailer",
        "Transfer-Encoding",
        "Upgrade",
        "Content-Length",
        "Accept-Encoding",
        "Content-Encoding",
    )
)


def target(sc: Sidecar, turn: TurnInput, *, forwarded: bool) -> Ordinal | None:
    """The owner's ordinal when the request should be relayed there, else None.
    ``forwarded``: a peer relayed it here (the caller checked it came from a peer)."""
    own = sc.settings.ordinal
    ring = len(sc.decode_sidecars)
    if forwarded or own is None or ring < 2 or own >= ring:
        return None
    owner = session.owner(turn.session_key, ring)
    return None if owner == own else owner


def _relay_headers(headers: Mapping[str, str]) -> CIMultiDict[str]:
    """Every end-to-end header, repeats kept: the owner pod must read a header sent
    twice as this pod did (owners.read_owner: twice is no owner), not as its last copy."""
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in _HOP_HEADERS)


async def forward(
    sc: Sidecar,
    request: web.Request,
    raw: bytes,
    turn: TurnInput,
    ordinal: Ordinal,
    client_request_id: str | None = None,
) -> web.StreamResponse | None:
    """Relay to the owner; None when this pod should serve the request instead.
    The owner gets the client's request id (``client_request_id``, or this pod's own
    when the client sent none): it logs it beside its own, which its engines see."""
    url = sc.decode_sidecars[ordinal].rstrip("/") + request.path_qs
    headers = _relay_headers(request.headers)
    headers[HDR_REQUEST_ID] = client_request_id or turn.request_id
    headers[HDR_FORWARDED_BY] = str(sc.settings.ordinal)
    try:
        upstream = await sc.http.post(
            url,
            data=raw,
            headers=headers,
            # The owner prefills and decodes within its own budgets; this hop allows
            # both (and aborts the owner's work when the client goes: closing it).
            timeout=aiohttp.ClientTimeout(
                total=sc.settings.prefill_timeout_seconds + sc.settings.decode_timeout_seconds,
                connect=sc.settings.connect_timeout_seconds,
                sock_connect=sc.settings.connect_timeout_seconds,
            ),
        )
    except TimeoutError as exc:
        if not isinstance(exc, aiohttp.ConnectionTimeoutError):
            # Connected, but no answer within both budgets: serving the turn here
            # again would double the wait.
            sc.metrics.forwarded.labels("timeout").inc()
            log.warning("owner timed out request_id=%s owner=%s", turn.request_id, ordinal)
            return _timed_out()
        sc.metrics.forwarded.labels("unreachable").inc()
        log.warning(
            "owner unreachable, serving here request_id=%s owner=%s err=%s",
            turn.request_id,
            ordinal,
            exc,
        )
        return None
    except aiohttp.ClientError as exc:
        sc.metrics.forwarded.labels("unreachable").inc()
        log.warning(
            "owner unreachable, serving here request_id=%s owner=%s err=%s",
            turn.request_id,
            ordinal,
            exc,
        )
        return None
    response: web.StreamResponse | None = None
    try:
        if upstream.status == 503 and HDR_DRAINING in upstream.headers:
            # The owner's pod is stopping (app.draining): its sessions' KV goes with
            # it, so this pod serves the turn (a recompute) instead of the client
            # retrying into the same refusal.
            await upstream.read()
            sc.metrics.forwarded.labels("owner-draining").inc()
            log.info(
                "owner draining, serving here request_id=%s owner=%s", turn.request_id, ordinal
            )
            return None
        if upstream.status >= 500:
            await upstream.read()
            sc.metrics.forwarded.labels("owner-error").inc()
            log.warning(
                "owner answered %s, serving here request_id=%s owner=%s",
                upstream.status,
                turn.request_id,
                ordinal,
            )
            return None
        response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
        response.headers.update(_relay_headers(upstream.headers))
        await response.prepare(request)
        async for chunk in upstream.content.iter_any():
            await response.write(chunk)
        await response.write_eof()
        sc.metrics.forwarded.labels("ok").inc()
        return response
    except (aiohttp.ClientError, ConnectionResetError, TimeoutError) as exc:
        sc.metrics.forwarded.labels("broken").inc()
        log.warning("relay broken request_id=%s owner=%s err=%s", turn.request_id, ordinal, exc)
        upstream.close()
        if response is None and isinstance(exc, TimeoutError):
            return _timed_out()
        # Once the client has part of the answer there is nothing to fall back to.
        return response
    finally:
        upstream.release()


def _timed_out() -> web.Response:
    return web.json_response(
        {
            "error": {
                "message": "the session's decode pod did not answer within the sidecar's "
                "budget (prefillTimeoutSeconds + decodeTimeoutSeconds); the request was "
                "aborted",
                "type": "upstream_timeout",
                "code": 504,
            }
        },
        status=504,
    )
