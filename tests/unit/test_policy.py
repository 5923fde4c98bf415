"""A server's live policy and its ceiling (``kvferry_operator.policy``), pure."""

from __future__ import annotations

import pytest

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
