"""Names and numbers the operator, the sidecar and clients agree on. Constants only."""

from __future__ import annotations

import enum
from typing import Final

# ------------------------------------------------------------------ ports (every engine pod)

# Clients and peers only ever talk to the sidecar; the engine is reached on localhost
# (and by prefill peers for the P->D request).
SIDECAR_PORT: Final = 8000
# The sidecar's internal port: peers' forwarded turns, Prometheus (/metrics) and the
# residency report (/v1/residency). The entry Service never exposes it, so clients
# cannot read another session's figures or pose as a peer.
SIDECAR_INTERNAL_PORT: Final = 8001
# The sidecar's metrics port: GET /metrics only (the sidecar's kvferry_* series and
# the engine's vllm:* ones), so a scraper is admitted without a peer's rights (8001
# takes relayed turns, 8200 is the raw engine).
SIDECAR_METRICS_PORT: Final = 8002
ENGINE_PORT: Final = 8200
NIXL_SIDE_CHANNEL_PORT: Final = 5600
# The engine's KV-event PUB socket and its replay ROUTER socket.
KV_EVENTS_PORT: Final = 5557
KV_EVENTS_REPLAY_PORT: Final = 5558

# ------------------------------------------------------------------ roles

# The two kinds of engine pod: the operator's StatefulSets, the sidecar's --role and
# the report's ``role``.
ROLE_PREFILL: Final = "prefill"
ROLE_DECODE: Final = "decode"
ROLES: Final = (ROLE_PREFILL, ROLE_DECODE)

# ------------------------------------------------------------------ handle expiry

# The sidecar stops offering a handle this long before D frees its blocks: vLLM's P
# declines reads in a handle's last 5 s, and a prefill may queue before it reads. The
# tuner adds the same margin to the inter-turn gap it wants covered, so the two
# cannot drift apart (which is why it is no setting).
HANDLE_EXPIRY_MARGIN_SECONDS: Final = 15

# ------------------------------------------------------------------ the report endpoint

REPORT_PATH: Final = "/v1/reports"
# On a 503 from an operator replica that does not hold the leader Lease: the sidecar
# sends the report again at once, on a new connection (the standby closed this one),
# which the Service balances to the leader.
HDR_OPERATOR_STANDBY: Final = "X-Kvferry-Standby"
# The sidecar's drain, on its internal port: the engine container's preStop hook GETs
# it and the kubelet stops the engine once it answers (kvferry_sidecar.drain).
DRAIN_PATH: Final = "/drain"
# Audience of the projected ServiceAccount token a sidecar presents with its report.
REPORT_TOKEN_AUDIENCE: Final = "kvferry"

# ------------------------------------------------------------------ HTTP headers

HDR_REQUEST_ID: Final = "X-Request-Id"
HDR_SESSION_ID: Final = "X-Session-Id"
# Set by a sidecar that forwards a request to the session's owner. Its presence makes
# the receiver serve the request itself, so one request is forwarded at most once.
HDR_FORWARDED_BY: Final = "X-Kvferry-Forwarded-By"
# On a 503 from a sidecar that is draining (its pod is stopping): it takes no new
# turns. A peer that forwarded the turn serves it itself; a client retries (Retry-After)
# and reaches another pod through the Service, which no longer lists this one.
HDR_DRAINING: Final = "X-Kvferry-Draining"
# Diagnostics on a turn's response, only when the server enables them
# (routing.diagnosticHeaders): they tell, at block granularity, how much of a prompt
# matched the session's previous turn, which a client guessing another's session key
# must not learn.
HDR_OUTCOME: Final = "X-Kvferry-Outcome"
HDR_REUSED_TOKENS: Final = "X-Kvferry-Reused-Tokens"
HDR_OWNER: Final = "X-Kvferry-Owner"
HDR_ROUTE: Final = "X-Kvferry-Route"
# Present when the answer will leave no handle for the next turn, with the reason.
HDR_HANDLE: Final = "X-Kvferry-Handle"

# ------------------------------------------------------------------ per-turn values


class Outcome(enum.StrEnum):
    """What happened to the session's KV on a turn: ``X-Kvferry-Outcome``, a metric
    label and a key of the report's ``outcomes``."""

    REUSED = "reused"  # P was sent the handle (or its aligned prefix)
    EXPIRED = "expired"  # a handle existed but was past expiry - margin (or another build)
    MISALIGNED = "misaligned"  # the prompt diverged from the handle's tokens too early
    NO_HANDLE = "no-handle"  # first turn, evicted, or not kept
    BELOW_THRESHOLD = "below-threshold"  # usable prefix shorter than the recompute threshold
    PULL_FAILED = "pull-failed"  # P failed with the handle; retried without it
    SKIPPED_PREFILL = "skipped-prefill"  # D prefilled the short tail itself
    # The handle's KV was computed under another model or adapter, cache_salt, media or
    # media options, or either turn truncates its prompt: same ids, other KV.
    KV_MISMATCH = "kv-mismatch"
    # No usable handle, but D's prefix cache (seen through its KV events) still held
    # the prompt's prefix: D prefilled the short tail itself.
    CACHED_ON_DECODE = "cached-on-decode"
    # A request field off the allowlist (kvferry_sidecar.allowlist): it may change the
    # rendered prompt or its KV where /tokenize cannot show it. No handle used or kept.
    UNSAFE_FIELD = "unsafe-field"
    # Media behind a URL whose bytes the sidecar cannot see (the sidecar setting
    # mediaUrlsImmutable says they never change). No handle used or kept.
    UNCACHEABLE_MEDIA = "uncacheable-media"
    # The sidecar binds handles to an owner (ownerHeader) and the request carried no
    # valid one: the gateway did not authenticate it. No handle used or kept.
    NO_OWNER = "no-owner"


class HandleFate(enum.StrEnum):
    """What became of a handle: the keys of the report's ``handles`` (one list, here,
    so the sidecar that counts them and the operator that decodes them agree).

    The sidecar's handle store drops a handle as TAKEN (a turn took it), EXPIRED,
    EVICTED, SUPERSEDED or CLEARED; a taken handle is then counted by the taking
    turn's outcome: CONSUMED (P read it), SKIPPED (D prefilled alone), MISALIGNED,
    BELOW_THRESHOLD, PULL_FAILED, KV_MISMATCH, or TAKEN when the turn says no more.
    """

    CONSUMED = "consumed"
    SKIPPED = "skipped"
    TAKEN = "taken"
    MISALIGNED = "misaligned"
    BELOW_THRESHOLD = "below-threshold"
    PULL_FAILED = "pull-failed"
    KV_MISMATCH = "kv-mismatch"
    EXPIRED = "expired"
    EVICTED = "evicted"  # a cap of the store: its own, or the owner's (report.Evictions)
    SUPERSEDED = "superseded"  # a newer turn's handle replaced it
    CLEARED = "cleared"  # the local engine restarted


class Route(enum.StrEnum):
    """Where a turn's prompt was prefilled (``X-Kvferry-Route``)."""

    REMOTE = "remote"  # a prefill engine, then D pulled from it
    SKIP = "skip"  # D alone, by choice (short uncached tail)
    FALLBACK = "fallback"  # D alone, because no prefill engine could do it
