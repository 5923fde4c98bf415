"""A server's live policy and its ceiling: what the sidecars apply without a restart. Pure.

Two kinds of setting shape how long decode keeps a session's KV:

- the **ceiling** (``spec.cacheTuning.maxRetentionSeconds``): decode's engine
  ``decoder_kv_blocks_ttl``, on the engine's command line, so changing it restarts the
  decode pods. D frees a handle's blocks then, whatever the sidecar does. A raise waits
  while the decode sidecars report handles no release can free (``ceiling_hold``):
  each would stay pinned the longer ceiling, and on vLLM 0.32 a pinned handle keeps D's
  engine loop busy;
- the **live policy** (``kvferry_wire.policy``): the retention under the ceiling
  (``kvTransfer.decodeRetentionSeconds``, or the value ``cacheTuning.mode: Auto``
  applied), ``kvTransfer.recomputeThreshold`` (or the measured break-even Auto
  applied), ``routing.skipPrefillBelowTokens`` and ``routing.prefillPlacement``.
  The operator answers each report push with it; the sidecar holds handles for the
  retention and releases them through a P when it ends (D would keep them to the
  ceiling). None of them is on a pod template, so changing them restarts nothing.

The engines' own ``kv_recompute_threshold`` is fixed (``ENGINE_RECOMPUTE_THRESHOLD``):
0 on prefill, so P pulls every handle the sidecar offers and the sidecar's live
threshold alone decides (any threshold >= 0 is at or above P's, as it must be: a P
that declined a pull the sidecar counted as reuse would recompute unseen); vLLM's
default 64 on decode, for D's pull of P's KV, which no policy sets.
"""

from __future__ import annotations

from kvferry_wire import policy as wire

from . import api

# Engine-side kv_recompute_threshold by role (see the module docstring).
ENGINE_RECOMPUTE_THRESHOLD = {api.ROLE_PREFILL: 0, api.ROLE_DECODE: 64}
# Prefill never holds a decode-side handle (the sidecar sends it prefill-side requests
# only), so its decoder_kv_blocks_ttl is unused: vLLM's default, fixed, so no ceiling
# change restarts prefill.
PREFILL_DECODER_TTL_SECONDS = 480


def retention_ceiling(server: api.Server) -> int:
    """Decode's ``decoder_kv_blocks_ttl`` in force: the longest the live retention may
    be (``maxRetentionSeconds``, or the ceiling its raise is held at)."""
    return server.retention_ceiling


def reason(server: api.Server) -> str:
    """Where the policy in force comes from, for ``kubectl describe``: the retention's
    source (the spec, Auto's decision, the ceiling) and the ceiling's (the spec, a
    held raise)."""
    spec = server.spec
    retention = server.decode_retention_seconds
    wanted = server.applied_retention or spec.kv_transfer.decode_retention_seconds
    if server.applied_retention:
        source = "applied by cacheTuning Auto from the tuner's recommendation"
    else:
        source = "spec.kvTransfer.decodeRetentionSeconds"
    if wanted > retention:
        source += f" ({wanted}s), at most the ceiling"
    ceiling = server.retention_ceiling
    asked = spec.cache_tuning.max_retention_seconds
    if ceiling < asked:
        held = (
            f"held below maxRetentionSeconds {asked}s while the decode sidecars report "
            "unreleasable pinned handles"
        )
    else:
        held = "spec.cacheTuning.maxRetentionSeconds"
    if server.applied_threshold is not None:
        threshold = "applied by cacheTuning Auto from the measured break-even"
    else:
        threshold = "spec.kvTransfer.recomputeThreshold"
    placement = f"spec.routing.prefillPlacement {spec.routing.prefill_placement}"
    return (
        f"retention {retention}s: {source}; ceiling {ceiling}s: {held}; recomputeThreshold "
        f"{server.recompute_threshold}: {threshold}; prefill placement: {placement}"
    )


def ceiling_hold(wanted: int, in_force: int | None, unreleasable: int | None) -> int | None:
    """The ceiling a raise of ``maxRetentionSeconds`` to ``wanted`` is held at, or None
    (the spec's ceiling goes in).

    ``in_force``: the ceiling decode runs (``status.retention.ceiling``; None before
    one was recorded: no pods have reported, nothing to hold); ``unreleasable``: the
    pinned handles the fresh decode reports say no release can free (None: no fresh
    decode report). Only a raise is held, and only while some pin is known to be
    unreleasable: a lowering bounds those pins sooner, and with no report to go by
    the gate does not stand in the way of the user's spec (the status says which)."""
    if in_force is None or wanted <= in_force or not unreleasable:
        return None
    return in_force


def hold_lifts(wanted: int, held: int, unreleasable: int | None) -> bool:
    """Whether a standing hold at ``held`` ends: the spec no longer asks above it, or
    every decode pod's fresh report shows no unreleasable pin. Unknown keeps it (a pod
    not heard from may hold some); a hold whose reports stopped is lifted by hand
    (docs/architecture.md)."""
    return wanted <= held or unreleasable == 0


def hold_message(wanted: int, held: int, unreleasable: int) -> str:
    return (
        f"maxRetentionSeconds {wanted}s held at {held}s: the decode sidecars report "
        f"{unreleasable} pinned handle(s) no release can free (no prefill engine, a failed "
        "release, a broken-off pull); each would stay pinned the longer ceiling. Decode "
        "restarts with the new decoder_kv_blocks_ttl once none is reported"
    )


def lift_message(wanted: int) -> str:
    return (
        f"maxRetentionSeconds {wanted}s in force: no decode sidecar reports an unreleasable "
        f"pinned handle; decode restarts with decoder_kv_blocks_ttl {wanted}s"
    )


def retention_in_force(server: api.Server) -> int:
    """What the decode sidecars hold handles for: Auto's applied value, else the spec's,
    under the ceiling (the rule's one home is ``api.Server.decode_retention_seconds``)."""
    return server.decode_retention_seconds


def build_policy(server: api.Server) -> wire.Policy:
    """The policy the server's sidecars are told."""
    spec = server.spec
    return wire.Policy(
        retention_seconds=retention_in_force(server),
        recompute_threshold=max(
            server.recompute_threshold, ENGINE_RECOMPUTE_THRESHOLD[api.ROLE_PREFILL]
        ),
        skip_prefill_below_tokens=spec.routing.skip_prefill_below_tokens,
        prefill_placement=spec.routing.prefill_placement,
    )


def config_policy(server: api.Server) -> wire.Policy:
    """The policy the settings file carries (what a sidecar applies until it hears the
    operator's): the spec's values, never Auto's, so a tuning decision rewrites no
    child object."""
    spec = server.spec
    return wire.Policy(
        retention_seconds=min(spec.kv_transfer.decode_retention_seconds, retention_ceiling(server)),
        recompute_threshold=spec.kv_transfer.recompute_threshold,
        skip_prefill_below_tokens=spec.routing.skip_prefill_below_tokens,
        prefill_placement=spec.routing.prefill_placement,
    )
