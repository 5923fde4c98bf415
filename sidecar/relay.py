"""The bidirectional turn protocol (decode role): the I/O half, over aiohttp.

The decisions are ``plan``'s (pure); this module talks to the engines and the
client and asks ``plan`` what to do at each step.

    serve_turn
      1. read_body        the body within its caps and the bytes-in-flight budget
                          (limits.py: 413, 400, 408, 503); a big turn's JSON work
                          runs in the heavy-work thread (offload.py)
         plan.parse_turn  body + headers -> TurnInput (session key, stream, ...),
                          each field read as vLLM reads it (fields.py) or a 400
      2. forward.target   not the session's owner? one hop there (forward.forward)
      3. prompt_tokens    the prompt's ids from D's /tokenize
      4. plan.plan_turn   the session's handle (taken from the store: single use),
                          expiry and alignment; the route: P (with/without handle)
                          or D alone
      5. run_prefill      a loop over attempts on the least-loaded ready P;
                          retries; pull failure -> recompute; plan.settle gives the
                          turn's outcome; what the requests carry is a release.Ride,
                          and the releaser settles the taken handle afterwards
      6. run_decode       local D with P's params; relayed as D's Content-Type says
                          (SSE or JSON, both parsed: a body that parses as neither
                          is a 502, never passed on); restore the client's view;
                          plan.build_handle keeps the next
      7. record_turn      TurnReport -> series, one log line, the residency model

Every failure of the reuse machinery degrades to a recompute; the client sees an
error only when the local decode engine itself cannot answer (502) or the request
is invalid (the sidecar's own 400, naming the field, for a body that is no JSON
object, a session key or model that is no Unicode text, or a field the sidecar acts
on that vLLM would refuse; otherwise the engine's own 4xx), or past a limit (413,
400, 408 or 503 naming the limit and its setting: ``limits.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from kvferry_wire.protocol import HDR_FORWARDED_BY, Outcome, Route

from . import anchor, fields, forward, limits, logfmt, offload, owners, plan, rewrite, session
from .release import PINNED_PULL_FAILED, Ride
from .runtime import Sidecar
from .types import (
    F_KV_PARAMS,
    JSON,
    LOCAL_HANDLE_PARAMS,
    Api,
    KVHandle,
    PrefillPlan,
    PrefillResult,
    TurnInput,
    TurnReport,
    TurnTimings,
)
from .upstream import (
    EngineTimeout,
    EngineUnavailable,
    EngineUnreachable,
    PrefillEngine,
    UpstreamError,
)

log = logging.getLogger(__name__)


def _session_id(sc: Sidecar, turn: TurnInput) -> str | None:
    return turn.session if sc.settings.tag_session_id else None


# ------------------------------------------------------------------ 3. tokens


async def prompt_tokens(sc: Sidecar, turn: TurnInput) -> list[int] | None:
    ids = rewrite.prompt_ids_in_body(turn.body)
    if ids is not None:
        return ids
    body = rewrite.tokenize_body(turn.body)
    if body is None:
        return None
    try:
        return await sc.local.client.tokenize(body, request_id=turn.request_id, heavy=turn.heavy)
    except UpstreamError as exc:
        log.info(
            "tokenize failed; no reuse this turn request_id=%s err=%s",
            logfmt.value(turn.request_id),
            logfmt.value(exc),
        )
        return None


# ------------------------------------------------------------------ 5. prefill


def _valid_prefill_params(data: Any) -> Mapping[str, Any] | None:
    if not isinstance(data, dict):
        return None
    params = data.get(F_KV_PARAMS)
    return params if isinstance(params, dict) and params else None


# Prefill attempt results (the kvferry_prefill_attempts_total label).
ATTEMPT_OK = "ok"
ATTEMPT_ABANDONED = "abandoned"  # the client left while P had the request
ATTEMPT_UNAVAILABLE = "unavailable"
ATTEMPT_TIMEOUT = "timeout"
ATTEMPT_NO_PARAMS = "no-params"  # P answered without kv_transfer_params
ATTEMPT_PULL_FAILED = "pull-failed"  # P failed with something to pull or release
ATTEMPT_ERROR = "error"


@dataclass(frozen=True)
class _Attempt:
    """One prefill request's result, and what the turn does next."""

    result: str
    params: Mapping[str, Any] | None = None  # P's kv_transfer_params (result ok)
    broke_off: bool = False  # it reached P carrying something: state unknown now
    fails_pull: bool = False  # a pull it dropped makes the turn's outcome pull-failed
    next_engine: bool = False  # the next attempt goes to another engine
    again: bool = True  # another attempt may follow


