"""Streamed turns on an engine that streams no handle (vLLM 0.32): the two one-token
requests that let such a turn keep one and pin nothing that is not tracked.

vLLM 0.32 returns ``kv_transfer_params`` only in a non-streamed answer
(``OpenAIServingChat.chat_completion_full_generator`` /
``OpenAIServingCompletion``'s full path); the streaming generators never put them on
a chunk. Yet D's NixlConnector pins every finished request that carried params
(``NixlPullConnectorScheduler.request_finished``: a decode-side request for
``decoder_kv_blocks_ttl``, a prefill-side one for ``kv_lease_duration``), whether the
answer was streamed or not. A streamed decode leg sent with P's params would pin its
KV for the whole TTL with nobody knowing where. So a streamed turn goes as:

1. ``read_prefill``: D reads P's KV in a non-streamed one-token request with P's
   params (``rewrite.anchor_body``): a decode-side request like any decode leg (its
   heartbeats keep P's lease alive while it waits), whose answer is D's handle for
   the prompt. The sidecar holds it, so it can release it like any other.
2. The answer streams from D without ``kv_transfer_params``: a plain request, which
   finds the prompt's blocks in D's prefix cache (the anchor holds them) and pins
   nothing when it finishes.
3. ``reanchor``: a one-token prefill-side request over the turn's ids, prompt +
   answer (``rewrite.reanchor_body``): D computes only the tail its prefix cache
   lacks (at most a block) and returns prefill-style params for its blocks, held for
   its ``kv_lease_duration`` and freed when P reads or releases them, the handle a
   turn D prefills alone leaves (``plan.build_handle``). The anchor's handle is then
   released; if the re-anchor fails it is kept instead (it still covers the prompt).

The relay holds back the stream's ``[DONE]`` until step 3 is over, so a client that
sends its next turn when its stream ends finds the handle.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from . import rewrite
from .runtime import Sidecar
from .types import F_KV_PARAMS, PATH_COMPLETIONS, TurnInput, TurnReport
from .upstream import UpstreamError

log = logging.getLogger(__name__)


def _session_id(sc: Sidecar, turn: TurnInput) -> str | None:
    return turn.session if sc.settings.tag_session_id else None


# The re-anchor holds back the client's [DONE]: on a saturated D it must not wait
# there for the whole prefill budget (300 s). Past this the request is closed (D
# aborts it, and an aborted request pins nothing) and the anchor's handle is kept.
REANCHOR_TIMEOUT_S = 30.0


async def _post(
    sc: Sidecar,
    turn: TurnInput,
    path: str,
    body: dict[str, Any],
    what: str,
    timeout: float | None = None,
):
    budget = sc.settings.prefill_timeout_seconds
    try:
        status, data = await sc.local.client.post_json(
            path,
            body,
            request_id=turn.request_id,
            timeout=budget if timeout is None else min(budget, timeout),
        )
    except UpstreamError as exc:
        log.warning("%s failed request_id=%s err=%s", what, turn.request_id, exc)
        return None
    if status != 200 or not isinstance(data, dict):
        log.warning("%s answered %s request_id=%s", what, status, turn.request_id)
        return None
    return data


async def read_prefill(
    sc: Sidecar, turn: TurnInput, prefill_params: Mapping[str, Any]
) -> rewrite.Capture | None:
    """Step 1: D reads P's KV; its answer's capture (D's handle for the prompt, or no
    params when D keeps none), or None when D could not answer (the stream then
    prefills on D: P's blocks go at the end of P's lease)."""
    body = rewrite.anchor_body(turn.body, prefill_params, _session_id(sc, turn))
    data = await _post(sc, turn, turn.api.path, body, "reading P's KV before a stream")
    return None if data is None else rewrite.capture_body(data)


async def reanchor(
    sc: Sidecar, turn: TurnInput, streamed: rewrite.Capture, report: TurnReport
) -> rewrite.Capture | None:
    """Step 3: the turn's KV anchored again on D; a capture whose params are D's
    prefill-side handle (its text the streamed answer's, for the next turn's slot)."""
    if streamed.prompt_ids is None or not streamed.output_ids:
        return None
    body = rewrite.reanchor_body(
        turn.body, [*streamed.prompt_ids, *streamed.output_ids], _session_id(sc, turn)
    )
    started = time.monotonic()
    data = await _post(
        sc, turn, PATH_COMPLETIONS, body, "re-anchoring a streamed turn", REANCHOR_TIMEOUT_S
    )
    report.timings.reanchor_s = time.monotonic() - started
    if data is None or not isinstance(data.get(F_KV_PARAMS), dict):
        return None
    capture = rewrite.capture_body(data)
    capture.text = streamed.text
    capture.finish_reason = streamed.finish_reason
    return capture
