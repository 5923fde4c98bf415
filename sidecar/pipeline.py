"""The bidirectional turn protocol (decode role), as small steps over typed values.

    serve_turn
      1. parse_turn       body + headers -> TurnInput (session key, stream, ...)
      2. forward.target   not the session's owner? one hop there (forward.forward)
      3. prompt_tokens    the prompt's ids from D's /tokenize
      4. plan_turn        take the session's handle, check expiry and alignment,
                          decide the route: P (with/without handle) or D alone
      5. run_prefill      least-loaded ready P; retries; pull failure -> recompute
      6. run_decode       local D with P's params; stream or not, as the client asked;
                          restore the client's view; capture the new handle
      7. record_turn      TurnReport -> series, one log line, the residency model

Every failure of the reuse machinery degrades to a recompute; the client sees an
error only when the local decode engine itself cannot answer (502) or the request
is invalid (the engine's own 4xx).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from typing import Any

import aiohttp
from aiohttp import web

from . import forward, rewrite
from .align import align, held_by_decode
from .handles import local_deadline
from .session import session_key, session_tag
from .state import Sidecar
from .types import (
    F_KV_PARAMS,
    HDR_HANDLE,
    HDR_OUTCOME,
    HDR_OWNER,
    HDR_REQUEST_ID,
    HDR_REUSED_TOKENS,
    HDR_ROUTE,
    JSON,
    K_DO_REMOTE_DECODE,
    K_REMOTE_BLOCK_IDS,
    K_REMOTE_NUM_TOKENS,
    LOCAL_PREFILL_PARAMS,
    Api,
    KVHandle,
    Outcome,
    PrefillPlan,
    PrefillResult,
    Route,
    TurnInput,
    TurnReport,
    TurnTimings,
    token_array,
)
from .upstream import EngineTimeout, EngineUnavailable, EngineUnreachable, UpstreamError

log = logging.getLogger(__name__)

# Reasons a turn leaves no handle (metric label, log field, X-Kvferry-Handle).
NOT_KEPT_STREAMING = "engine-streams-no-handle"
NOT_KEPT_MULTI = "multiple-sequences"
NOT_KEPT_OFF = "bidirectional-off"
NOT_KEPT_NONE = "engine-returned-none"
NOT_KEPT_NO_IDS = "no-token-ids"
NOT_KEPT_ERROR = "error"


class BadRequest(Exception):
    """The client's body cannot be served (not JSON, not an object)."""


# ------------------------------------------------------------------ 1. parse


def parse_turn(
    sc: Sidecar,
    api: Api,
    body: Mapping[str, Any],
    headers: Mapping[str, str],
    request_id: str,
    received_at: float,
) -> TurnInput:
    key = session_key(body, headers, sc.settings.session_keys)
    prompt = body.get("prompt")
    single_prompt = (
        api is Api.CHAT or isinstance(prompt, str) or (rewrite.prompt_ids_in_body(body) is not None)
    )
    single = (
        (body.get("n") in (None, 1))
        and (body.get("best_of") in (None, 1))
        and not body.get("use_beam_search")
        and single_prompt
    )
    return TurnInput(
        api=api,
        body=rewrite.client_body(body),
        request_id=request_id,
        session_key=key,
        session=session_tag(key),
        stream=bool(body.get("stream")),
        wants_token_ids=bool(body.get("return_token_ids")),
        single_sequence=single,
        received_at=received_at,
    )


def _session_id(sc: Sidecar, turn: TurnInput) -> str | None:
    return turn.session if sc.settings.tag_session_id else None


def keeps_handle(sc: Sidecar, turn: TurnInput) -> str | None:
    """None when this turn can leave a handle; else the reason it cannot."""
    if not sc.settings.bidirectional:
        return NOT_KEPT_OFF
    if not turn.single_sequence:
        return NOT_KEPT_MULTI
    if turn.stream and not sc.local.streaming_handles:
        return NOT_KEPT_STREAMING
    return None