async def _attempt(sc: Sidecar, engine: PrefillEngine, turn: TurnInput, ride: Ride) -> _Attempt:
    """Send the prefill request once and classify what came back."""
    carrying = ride.params()
    body = rewrite.prefill_body(turn.body, carrying, _session_id(sc, turn))
    try:
        with sc.pool.in_flight(engine):
            status, data = await engine.client.post_json(
                turn.api.path,
                body,
                request_id=turn.request_id,
                timeout=sc.settings.prefill_timeout_seconds,
                heavy=turn.heavy,
            )
    except asyncio.CancelledError:
        sc.metrics.prefill_attempts.labels(ATTEMPT_ABANDONED).inc()
        ride.broke_off()
        raise
    except EngineUnavailable as exc:
        sc.pool.mark_down(engine.url)
        log.warning(
            "prefill engine unavailable request_id=%s err=%s",
            logfmt.value(turn.request_id),
            logfmt.value(exc),
        )
        # Never connected: what it carried is untouched, the next engine gets it.
        reached = not isinstance(exc, EngineUnreachable)
        return _Attempt(
            ATTEMPT_UNAVAILABLE, broke_off=reached, fails_pull=reached, next_engine=True
        )
    except EngineTimeout as exc:
        log.warning(
            "prefill timed out request_id=%s err=%s",
            logfmt.value(turn.request_id),
            logfmt.value(exc),
        )
        return _Attempt(ATTEMPT_TIMEOUT, broke_off=True, fails_pull=True, next_engine=True)
    params = _valid_prefill_params(data) if status == 200 else None
    if params is not None:
        return _Attempt(ATTEMPT_OK, params, again=False)
    if status == 200:
        log.warning(
            "prefill engine returned no kv_transfer_params (is it running the "
            "NixlConnector?) request_id=%s engine=%s",
            turn.request_id,
            engine.url,
        )
        return _Attempt(ATTEMPT_NO_PARAMS, broke_off=True, again=False)
    if carrying is not None:
        # A failed pull (handle expired, D gone) under kv_load_failure_policy=fail is
        # an immediate 500: retry at once without the handle = recompute.
        log.warning(
            "prefill failed with a handle; recomputing request_id=%s status=%s",
            turn.request_id,
            status,
        )
        return _Attempt(ATTEMPT_PULL_FAILED, broke_off=True, fails_pull=True)
    if 400 <= status < 500:
        # Let D answer: if the request is invalid, D's error is the canonical one.
        return _Attempt(ATTEMPT_ERROR, again=False)
    log.warning(
        "prefill failed request_id=%s engine=%s status=%s",
        turn.request_id,
        engine.url,
        status,
    )
    return _Attempt(ATTEMPT_ERROR, next_engine=True)


async def run_prefill(
    sc: Sidecar, turn: TurnInput, planned: PrefillPlan, rules: plan.Rules, timings: TurnTimings
) -> PrefillResult:
    """The turn's prefill on the least-loaded ready P: each engine once, plus one
    retry without the handle after a failed pull; a fallback (D prefills) otherwise."""
    if planned.route is Route.SKIP:
        outcome, reused = plan.settle(planned, Route.SKIP, planned.outcome)
        # D prefills alone and carries no kv_transfer_params (types.py: no handle).
        return PrefillResult(Route.SKIP, outcome, None, reused)
    outcome = planned.outcome
    tried: set[str] = set()
    attempts = 0
    started = time.monotonic()
    budget = len(sc.pool.engines) + 1
    with sc.releaser.ride(planned.handle_params, planned.taken) as ride:
        while attempts < budget and (engine := sc.pool.choose(tried)) is not None:
            attempts += 1
            if timings.queue_s is None:
                timings.queue_s = time.monotonic() - turn.received_at
            attempt = await _attempt(sc, engine, turn, ride)
            sc.metrics.prefill_attempts.labels(attempt.result).inc()
            if attempt.params is not None:
                outcome, reused = plan.settle(planned, Route.REMOTE, outcome)
                return PrefillResult(
                    Route.REMOTE,
                    outcome,
                    attempt.params,
                    reused,
                    engine.url,
                    attempts,
                    time.monotonic() - started,
                    handle_freed=ride.answered(),
                    handle_unknown=ride.taken_unknown,
                )
            if attempt.broke_off:
                if attempt.fails_pull and ride.pulling:
                    outcome = Outcome.PULL_FAILED
                ride.broke_off()
            if attempt.next_engine:
                tried.add(engine.url)
            if not attempt.again:
                break
    elapsed = time.monotonic() - started if attempts else None
    outcome, reused = plan.settle(planned, Route.FALLBACK, outcome)
    return PrefillResult(
        Route.FALLBACK,
        outcome,
        None,
        reused,
        None,
        attempts,
        elapsed,
        handle_unknown=ride.taken_unknown,
    )


