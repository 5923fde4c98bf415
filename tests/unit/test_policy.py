"""A server's live policy and its ceiling (``kvferry_operator.policy``), pure."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvferry_operator import api, policy
from tests.manifests import server


def parsed(spec: dict | None = None, applied: int | None = None) -> api.Server:
    obj = server(spec)
    if applied is not None:
        obj["status"] = {"retention": {"applied": applied}}
    return api.parse_server(obj)


@pytest.mark.parametrize(
    ("spec", "applied", "retention"),
    [
        ({}, None, 480),  # the spec's
        ({"cacheTuning": {"mode": "Auto"}}, 120, 120),  # Auto's applied value
        ({"cacheTuning": {"mode": "Recommend"}}, 120, 480),  # a leftover of Auto: the spec's
        ({"kvTransfer": {"decodeRetentionSeconds": 7200}}, None, 1800),  # under the ceiling
        ({"cacheTuning": {"maxRetentionSeconds": 60}}, None, 60),
    ],
    ids=["spec", "auto", "recommend-ignores-auto", "spec-over-ceiling", "low-ceiling"],
)
def test_the_retention_in_force_is_the_wanted_one_under_the_ceiling(spec, applied, retention):
    assert policy.build_policy(parsed(spec, applied)).retention_seconds == retention


def test_the_policy_carries_the_specs_threshold_and_skip_prefill():
    spec = {"kvTransfer": {"recomputeThreshold": 0}, "routing": {"skipPrefillBelowTokens": 7}}
    built = policy.build_policy(parsed(spec))
    # 0 is allowed: P's engine-side threshold is 0, so the live one is never below it.
    assert (built.recompute_threshold, built.skip_prefill_below_tokens) == (0, 7)
    assert policy.ENGINE_RECOMPUTE_THRESHOLD[api.ROLE_PREFILL] == 0


def test_the_settings_file_never_carries_autos_value():
    # A tuning decision must rewrite no child: the file starts pods at the spec's.
    auto = parsed({"cacheTuning": {"mode": "Auto"}}, applied=120)
    assert policy.config_policy(auto).retention_seconds == 480
    assert policy.build_policy(auto).retention_seconds == 120


def test_the_ceiling_is_max_retention_seconds():
    assert policy.retention_ceiling(parsed()) == 1800
    assert policy.retention_ceiling(parsed({"cacheTuning": {"maxRetentionSeconds": 900}})) == 900


def held(spec: dict | None, ceiling_held: int) -> api.Server:
    obj = server(spec)
    obj["status"] = {"retention": {"ceiling": ceiling_held, "ceilingHeld": ceiling_held}}
    return api.parse_server(obj)


def test_a_held_ceiling_bounds_the_engine_ttl_and_the_retention_in_force():
    spec = {
        "cacheTuning": {"maxRetentionSeconds": 3600},
        "kvTransfer": {"decodeRetentionSeconds": 900},
    }
    server_ = held(spec, 600)
    assert policy.retention_ceiling(server_) == 600
    assert policy.build_policy(server_).retention_seconds == 600
    # A lowering below the hold is the spec's at once.
    assert policy.retention_ceiling(held({"cacheTuning": {"maxRetentionSeconds": 300}}, 600)) == 300


@pytest.mark.parametrize(
    ("wanted", "in_force", "unreleasable", "hold"),
    [
        (1800, 600, 2, 600),  # a raise while pins cannot be freed: held where it is
        (1800, 600, 0, None),  # none unreleasable: the raise goes in
        (1800, 600, None, None),  # no fresh decode report: nothing to go by, not held
        (300, 600, 5, None),  # a lowering bounds those pins sooner: never held
        (600, 600, 5, None),  # unchanged
        (1800, None, 5, None),  # no ceiling recorded yet (nobody reported)
    ],
    ids=["raise-held", "raise-free", "raise-unknown", "lower", "same", "unrecorded"],
)
def test_the_ceiling_gate_holds_only_a_raise_over_unreleasable_pins(
    wanted, in_force, unreleasable, hold
):
    assert policy.ceiling_hold(wanted, in_force, unreleasable) == hold


@given(
    wanted=st.integers(60, 86400),
    in_force=st.none() | st.integers(60, 86400),
    unreleasable=st.none() | st.integers(0, 10_000),
)
def test_a_held_ceiling_is_never_above_the_one_in_force_nor_the_spec(
    wanted, in_force, unreleasable
):
    hold = policy.ceiling_hold(wanted, in_force, unreleasable)
    if hold is None:
        return
    # Holding never raises anything: it keeps the ceiling decode runs, below the spec's.
    assert hold == in_force and hold < wanted and unreleasable


def test_the_reason_names_where_the_retention_ceiling_threshold_and_placement_come_from():
    assert policy.reason(parsed({"kvTransfer": {"decodeRetentionSeconds": 7200}})) == (
        "retention 1800s: spec.kvTransfer.decodeRetentionSeconds (7200s), at most the "
        "ceiling; ceiling 1800s: spec.cacheTuning.maxRetentionSeconds; recomputeThreshold "
        "64: spec.kvTransfer.recomputeThreshold; prefill placement: "
        "spec.routing.prefillPlacement Measured"
    )
    auto = policy.reason(parsed({"cacheTuning": {"mode": "Auto"}}, applied=120))
    assert auto.startswith("retention 120s: applied by cacheTuning Auto")
    assert "held below maxRetentionSeconds 3600s" in policy.reason(
        held({"cacheTuning": {"maxRetentionSeconds": 3600}}, 600)
    )
    measured = dataclasses.replace(parsed({"cacheTuning": {"mode": "Auto"}}), applied_threshold=21)
    assert "recomputeThreshold 21: applied by cacheTuning Auto from the measured break-even" in (
        policy.reason(measured)
    )
    assert policy.build_policy(measured).recompute_threshold == 21