def local_params(sc: Sidecar, turn: TurnInput) -> Mapping[str, Any] | None:
    """kv_transfer_params for a turn D prefills itself: the no-transfer flags when a
    handle can be captured (vLLM returns one only for requests that carried params),
    none otherwise (no point pinning blocks nobody will learn about)."""
    return None if keeps_handle(sc, turn) else LOCAL_PREFILL_PARAMS


# ------------------------------------------------------------------ 3. tokens


async def prompt_tokens(sc: Sidecar, turn: TurnInput) -> list[int] | None:
    ids = rewrite.prompt_ids_in_body(turn.body)
    if ids is not None:
        return ids
    body = rewrite.tokenize_body(turn.body)
    if body is None:
        return None
    try:
        return await sc.local.client.tokenize(body, request_id=turn.request_id)
    except UpstreamError as exc:
        log.info("tokenize failed; no reuse this turn request_id=%s err=%s", turn.request_id, exc)
        return None


# ------------------------------------------------------------------ 4. plan


def plan_turn(sc: Sidecar, turn: TurnInput, prompt_ids: list[int] | None) -> PrefillPlan:
    """Take the session's handle and decide where the prompt is prefilled. No I/O."""
    s = sc.settings
    prompt_len = None if prompt_ids is None else len(prompt_ids)
    if not turn.single_sequence:
        # vLLM's P/D transfer and the handle both describe one sequence.
        return PrefillPlan(Route.SKIP, Outcome.SKIPPED_PREFILL, None, prompt_len, 0, 0, None)
    lookup = sc.store.take(turn.session)
    handle = lookup.handle
    if handle is None:
        outcome, alignment, held = lookup.outcome, None, 0
    elif prompt_ids is None:
        # Cannot prove the prompt extends the handle: do not use it.
        outcome, alignment, held = Outcome.MISALIGNED, None, 0
    else:
        block_size = sc.local.block_size
        alignment = align(
            prompt_ids, handle, block_size=block_size, threshold=s.recompute_threshold
        )
        outcome = alignment.outcome
        held = held_by_decode(alignment, handle, block_size)
    aligned = alignment.aligned_tokens if alignment else 0
    if prompt_len is not None and prompt_len - held < s.skip_prefill_below_tokens:
        return PrefillPlan(
            Route.SKIP, Outcome.SKIPPED_PREFILL, None, prompt_len, aligned, held, lookup.age_s
        )
    params = alignment.params if alignment else None
    reused = alignment.usable_tokens if alignment else 0
    return PrefillPlan(Route.REMOTE, outcome, params, prompt_len, aligned, reused, lookup.age_s)


# ------------------------------------------------------------------ 5. prefill


def _valid_prefill_params(data: Any) -> Mapping[str, Any] | None:
    if not isinstance(data, dict):
        return None
    params = data.get(F_KV_PARAMS)
    return params if isinstance(params, dict) and params else None