# ------------------------------------------------------------------ 6. decode


async def _in_flight(sc: Sidecar, work: Awaitable[None]) -> None:
    """Work a turn leaves running once its client may have gone (a re-anchor): a
    drain waits for it like a turn (drain.py, rule 1)."""
    with sc.drainer.turn():
        await work


def error_body(message: str, kind: str, status: int, param: str | None = None) -> JSON:
    error: JSON = {"message": message, "type": kind, "code": status}
    if param is not None:
        error["param"] = param  # the request field at fault, as vLLM and OpenAI name it
    return {"error": error}


def engine_error(status: int, raw: bytes) -> JSON:
    """D's error answer rebuilt, never relayed as sent: a 4xx keeps vLLM's message,
    type and param (the request was refused; the client must learn why), a 5xx says
    only its status (its text is the engine's internals)."""
    if 400 <= status < 500:
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError):
            data = None
        # vLLM answers {"error": {...}}; older releases put the fields at the top.
        error = data.get("error", data) if isinstance(data, dict) else None
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            kind = error.get("type")
            param = error.get("param")
            return error_body(
                error["message"][:2000],
                kind if isinstance(kind, str) else "invalid_request_error",
                status,
                param if isinstance(param, str) else None,
            )
        return error_body(
            f"the engine refused the request ({status})", "invalid_request_error", status
        )
    return error_body(f"the engine failed ({status}); retry shortly", "engine_error", status)


def not_ready(sc: Sidecar, request_id: str, detail: str) -> web.Response:
    # The engine's address and the connection error stay in the log: they are the
    # pod's internals, not the client's business.
    message = "the decode engine is not ready; the request was not served, retry shortly"
    log.warning(
        "upstream not ready request_id=%s engine=%s detail=%s",
        logfmt.value(request_id),
        sc.settings.engine_url,
        logfmt.value(detail),
    )
    # X-Request-Id: app.echo_request_id, as on every response.
    return web.json_response(error_body(message, "upstream_not_ready", 502), status=502)


async def _open_decode(
    sc: Sidecar, turn: TurnInput, params: Mapping[str, Any] | None
) -> aiohttp.ClientResponse:
    body = rewrite.decode_body(turn.body, params, _session_id(sc, turn))
    s = sc.settings
    return await sc.local.client.open(
        turn.api.path,
        body,
        request_id=turn.request_id,
        total=s.decode_timeout_seconds,
        # A non-streamed answer comes in one piece at the end: only the total applies.
        idle=s.stream_idle_timeout_seconds if turn.stream else None,
        heavy=turn.heavy,
    )


def timed_out(sc: Sidecar, request_id: str, detail: str) -> web.Response:
    message = (
        f"the decode engine did not answer within the sidecar's budget ({detail}); "
        "the request was aborted"
    )
    log.warning(
        "decode timed out request_id=%s detail=%s",
        logfmt.value(request_id),
        logfmt.value(detail),
    )
    return web.json_response(error_body(message, "upstream_timeout", 504), status=504)


