"""Which legs of a turn go into the cost fits (kvferry_wire.costfit), with which
features: only legs that time what they say. One test per rule."""

from __future__ import annotations

import dataclasses

import pytest

from kvferry_sidecar import placement
from kvferry_sidecar.residency import MAX_TIMED_OUTPUT_TOKENS
from kvferry_sidecar.types import TurnReport
from kvferry_wire import costfit as cf
from kvferry_wire.protocol import Outcome, Route

from .test_residency import make, turn

CHOICE = placement.Choice(False, placement.BY_COLD)


def leg(report: TurnReport, **fields) -> TurnReport:
    """A successful turn with one prefill attempt and D's leg timed (streamed: one
    token), as relay.py fills them."""
    base = dataclasses.replace(
        report, prefill_attempts=1, choice=CHOICE, timed_output_tokens=1, decode_holds=0
    )
    base.timings.decode_s = 0.2
    return dataclasses.replace(base, **fields)


def features(fit: cf.LinearFit, shape: cf.Shape) -> dict[str, int]:
    return dict(zip(shape.features, fit.nonzero, strict=True))


def test_a_pull_and_a_recompute_each_add_a_prefill_leg_with_their_tokens():
    r, _ = make()
    r.observe_turn(leg(turn(prompt=1000)))
    r.observe_turn(leg(turn(outcome=Outcome.REUSED, prompt=1200, reused=960)))
    fit = r.prefill_leg
    assert fit.observations == 2
    assert features(fit, cf.PREFILL_LEG) == {
        cf.ONE: 2,
        cf.PULL: 1,
        cf.PULLED_TOKENS: 1,
        cf.COMPUTED_TOKENS: 2,
    }
    # Σ w·pulled·computed: only the pull has both, 960 x 240, at its prompt's weight.
    k = len(cf.PREFILL_LEG.features)
    i, j = (
        cf.PREFILL_LEG.features.index(cf.PULLED_TOKENS),
        cf.PREFILL_LEG.features.index(cf.COMPUTED_TOKENS),
    )
    assert fit.xx[cf._index(i, j, k)] == pytest.approx(cf.weight_of(1200) * 960 * 240)


def test_a_prefill_of_several_attempts_is_no_leg():
    """A failed pull retried without the handle timed both attempts."""
    r, _ = make()
    r.observe_turn(leg(turn(prompt=1000), prefill_attempts=2))
    assert r.prefill_leg.observations == 0


def test_d_alone_and_the_p_path_add_decode_legs_with_what_d_held():
    r, _ = make()
    r.observe_turn(
        leg(turn(outcome=Outcome.SKIPPED_PREFILL, route=Route.SKIP, prompt=1000), decode_holds=900)
    )
    r.observe_turn(leg(turn(prompt=1000), decode_holds=300))
    fit = r.decode_leg
    assert features(fit, cf.DECODE_LEG) == {
        cf.ONE: 2,
        cf.ALONE: 1,
        cf.ALONE_COMPUTED_TOKENS: 1,
        cf.FETCHED_TOKENS: 1,
        cf.OUTPUT_TOKENS: 2,
    }
    k = len(cf.DECODE_LEG.features)
    alone = cf.DECODE_LEG.features.index(cf.ALONE_COMPUTED_TOKENS)
    fetched = cf.DECODE_LEG.features.index(cf.FETCHED_TOKENS)
    assert fit.xy[alone] == pytest.approx(cf.weight_of(1000) * 100 * 0.2)  # 1000 - 900
    assert fit.xy[fetched] == pytest.approx(cf.weight_of(1000) * 700 * 0.2)  # 1000 - 300
    assert fit.xx[cf._index(alone, alone, k)] == pytest.approx(cf.weight_of(1000) * 100 * 100)


@pytest.mark.parametrize(
    "why",
    [
        {"route": Route.FALLBACK},  # D's leg followed a failure
        {"holds_known": False},  # a turn off the allowlist: what D held not asked
        {"choice": None},  # several sequences, or no ids
        {"timed_output_tokens": MAX_TIMED_OUTPUT_TOKENS + 1},  # mostly decoding
        {"timed_output_tokens": None},  # nothing timed
        {"status": 500},  # a failed turn's timings describe the failure
    ],
    ids=["fallback", "reuse-off", "no-choice", "long-answer", "untimed", "failed"],
)
def test_a_decode_leg_that_does_not_time_its_prefill_is_not_added(why):
    r, _ = make()
    r.observe_turn(leg(turn(Outcome.SKIPPED_PREFILL, Route.SKIP), **why))
    assert r.decode_leg.observations == 0


def test_the_report_carries_copies_of_the_fits():
    r, _ = make()
    r.observe_turn(leg(turn(prompt=1000)))
    snap = r.snapshot(0.0)
    r.observe_turn(leg(turn(prompt=1000)))
    assert snap.costs.prefill_leg.observations == 1
    assert r.prefill_leg.observations == 2
    assert snap.placements.prefill_by_cold_rule == 1
