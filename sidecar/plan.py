"""The turn plan: every decision of the bidirectional turn protocol, without I/O.

``relay`` does the talking (engines, client); it asks this module what to do at
each step and what the turn's outcome is, so the rules can be read and tested
without aiohttp:

- ``parse_turn``: body + headers -> ``TurnInput`` (session key, stream, one
  sequence or several; the fields read as vLLM reads them, ``fields.py``, or
  ``fields.InvalidField``);
- ``reuse_off``: the allowlist rule (``allowlist.py``), media behind URLs and a
  turn of no known owner (``owners.py``): a turn that may render another prompt than
  its ids say, or may be anyone's, neither uses nor keeps a handle;
- ``handle_not_kept``: whether this turn can leave a handle for the next one;
- ``plan_turn``: with the session's handle (already taken from the store), the
  prompt's ids, the engine's block size and what D's prefix cache holds: use the
  handle or not (KV identity, alignment, threshold), prefill on P or let D prefill
  alone;
- ``settle``: the turn's final outcome once the prefill leg ran (a handle offered
  to no P is not "reused");
- ``build_handle``: D's answer -> the ``KVHandle`` kept for the next turn;
- ``response_headers``: the diagnostics every turn's answer carries.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvferry_wire.protocol import (
    HDR_HANDLE,
    HDR_OUTCOME,
    HDR_OWNER,
    HDR_REUSED_TOKENS,
    HDR_ROUTE,
    Outcome,
    Route,
)

from . import allowlist, fields, owners, placement, rewrite
from .align import align, held_by_decode
from .handles import Lookup, local_deadline
from .identity import compatible, kv_identity
from .session import handle_slot, next_handle_slot, session_key, session_tag
from .types import (
    K_DO_REMOTE_DECODE,
    K_DO_REMOTE_PREFILL,
    K_REMOTE_BLOCK_IDS,
    K_REMOTE_EXPIRY,
    K_REMOTE_NUM_TOKENS,
    Api,
    KVHandle,
    PrefillPlan,
    TurnInput,
    TurnReport,
    token_array,
)

# Reasons a turn leaves no handle (metric label, log field, X-Kvferry-Handle).
NOT_KEPT_STREAMING = "engine-streams-no-handle"
NOT_KEPT_MULTI = "multiple-sequences"
NOT_KEPT_OFF = "bidirectional-off"
NOT_KEPT_NONE = "engine-returned-none"
NOT_KEPT_NO_IDS = "no-token-ids"
NOT_KEPT_ERROR = "error"
NOT_KEPT_TRUNCATION = "truncation"  # the engine truncates: positions are not the ids'
NOT_KEPT_UNSAFE_FIELD = Outcome.UNSAFE_FIELD.value
NOT_KEPT_UNCACHEABLE_MEDIA = Outcome.UNCACHEABLE_MEDIA.value
NOT_KEPT_NO_OWNER = Outcome.NO_OWNER.value


@dataclass(frozen=True)
class Rules:
    """The settings and engine facts the plan depends on (read once per turn)."""

    bidirectional: bool
    streaming_handles: bool  # D returns the handle on a streamed answer (vLLM 0.33+)
    block_size: int | None
    recompute_threshold: int
    skip_prefill_below_tokens: int
    diagnostic_headers: bool = False  # X-Kvferry-* on responses (routing.diagnosticHeaders)
    media_urls_immutable: bool = False  # the bytes behind a media URL never change
    # Where a prefill runs (placement.py): Measured or Threshold, the costs measured
    # so far (None: none), the D legs in flight now besides this turn's and the rate
    # of D legs of late (a second).
    prefill_placement: str = placement.PLACEMENT_MEASURED
    costs: placement.Costs | None = None
    running_on_decode: int = 0
    decode_arrivals: float = 0.0


# The handle verdicts a turn D prefills alone still reports as its outcome.
_VERDICTS_KEPT_ON_DECODE = (Outcome.MISALIGNED, Outcome.KV_MISMATCH)


def _place(rules: Rules, prompt_len: int, on_decode: int, pull: int) -> placement.Choice:
    return placement.choose(
        rules.prefill_placement,
        rules.skip_prefill_below_tokens,
        placement.Turn(prompt_len, on_decode, pull, rules.running_on_decode, rules.decode_arrivals),
        rules.costs,
    )


# ------------------------------------------------------------------ 1. parse


def parse_turn(
    api: Api,
    body: Mapping[str, Any],
    headers: Mapping[str, str],
    request_id: str,
    received_at: float,
    session_keys: tuple[str, ...],
    owner_rule: owners.Rule | None = None,
) -> TurnInput:
    """Raises ``fields.InvalidField`` for a field vLLM would refuse. ``owner_rule``:
    owners are on (the ``owner_header`` setting), read the turn's from its header."""
    asked = fields.read_request(api, body)
    key = session_key(body, headers, session_keys)
    owner = owners.read_owner(headers, owner_rule) if owner_rule is not None else None
    no_owner = owner_rule is not None and owner is None
    prompt = body.get("prompt")
    single_prompt = (
        api is Api.CHAT or isinstance(prompt, str) or (rewrite.prompt_ids_in_body(body) is not None)
    )
    single = (
        asked.n == 1 and asked.best_of in (None, 1) and not asked.use_beam_search and single_prompt
    )
    return TurnInput(
        api=api,
        body=rewrite.client_body(body),
        request_id=request_id,
        session_key=key,
        session=session_tag(key),
        slot=handle_slot(key, body, owners.NO_OWNER if no_owner else owner),
        identity=kv_identity(body),
        stream=asked.stream,
        wants_token_ids=asked.return_token_ids,
        single_sequence=single,
        received_at=received_at,
        unsafe_field=allowlist.unsafe_field(api, body, session_keys),
        owner=owner,
        no_owner=no_owner,
    )