async def run_decode(
    sc: Sidecar,
    request: web.Request,
    turn: TurnInput,
    prefill: PrefillResult,
    rules: plan.Rules,
    report: TurnReport,
) -> web.StreamResponse:
    timings = report.timings
    if timings.queue_s is None:
        timings.queue_s = time.monotonic() - turn.received_at
    p_done = time.monotonic()
    # A streamed turn on vLLM 0.32 goes through anchor.py: D reads P's KV in a
    # one-token request first, the answer streams without kv_transfer_params.
    streamed = plan.streams_without_params(turn, rules)
    # Prefilled by D alone: as a prefill-side request, so D keeps a handle vLLM frees.
    keeps = plan.handle_not_kept(turn, rules) is None and not streamed
    local = LOCAL_HANDLE_PARAMS if keeps else None
    params = prefill.decode_params
    anchored: rewrite.Capture | None = None
    try:
        if streamed and params is not None:
            anchored = await anchor.read_prefill(sc, turn, params)
            params = None
            if anchored is None:
                report.route = Route.FALLBACK  # D could not read P's KV: D prefills
        upstream = await _open_decode(sc, turn, params or local)
        if upstream.status >= 500 and prefill.route is Route.REMOTE and params is not None:
            # D could not pull P's blocks (P gone, lease expired): D prefills itself.
            await upstream.read()
            upstream.release()
            log.warning(
                "decode failed with prefill params; prefilling on D request_id=%s status=%s",
                turn.request_id,
                upstream.status,
            )
            report.route = Route.FALLBACK
            upstream = await _open_decode(sc, turn, local)
    except EngineTimeout as exc:
        _release_capture(sc, turn, anchored)
        report.status, report.error = 504, exc.reason
        return timed_out(sc, turn.request_id, exc.reason)
    except UpstreamError as exc:
        _release_capture(sc, turn, anchored)
        report.status, report.error = 502, exc.reason
        return not_ready(sc, turn.request_id, exc.reason)
    except asyncio.CancelledError:
        _release_capture(sc, turn, anchored)
        raise
    if prefill.route is Route.REMOTE:
        timings.p_to_d_s = time.monotonic() - p_done
    report.status = upstream.status
    headers = plan.response_headers(
        turn,
        report,
        rules,
        ordinal=sc.settings.ordinal,
        engine_version=sc.local.info.version,
    )
    settled = False

    def finish(capture: rewrite.Capture) -> Awaitable[None]:
        # A streamed turn's handle, before the client's stream ends (anchor.py). Once
        # the client has the finish chunk, many close (a break on finish_reason): the
        # turn is complete, so leaving must not abort the re-anchor and release the
        # anchor. It runs as a task of its own; the caller waits on it shielded.
        nonlocal settled
        settled = True
        if not streamed:
            # vLLM 0.33 put the handle on the finish chunk: D pins it whether or not
            # the client stays for [DONE], so it is kept (or released) now.
            _keep_handle(sc, turn, capture, rules, report)
            return _done()
        keeping = asyncio.ensure_future(
            _in_flight(sc, _keep_streamed_handle(sc, turn, capture, anchored, rules, report))
        )
        _KEEPING.add(keeping)
        keeping.add_done_callback(_KEEPING.discard)
        return asyncio.shield(keeping)

    try:
        if upstream.status != 200:
            raw = await upstream.read()
            report.error = f"decode answered {upstream.status}"
            log.warning(
                "decode answered %d request_id=%s body=%s",
                upstream.status,
                logfmt.value(turn.request_id),
                logfmt.value(raw[:2000].decode("utf-8", "replace")),
            )
            return web.json_response(
                engine_error(upstream.status, raw), status=upstream.status, headers=headers
            )
        # What D sent decides the relay, not what the request asked: a JSON answer to
        # a streamed request is parsed and stripped like any JSON answer.
        if upstream.content_type == _EVENT_STREAM:
            response, capture = await _relay_stream(
                request,
                upstream,
                turn,
                headers,
                report,
                finish,
                finish_after_break=not streamed,
                decode_started=p_done,
            )
        else:
            response, capture = await _answered(sc, upstream, turn, headers, report)
            # D's whole answer, every token of it: the decode leg's cost fit is told how
            # many (residency.py).
            timings.decode_s = time.monotonic() - p_done
            report.timed_output_tokens = len(capture.output_ids) or None
        report.finish_reason = capture.finish_reason
        if report.error is None and not settled:
            if streamed:
                await finish(capture)
            else:
                _keep_handle(sc, turn, capture, rules, report)
    except TimeoutError:
        # The answer did not finish within the budget: closing D's connection aborts it.
        upstream.close()
        report.status, report.error = 504, "decode answer timed out"
        return timed_out(sc, turn.request_id, f"{sc.settings.decode_timeout_seconds}s in all")
    finally:
        upstream.release()
        if not settled:
            _release_capture(sc, turn, anchored)  # the stream broke, or the client left
    return response