async def run_prefill(
    sc: Sidecar, turn: TurnInput, plan: PrefillPlan, timings: TurnTimings
) -> PrefillResult:
    if plan.route is Route.SKIP:
        return PrefillResult(Route.SKIP, plan.outcome, local_params(sc, turn))
    s = sc.settings
    handle = plan.handle_params
    outcome = plan.outcome
    tried: set[str] = set()
    attempts = 0
    started = time.monotonic()
    # Each engine once, plus one retry without the handle after a failed pull.
    budget = len(sc.pool.engines) + 1
    while attempts < budget:
        engine = sc.pool.choose(tried)
        if engine is None:
            break
        attempts += 1
        if timings.queue_s is None:
            timings.queue_s = time.monotonic() - turn.received_at
        body = rewrite.prefill_body(turn.body, handle, _session_id(sc, turn))
        try:
            with sc.pool.in_flight(engine):
                status, data = await engine.client.post_json(
                    turn.api.path,
                    body,
                    request_id=turn.request_id,
                    timeout=s.prefill_timeout_seconds,
                )
        except EngineUnavailable as exc:
            sc.metrics.prefill_attempts.labels("unavailable").inc()
            sc.pool.mark_down(engine.url)
            tried.add(engine.url)
            log.warning("prefill engine unavailable request_id=%s err=%s", turn.request_id, exc)
            if handle is not None and not isinstance(exc, EngineUnreachable):
                # P may have read D's blocks before it broke off, and a completed read
                # frees them: sending the handle again could read freed memory.
                handle, outcome = None, Outcome.PULL_FAILED
            # Never connected: the handle is untouched, the next engine gets it.
            continue
        except EngineTimeout as exc:
            sc.metrics.prefill_attempts.labels("timeout").inc()
            tried.add(engine.url)
            log.warning("prefill timed out request_id=%s err=%s", turn.request_id, exc)
            if handle is not None:
                handle, outcome = None, Outcome.PULL_FAILED
            continue
        params = _valid_prefill_params(data) if status == 200 else None
        if params is not None:
            sc.metrics.prefill_attempts.labels("ok").inc()
            return PrefillResult(
                Route.REMOTE, outcome, params, engine.url, attempts, time.monotonic() - started
            )
        if status == 200:
            sc.metrics.prefill_attempts.labels("no-params").inc()
            log.warning(
                "prefill engine returned no kv_transfer_params (is it running the "
                "NixlConnector?) request_id=%s engine=%s",
                turn.request_id,
                engine.url,
            )
            break
        if handle is not None:
            # A failed pull (handle expired, D gone) under kv_load_failure_policy=fail
            # is an immediate 500: retry at once without the handle = recompute.
            sc.metrics.prefill_attempts.labels("pull-failed").inc()
            log.warning(
                "prefill failed with the handle; recomputing request_id=%s status=%s",
                turn.request_id,
                status,
            )
            handle, outcome = None, Outcome.PULL_FAILED
            continue
        sc.metrics.prefill_attempts.labels("error").inc()
        if 400 <= status < 500:
            # Let D answer: if the request is invalid, D's error is the canonical one.
            break
        tried.add(engine.url)
        log.warning(
            "prefill failed request_id=%s engine=%s status=%s", turn.request_id, engine.url, status
        )
    elapsed = time.monotonic() - started if attempts else None
    return PrefillResult(Route.FALLBACK, outcome, local_params(sc, turn), None, attempts, elapsed)


# ------------------------------------------------------------------ 6. decode


def build_handle(
    sc: Sidecar, turn: TurnInput, capture: rewrite.Capture, received_wall: float
) -> tuple[KVHandle | None, str | None]:
    params = capture.params
    if not params or not params.get(K_DO_REMOTE_DECODE) or not params.get(K_REMOTE_BLOCK_IDS):
        return None, NOT_KEPT_NONE
    if capture.prompt_ids is None or not capture.output_ids:
        return None, NOT_KEPT_NO_IDS
    try:
        ids = token_array([*capture.prompt_ids, *capture.output_ids])
    except (OverflowError, TypeError):
        return None, NOT_KEPT_NO_IDS
    now = sc.store.now()
    num = params.get(K_REMOTE_NUM_TOKENS)
    num_tokens = num if isinstance(num, int) and num > 0 else len(ids) - 1
    handle = KVHandle(
        session=turn.session,
        params=dict(params),
        token_ids=ids,
        num_tokens=min(num_tokens, len(ids)),
        engine_build=sc.settings.engine_build,
        created_at=now,
        expires_at=local_deadline(
            params,
            received_at=now,
            received_wall=received_wall,
            retention_s=sc.settings.retention_seconds,
        ),
        request_id=turn.request_id,
    )
    return handle, None