# ------------------------------------------------------------------ reuse off


def reuse_off(turn: TurnInput, rules: Rules) -> Outcome | None:
    """Why this turn may neither use nor keep a handle whatever the ids say, or None.

    Its KV may not be what its ids describe: a field off the allowlist may render
    another prompt than ``/tokenize`` did (``allowlist.py``), and media behind a URL
    may have other bytes than last turn under the same identity. A turn of no known
    owner (owners on, no valid header) could be anyone's: it may touch no handle."""
    if turn.no_owner:
        return Outcome.NO_OWNER
    if turn.unsafe_field is not None:
        return Outcome.UNSAFE_FIELD
    if turn.identity.remote_media and not rules.media_urls_immutable:
        return Outcome.UNCACHEABLE_MEDIA
    return None


# ------------------------------------------------------------------ handles kept or not


def handle_not_kept(turn: TurnInput, rules: Rules) -> str | None:
    """None when this turn can leave a handle; else the reason it cannot."""
    if not rules.bidirectional:
        return NOT_KEPT_OFF
    if not turn.single_sequence:
        return NOT_KEPT_MULTI
    if turn.identity.truncates:
        return NOT_KEPT_TRUNCATION
    off = reuse_off(turn, rules)
    if off is not None:
        return off.value
    if turn.stream and not rules.streaming_handles and turn.identity.media:
        # Re-anchoring (below) sends only token ids: a media turn's KV is not theirs.
        return NOT_KEPT_STREAMING
    return None


def streams_without_params(turn: TurnInput, rules: Rules) -> bool:
    """A streamed turn on an engine that streams no handle (vLLM 0.32): D would pin
    whatever a streamed request with kv_transfer_params leaves and never say where, so
    D reads P's KV in a one-token request that returns a handle
    (``rewrite.anchor_body``, released or replaced afterwards) and the answer streams
    without kv_transfer_params (``anchor.py``)."""
    return turn.stream and not rules.streaming_handles


def reanchors(turn: TurnInput, rules: Rules) -> bool:
    """Such a streamed turn that may keep a handle all the same: a one-token
    prefill-side request over its ids re-anchors it (``rewrite.reanchor_body``)."""
    return streams_without_params(turn, rules) and handle_not_kept(turn, rules) is None


# ------------------------------------------------------------------ 4. plan


