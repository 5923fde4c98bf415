"""Where a turn's prefill runs (kvferry_sidecar.placement): the measured costs of the
P path and of D alone, D's load, and the skip-prefill rule while the costs are not
known; and plan_turn routing by that choice. One test per rule, named after it."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvferry_sidecar import placement as pl
from kvferry_sidecar import plan
from kvferry_sidecar.handles import Lookup
from kvferry_sidecar.types import Api
from kvferry_wire import costfit as cf
from kvferry_wire.policy import PLACEMENT_MEASURED, PLACEMENT_THRESHOLD
from kvferry_wire.protocol import Outcome, Route

# P: 50 ms + 17 ms a pull, 0.5 ms a pulled token, 1.3 ms a computed one.
PREFILL = cf.Solved(
    {cf.ONE: 0.05, cf.PULL: 0.017, cf.PULLED_TOKENS: 0.0005, cf.COMPUTED_TOKENS: 0.0013}, 0.0, 100
)
# D: 30 ms, 20 ms more alone, 1.2 ms a token it computes, 0.1 ms a token read from P.
DECODE = cf.Solved(
    {
        cf.ONE: 0.03,
        cf.ALONE: 0.02,
        cf.ALONE_COMPUTED_TOKENS: 0.0012,
        cf.FETCHED_TOKENS: 0.0001,
        cf.OUTPUT_TOKENS: 0.01,
    },
    0.0,
    100,
)
COSTS = pl.Costs(PREFILL, DECODE)


def turn(prompt: int, on_decode: int = 0, pull: int = 0, running: int = 0) -> pl.Turn:
    return pl.Turn(prompt, on_decode, pull, running)


def test_threshold_placement_is_the_skip_prefill_rule_alone():
    assert pl.choose(PLACEMENT_THRESHOLD, 256, turn(300, on_decode=100), COSTS) == pl.Choice(
        True, pl.BY_RULE
    )
    assert not pl.choose(PLACEMENT_THRESHOLD, 256, turn(300), COSTS).alone


@pytest.mark.parametrize(
    "costs",
    [None, pl.Costs(cf.Unsolved("3 legs measured, 8 needed"), DECODE)],
    ids=["none", "prefill-unknown"],
)
def test_until_both_costs_are_known_the_rule_decides(costs):
    choice = pl.choose(PLACEMENT_MEASURED, 256, turn(200), costs)
    assert (choice.alone, choice.decided_by) == (True, pl.BY_COLD)
    assert not pl.choose(PLACEMENT_MEASURED, 256, turn(400), costs).alone


def test_an_idle_d_prefills_a_tail_it_computes_sooner_than_the_p_path():
    """A 464-token tail over 1,147 tokens D holds: D alone 0.6 s against the P path's
    pull of the history, the tail on P and D reading it all back."""
    choice = pl.choose(PLACEMENT_MEASURED, 256, turn(1611, on_decode=1147, pull=1147), COSTS)
    assert choice.decided_by == pl.BY_COSTS and choice.alone
    assert choice.alone_s == pytest.approx(0.03 + 0.02 + 464 * 0.0012 + 0.01)
    assert choice.p_path_s == pytest.approx(
        0.05 + 0.017 + 1147 * 0.0005 + 464 * 0.0013 + 0.03 + 464 * 0.0001 + 0.01
    )
    assert choice.interference_s == 0


def test_each_stream_d_is_decoding_pays_for_the_tail_d_computes():
    """The same turn with three streams on D: their wait (3 x 0.56 s) goes on D
    alone's side, and the P path wins."""
    choice = pl.choose(
        PLACEMENT_MEASURED, 256, turn(1611, on_decode=1147, pull=1147, running=3), COSTS
    )
    assert not choice.alone
    assert choice.interference_s == pytest.approx(3 * 464 * 0.0012)


def test_a_p_that_computes_much_faster_wins_a_long_first_turn():
    fast_p = pl.Costs(
        cf.Solved({**PREFILL.coefficients, cf.COMPUTED_TOKENS: 0.0002}, 0.0, 100), DECODE
    )
    assert not pl.choose(PLACEMENT_MEASURED, 256, turn(4000), fast_p).alone
    assert pl.choose(PLACEMENT_MEASURED, 256, turn(4000), COSTS).alone