_EVENT_STREAM = "text/event-stream"


def _done() -> asyncio.Future[None]:
    done = asyncio.get_running_loop().create_future()
    done.set_result(None)
    return done


# Streamed turns' handles being kept after their client left (held until done).
_KEEPING: set[asyncio.Future[None]] = set()


async def _answered(
    sc: Sidecar,
    upstream: aiohttp.ClientResponse,
    turn: TurnInput,
    headers: dict[str, str],
    report: TurnReport,
) -> tuple[web.StreamResponse, rewrite.Capture]:
    """D's JSON answer relayed (``_relay_body``). D has finished the request when it
    answers, so it holds the turn's KV whatever the client does now: a client that
    leaves while the answer is read (off the loop for a big one) must not make the
    sidecar drop the handle, or D pins it, untracked, until its TTL. The reading is
    shielded from the cancellation and its handle released."""
    reading = asyncio.ensure_future(_relay_body(upstream, turn, headers, report))
    try:
        return await asyncio.shield(reading)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            _, capture = await reading
            _release_capture(sc, turn, capture)  # the client left: D pins it
        raise


def _read_answer(raw: bytes, wants_token_ids: bool) -> tuple[str, rewrite.Capture] | None:
    """D's JSON answer as the client gets it, and what it says about the handle; None
    when it is no JSON object."""
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict):
        return None
    capture = rewrite.capture_body(obj)
    rewrite.restore_body(obj, wants_token_ids=wants_token_ids)
    return json.dumps(obj), capture


async def _relay_body(
    upstream: aiohttp.ClientResponse,
    turn: TurnInput,
    headers: dict[str, str],
    report: TurnReport,
) -> tuple[web.StreamResponse, rewrite.Capture]:
    raw = await upstream.read()
    # A long prompt's answer carries its token ids: read and rewritten off the loop.
    heavy = len(raw) > offload.HEAVY_BYTES
    answer = await offload.maybe(heavy, _read_answer, raw, turn.wants_token_ids)
    if answer is None:
        # Never relay what was not parsed: it may carry what restore_body strips.
        report.status, report.error = 502, "decode answered a body that is not a JSON object"
        log.warning(
            "decode answer not a JSON object request_id=%s content_type=%s",
            logfmt.value(turn.request_id),
            logfmt.value(upstream.content_type),
        )
        message = "the decode engine's answer could not be read; the request was not served"
        return web.json_response(
            error_body(message, "upstream_error", 502), status=502, headers=headers
        ), rewrite.Capture()
    text, capture = answer
    return web.Response(text=text, content_type="application/json", headers=headers), capture


async def _relay_stream(
    request: web.Request,
    upstream: aiohttp.ClientResponse,
    turn: TurnInput,
    headers: dict[str, str],
    report: TurnReport,
    finish: Callable[[rewrite.Capture], Awaitable[None]] | None = None,
    *,
    finish_after_break: bool = False,
    decode_started: float | None = None,
) -> tuple[web.StreamResponse, rewrite.Capture]:
    """``finish``: awaited once the answer is relayed, before the client's ``[DONE]``
    (a streamed turn's handle is made then, anchor.py). ``finish_after_break``: also
    called when the stream breaks after the finish chunk (the handle D put on it is
    pinned; a re-anchor on a D whose stream just broke is not worth starting).
    ``decode_started``: when D's leg began (its first token times the leg)."""
    response = web.StreamResponse(status=200, headers=headers)
    response.content_type = upstream.content_type or "text/event-stream"
    response.headers["Cache-Control"] = "no-cache"
    await response.prepare(request)
    sse = rewrite.SSERewriter(wants_token_ids=turn.wants_token_ids, hold_done=finish is not None)
    finishing: Awaitable[None] | None = None
    try:
        async for chunk in upstream.content.iter_any():
            # An event with a long prompt's token ids is parsed off the loop.
            heavy = sse.pending + len(chunk) > offload.HEAVY_BYTES
            out = await offload.maybe(heavy, sse.feed, chunk)
            if out:
                if report.timings.first_token_s is None:
                    report.timings.first_token_s = time.monotonic() - turn.received_at
                    if decode_started is not None:
                        report.timings.decode_s = time.monotonic() - decode_started
                        report.timed_output_tokens = 1
                await response.write(out)
        tail = sse.flush()
        if tail:
            await response.write(tail)
        if finish is not None:
            report.finish_reason = sse.capture.finish_reason
            finishing = finish(sse.capture)
            await finishing
            if sse.done:
                await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except asyncio.CancelledError:
        # The client left. After the finish chunk the answer is whole (its ids are all
        # captured): the handle is still made, without the client.
        if finish is not None and finishing is None and sse.capture.finish_reason is not None:
            finish(sse.capture)
        raise
    except (aiohttp.ClientError, ConnectionResetError, TimeoutError) as exc:
        # D broke off or fell silent past the idle budget, or the client left (closing
        # D's stream aborts the request). The client already has the headers: it gets
        # an error event, as vLLM sends one when a stream fails, and the stream ends.
        # After the finish chunk the answer is whole and D holds its KV: as above.
        after_finish = finishing is None and sse.capture.finish_reason is not None
        if finish is not None and finish_after_break and after_finish:
            finish(sse.capture)
        upstream.close()
        report.error = f"stream broken: {type(exc).__name__}: {exc}"
        log.warning(
            "stream broken request_id=%s err=%s",
            logfmt.value(turn.request_id),
            logfmt.value(repr(exc)),
        )
        why = "timed out" if isinstance(exc, TimeoutError) else "broke off"
        event = error_body(f"the decode engine {why} mid-answer", "upstream_error", 502)
        with contextlib.suppress(ConnectionResetError, aiohttp.ClientError, RuntimeError):
            await response.write(f"data: {json.dumps(event)}\n\n".encode())
            await response.write_eof()
    return response, sse.capture


