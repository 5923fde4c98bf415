"""Typed values and vLLM vocabulary of the sidecar. Nothing else lives here.

No I/O and no aiohttp: every other module imports this one, and it imports only the
standard library, ``kvferry_wire`` (the headers, outcomes and routes clients see) and
the pure value modules ``identity`` and ``placement``.
"""

from __future__ import annotations

import enum
from array import array
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from kvferry_wire.protocol import HandleFate, Outcome, Route

from .identity import KVIdentity
from .placement import Choice

# ------------------------------------------------------------------ ids

# The sidecar's own id of a turn (uuid4 hex), the X-Request-Id of every engine request
# of the turn, both legs; a client's X-Request-Id is only echoed and logged.
RequestId = str
SessionKey = str  # the raw key a request was routed by (may be a user id: never logged)
SessionTag = str  # short digest of a SessionKey, safe for logs and engine `session_id`
Ordinal = int  # a decode pod's StatefulSet ordinal
JSON = dict[str, Any]

# ------------------------------------------------------------------ HTTP vocabulary

# Headers clients and peers see are the wire contract: kvferry_wire.protocol.HDR_*.
PATH_CHAT: Final = "/v1/chat/completions"
PATH_COMPLETIONS: Final = "/v1/completions"
PATH_MODELS: Final = "/v1/models"
PATH_TOKENIZE: Final = "/tokenize"
PATH_VERSION: Final = "/version"
PATH_HEALTH: Final = "/health"
PATH_METRICS: Final = "/metrics"
PATH_RESIDENCY: Final = "/v1/residency"

# ------------------------------------------------------------------ body fields

F_KV_PARAMS: Final = "kv_transfer_params"
F_RETURN_TOKEN_IDS: Final = "return_token_ids"
F_PROMPT_TOKEN_IDS: Final = "prompt_token_ids"
F_TOKEN_IDS: Final = "token_ids"
F_SESSION_ID: Final = "session_id"
F_STREAM: Final = "stream"
F_STREAM_OPTIONS: Final = "stream_options"
F_MAX_TOKENS: Final = "max_tokens"
F_MAX_COMPLETION_TOKENS: Final = "max_completion_tokens"
# Extension arguments; vLLM reads vllm_xargs["kv_transfer_params"] when the top-level
# kv_transfer_params is empty.
F_VLLM_XARGS: Final = "vllm_xargs"

# kv_transfer_params keys (vLLM NixlConnector, pull mode).
K_DO_REMOTE_DECODE: Final = "do_remote_decode"
K_DO_REMOTE_PREFILL: Final = "do_remote_prefill"
K_REMOTE_ENGINE_ID: Final = "remote_engine_id"
K_REMOTE_REQUEST_ID: Final = "remote_request_id"
K_REMOTE_BLOCK_IDS: Final = "remote_block_ids"
K_REMOTE_HOST: Final = "remote_host"
K_REMOTE_PORT: Final = "remote_port"
K_REMOTE_NUM_TOKENS: Final = "remote_num_tokens"
# D's deadline for its pinned blocks, on D's time.perf_counter() clock. Forwarded
# untouched: seen with 0.32, a handle without it let P read freed blocks silently.
K_REMOTE_EXPIRY: Final = "remote_blocks_expiry_time"

# The prefill leg asks P to keep its KV for a remote decode (P->D).
PREFILL_REQUEST_PARAMS: Final[Mapping[str, Any]] = {
    K_DO_REMOTE_DECODE: True,
    K_DO_REMOTE_PREFILL: False,
    K_REMOTE_ENGINE_ID: None,
    K_REMOTE_BLOCK_IDS: None,
    K_REMOTE_HOST: None,
    K_REMOTE_PORT: None,
}

# A turn D prefills itself goes to D as a prefill-side request. vLLM 0.32 tracks and
# frees only requests that entered its NIXL worker's batch (do_remote_decode, or
# do_remote_prefill with bidirectional); with the "no transfer" flags (both False) it
# would return a handle whose blocks nothing ever frees. A prefill-side request returns
# P-style params for D's blocks (do_remote_prefill=True, D's engine id), held for D's
# kv_lease_duration (``local_handle_seconds``) and freed when P reads or releases them:
# plan.build_handle turns them into a handle P pulls like any other.
LOCAL_HANDLE_PARAMS: Final[Mapping[str, Any]] = {
    K_DO_REMOTE_DECODE: True,
    K_DO_REMOTE_PREFILL: False,
}