@given(st.integers(1, 8000), st.integers(0, 8000), st.integers(0, 64))
def test_more_load_on_d_never_sends_a_turn_from_p_to_d(prompt, held, running):
    on_decode = min(held, prompt)
    base = pl.choose(PLACEMENT_MEASURED, 256, turn(prompt, on_decode, running=running), COSTS)
    busier = pl.choose(PLACEMENT_MEASURED, 256, turn(prompt, on_decode, running=running + 1), COSTS)
    assert base.alone or not busier.alone


# ------------------------------------------------------------------ plan_turn

RULES = plan.Rules(
    bidirectional=True,
    streaming_handles=False,
    block_size=4,
    recompute_threshold=4,
    skip_prefill_below_tokens=256,
    prefill_placement=PLACEMENT_MEASURED,
    costs=COSTS,
)


def a_turn() -> plan.TurnInput:
    return plan.parse_turn(
        Api.COMPLETIONS,
        {"model": "m", "prompt": "x"},
        {},
        "rid",
        0.0,
        ("session_id",),
    )


def test_plan_sends_a_measured_choice_of_d_alone_to_d_with_what_d_holds():
    cached = 1024
    planned = plan.plan_turn(
        a_turn(), list(range(1500)), Lookup(None, Outcome.NO_HANDLE, None), RULES, lambda: cached
    )
    assert (planned.route, planned.outcome) == (Route.SKIP, Outcome.CACHED_ON_DECODE)
    assert planned.decode_holds == planned.reused_tokens == cached
    assert planned.choice is not None and planned.choice.decided_by == pl.BY_COSTS


def test_plan_asks_d_s_prefix_cache_for_every_measured_choice():
    asked: list[int] = []

    def cached() -> int:
        asked.append(1)
        return 0

    plan.plan_turn(a_turn(), list(range(100)), Lookup(None, Outcome.NO_HANDLE, None), RULES, cached)
    assert asked == [1]


def test_plan_keeps_a_turn_on_p_when_d_is_busy():
    busy = plan.Rules(**{**RULES.__dict__, "running_on_decode": 8})
    planned = plan.plan_turn(
        a_turn(), list(range(1500)), Lookup(None, Outcome.NO_HANDLE, None), busy, lambda: 1024
    )
    assert planned.route is Route.REMOTE and planned.decode_holds == 1024
    assert planned.choice is not None and not planned.choice.alone


def test_turns_expected_on_d_meanwhile_pay_for_the_tail_too():
    """With no stream on D but turns reaching it two a second, a 464-token tail
    (0.56 s of D's compute) costs those arriving meanwhile 2 x 0.56² / 2 s."""
    t = turn(1611, on_decode=1147, pull=1147)
    quiet = pl.choose(PLACEMENT_MEASURED, 256, t, COSTS)
    busy = pl.choose(PLACEMENT_MEASURED, 256, pl.Turn(1611, 1147, 1147, 0, 2.0), COSTS)
    compute = 464 * 0.0012
    assert quiet.interference_s == 0
    assert busy.interference_s == pytest.approx(2.0 * compute * compute / 2)


def test_the_arrival_rate_is_of_the_last_minute():
    now = [0.0]
    arrivals = pl.Arrivals(clock=lambda: now[0])
    assert arrivals.rate() == 0.0
    for _ in range(30):
        arrivals.note()
        now[0] += 2.0  # one every 2 s for a minute
    assert arrivals.rate() == pytest.approx(0.5, rel=0.05)
    now[0] += 120.0  # then nothing: the window forgets them
    assert arrivals.rate() == 0.0


def test_a_misaligned_turn_d_prefills_alone_still_says_misaligned():
    """A client that rewrote its history is what ``misaligned`` tells the operator:
    the verdict stays when the costs send the turn to D alone (the handle's fate too)."""
    from tests.unit.sidecar.test_align import make_handle

    t = a_turn()
    handle = dataclasses.replace(
        make_handle(list(range(1, 1201)), block_size=4), identity=t.identity
    )
    prompt = [7, *range(2, 1501)]  # the first token rewritten
    planned = plan.plan_turn(t, prompt, Lookup(handle, Outcome.REUSED, 5.0), RULES)
    assert (planned.route, planned.outcome) == (Route.SKIP, Outcome.MISALIGNED)
    assert planned.handle_params is None and planned.taken is handle