def _build_handle(
    sc: Sidecar, turn: TurnInput, capture: rewrite.Capture
) -> tuple[KVHandle | None, str | None]:
    """``plan.build_handle`` of D's answer, now, with this sidecar's settings; noted
    in the pin journal, kept or not (D pins it either way)."""
    handle, why = plan.build_handle(
        turn,
        capture,
        now=sc.store.now(),
        received_wall=time.time(),
        engine_build=sc.settings.engine_build,
        # D's deadline (the ceiling); the retention in force is the store's to apply.
        retention_s=sc.settings.retention_ceiling,
        local_lease_s=sc.settings.local_handle_seconds,
    )
    if handle is not None:
        sc.note_pinned(handle)
    return handle, why


def _release_capture(sc: Sidecar, turn: TurnInput, capture: rewrite.Capture | None) -> None:
    """Release the handle in a D answer no turn will read (anchor.read_prefill's, or
    a JSON answer whose client left while it was read)."""
    if capture is None:
        return
    handle, _ = _build_handle(sc, turn, capture)
    if handle is not None:
        sc.releaser.release(handle)


async def _keep_streamed_handle(
    sc: Sidecar,
    turn: TurnInput,
    capture: rewrite.Capture,
    anchored: rewrite.Capture | None,
    rules: plan.Rules,
    report: TurnReport,
) -> None:
    """A streamed turn on an engine that streams no handle (anchor.py): keep the
    re-anchored handle and release the anchor's, or keep the anchor's (it covers the
    prompt) when the re-anchor failed."""
    if capture.params:
        # The engine did stream a handle (a JSON answer to a streamed request).
        _release_capture(sc, turn, anchored)
        _keep_handle(sc, turn, capture, rules, report)
        return
    if not plan.reanchors(turn, rules):
        _release_capture(sc, turn, anchored)
        report.handle_not_kept_reason = plan.handle_not_kept(turn, rules)
        return
    try:
        fresh = await anchor.reanchor(sc, turn, capture, report)
    except asyncio.CancelledError:
        # The client left: the re-anchor, if D got it, is held for D's lease (vLLM frees
        # it); the anchor is the sidecar's to release.
        _release_capture(sc, turn, anchored)
        raise
    if fresh is not None:
        _release_capture(sc, turn, anchored)
        _keep_handle(sc, turn, fresh, rules, report)
    elif anchored is not None:
        anchored.text = capture.text  # the next turn's history holds the streamed answer
        _keep_handle(sc, turn, anchored, rules, report)
    else:
        report.handle_not_kept_reason = plan.NOT_KEPT_NONE


