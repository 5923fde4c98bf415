"""The retention tuner: table cases for the rules, properties for the invariants."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry_operator import tune
from kvferry_operator.tune import TuningInputs
from kvferry_wire import costfit
from kvferry_wire.report import Histogram, merge_histograms

BOUNDS = (1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0)


def hist_of(samples: list[float]) -> Histogram:
    counts = [0] * (len(BOUNDS) + 1)
    for s in samples:
        i = next((i for i, b in enumerate(BOUNDS) if s <= b), len(BOUNDS))
        counts[i] += 1
    return Histogram(BOUNDS, tuple(counts))


def inputs(samples: list[float], **kw) -> TuningInputs:
    base = dict(
        gaps=hist_of(samples),
        current_retention=480,
        coverage=0.95,
        min_retention=30,
        max_retention=1800,
    )
    base.update(kw)
    return TuningInputs(**base)


class TestHistogram:
    def test_quantile_interpolates_inside_the_bucket(self):
        h = Histogram((10.0, 20.0), (0, 10, 0))
        assert h.quantile(0.5) == (15.0, False)

    def test_overflow_is_a_lower_bound(self):
        h = Histogram((10.0,), (1, 9))
        assert h.quantile(0.95) == (10.0, True)

    def test_merge_sums_counts(self):
        a, b = Histogram((1.0,), (1, 2)), Histogram((1.0,), (3, 4))
        assert merge_histograms([a, b], (1.0,)) == Histogram((1.0,), (4, 6))

    def test_merge_refuses_different_bounds(self):
        with pytest.raises(ValueError, match="different bucket bounds"):
            merge_histograms([Histogram((1.0,), (0, 0)), Histogram((2.0,), (0, 0))], (1.0,))

    def test_malformed_counts_are_rejected(self):
        with pytest.raises(ValueError, match="overflow"):
            Histogram((1.0, 2.0), (1, 2))


# Gaps land in buckets; 100 gaps of 40 s sit in (30, 60], whose p95 interpolates
# to 58.5 s -> 59 + 15 s margin = 74 s. 100 s gaps: (60, 120] -> 117 -> 132;
# under pressure halved to 66.
RETENTION_CASES = [
    # name, samples, extra inputs, expected value, fragment of the reason
    ("too few gaps keeps current", [40.0] * 5, {}, 480, "only 5 inter-turn gaps"),
    ("covers p95 plus margins", [40.0] * 100, {}, 74, "p95 of 100 inter-turn gaps"),
    ("clamped to max", [3000.0] * 100, {}, 1800, "clamped to [30, 1800]"),
    ("clamped to min", [0.5] * 100, {}, 30, "clamped to [30, 1800]"),
    ("overflow said plainly", [5000.0] * 100, {}, 1800, "or more"),
    ("kv pressure lowers", [100.0] * 100, {"decode_kv_usage_max": 0.97}, 66, "KV pressure"),
    ("preemptions lower", [100.0] * 100, {"preemptions_delta": 3}, 66, "preemptions +3"),
    (
        "pressure with few gaps halves current",
        [10.0] * 3,
        {"decode_kv_usage_max": 0.95},
        240,
        "KV pressure with only 3 gaps",
    ),
]


@pytest.mark.parametrize(
    ("name", "samples", "extra", "value", "reason"),
    RETENTION_CASES,
    ids=[c[0] for c in RETENTION_CASES],
)
def test_retention_rule(name, samples, extra, value, reason):
    rec = tune.recommend_retention(inputs(samples, **extra))
    assert rec.value == value
    assert reason in rec.reason
    assert rec.inputs["gapSamples"] == len(samples)


gap_lists = st.lists(st.floats(min_value=0.1, max_value=5000.0), min_size=0, max_size=300)


@settings(max_examples=300, deadline=None)
@given(
    samples=gap_lists,
    coverage=st.floats(min_value=0.5, max_value=0.999),
    lo=st.integers(10, 600),
    span=st.integers(0, 3000),
    current=st.integers(10, 3600),
    usage=st.none() | st.floats(0, 1),
    preempt=st.integers(0, 5),
)
def test_recommendation_stays_within_bounds(samples, coverage, lo, span, current, usage, preempt):
    hi = lo + span
    current = max(lo, min(hi, current))
    rec = tune.recommend_retention(
        inputs(
            samples,
            coverage=coverage,
            min_retention=lo,
            max_retention=hi,
            current_retention=current,
            decode_kv_usage_max=usage,
            preemptions_delta=preempt,
        )
    )
    assert lo <= rec.value <= hi
    assert rec.reason


@settings(max_examples=200, deadline=None)
@given(
    samples=st.lists(st.floats(0.1, 1500.0), min_size=tune.MIN_GAP_SAMPLES, max_size=300),
    coverage=st.floats(0.5, 0.99),
)
def test_unpressured_recommendation_covers_the_coverage_share_of_gaps(samples, coverage):
    # The promise behind the number: at least `coverage` of the observed gaps
    # arrive while the handle is still offered.
    rec = tune.recommend_retention(inputs(samples, coverage=coverage, max_retention=1800))
    offered = rec.value - tune.EXPIRY_MARGINS_SECONDS
    # Bucketed data can only promise coverage up to the bucket holding the quantile.
    covered_bound = next((b for b in BOUNDS if b >= offered), math.inf)
    share = sum(1 for s in samples if s <= covered_bound) / len(samples)
    assert share >= coverage or rec.value == 1800


@settings(max_examples=100, deadline=None)
@given(samples=gap_lists, usage=st.floats(0, 1), preempt=st.integers(0, 3))
def test_pressure_never_raises_above_the_unpressured_value(samples, usage, preempt):
    calm = tune.recommend_retention(inputs(samples))
    pressed = tune.recommend_retention(
        inputs(samples, decode_kv_usage_max=usage, preemptions_delta=preempt)
    )
    assert pressed.value <= max(calm.value, 480)


@settings(max_examples=100, deadline=None)
@given(
    samples=st.lists(st.floats(0.1, 5000.0), max_size=tune.MIN_GAP_SAMPLES - 1),
    current=st.integers(30, 1800),
)
def test_too_little_data_never_raises(samples, current):
    rec = tune.recommend_retention(inputs(samples, current_retention=current))
    assert rec.value <= current


@given(samples=gap_lists, split=st.integers(0, 300))
def test_the_recommendation_depends_on_the_gaps_not_on_which_pod_saw_them(samples, split):
    # The aggregator merges per-pod histograms in whatever order the pods reported.
    a, b = hist_of(samples[:split]), hist_of(samples[split:])
    whole = tune.recommend_retention(inputs(samples))
    for parts in ([a, b], [b, a]):
        merged = merge_histograms(parts, BOUNDS)
        assert tune.recommend_retention(inputs([], gaps=merged)) == whole


def prefill_fit(pull: float, per_pulled: float, per_computed: float, fixed: float = 0.05):
    """The prefill legs a decode pod would time at these costs: a recompute and a
    pull of each history size (16 new tokens each)."""
    fit = costfit.empty(costfit.PREFILL_LEG)
    for n in (8, 16, 32, 64, 128, 256, 512, 1024, 2048) * 3:
        for pulled in (0, n):
            x = {costfit.PULL: 1.0 if pulled else 0.0, costfit.PULLED_TOKENS: pulled}
            x[costfit.COMPUTED_TOKENS] = n + 16 - pulled
            seconds = fixed + (pull if pulled else 0) + per_pulled * pulled
            costfit.observe(
                fit, costfit.PREFILL_LEG, x, seconds + per_computed * (n + 16 - pulled), n
            )
    return fit


class TestThreshold:
    def test_no_legs_keeps_the_threshold_in_force(self):
        rec = tune.recommend_threshold(inputs([], current_threshold=64))
        assert (rec.value, rec.measured) == (64, False)
        assert rec.reason == "0 pulls and 0 recomputes measured, 20 of each needed: keeping 64"

    def test_too_few_pulls_keep_the_threshold_in_force(self):
        """19 pulls (and as many recomputes) say what they say, but a threshold Auto
        applies from them could stop every pull: kept until 20 of each."""
        fit = costfit.empty(costfit.PREFILL_LEG)
        for n in range(19):
            x = {costfit.PULL: 1.0, costfit.PULLED_TOKENS: 100 + n, costfit.COMPUTED_TOKENS: 16}
            costfit.observe(fit, costfit.PREFILL_LEG, x, 0.1, 116)
            costfit.observe(fit, costfit.PREFILL_LEG, {costfit.COMPUTED_TOKENS: 116 + n}, 0.2, 116)
        rec = tune.recommend_threshold(inputs([], current_threshold=64, prefill_leg=fit))
        assert (rec.value, rec.measured) == (64, False)
        assert rec.reason == "19 pulls and 19 recomputes measured, 20 of each needed: keeping 64"

    def test_the_break_even_of_the_fitted_legs(self):
        # 17 ms a pull, 0.5 ms a pulled token, 1.3 ms a computed one:
        # 0.017 / (0.0013 - 0.0005) = 21.25 -> pulls win from 22 tokens.
        rec = tune.recommend_threshold(inputs([], prefill_leg=prefill_fit(0.017, 0.0005, 0.0013)))
        assert (rec.value, rec.measured) == (22, True)
        assert "a pull costs 17.0ms + 500.0us/token, a recompute 1300.0us/token" in rec.reason
        assert rec.reason.endswith("pulls win from 22 tokens")
        assert rec.inputs["pullLegs"] == 27 and rec.inputs["prefillLegs"] == 54

    def test_a_pulled_token_no_cheaper_than_a_computed_one_means_never_pull(self):
        rec = tune.recommend_threshold(
            inputs([], max_model_len=32768, prefill_leg=prefill_fit(0.01, 0.002, 0.0013))
        )
        assert rec.value == 32768
        assert "never pull" in rec.reason

    @pytest.mark.parametrize(
        ("mode", "recommended", "applied", "apply"),
        [
            ("Recommend", 200, 64, False),
            ("Auto", 64, 64, False),
            ("Auto", 70, 64, False),  # 6 tokens: under 16
            ("Auto", 90, 64, True),
            ("Auto", 1000, 900, False),  # 100 tokens: under 25 % of 900
            ("Auto", 1200, 900, True),
            ("Auto", 0, 64, True),
        ],
    )
    def test_auto_moves_the_threshold_only_when_it_moved_far(
        self, mode, recommended, applied, apply
    ):
        rec = tune.Recommendation(recommended, "fitted")
        assert tune.plan_threshold_apply(mode, rec, applied).apply is apply

    def test_auto_never_applies_what_was_not_measured(self):
        rec = tune.Recommendation(0, "no prefill legs reported: keeping 0", measured=False)
        decision = tune.plan_threshold_apply("Auto", rec, 64)
        assert not decision.apply and "no measured break-even yet" in decision.reason


APPLY_CASES = [
    ("observe never applies", dict(mode="Observe"), False, "mode Observe"),
    ("recommend never applies", dict(mode="Recommend"), False, "mode Recommend"),
    ("same value", dict(recommended=480), False, "already running"),
    ("small change", dict(recommended=500), False, "not worth a restart"),
    ("not ready", dict(ready=False), False, "not Ready"),
    ("one role at a time", dict(rolling_role="decode"), False, "one role at a time"),
    ("daily budget spent", dict(restarts=[90000.0, 95000.0]), False, "maxRestartsPerDay 2"),
    ("old restarts do not count", dict(restarts=[1.0, 2.0]), True, "applying 120s"),
    ("auto applies", {}, True, "applying 120s (was 480s)"),
]


@pytest.mark.parametrize(
    ("name", "kw", "apply", "reason"), APPLY_CASES, ids=[c[0] for c in APPLY_CASES]
)
def test_plan_apply(name, kw, apply, reason):
    base = dict(
        mode="Auto",
        recommended=120,
        applied=480,
        ready=True,
        restarts=[],
        now=100000.0,
        max_restarts_per_day=2,
        rolling_role=None,
    )
    decision = tune.plan_apply(**{**base, **kw})
    assert decision.apply is apply
    assert reason in decision.reason


LIVE_APPLY_CASES = [
    # name, kwargs over the base, applied?, reason contains
    ("a lower value applies at once", {}, True, "applied 120s live (was 480s)"),
    ("a small change too: no restart to be worth", dict(recommended=470), True, "live"),
    ("Recommend applies nothing", dict(mode="Recommend"), False, "not applied"),
    ("the same value is already in force", dict(recommended=480), False, "already in force"),
    ("never over the ceiling", dict(recommended=2000), False, "over the ceiling"),
]


@pytest.mark.parametrize(
    ("name", "kw", "apply", "reason"), LIVE_APPLY_CASES, ids=[c[0] for c in LIVE_APPLY_CASES]
)
def test_plan_live_apply(name, kw, apply, reason):
    base = dict(mode="Auto", recommended=120, applied=480, ceiling=1800)
    decision = tune.plan_live_apply(**{**base, **kw})
    assert decision.apply is apply
    assert reason in decision.reason


def test_the_recommendation_event_carries_its_inputs():
    """`kubectl describe dserver` shows this message: the value, why, and the inputs."""
    from kvferry_operator.publisher import recommendation_message

    rec = tune.Recommendation(
        12,
        "p95 of 20 inter-turn gaps is 9.5s",
        {"gapSamples": 20, "preemptionsDelta": 4, "x": None},
    )
    assert recommendation_message(rec) == (
        "decodeRetentionSeconds 12s recommended: p95 of 20 inter-turn gaps is 9.5s "
        "(inputs: gapSamples=20, preemptionsDelta=4)"
    )