def plan_turn(
    turn: TurnInput,
    prompt_ids: list[int] | None,
    lookup: Lookup | None,
    rules: Rules,
    cached_on_decode: Callable[[], int] = lambda: 0,
) -> PrefillPlan:
    """Use the session's handle or not, and where the prompt is prefilled.

    ``lookup`` is the store's answer for the session (the handle is already taken:
    single use); None for a turn of several sequences, which never uses one.
    ``cached_on_decode`` says how many prompt tokens D's prefix cache holds (from its
    KV events); asked only when a handle cannot show D holds enough.
    """
    prompt_len = None if prompt_ids is None else len(prompt_ids)
    if lookup is None or not turn.single_sequence:
        # vLLM's P/D transfer and the handle both describe one sequence.
        return PrefillPlan(Route.SKIP, Outcome.SKIPPED_PREFILL, None, prompt_len, 0, 0, None)
    handle = lookup.handle
    off = reuse_off(turn, rules)
    if off is not None:
        # The handle only rides along to be released. D's prefix cache is not asked
        # either: its block hashes would come from ids this prompt may not have. Where
        # the prompt is prefilled is chosen as for any turn holding nothing on D.
        choice = _place(rules, prompt_len, 0, 0) if prompt_len is not None else None
        route = Route.SKIP if choice is not None and choice.alone else Route.REMOTE
        return PrefillPlan(
            route,
            off,
            None,
            prompt_len,
            0,
            0,
            lookup.age_s,
            taken=handle,
            choice=choice,
            holds_known=False,
        )
    alignment, held = None, 0
    if handle is None:
        outcome = lookup.outcome
    elif compatible(handle.identity, turn.identity) is not None:
        # Same ids, other KV: never offered to P (it rides along only to be released).
        outcome = Outcome.KV_MISMATCH
    elif prompt_ids is None:
        # Cannot prove the prompt extends the handle: do not use it.
        outcome = Outcome.MISALIGNED
    else:
        alignment = align(
            prompt_ids, handle, block_size=rules.block_size, threshold=rules.recompute_threshold
        )
        outcome = alignment.outcome
        held = held_by_decode(alignment, handle, rules.block_size)
    aligned = alignment.aligned_tokens if alignment else 0
    params = alignment.params if alignment else None
    reused = alignment.usable_tokens if alignment else 0
    choice, on_decode = None, held
    if prompt_len is not None:
        measured = rules.prefill_placement == placement.PLACEMENT_MEASURED
        skip = rules.skip_prefill_below_tokens
        # D's prefix cache is asked only when it could change the choice: under the
        # rule, when the handle alone does not already send the turn to D.
        ask = measured or (prompt_len - held >= skip and prompt_len - skip > 0)
        cached = cached_on_decode() if ask else 0
        on_decode = max(held, cached)
        pull = reused if params is not None else 0
        choice = _place(rules, prompt_len, on_decode, pull)
        if choice.alone:
            # D holds the prefix through the handle, or else (no usable handle says
            # so) through its prefix cache. A handle whose ids or KV the prompt does not
            # match keeps its verdict: it says a client rewrote its history.
            if outcome in _VERDICTS_KEPT_ON_DECODE:
                why = outcome
            elif cached <= held:
                why = Outcome.SKIPPED_PREFILL
            else:
                why = Outcome.CACHED_ON_DECODE
            return PrefillPlan(
                Route.SKIP,
                why,
                None,
                prompt_len,
                aligned,
                on_decode,
                lookup.age_s,
                taken=handle,
                choice=choice,
                decode_holds=on_decode,
            )
    return PrefillPlan(
        Route.REMOTE,
        outcome,
        params,
        prompt_len,
        aligned,
        reused,
        lookup.age_s,
        taken=handle,
        choice=choice,
        decode_holds=on_decode,
    )


def settle(plan: PrefillPlan, route: Route, outcome: Outcome) -> tuple[Outcome, int]:
    """The turn's outcome and reused tokens once the prefill leg ran.

    ``route``/``outcome`` are what the leg did: it may have fallen back to D (no P
    could prefill) or dropped the handle after a failed pull.
    """
    if route is Route.FALLBACK and outcome is Outcome.REUSED:
        # No prefill engine took the handle: D prefills alone (its prefix cache still
        # holds the session's pinned blocks).
        outcome = Outcome.SKIPPED_PREFILL
    if plan.outcome is Outcome.REUSED and outcome is not Outcome.REUSED:
        return outcome, 0  # the handle was not used after all
    return outcome, plan.reused_tokens