# ------------------------------------------------------------------ the handle


def handle_blocks(params: Mapping[str, Any]) -> int:
    """Blocks a handle pins on D: ``remote_block_ids`` is one flat list or one list
    per KV cache group (the longest group spans the prefix)."""
    ids = params.get(K_REMOTE_BLOCK_IDS)
    if not isinstance(ids, (list, tuple)) or not ids:
        return 0
    if all(isinstance(b, int) for b in ids):
        return len(ids)
    return max((len(g) for g in ids if isinstance(g, (list, tuple))), default=0)


def token_array(ids: Any) -> array:
    """Token ids as a compact uint32 array (a 32k-token conversation is 128 KiB)."""
    return array("I", ids)


@dataclass(frozen=True, eq=False)
class KVHandle:
    """What D returned at the end of a turn: its pinned KV for prompt + answer.

    ``params`` is D's ``kv_transfer_params`` exactly as returned and is only ever
    copied, never edited in place (see ``align.params_for_prefill``).
    """

    session: SessionTag
    params: Mapping[str, Any]
    # Prompt ids followed by generated ids, from return_token_ids. KV exists for the
    # first `num_tokens` of them (the last sampled token was never forwarded).
    token_ids: array
    num_tokens: int
    engine_build: str | None
    created_at: float  # time.monotonic() when the sidecar received it
    # Monotonic deadline after which D frees the blocks; None when unknown.
    expires_at: float | None
    request_id: RequestId = ""
    # What the KV depends on besides the token ids (identity.compatible decides).
    identity: KVIdentity = field(default_factory=KVIdentity)
    # The authenticated client it belongs to (owners.owner_tag); None = owners off.
    owner: str | None = None
    # D prefilled the turn alone: its blocks live for D's lease (``expires_at``), not
    # the ceiling; the retention policy bounds it by that lease (retention.py).
    lease_bound: bool = False

    @property
    def blocks(self) -> int:
        return handle_blocks(self.params)


# ------------------------------------------------------------------ outcomes


# Why a handle left the store: the fates handles.py gives. The vocabulary (and the
# fates a taking turn's outcome adds) is the wire's, which the operator checks.
STORE_FATES: Final = (
    HandleFate.TAKEN,
    HandleFate.EXPIRED,
    HandleFate.EVICTED,
    HandleFate.SUPERSEDED,
    HandleFate.CLEARED,
)


class Stage(enum.StrEnum):
    """TTFT split as the sidecar sees it (labels of one histogram).

    QUEUE: arrival -> the first engine request (routing, tokenize, handle check).
    PREFILL: the prefill leg on P, pull from D and tail compute together (P's HTTP
      answer does not separate them; vLLM's nixl metrics do, per engine).
    P_TO_D: P's answer -> D's response headers (D pulls P's blocks in between).
    FIRST_TOKEN: arrival -> the first chunk written to a streaming client (a
      non-streaming answer has no first token to time; its turn logs total_s).
    """

    QUEUE = "queue"
    PREFILL = "prefill"
    P_TO_D = "p_to_d"
    FIRST_TOKEN = "first_token"


class Api(enum.StrEnum):
    CHAT = "chat"
    COMPLETIONS = "completions"

    @property
    def path(self) -> str:
        return PATH_CHAT if self is Api.CHAT else PATH_COMPLETIONS


# ------------------------------------------------------------------ turn values


