"""The live policy: what the operator tells a server's sidecars to apply without a restart.

It travels in the answer to the sidecar's report push (``POST /v1/reports``, 202:
``{"accepted": true, "policy": {...}}``). The push is authenticated (TokenReview, the
pod a member of its server's StatefulSet), and the operator answers with the policy of
that pod's server alone, so a sidecar can only learn its own server's policy.

Fields (camelCase on the wire):

- ``version``: the format, ``POLICY_VERSION``; another is refused whole (a newer
  operator's policy must not be half understood);
- ``revision``: names the policy (a digest of its values), so a sidecar, its
  ``/metrics`` and the operator's status can say which one is in force;
- ``retentionSeconds``: how long a decode sidecar holds a handle for the session's
  next turn (at most the pod's ceiling, D's ``decoder_kv_blocks_ttl``: the sidecar
  clamps to it, since a pod started before a ceiling change has the older one);
- ``recomputeThreshold``: a handle whose usable prefix is shorter is not pulled;
- ``skipPrefillBelowTokens``: D prefills alone when the uncached tail is shorter;
- ``prefillPlacement`` (optional): ``Measured``, where a turn's prefill runs is
  chosen per turn from the measured costs of P and of D alone and D's load
  (``kvferry_sidecar.placement``), ``skipPrefillBelowTokens`` deciding until both
  are measured; ``Threshold``: that rule alone. A policy without it keeps the value
  in force (an older operator's).

:func:`decode` checks each field apart (type, bounds) and returns the good ones with
one error per refused field, naming it: the sidecar applies what is good and keeps
the last good value of the rest. Unknown fields are ignored (an older sidecar reads a
newer operator's policy of the same version).

POLICY_VERSION history:
  1 - first version: retentionSeconds, recomputeThreshold, skipPrefillBelowTokens.
      Later in 1: prefillPlacement, optional (an older sidecar ignores it, an older
      operator's policy leaves it as it is).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

POLICY_VERSION: Final = 1
# The report answer's key for it.
RESPONSE_KEY: Final = "policy"
# A report answer is a few hundred bytes; a sidecar reads at most this of it.
MAX_RESPONSE_BYTES: Final = 16 * 1024
# The CRD's bounds of decodeRetentionSeconds / maxRetentionSeconds.
MIN_RETENTION_SECONDS: Final = 10
MAX_RETENTION_SECONDS: Final = 86400
# Token counts: above any model's context (vLLM's largest is a few million).
MAX_TOKENS: Final = 1 << 24
MAX_REVISION_CHARS: Final = 64
_REVISION_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")

K_VERSION: Final = "version"
K_REVISION: Final = "revision"
K_RETENTION: Final = "retentionSeconds"
K_THRESHOLD: Final = "recomputeThreshold"
K_SKIP: Final = "skipPrefillBelowTokens"
K_PLACEMENT: Final = "prefillPlacement"
PLACEMENT_MEASURED: Final = "Measured"
PLACEMENT_THRESHOLD: Final = "Threshold"
PLACEMENTS: Final = (PLACEMENT_MEASURED, PLACEMENT_THRESHOLD)


@dataclass(frozen=True)
class Policy:
    retention_seconds: float
    recompute_threshold: int
    skip_prefill_below_tokens: int
    prefill_placement: str = PLACEMENT_MEASURED

    def revision(self) -> str:
        """A digest of the values: equal policies have equal revisions, whoever built them."""
        canon = json.dumps(_values(self), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canon.encode()).hexdigest()[:16]


def _values(policy: Policy) -> dict[str, Any]:
    retention = policy.retention_seconds
    return {
        K_RETENTION: int(retention) if float(retention).is_integer() else retention,
        K_THRESHOLD: policy.recompute_threshold,
        K_SKIP: policy.skip_prefill_below_tokens,
        K_PLACEMENT: policy.prefill_placement,
    }


def encode(policy: Policy) -> dict[str, Any]:
    """The policy as the report answer carries it."""
    return {K_VERSION: POLICY_VERSION, K_REVISION: policy.revision(), **_values(policy)}


@dataclass(frozen=True)
class Decoded:
    """What :func:`decode` made of a policy: the good fields, and why each other one
    was refused (field name -> message)."""

    revision: str | None
    fields: dict[str, float | int | str]
    errors: dict[str, str]


def _number(value: Any, lo: float, hi: float, *, integer: bool) -> float | int | str:
    """The value, or the reason it is refused."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"must be a number, got {type(value).__name__}"
    if isinstance(value, float) and not math.isfinite(value):
        return "must be finite"
    if integer and not (isinstance(value, int) or value.is_integer()):
        return f"must be a whole number, got {value!r}"
    if not lo <= value <= hi:
        return f"must be within [{lo:g}, {hi:g}], got {value!r}"
    return int(value) if integer else float(value)


# field -> (lowest, highest, whole number only)
_BOUNDS: Final = {
    K_RETENTION: (MIN_RETENTION_SECONDS, MAX_RETENTION_SECONDS, False),
    K_THRESHOLD: (0, MAX_TOKENS, True),
    K_SKIP: (0, MAX_TOKENS, True),
}


def decode(raw: Any) -> Decoded:
    """Check a policy field by field (see the module docstring). A value that is not an
    object, or of another version, is refused whole (``errors`` names why)."""
    if not isinstance(raw, Mapping):
        return Decoded(None, {}, {RESPONSE_KEY: f"must be an object, got {type(raw).__name__}"})
    version = raw.get(K_VERSION)
    if version != POLICY_VERSION or isinstance(version, bool):
        return Decoded(
            None, {}, {K_VERSION: f"must be {POLICY_VERSION} (this sidecar's), got {version!r}"}
        )
    errors: dict[str, str] = {}
    revision = raw.get(K_REVISION)
    if not isinstance(revision, str) or not _REVISION_RE.fullmatch(revision):
        errors[K_REVISION] = (
            f"must be 1-{MAX_REVISION_CHARS} of [A-Za-z0-9._-], got {str(revision)[:80]!r}"
        )
        revision = None
    fields: dict[str, float | int | str] = {}
    if K_PLACEMENT in raw:
        placement = raw[K_PLACEMENT]
        if placement in PLACEMENTS:
            fields[K_PLACEMENT] = placement
        else:
            errors[K_PLACEMENT] = (
                f"must be one of {', '.join(PLACEMENTS)}, got {str(placement)[:40]!r}"
            )
    for key, (lo, hi, integer) in _BOUNDS.items():
        if key not in raw:
            errors[key] = "missing"
            continue
        value = _number(raw[key], lo, hi, integer=integer)
        if isinstance(value, str):
            errors[key] = value
        else:
            fields[key] = value
    return Decoded(revision, fields, errors)
