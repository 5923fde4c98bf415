"""Measured prefill placement in a running sidecar (fake engines on real ports): every
turn's legs feed the cost fits the report carries, and once both fits can say what
each way costs the next turn goes where they say, not where the rule would send it;
the policy turns it on and off live."""

from __future__ import annotations

from kvferry_sidecar import placement
from kvferry_sidecar.promtext import Scrape
from kvferry_wire import costfit as cf
from kvferry_wire import policy as wire

from .conftest import Engines, MakeSidecar, sidecar_of
from .test_turns import LONG_QUESTION, Conversation, outcome


def seed_costs(sc, *, alone_per_token: float, p_per_token: float) -> None:
    """Legs as a server whose D computes at ``alone_per_token`` s and whose P at
    ``p_per_token`` s would have measured them (the fakes' own timings say nothing)."""
    r = sc.residency
    for n in (4, 8, 16, 32, 64, 128):
        for pulled in (0, n // 2):
            x = {cf.PULL: 1.0 if pulled else 0.0, cf.PULLED_TOKENS: pulled}
            x[cf.COMPUTED_TOKENS] = n - pulled
            cf.observe(r.prefill_leg, cf.PREFILL_LEG, x, 0.05 + p_per_token * (n - pulled), n)
        cf.observe(
            r.decode_leg,
            cf.DECODE_LEG,
            {cf.ALONE: 1.0, cf.ALONE_COMPUTED_TOKENS: n, cf.OUTPUT_TOKENS: 1},
            0.02 + alone_per_token * n,
            n,
        )
        cf.observe(
            r.decode_leg,
            cf.DECODE_LEG,
            {cf.FETCHED_TOKENS: n, cf.OUTPUT_TOKENS: 1},
            0.03 + 0.0001 * n,
            n,
        )


async def test_each_turn_adds_its_legs_to_the_fits_the_report_carries(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    client = await make_sidecar()
    sc = sidecar_of(client)
    conv = Conversation(client)
    await conv.ask(LONG_QUESTION)
    await conv.ask("and a second question of a few words")
    report = sc.snapshot()
    prefill, decode = report.costs.prefill_leg, report.costs.decode_leg
    assert prefill.observations == 2
    # One recompute (turn 1) and one pull (turn 2): the pull indicator seen once.
    assert prefill.nonzero[cf.PREFILL_LEG.features.index(cf.PULL)] == 1
    assert decode.observations == 2
    assert decode.nonzero[cf.DECODE_LEG.features.index(cf.FETCHED_TOKENS)] == 2


async def test_measured_costs_send_a_turn_to_d_alone_that_the_rule_sends_to_p(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """skipPrefillBelowTokens 0 would send every turn to P; the costs say D computes
    a token as fast as P and saves P's round trip, so D prefills alone."""
    client = await make_sidecar(prefill_placement="Measured")
    sc = sidecar_of(client)
    seed_costs(sc, alone_per_token=0.001, p_per_token=0.001)
    conv = Conversation(client)
    resp, _ = await conv.ask(LONG_QUESTION)
    assert resp.headers["X-Kvferry-Route"] == "skip"
    assert not [s for s in engines.prefill[0].seen + engines.prefill[1].seen]
    scrape = Scrape(await (await client.get("/metrics")).text())
    assert scrape.total("kvferry_placements_total", placement="decode", decided_by="costs") == 1


async def test_a_d_slower_than_the_p_path_keeps_turns_on_p(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    client = await make_sidecar(prefill_placement="Measured")
    sc = sidecar_of(client)
    seed_costs(sc, alone_per_token=0.05, p_per_token=0.001)
    resp, _ = await Conversation(client).ask(LONG_QUESTION)
    assert resp.headers["X-Kvferry-Route"] == "remote"
    assert outcome(resp) == "no-handle"


async def test_the_policy_turns_measured_placement_off_live(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    client = await make_sidecar(prefill_placement="Measured")
    sc = sidecar_of(client)
    seed_costs(sc, alone_per_token=0.001, p_per_token=0.001)
    policy = wire.Policy(480, 4, 0, prefill_placement=wire.PLACEMENT_THRESHOLD)
    sc.on_report_answer({"accepted": True, "policy": wire.encode(policy)})
    assert sc.rules().costs is None
    resp, _ = await Conversation(client).ask(LONG_QUESTION)
    assert resp.headers["X-Kvferry-Route"] == "remote"
    scrape = Scrape(await (await client.get("/metrics")).text())
    assert scrape.total("kvferry_placements_total", placement="prefill", decided_by="rule") == 1


async def test_cold_costs_leave_the_choice_to_the_rule(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    client = await make_sidecar(prefill_placement="Measured")
    costs = sidecar_of(client).costs()
    assert not costs.known and "legs measured" in costs.why_unknown
    resp, _ = await Conversation(client).ask(LONG_QUESTION)
    assert resp.headers["X-Kvferry-Route"] == "remote"
    scrape = Scrape(await (await client.get("/metrics")).text())
    assert scrape.total("kvferry_placements_total", placement="prefill", decided_by="cold") == 1
    assert placement.BY_COLD == "cold"