def _headers(sc: Sidecar, turn: TurnInput, report: TurnReport) -> dict[str, str]:
    headers = {
        HDR_REQUEST_ID: turn.request_id,
        HDR_OUTCOME: report.outcome.value,
        HDR_REUSED_TOKENS: str(report.reused_tokens),
        HDR_ROUTE: report.route.value,
    }
    if sc.settings.ordinal is not None:
        headers[HDR_OWNER] = str(sc.settings.ordinal)
    reason = keeps_handle(sc, turn)
    if reason == NOT_KEPT_STREAMING:
        headers[HDR_HANDLE] = (
            f"not-kept; reason={reason}; engine={sc.local.info.version or 'unknown'}; "
            "vLLM < 0.33 returns no kv_transfer_params when streaming, the next turn "
            "recomputes (send stream=false or upgrade to keep KV)"
        )
    elif reason is not None:
        headers[HDR_HANDLE] = f"not-kept; reason={reason}"
    return headers


def error_body(message: str, kind: str, status: int) -> JSON:
    return {"error": {"message": message, "type": kind, "code": status}}


def not_ready(sc: Sidecar, request_id: str, detail: str) -> web.Response:
    message = (
        f"decode engine at {sc.settings.engine_url} is not ready ({detail}); "
        "the request was not served, retry shortly"
    )
    log.warning("upstream not ready request_id=%s detail=%s", request_id, detail)
    return web.json_response(
        error_body(message, "upstream_not_ready", 502),
        status=502,
        headers={HDR_REQUEST_ID: request_id},
    )


async def _open_decode(
    sc: Sidecar, turn: TurnInput, params: Mapping[str, Any] | None
) -> aiohttp.ClientResponse:
    body = rewrite.decode_body(turn.body, params, _session_id(sc, turn))
    return await sc.local.client.open(turn.api.path, body, request_id=turn.request_id)


async def run_decode(
    sc: Sidecar,
    request: web.Request,
    turn: TurnInput,
    prefill: PrefillResult,
    report: TurnReport,
) -> web.StreamResponse:
    timings = report.timings
    if timings.queue_s is None:
        timings.queue_s = time.monotonic() - turn.received_at
    p_done = time.monotonic()
    try:
        upstream = await _open_decode(sc, turn, prefill.decode_params)
        if upstream.status >= 500 and prefill.route is Route.REMOTE:
            # D could not pull P's blocks (P gone, lease expired): D prefills itself.
            await upstream.read()
            upstream.release()
            log.warning(
                "decode failed with prefill params; prefilling on D request_id=%s status=%s",
                turn.request_id,
                upstream.status,
            )
            report.route = Route.FALLBACK
            upstream = await _open_decode(sc, turn, local_params(sc, turn))
    except UpstreamError as exc:
        report.status, report.error = 502, exc.reason
        return not_ready(sc, turn.request_id, exc.reason)
    if prefill.route is Route.REMOTE:
        timings.p_to_d_s = time.monotonic() - p_done
    report.status = upstream.status
    headers = _headers(sc, turn, report)
    try:
        if upstream.status != 200:
            raw = await upstream.read()
            report.error = f"decode answered {upstream.status}"
            return web.Response(
                status=upstream.status,
                body=raw,
                content_type=upstream.content_type,
                headers=headers,
            )
        if turn.stream:
            response, capture = await _relay_stream(request, upstream, turn, headers, report)
        else:
            response, capture = await _relay_body(upstream, turn, headers)
    finally:
        upstream.release()
    if report.error is None:
        _keep_handle(sc, turn, capture, report)
    return response


async def _relay_body(
    upstream: aiohttp.ClientResponse, turn: TurnInput, headers: dict[str, str]
) -> tuple[web.StreamResponse, rewrite.Capture]:
    raw = await upstream.read()
    try:
        obj = json.loads(raw)
    except ValueError:
        obj = None
    if not isinstance(obj, dict):
        return web.Response(body=raw, content_type=upstream.content_type, headers=headers), (
            rewrite.Capture()
        )
    capture = rewrite.capture_body(obj)
    rewrite.restore_body(obj, wants_token_ids=turn.wants_token_ids)
    return web.json_response(obj, headers=headers), capture