def _keep_handle(
    sc: Sidecar,
    turn: TurnInput,
    capture: rewrite.Capture,
    rules: plan.Rules,
    report: TurnReport,
) -> None:
    """Keep the handle D's answer left for the next turn; release one that cannot be
    kept (D pins it all the same)."""
    reason = plan.handle_not_kept(turn, rules)
    handle, why = _build_handle(sc, turn, capture)
    if handle is not None and reason is None and why is None:
        if sc.store.put(handle, previous=turn.slot):
            report.handle_kept = True
            report.next_session = handle.session
        else:
            # Refused by admission, or alone over its owner's token cap: released at once.
            report.handle_not_kept_reason = sc.store.refused_by or owners.EVICT_OWNER_TOKENS
        return
    report.handle_not_kept_reason = reason or why
    if handle is not None:
        sc.releaser.release(handle)


# ------------------------------------------------------------------ 1. the body

# Bodies above this are parsed in a thread (limits.PARSE_IN_THREAD_BYTES).
BIG = limits.PARSE_IN_THREAD_BYTES
_ERROR_TYPES = {408: "request_timeout", 503: "server_busy"}


def refuse(refusal: limits.Refusal) -> web.Response:
    """The client's answer to a request the sidecar will not take."""
    kind = _ERROR_TYPES.get(refusal.status, "invalid_request_error")
    headers = {"Retry-After": str(limits.RETRY_AFTER_SECONDS)} if refusal.status == 503 else None
    return web.json_response(
        error_body(refusal.message, kind, refusal.status, refusal.param),
        status=refusal.status,
        headers=headers,
    )


async def refuse_unread(request: web.Request, refusal: limits.Refusal) -> web.StreamResponse:
    """The answer to a request refused while reading its body. Its body not read whole,
    the connection is not kept (``Connection: close``): aiohttp reads what still
    arrives for its lingering time, so a client still sending gets this answer and not
    a reset, then closes. A 408's connection is closed as soon as the answer is out:
    nothing is arriving, and a sender that finished the body during the lingering
    time would otherwise keep the connection for the keep-alive time (an hour)."""
    response = refuse(refusal)
    if request.content.is_eof():
        return response
    response.force_close()
    if refusal.status == 408:
        await response.prepare(request)
        await response.write_eof()
        # Closes the transport once what is written has gone out, and ends aiohttp's
        # work on the connection: no lingering read.
        request.protocol.force_close()
    return response


async def read_body(
    sc: Sidecar, request: web.Request, caps: limits.BodyCaps, held: limits.Hold
) -> tuple[bytes, dict[str, Any]] | limits.Refusal:
    """The raw body and its JSON object, read within ``caps``, the in-flight budget
    (``held`` grows with the bytes that arrive, never with a length only declared:
    heads that declare big bodies and send nothing must not hold the budget from
    everyone else) and ``body_timeout_seconds``; or why not. A declared length past
    the caps is refused before a byte of the body is read."""
    declared = request.content_length
    if declared is not None:
        refused = limits.too_large(declared, caps) or held.fits(declared)
        if refused is not None:
            return refused
    chunks: list[bytes] = []
    size = 0
    deadline = sc.settings.body_timeout_seconds
    try:
        async with asyncio.timeout(deadline):
            while chunk := await request.content.readany():
                chunks.append(chunk)
                size += len(chunk)
                refused = limits.too_large(size, caps) or held.grow(size)
                if refused is not None:
                    return refused
    except TimeoutError:
        message = (
            f"the request body did not arrive within {deadline}s "
            f"({limits.key('body_timeout_seconds')})"
        )
        return limits.Refusal(408, message)
    raw = b"".join(chunks)
    del chunks
    parsed = await offload.maybe(size > BIG, limits.parse_body, raw, caps)
    return parsed if isinstance(parsed, limits.Refusal) else (raw, parsed)


# ------------------------------------------------------------------ the turn


def _parse_turn(heavy: bool, *args: Any) -> TurnInput:
    turn = plan.parse_turn(*args)
    return dataclasses.replace(turn, heavy=True) if heavy else turn


def _client_gone(sc: Sidecar, report: TurnReport, received_at: float) -> None:
    report.status, report.error = 499, "client went away"
    report.timings.total_s = time.monotonic() - received_at
    sc.record_turn(report)


