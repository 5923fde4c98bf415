"""The live policy: its wire format checked field by field, the holder's rules
(``kvferry_sidecar.policy``; one test per rule, named after it) and the handle store
applying the retention in force to the handles it holds."""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvferry_sidecar.handles import HandleStore
from kvferry_sidecar.policy import SOURCE_CONFIG, SOURCE_OPERATOR, InForce, LivePolicy
from kvferry_sidecar.types import HandleFate, KVHandle, token_array
from kvferry_wire import policy as wire

GOOD = wire.encode(
    wire.Policy(
        retention_seconds=120,
        recompute_threshold=32,
        skip_prefill_below_tokens=512,
        prefill_placement=wire.PLACEMENT_THRESHOLD,
    )
)
CEILING = 1800.0


def holder(changes: list[InForce] | None = None, ceiling: float = CEILING) -> LivePolicy:
    return LivePolicy(
        retention_seconds=480,
        recompute_threshold=64,
        skip_prefill_below_tokens=256,
        ceiling_seconds=ceiling,
        on_change=changes.append if changes is not None else None,
    )


def values(p: LivePolicy) -> tuple[float, int, int]:
    return (p.retention_seconds, p.recompute_threshold, p.skip_prefill_below_tokens)


# ------------------------------------------------------------------ the wire format


def test_encode_then_decode_gives_back_every_field():
    decoded = wire.decode(GOOD)
    assert decoded.errors == {}
    assert decoded.fields == {
        wire.K_RETENTION: 120.0,
        wire.K_THRESHOLD: 32,
        wire.K_SKIP: 512,
        wire.K_PLACEMENT: wire.PLACEMENT_THRESHOLD,
    }
    assert decoded.revision == GOOD[wire.K_REVISION]


def test_equal_policies_have_equal_revisions_and_different_ones_not():
    a = wire.Policy(120, 32, 512)
    assert a.revision() == wire.Policy(120.0, 32, 512).revision()
    assert a.revision() != wire.Policy(121, 32, 512).revision()


@pytest.mark.parametrize(
    ("field", "value", "why"),
    [
        (wire.K_RETENTION, "120", "must be a number"),
        (wire.K_RETENTION, True, "must be a number"),
        (wire.K_RETENTION, 5, "within [10, 86400]"),
        (wire.K_RETENTION, 86401, "within [10, 86400]"),
        (wire.K_RETENTION, math.inf, "finite"),
        (wire.K_THRESHOLD, -1, "within [0,"),
        (wire.K_THRESHOLD, 1.5, "whole number"),
        (wire.K_SKIP, None, "must be a number"),
        (wire.K_SKIP, 1 << 30, "within [0,"),
    ],
)
def test_a_bad_field_is_refused_alone_naming_the_field(field, value, why):
    decoded = wire.decode({**GOOD, field: value})
    assert list(decoded.errors) == [field] and why in decoded.errors[field]
    assert set(decoded.fields) == {
        wire.K_RETENTION,
        wire.K_THRESHOLD,
        wire.K_SKIP,
        wire.K_PLACEMENT,
    } - {field}


@pytest.mark.parametrize("value", ["measured", "", None, 1, ["Measured"]])
def test_a_placement_not_of_the_vocabulary_is_refused_alone(value):
    decoded = wire.decode({**GOOD, wire.K_PLACEMENT: value})
    assert list(decoded.errors) == [wire.K_PLACEMENT]
    assert "Measured, Threshold" in decoded.errors[wire.K_PLACEMENT]
    assert set(decoded.fields) == {wire.K_RETENTION, wire.K_THRESHOLD, wire.K_SKIP}


def test_a_policy_without_a_placement_leaves_the_one_in_force():
    """An older operator's policy has no prefillPlacement: no error, nothing changed."""
    p = holder()
    p.offer(GOOD)
    assert p.prefill_placement == wire.PLACEMENT_THRESHOLD
    older = {k: v for k, v in GOOD.items() if k != wire.K_PLACEMENT}
    assert p.offer({**older, wire.K_SKIP: 100}) == {}
    assert (p.prefill_placement, p.skip_prefill_below_tokens) == (wire.PLACEMENT_THRESHOLD, 100)


@pytest.mark.parametrize(
    ("raw", "key"),
    [([], wire.RESPONSE_KEY), ("x", wire.RESPONSE_KEY), ({**GOOD, "version": 2}, wire.K_VERSION)],
    ids=["a list", "a string", "another version"],
)
def test_a_policy_not_an_object_or_of_another_version_is_refused_whole(raw, key):
    decoded = wire.decode(raw)
    assert (decoded.fields, list(decoded.errors)) == ({}, [key])


@given(
    st.dictionaries(
        st.sampled_from([wire.K_VERSION, wire.K_REVISION, wire.K_RETENTION, wire.K_THRESHOLD,
                         wire.K_SKIP, "other"]),
        st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=80),
                  st.lists(st.integers(), max_size=3)),
    )
)  # fmt: skip
def test_any_value_decodes_to_fields_within_their_bounds(raw: dict[str, Any]):
    """Whatever arrives, every field kept is of its type and within its bounds, and
    every other field the policy names has an error."""
    decoded = wire.decode(raw)
    for key, value in decoded.fields.items():
        lo, hi, integer = wire._BOUNDS[key]
        assert lo <= value <= hi and not isinstance(value, bool)
        assert isinstance(value, int) if integer else isinstance(value, float)
    if decoded.fields:
        assert set(decoded.fields) | set(decoded.errors) >= set(wire._BOUNDS)