@dataclass(frozen=True)
class TurnInput:
    """A client request, parsed once."""

    api: Api
    body: Mapping[str, Any]  # client's body minus fields it may not set (kv params)
    request_id: RequestId
    session_key: SessionKey
    session: SessionTag  # tag of the key: routing, engine session_id
    slot: SessionTag  # where this turn's handle is looked up (session.handle_slot)
    identity: KVIdentity  # what the prompt's KV depends on besides its ids
    stream: bool
    wants_token_ids: bool  # the client itself asked for return_token_ids
    # False for n > 1, beam search or batched prompts: P/D and handles need one sequence.
    single_sequence: bool
    received_at: float
    # The first field off the allowlist (allowlist.unsafe_field): no reuse this turn.
    unsafe_field: str | None = None
    # The authenticated client (owners.owner_tag); None = owners off or none valid.
    owner: str | None = None
    # Owners are on and the request carried no valid owner: no reuse this turn.
    no_owner: bool = False
    # A big body (past limits.PARSE_IN_THREAD_BYTES): its engine legs' JSON is written
    # and read off the event loop (offload.py).
    heavy: bool = False


@dataclass(frozen=True)
class PrefillPlan:
    """The decision for this turn, before any engine is asked to compute."""

    route: Route
    outcome: Outcome
    handle_params: Mapping[str, Any] | None  # kv_transfer_params for P (None: recompute)
    prompt_tokens: int | None
    aligned_tokens: int  # common prefix of the prompt and the handle's tokens
    reused_tokens: int  # tokens P is told to pull (or D already holds, when skipping)
    handle_age_s: float | None  # inter-turn gap, when a handle was found
    # The session's handle, taken from the store (single use) whether or not this turn
    # reads it: one nobody reads still pins D's blocks and must be released.
    taken: KVHandle | None = None
    # Where the prefill runs and why (placement.Choice; None: not chosen, one route).
    choice: Choice | None = None
    # Prompt tokens D holds (the handle's pinned blocks or its prefix cache), as far as
    # the plan asked: what D does not compute alone, or read from P on the P path.
    # ``holds_known`` False: not asked (a turn off the allowlist), so its D leg is not
    # one the cost fit can use.
    decode_holds: int = 0
    holds_known: bool = True


@dataclass(frozen=True)
class PrefillResult:
    """What the prefill leg produced for the decode leg."""

    route: Route
    outcome: Outcome  # final: plan.settle has run
    decode_params: Mapping[str, Any] | None  # P's kv_transfer_params for D
    reused_tokens: int = 0  # what P was told to pull (or D holds, when skipping)
    engine: str | None = None
    attempts: int = 0
    prefill_s: float | None = None
    # The taken handle left D's pin list: P read it, or P registered an empty pull
    # for it (a release riding on this prefill).
    handle_freed: bool = False
    # A prefill attempt that carried the taken handle broke off: read, released or
    # neither, nobody knows (pinned in the figures until D's deadline).
    handle_unknown: bool = False


@dataclass
class TurnTimings:
    queue_s: float | None = None
    prefill_s: float | None = None
    p_to_d_s: float | None = None
    first_token_s: float | None = None
    total_s: float | None = None
    # A streamed turn's re-anchor request on D (anchor.py), after its last token.
    reanchor_s: float | None = None
    # D's leg: the request to D until its first token (streamed) or its whole answer
    # (not streamed: ``TurnReport.timed_output_tokens`` says how many tokens that was).
    decode_s: float | None = None


@dataclass
class TurnReport:
    """Everything one turn did; metrics.record() turns it into series and a log line."""

    request_id: RequestId
    session: SessionTag  # the handle slot of this turn
    api: Api
    stream: bool
    outcome: Outcome
    route: Route
    status: int = 200
    client_request_id: str | None = None  # the client's X-Request-Id (its text)
    owner: str | None = None  # the owner's tag (never the raw identity)
    # The slot this turn's handle was kept under (the next turn's); None = session.
    next_session: SessionTag | None = None
    prefill_engine: str | None = None
    prefill_attempts: int = 0
    prompt_tokens: int | None = None
    aligned_tokens: int = 0
    reused_tokens: int = 0
    handle_age_s: float | None = None
    handle_kept: bool = False
    handle_not_kept_reason: str | None = None
    finish_reason: str | None = None  # D's: stop, length, ...
    decode_holds: int = 0  # PrefillPlan.decode_holds
    holds_known: bool = True  # PrefillPlan.holds_known
    choice: Choice | None = None  # where the prefill ran and why (placement.py)
    # Tokens D generated within timings.decode_s (1 for a streamed turn: its first).
    timed_output_tokens: int | None = None
    timings: TurnTimings = field(default_factory=TurnTimings)
    error: str | None = None