# ------------------------------------------------------------------ 6. the new handle


def build_handle(
    turn: TurnInput,
    capture: rewrite.Capture,
    *,
    now: float,
    received_wall: float,
    engine_build: str | None,
    retention_s: float,
    local_lease_s: float,
) -> tuple[KVHandle | None, str | None]:
    """The handle D's answer left, and why it cannot be kept for the next turn (None:
    it can). No handle means D returned none; a handle that cannot be kept still pins
    D's blocks and must be released.

    A turn D prefilled alone (sent as ``LOCAL_HANDLE_PARAMS``) comes back with
    prefill-side params for D's own blocks, held for D's lease (``local_lease_s``):
    they are turned into the decode-side form P pulls, the form every handle has.

    ``retention_s`` is D's own hold on a decode-side handle (``decoder_kv_blocks_ttl``,
    the ceiling): the handle's ``expires_at`` is D's deadline; the retention in force
    is the store's to apply (``handles.py``). ``now`` is on the handle store's clock;
    ``received_wall`` the wall clock then. The handle is filed under the slot the
    conversation's next turn will look up."""
    params = capture.params
    if not params or not params.get(K_REMOTE_BLOCK_IDS):
        return None, NOT_KEPT_NONE
    lease_bound = False
    if params.get(K_DO_REMOTE_PREFILL) and not params.get(K_DO_REMOTE_DECODE):
        params = {
            **params,
            K_DO_REMOTE_DECODE: True,
            K_DO_REMOTE_PREFILL: False,
            K_REMOTE_EXPIRY: None,
        }
        # vLLM frees a prefill-side request's blocks at its kv_lease_duration
        # (NixlPullConnectorScheduler.request_finished), whatever
        # decoder_kv_blocks_ttl says: that is the handle's life.
        retention_s = local_lease_s
        lease_bound = True
    elif not params.get(K_DO_REMOTE_DECODE):
        return None, NOT_KEPT_NONE
    why = None
    try:
        ids = token_array([*(capture.prompt_ids or ()), *capture.output_ids])
    except (OverflowError, TypeError):
        ids = token_array(())
    if capture.prompt_ids is None or not capture.output_ids or not ids:
        why = NOT_KEPT_NO_IDS
    num = params.get(K_REMOTE_NUM_TOKENS)
    num_tokens = num if isinstance(num, int) and num > 0 else len(ids) - 1
    handle = KVHandle(
        session=next_handle_slot(turn.session_key, turn.body, capture.text, turn.owner),
        params=dict(params),
        token_ids=ids,
        num_tokens=min(num_tokens, len(ids)),
        engine_build=engine_build,
        created_at=now,
        expires_at=local_deadline(
            params, received_at=now, received_wall=received_wall, retention_s=retention_s
        ),
        request_id=turn.request_id,
        identity=turn.identity,
        owner=turn.owner,
        lease_bound=lease_bound,
    )
    return handle, why


# ------------------------------------------------------------------ response headers


def response_headers(
    turn: TurnInput,
    report: TurnReport,
    rules: Rules,
    *,
    ordinal: int | None,
    engine_version: str | None,
) -> dict[str, str]:
    # X-Request-Id is the app's (it echoes the client's id on every response).
    headers: dict[str, str] = {}
    if not rules.diagnostic_headers:
        return headers
    headers[HDR_OUTCOME] = report.outcome.value
    headers[HDR_REUSED_TOKENS] = str(report.reused_tokens)
    headers[HDR_ROUTE] = report.route.value
    if ordinal is not None:
        headers[HDR_OWNER] = str(ordinal)
    reason = handle_not_kept(turn, rules)
    if reason == NOT_KEPT_STREAMING:
        headers[HDR_HANDLE] = (
            f"not-kept; reason={reason}; engine={engine_version or 'unknown'}; "
            "vLLM < 0.33 returns no kv_transfer_params when streaming and a turn with "
            "media cannot be re-anchored from its ids, the next turn recomputes (send "
            "stream=false or upgrade to keep KV)"
        )
    elif reason is not None:
        headers[HDR_HANDLE] = f"not-kept; reason={reason}"
    return headers
