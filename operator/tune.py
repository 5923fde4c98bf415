"""Cache-retention tuner: aggregated residency reports -> recommendations. Pure.

The algorithm, per DisaggregatedServer:

1. **Retention** (``kvTransfer.decodeRetentionSeconds``). A decode pod pins a
   finished turn's KV until the next turn reads it or the retention ends. It
   pays only if the next turn comes within the retention, so the retention
   should cover the ``coverage`` quantile of observed inter-turn gaps, plus
   the margin by which the handle is dropped early (the sidecar stops offering
   it ``HANDLE_EXPIRY_MARGIN_SECONDS`` before decode frees it, which also covers
   vLLM declining reads in the last 5 s). The result is clamped to
   ``[minRetentionSeconds, maxRetentionSeconds]``.
2. **Pressure.** Pinned KV is taken from the decode cache. When the decode
   pods' KV usage passes the high-water mark or their engines preempted
   requests within the last minutes (``pressure.PreemptionWindow``), retention is
   lowered (halved, never above what runs now, never
   below the minimum): fewer pinned handles, more room for running requests.
3. **Too little data.** With fewer than ``MIN_GAP_SAMPLES`` gaps the tuner
   recommends what runs now: it never raises retention on a handful of turns.
4. **Recompute threshold** (``kvTransfer.recomputeThreshold``). A pull costs a
   fixed latency plus bytes/token over the measured bandwidth; recomputing
   costs the measured prefill seconds per token. Pulling wins from
   ``N* = latency / (recompute_s_per_token - transfer_s_per_token)`` tokens
   on; if transfer per token is not cheaper, the threshold is the model
   length (never pull).

Every recommendation carries the inputs it used and a one-line reason, and is
deterministic for its inputs.

:func:`plan_live_apply` decides, for ``Auto``, whether to apply a recommendation:
the retention is live (``policy.py``: the sidecars are told with their next report
answer, no pod restarts), so any change under the ceiling is applied at once, and a
value over the ceiling (``maxRetentionSeconds``, which also bounds the
recommendation) never is: raising the ceiling is the user's spec change.
:func:`plan_apply` is the earlier rule, when applying meant a rolling restart
(never while not Ready, at most ``maxRestartsPerDay`` in 24 h, one role at a time):
the operator no longer uses it; ``bench/eviction.py`` replays it as the policy it
replaced.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kvferry_wire.protocol import HANDLE_EXPIRY_MARGIN_SECONDS
from kvferry_wire.report import Histogram

from .api import MODE_AUTO

# Fewer gaps than this and a quantile says little about the traffic.
MIN_GAP_SAMPLES = 20
# The sidecar stops offering a handle this long before decode frees it (which also
# covers vLLM declining reads in a handle's last 5 s): a gap is served only if
# retention >= gap + margin. One number, shared with the sidecar through the wire.
EXPIRY_MARGINS_SECONDS = HANDLE_EXPIRY_MARGIN_SECONDS
# Decode KV usage above this share means pinned handles crowd out live requests.
KV_USAGE_HIGH_WATER = 0.90
PRESSURE_FACTOR = 0.5
# Only a change of at least this share is worth a rolling restart.
MIN_APPLY_CHANGE = 0.2
DAY_SECONDS = 86400


# The context length assumed when spec.model.maxModelLen is unset (the engine's own).
DEFAULT_MAX_MODEL_LEN = 131072


@dataclass(frozen=True)
class TuningInputs:
    gaps: Histogram | None
    current_retention: int
    coverage: float
    min_retention: int
    max_retention: int
    decode_kv_usage_max: float | None = None  # 0..1, highest among decode pods
    preemptions_delta: int = 0  # decode preemptions within pressure.WINDOW_SECONDS
    # For the recompute threshold:
    bytes_per_token: float | None = None
    transfer_bytes_per_second: float | None = None
    pull_fixed_latency_seconds: float | None = None
    recompute_seconds_per_token: float | None = None
    current_threshold: int = 64
    max_model_len: int = DEFAULT_MAX_MODEL_LEN


@dataclass(frozen=True)
class Recommendation:
    value: int
    reason: str
    inputs: dict[str, Any] = field(default_factory=dict)


def is_under_pressure(inp: TuningInputs) -> bool:
    usage_high = inp.decode_kv_usage_max is not None and (
        inp.decode_kv_usage_max >= KV_USAGE_HIGH_WATER
    )
    return usage_high or inp.preemptions_delta > 0


def clamp(value: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, value))


def recommend_retention(inp: TuningInputs) -> Recommendation:
    samples = inp.gaps.total if inp.gaps else 0
    inputs: dict[str, Any] = {
        "gapSamples": samples,
        "coverage": inp.coverage,
        "current": inp.current_retention,
        "min": inp.min_retention,
        "max": inp.max_retention,
        "decodeKVUsageMax": inp.decode_kv_usage_max,
        "preemptionsDelta": inp.preemptions_delta,
    }
    pressure = is_under_pressure(inp)
    if samples < MIN_GAP_SAMPLES:
        if pressure:
            value = clamp(
                math.floor(inp.current_retention * PRESSURE_FACTOR),
                inp.min_retention,
                inp.current_retention,
            )
            return Recommendation(
                value,
                f"KV pressure with only {samples} gaps observed: lowering to {value}s",
                inputs,
            )
        return Recommendation(
            inp.current_retention,
            f"only {samples} inter-turn gaps observed (need {MIN_GAP_SAMPLES}): keeping "
            f"{inp.current_retention}s",
            inputs,
        )
    assert inp.gaps is not None
    q, lower_bound = inp.gaps.quantile(inp.coverage)
    inputs["gapQuantileSeconds"] = round(q, 3)
    wanted = math.ceil(q) + EXPIRY_MARGINS_SECONDS
    value = clamp(wanted, inp.min_retention, inp.max_retention)
    pct = f"p{round(inp.coverage * 100, 2):g}"
    reason = f"{pct} of {samples} inter-turn gaps is {q:.1f}s"
    if lower_bound:
        reason += f" or more (gaps beyond {q:g}s seen)"
    reason += f"; +{EXPIRY_MARGINS_SECONDS}s margins"
    if value != wanted:
        reason += f", clamped to [{inp.min_retention}, {inp.max_retention}]"
    if pressure:
        lowered = clamp(
            math.floor(min(value, inp.current_retention) * PRESSURE_FACTOR),
            inp.min_retention,
            inp.max_retention,
        )
        if lowered < value:
            value = lowered
            reason += (
                f"; lowered to {value}s under KV pressure (usage "
                f"{inp.decode_kv_usage_max}, preemptions +{inp.preemptions_delta})"
            )
    return Recommendation(value, f"{reason} -> {value}s", inputs)


def break_even_tokens(
    bytes_per_token: float,
    transfer_bytes_per_second: float,
    pull_fixed_seconds: float,
    recompute_seconds_per_token: float,
) -> int | None:
    """The shortest history whose pull (fixed latency + bytes / bandwidth) beats
    recomputing it; None when moving a token is not faster than recomputing it."""
    saving = recompute_seconds_per_token - bytes_per_token / transfer_bytes_per_second
    if saving <= 0:
        return None
    return math.ceil(max(0.0, pull_fixed_seconds) / saving)


def recommend_threshold(inp: TuningInputs) -> Recommendation:
    inputs = {
        "bytesPerToken": inp.bytes_per_token,
        "transferBytesPerSecond": inp.transfer_bytes_per_second,
        "pullFixedLatencySeconds": inp.pull_fixed_latency_seconds,
        "recomputeSecondsPerToken": inp.recompute_seconds_per_token,
    }
    needed = (
        inp.bytes_per_token,
        inp.transfer_bytes_per_second,
        inp.pull_fixed_latency_seconds,
        inp.recompute_seconds_per_token,
    )
    if any(v is None or v <= 0 for v in needed[:2]) or any(v is None for v in needed[2:]):
        return Recommendation(
            inp.current_threshold,
            f"no transfer or prefill measurements yet: keeping {inp.current_threshold}",
            inputs,
        )
    assert inp.bytes_per_token and inp.transfer_bytes_per_second
    assert inp.pull_fixed_latency_seconds is not None
    assert inp.recompute_seconds_per_token is not None
    transfer = inp.bytes_per_token / inp.transfer_bytes_per_second
    inputs["transferSecondsPerToken"] = transfer
    breakeven = break_even_tokens(
        inp.bytes_per_token,
        inp.transfer_bytes_per_second,
        inp.pull_fixed_latency_seconds,
        inp.recompute_seconds_per_token,
    )
    if breakeven is None:
        return Recommendation(
            inp.max_model_len,
            f"pulling a token ({transfer * 1e6:.1f}us) is not faster than recomputing it "
            f"({inp.recompute_seconds_per_token * 1e6:.1f}us): never pull",
            inputs,
        )
    value = clamp(breakeven, 0, inp.max_model_len)
    return Recommendation(
        value,
        f"pull costs {inp.pull_fixed_latency_seconds * 1e3:.1f}ms + {transfer * 1e6:.2f}us/token,"
        f" recompute {inp.recompute_seconds_per_token * 1e6:.1f}us/token: pulls win from "
        f"{value} tokens",
        inputs,
    )


@dataclass(frozen=True)
class ApplyDecision:
    apply: bool
    reason: str


def plan_live_apply(mode: str, recommended: int, applied: int, ceiling: int) -> ApplyDecision:
    """Whether ``Auto`` applies ``recommended`` now (live: nothing restarts)."""
    if mode != MODE_AUTO:
        return ApplyDecision(False, f"mode {mode}: recommendations are not applied")
    if recommended == applied:
        return ApplyDecision(False, "already in force")
    if recommended > ceiling:
        return ApplyDecision(False, f"{recommended}s is over the ceiling in force ({ceiling}s)")
    return ApplyDecision(True, f"applied {recommended}s live (was {applied}s)")


def plan_apply(
    mode: str,
    recommended: int,
    applied: int,
    ready: bool,
    restarts: list[float],
    now: float,
    max_restarts_per_day: int,
    rolling_role: str | None,
) -> ApplyDecision:
    """Whether ``Auto`` should roll the pods to ``recommended`` now."""
    if mode != MODE_AUTO:
        return ApplyDecision(False, f"mode {mode}: recommendations are not applied")
    if recommended == applied:
        return ApplyDecision(False, "already running the recommended value")
    if abs(recommended - applied) < MIN_APPLY_CHANGE * applied:
        return ApplyDecision(False, f"change under {MIN_APPLY_CHANGE:.0%}: not worth a restart")
    if not ready:
        return ApplyDecision(False, "server is not Ready: not restarting pods now")
    if rolling_role:
        return ApplyDecision(False, f"{rolling_role} is still rolling: one role at a time")
    recent = [t for t in restarts if now - t < DAY_SECONDS]
    if len(recent) >= max_restarts_per_day:
        return ApplyDecision(
            False,
            f"{len(recent)} restarts in the last 24h (maxRestartsPerDay {max_restarts_per_day})",
        )
    return ApplyDecision(True, f"applying {recommended}s (was {applied}s)")