async def _relay_stream(
    request: web.Request,
    upstream: aiohttp.ClientResponse,
    turn: TurnInput,
    headers: dict[str, str],
    report: TurnReport,
) -> tuple[web.StreamResponse, rewrite.Capture]:
    response = web.StreamResponse(status=200, headers=headers)
    response.content_type = upstream.content_type or "text/event-stream"
    response.headers["Cache-Control"] = "no-cache"
    await response.prepare(request)
    sse = rewrite.SSERewriter(wants_token_ids=turn.wants_token_ids)
    try:
        async for chunk in upstream.content.iter_any():
            out = sse.feed(chunk)
            if out:
                if report.timings.first_token_s is None:
                    report.timings.first_token_s = time.monotonic() - turn.received_at
                await response.write(out)
        tail = sse.flush()
        if tail:
            await response.write(tail)
        await response.write_eof()
    except (aiohttp.ClientError, ConnectionResetError) as exc:
        # D broke off, or the client left (closing D's stream aborts the request).
        upstream.close()
        report.error = f"stream broken: {exc}"
        log.warning("stream broken request_id=%s err=%s", turn.request_id, exc)
    return response, sse.capture


def _keep_handle(
    sc: Sidecar, turn: TurnInput, capture: rewrite.Capture, report: TurnReport
) -> None:
    reason = keeps_handle(sc, turn)
    if reason is None:
        handle, reason = build_handle(sc, turn, capture, time.time())
        if handle is not None:
            sc.store.put(handle)
            report.handle_kept = True
            return
    report.handle_not_kept_reason = reason


# ------------------------------------------------------------------ the turn


async def serve_turn(
    sc: Sidecar, request: web.Request, api: Api, request_id: str
) -> web.StreamResponse:
    received_at = time.monotonic()
    raw = await request.read()
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    if not isinstance(body, dict):
        return web.json_response(
            error_body("request body must be a JSON object", "invalid_request_error", 400),
            status=400,
        )
    turn = parse_turn(sc, api, body, request.headers, request_id, received_at)

    owner = forward.target(sc, turn, request.headers)
    if owner is not None:
        relayed = await forward.forward(sc, request, raw, turn, owner)
        if relayed is not None:
            return relayed

    if not sc.local.ready:
        return not_ready(sc, request_id, sc.local.last_error or "health check failed")

    prompt_ids = await prompt_tokens(sc, turn)
    plan = plan_turn(sc, turn, prompt_ids)
    report = TurnReport(
        request_id=request_id,
        session=turn.session,
        api=api,
        stream=turn.stream,
        outcome=plan.outcome,
        route=plan.route,
        prompt_tokens=plan.prompt_tokens,
        aligned_tokens=plan.aligned_tokens,
        reused_tokens=plan.reused_tokens,
        handle_age_s=plan.handle_age_s,
    )
    prefill = await run_prefill(sc, turn, plan, report.timings)
    report.outcome, report.route = prefill.outcome, prefill.route
    report.prefill_engine, report.prefill_attempts = prefill.engine, prefill.attempts
    report.timings.prefill_s = prefill.prefill_s if prefill.route is Route.REMOTE else None
    if prefill.route is Route.FALLBACK and prefill.outcome is Outcome.REUSED:
        # No prefill engine took the handle: D prefills alone (its prefix cache still
        # holds the session's pinned blocks).
        report.outcome = Outcome.SKIPPED_PREFILL
    if report.outcome is not Outcome.REUSED and plan.outcome is Outcome.REUSED:
        report.reused_tokens = 0  # the handle was not used after all
    response = await run_decode(sc, request, turn, prefill, report)
    report.timings.total_s = time.monotonic() - received_at
    sc.record_turn(report)
    return response