async def serve_turn(
    sc: Sidecar,
    request: web.Request,
    api: Api,
    request_id: str,
    *,
    client_request_id: str | None = None,
    from_peer: bool = True,
    budget: limits.InflightBudget,
) -> web.StreamResponse:
    """One turn. ``request_id`` is the sidecar's own (the engines see it);
    ``client_request_id`` the client's X-Request-Id, logged beside it and passed on to
    the owner when the turn is forwarded. ``from_peer``: the request came in on the
    internal port, so an ``X-Kvferry-Forwarded-By`` header on it is a peer's, not a
    client's. ``budget``: the body bytes every turn in progress holds; this turn's
    count until it is over."""
    received_at = time.monotonic()
    caps = limits.body_caps(sc.settings, sc.local.info.max_model_len)
    with budget.hold() as held:
        read = await read_body(sc, request, caps, held)
        if isinstance(read, limits.Refusal):
            return await refuse_unread(request, read)
        raw, body = read
        field = session.invalid_text_field(body, request.headers, sc.settings.session_keys)
        if field is not None:
            message = (
                f"{field} is not valid Unicode text (it holds a lone surrogate, U+D800-U+DFFF)"
            )
            return refuse(limits.Refusal(400, message, field))
        parse = functools.partial(
            _parse_turn,
            len(raw) > BIG,
            api,
            body,
            request.headers,
            request_id,
            received_at,
            sc.settings.session_keys,
            sc.owner_rule,
        )
        try:
            # The media digests walk the whole body: off the loop when it is big.
            turn = await offload.maybe(len(raw) > BIG, parse)
        except fields.InvalidField as exc:
            return refuse(limits.Refusal(400, str(exc), exc.field))
        return await _serve(sc, request, turn, raw, client_request_id, from_peer)


async def _serve(
    sc: Sidecar,
    request: web.Request,
    turn: TurnInput,
    raw: bytes,
    client_request_id: str | None,
    from_peer: bool,
) -> web.StreamResponse:
    """Steps 2 to 7 of a parsed turn."""
    api, request_id, received_at = turn.api, turn.request_id, turn.received_at

    owner = forward.target(sc, turn, forwarded=from_peer and HDR_FORWARDED_BY in request.headers)
    if owner is not None:
        relayed = await forward.forward(sc, request, raw, turn, owner, client_request_id)
        if relayed is not None:
            return relayed

    if not sc.local.ready:
        return not_ready(sc, request_id, sc.local.last_error or "health check failed")

    rules = sc.rules()
    prompt_ids = await prompt_tokens(sc, turn)
    # Taken now, before any await: single use even when two turns of a session race.
    lookup = sc.store.take(turn.slot) if turn.single_sequence else None
    planned = plan.plan_turn(
        turn, prompt_ids, lookup, rules, lambda: sc.cached_on_decode(turn, prompt_ids)
    )
    report = TurnReport(
        request_id=request_id,
        client_request_id=client_request_id,
        owner=turn.owner,
        session=turn.slot,
        api=api,
        stream=turn.stream,
        outcome=planned.outcome,
        route=planned.route,
        prompt_tokens=planned.prompt_tokens,
        aligned_tokens=planned.aligned_tokens,
        reused_tokens=planned.reused_tokens,
        handle_age_s=planned.handle_age_s,
        decode_holds=planned.decode_holds,
        holds_known=planned.holds_known,
        choice=planned.choice,
    )
    try:
        prefill = await run_prefill(sc, turn, planned, rules, report.timings)
    except asyncio.CancelledError:
        # The client went away mid-prefill (aiohttp cancels the handler, which closes
        # P's connection: P aborts). The taken handle may have reached P: unknown.
        if planned.taken is not None:
            sc.releaser.pin_until_expiry(planned.taken, PINNED_PULL_FAILED)
        _client_gone(sc, report, received_at)
        raise
    sc.releaser.settle_taken(planned.taken, prefill)
    report.outcome, report.route = prefill.outcome, prefill.route
    report.reused_tokens = prefill.reused_tokens
    report.prefill_engine, report.prefill_attempts = prefill.engine, prefill.attempts
    report.timings.prefill_s = prefill.prefill_s if prefill.route is Route.REMOTE else None
    try:
        with sc.decoding():
            response = await run_decode(sc, request, turn, prefill, rules, report)
    except asyncio.CancelledError:
        _client_gone(sc, report, received_at)  # D's connection closed: D aborts
        raise
    report.timings.total_s = time.monotonic() - received_at
    sc.record_turn(report)
    return response
