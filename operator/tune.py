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
4. **Recompute threshold** (``kvTransfer.recomputeThreshold``). Every prefill
   leg the decode sidecars time goes into one least-squares fit
   (``kvferry_wire.costfit``, summed over the decode pods): seconds = fixed +
   pull·[pulled] + per-pulled-token·pulled + per-computed-token·computed. A
   pull of N history tokens beats computing them from
   ``N* = pull / (per-computed-token - per-pulled-token)`` on; if a pulled token
   is not cheaper than a computed one the threshold is the model length (never
   pull). The fit is of whole legs as the turns saw them, not of NIXL's own
   counters, which miss the engine steps around a transfer and, on a throttled
   link, half the wire time (docs/performance.md, "Break-even"). Until it has
   ``MIN_THRESHOLD_LEGS`` pulls and as many recomputes the threshold in force is
   kept (a threshold from a few noisy pulls could stop every pull, and with them the
   measuring).
   At or above P's engine-side ``kv_recompute_threshold`` (0 as rendered,
   ``policy.ENGINE_RECOMPUTE_THRESHOLD``), which only a restart changes.

Every recommendation carries the inputs it used and a one-line reason, and is
deterministic for its inputs.

:func:`plan_threshold_apply` decides, for ``Auto``, whether to apply a threshold:
live like the retention, once it moved far enough from the one in force that the
change is worth a new policy revision (near the break-even both ways cost about the
same, so a fit's noise must not churn the policy).

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

from kvferry_wire import costfit
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
# A threshold moves in force only by at least this much (tokens, and share of it).
MIN_THRESHOLD_CHANGE_TOKENS = 16
MIN_THRESHOLD_CHANGE_SHARE = 0.25
# What the threshold's fit must have seen (costfit.solve's ``needed``), and how many
# pulls and recomputes: a threshold Auto applies from a few noisy legs (a slow first
# NIXL handshake) could stop every pull, and with it the measuring of pulls.
THRESHOLD_NEEDS = (costfit.PULL, costfit.PULLED_TOKENS, costfit.COMPUTED_TOKENS)
MIN_THRESHOLD_LEGS = 20


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
    current_threshold: int = 64
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    # The decode pods' prefill legs, summed (costfit.PREFILL_LEG): what the threshold
    # is fitted from.
    prefill_leg: costfit.LinearFit | None = None


@dataclass(frozen=True)
class Recommendation:
    value: int
    reason: str
    inputs: dict[str, Any] = field(default_factory=dict)
    # False: too little was measured, ``value`` is what runs now.
    measured: bool = True


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
    """The measured break-even (step 4 of the module docstring), with its inputs."""
    fit = inp.prefill_leg or costfit.empty(costfit.PREFILL_LEG)
    pulls = fit.nonzero[costfit.PREFILL_LEG.features.index(costfit.PULL)]
    recomputes = fit.observations - pulls
    solved: costfit.Solved | costfit.Unsolved
    if pulls < MIN_THRESHOLD_LEGS or recomputes < MIN_THRESHOLD_LEGS:
        solved = costfit.Unsolved(
            f"{pulls} pulls and {recomputes} recomputes measured, {MIN_THRESHOLD_LEGS} of "
            "each needed"
        )
    else:
        solved = costfit.solve(fit, costfit.PREFILL_LEG, THRESHOLD_NEEDS)
    if isinstance(solved, costfit.Unsolved):
        return Recommendation(
            inp.current_threshold,
            f"{solved.reason}: keeping {inp.current_threshold}",
            {"prefillLegs": fit.observations, "pullLegs": pulls},
            measured=False,
        )
    c = solved.coefficients
    inputs: dict[str, Any] = {
        "prefillLegs": solved.observations,
        "pullLegs": pulls,
        "pullFixedSeconds": round(c[costfit.PULL], 6),
        "pullSecondsPerToken": round(c[costfit.PULLED_TOKENS], 9),
        "recomputeSecondsPerToken": round(c[costfit.COMPUTED_TOKENS], 9),
        "rmsSeconds": round(solved.rms_seconds, 6),
    }
    pull, per_pulled = c[costfit.PULL], c[costfit.PULLED_TOKENS]
    costs = (
        f"a pull costs {pull * 1e3:.1f}ms + {per_pulled * 1e6:.1f}us/token, a recompute "
        f"{c[costfit.COMPUTED_TOKENS] * 1e6:.1f}us/token ({solved.observations} prefill "
        f"legs, {inputs['pullLegs']} pulls)"
    )
    breakeven = costfit.break_even_tokens(solved)
    if breakeven is None:
        return Recommendation(
            inp.max_model_len, f"{costs}: a pulled token is no cheaper, never pull", inputs
        )
    # The fit is of floats: a break-even a rounding above a whole number is that number.
    value = clamp(math.ceil(breakeven - 1e-6), 0, inp.max_model_len)
    return Recommendation(value, f"{costs}: pulls win from {value} tokens", inputs)


def plan_threshold_apply(mode: str, rec: Recommendation, applied: int) -> ApplyDecision:
    """Whether ``Auto`` puts the measured threshold ``rec`` in force now (live)."""
    if mode != MODE_AUTO:
        return ApplyDecision(False, f"mode {mode}: recommendations are not applied")
    if not rec.measured:
        return ApplyDecision(False, f"no measured break-even yet ({rec.reason})")
    moved = abs(rec.value - applied)
    if moved == 0:
        return ApplyDecision(False, "already in force")
    if moved < max(MIN_THRESHOLD_CHANGE_TOKENS, MIN_THRESHOLD_CHANGE_SHARE * applied):
        return ApplyDecision(
            False,
            f"{rec.value} is within {MIN_THRESHOLD_CHANGE_TOKENS} tokens or "
            f"{MIN_THRESHOLD_CHANGE_SHARE:.0%} of {applied} in force: not worth a new policy",
        )
    return ApplyDecision(True, f"applied {rec.value} live (was {applied})")


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
