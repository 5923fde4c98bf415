"""The live policy in a running sidecar (fake engines on real ports): a policy from the
operator's report answer changes the next turn's plan, moves the retention policy's
floor for the handles held, and shows on /metrics, with nothing restarted."""

from __future__ import annotations

from typing import Any

from kvferry_sidecar.promtext import Scrape
from kvferry_wire import policy as wire

from .conftest import Engines, MakeSidecar, sidecar_of
from .test_turns import (
    LONG_QUESTION,
    Conversation,
    outcome,
)


def answer(**values: Any) -> dict[str, Any]:
    p = wire.Policy(
        retention_seconds=values.get("retention", 480),
        recompute_threshold=values.get("threshold", 4),
        skip_prefill_below_tokens=values.get("skip", 0),
    )
    return {"accepted": True, "policy": wire.encode(p)}


async def test_a_lower_retention_lowers_the_floor_not_the_end(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """The retention in force is the policy's floor (retention.Wiring): a lower one lets
    the policy release a handle for usefulness sooner, but a handle still worth keeping
    is offered until the ceiling less the margin, as D holds it."""
    client = await make_sidecar(retention_seconds=480, retention_ceiling_seconds=1800)
    sc = sidecar_of(client)
    assert await sc.scrape_engine() is True  # D's size known: the ceiling ends a handle
    sc.release_due()
    conv = Conversation(client)
    await conv.ask(LONG_QUESTION)
    assert sc.retention.limits.min_retention_s == 480
    sc.on_report_answer(answer(retention=60))
    assert sc.retention.limits.min_retention_s == 60
    engines.clock.advance(60)  # past the old end (the retention in force)
    assert sc.store.purge_expired() == 0
    resp, _ = await conv.ask("and then")
    assert outcome(resp) == "reused"


async def test_the_next_turn_plans_with_the_policys_skip_prefill(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    client = await make_sidecar()
    sc = sidecar_of(client)
    conv = Conversation(client)
    await conv.ask(LONG_QUESTION)
    # Every tail is now short: D prefills alone, P is not asked.
    sc.on_report_answer(answer(skip=100_000))
    before = engines.prefill_calls()
    resp, _ = await conv.ask("and then")
    assert resp.headers["X-Kvferry-Route"] == "skip"
    assert engines.prefill_calls() == before + 1  # only the release of the unread handle
    assert sc.rules().skip_prefill_below_tokens == 100_000


async def test_metrics_show_the_policy_in_force(make_sidecar: MakeSidecar) -> None:
    client = await make_sidecar(retention_seconds=480, retention_ceiling_seconds=1800)
    scrape = Scrape(await (await client.get("/metrics")).text())
    assert scrape.total("kvferry_retention_seconds") == 480
    assert scrape.total("kvferry_retention_ceiling_seconds") == 1800
    assert scrape.total("kvferry_policy_info", source="config") == 1
    told = answer(retention=120, threshold=32, skip=7)
    sidecar_of(client).on_report_answer(told)
    scrape = Scrape(await (await client.get("/metrics")).text())
    assert scrape.total("kvferry_retention_seconds") == 120
    assert scrape.total("kvferry_recompute_threshold_tokens") == 32
    assert scrape.total("kvferry_skip_prefill_below_tokens") == 7
    revision = told["policy"][wire.K_REVISION]
    assert scrape.total("kvferry_policy_info", revision=revision, source="operator") == 1
    assert scrape.total("kvferry_policy_info", source="config") == 0


async def test_an_answer_without_a_policy_changes_nothing(make_sidecar: MakeSidecar) -> None:
    sc = sidecar_of(await make_sidecar())
    before = sc.policy.current
    for odd in (None, {"accepted": True}, {"policy": "garbage"}):
        sc.on_report_answer(odd)
    assert sc.policy.current == before