# ------------------------------------------------------------------ the holder's rules


def test_config_until_told():
    p = holder()
    assert values(p) == (480, 64, 256)
    assert (p.current.source, p.current.revision) == (SOURCE_CONFIG, SOURCE_CONFIG)


def test_field_by_field(caplog):
    changes: list[InForce] = []
    p = holder(changes)
    p.offer(GOOD)
    with caplog.at_level(logging.WARNING, logger="kvferry_sidecar.policy"):
        refused = p.offer({**GOOD, wire.K_RETENTION: -3, wire.K_SKIP: 100})
    assert list(refused) == [wire.K_RETENTION]
    # The good field applied, the refused one kept its last good value.
    assert values(p) == (120, 32, 100)
    assert "field=retentionSeconds" in caplog.text
    assert p.refusals == 1 and len(changes) == 2
    # The same refusal in the next answer is counted, not logged again.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvferry_sidecar.policy"):
        p.offer({**GOOD, wire.K_RETENTION: -3, wire.K_SKIP: 100})
    assert caplog.text == "" and p.refusals == 2


def test_under_the_ceiling():
    p = holder(ceiling=300)
    assert p.retention_seconds == 300  # the file's 480 too is held under it
    p.offer({**GOOD, wire.K_RETENTION: 900})
    assert p.retention_seconds == 300
    p.offer({**GOOD, wire.K_RETENTION: 200})
    assert p.retention_seconds == 200


def test_nothing_new_nothing_done(caplog):
    changes: list[InForce] = []
    p = holder(changes)
    p.offer(GOOD)
    with caplog.at_level(logging.INFO, logger="kvferry_sidecar.policy"):
        p.offer(GOOD)
    assert len(changes) == 1 and caplog.text == ""
    assert (p.current.source, p.current.revision) == (SOURCE_OPERATOR, GOOD[wire.K_REVISION])


def test_a_refused_revision_with_good_values_is_in_force_unnamed():
    p = holder()
    p.offer({**GOOD, wire.K_REVISION: "no spaces allowed"})
    assert values(p) == (120, 32, 512) and p.current.revision == "unknown"


@given(st.lists(st.dictionaries(st.sampled_from(list(wire._BOUNDS)), st.integers(-5, 100_000))))
def test_whatever_is_offered_the_policy_in_force_stays_in_bounds(offers: list[dict[str, int]]):
    p = holder(ceiling=600)
    for offer in offers:
        p.offer({wire.K_VERSION: 1, wire.K_REVISION: "r", **offer})
        assert wire.MIN_RETENTION_SECONDS <= p.retention_seconds <= 600
        assert 0 <= p.recompute_threshold <= wire.MAX_TOKENS
        assert 0 <= p.skip_prefill_below_tokens <= wire.MAX_TOKENS


# ------------------------------------------------------------------ the store under it

MARGIN = 15.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def handle(session: str, created: float, engine_ttl: float = CEILING) -> KVHandle:
    return KVHandle(
        session=session,
        params={"remote_block_ids": [[1]], "remote_num_tokens": 7},
        token_ids=token_array(range(8)),
        num_tokens=7,
        engine_build="b",
        created_at=created,
        expires_at=created + engine_ttl,
    )


def store_under(p: LivePolicy, clock: Clock, drops: list) -> HandleStore:
    return HandleStore(
        cap=8,
        margin_s=MARGIN,
        engine_build="b",
        clock=clock,
        on_drop=lambda fate, h: drops.append((fate, h.session)),
        retention=lambda: p.retention_seconds,
    )


def test_a_lower_retention_reaches_the_handles_already_held():
    p, clock, drops = holder(), Clock(), []
    store = store_under(p, clock, drops)
    store.put(handle("s1", clock.now))
    clock.now += 200
    assert store.purge_expired() == 0  # 200 s < 480 - 15
    p.offer(GOOD)  # 120 s now
    assert store.purge_expired() == 1
    assert drops == [(HandleFate.EXPIRED, "s1")]


def test_a_handle_the_policy_let_go_is_not_near_ds_deadline():
    # The runtime releases it through a P (D would keep it to the ceiling); one near
    # D's own deadline is pinned until then instead.
    p, clock, drops = holder(), Clock(), []
    store = store_under(p, clock, drops)
    p.offer(GOOD)
    h = handle("s1", clock.now)
    clock.now += 120 - MARGIN
    assert store.is_expired(h, clock.now) and not store.engine_expiring(h, clock.now)
    clock.now = h.expires_at - MARGIN
    assert store.engine_expiring(h, clock.now)


def test_a_higher_retention_keeps_a_handle_up_to_ds_deadline_only():
    p, clock, drops = holder(), Clock(), []
    store = store_under(p, clock, drops)
    h = handle("s1", clock.now, engine_ttl=300)  # D's own deadline: 300 s
    p.offer({**GOOD, wire.K_RETENTION: 1800})
    assert not store.is_expired(h, clock.now + 300 - MARGIN - 1)
    assert store.is_expired(h, clock.now + 300 - MARGIN)
