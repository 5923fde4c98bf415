"""One series per fact: the series docs/upgrading.md lists as removed are exported by
nobody, and each replacement carries the figure its rewrite promises."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient

from kvferry_dev import dashboard
from kvferry_sidecar.promtext import Scrape

from .conftest import Engines, MakeSidecar, sidecar_of
from .test_turns import LONG_QUESTION, Conversation, outcome, releases_done

UPGRADING = Path(__file__).resolve().parents[3] / "docs" / "upgrading.md"
# A row of the removed-series table: | `old{labels}` | `new{labels}` | what differs |
_ROW = re.compile(r"^\| `(kvferry_[a-z0-9_]+)(?:\{[^}]*\})?` \| `(kvferry_[a-z0-9_]+)", re.M)
_SUFFIX = re.compile(r"_(total|bucket|count|sum|created)$")
# What a handle a turn took becomes (docs/upgrading.md's rewrite of fate="taken").
TAKEN_FATES = ("consumed", "skipped", "misaligned", "below-threshold", "pull-failed")
TAKEN_FATES += ("kv-mismatch", "taken")


def base(name: str) -> str:
    return _SUFFIX.sub("", name)


def replaced() -> dict[str, str]:
    """Removed series -> the series that replaces it, as the upgrade note says."""
    return {base(old): base(new) for old, new in _ROW.findall(UPGRADING.read_text())}


async def scrape(client: TestClient) -> Scrape:
    return Scrape(await (await client.get("/metrics")).text())


def exported(s: Scrape) -> set[str]:
    return {base(sample.name) for sample in s.samples}


def test_the_upgrade_note_lists_the_six_removed_series() -> None:
    # Bug prevented: a table row the pattern misses would silently drop out of the
    # checks below.
    assert replaced() == {
        "kvferry_handle_drops": "kvferry_handle_fates",
        "kvferry_turn_gap_seconds": "kvferry_inter_turn_gap_seconds",
        "kvferry_handles_pinned": "kvferry_pinned_handles",
        "kvferry_handle_oldest_age_seconds": "kvferry_pinned_oldest_age_seconds",
        "kvferry_prompt_tokens": "kvferry_prompt_tokens_by_index",
        "kvferry_reused_tokens": "kvferry_reused_tokens_by_index",
    }


@pytest.mark.parametrize("role", ["decode", "prefill"])
async def test_removed_series_are_gone_and_replacements_are_there(
    make_sidecar: MakeSidecar, role: str
) -> None:
    client = await make_sidecar(role=role)
    if role == "decode":
        conv = Conversation(client, stream=True)
        await conv.ask(LONG_QUESTION)
        await conv.ask("and then")
    names = exported(await scrape(client))
    assert not names & set(replaced())
    # Counters by label appear with their first count; the prefill role counts none.
    labelled = {"kvferry_handle_fates", "kvferry_prompt_tokens_by_index"}
    labelled.add("kvferry_reused_tokens_by_index")
    expected = set(replaced().values()) - (labelled if role == "prefill" else set())
    assert expected <= names


def test_the_dashboard_queries_no_removed_series() -> None:
    queried = set(re.findall(r"kvferry_[a-z0-9_]+", dashboard.render()))
    assert not {base(q) for q in queried} & set(replaced())


async def test_pinned_handles_less_unused_is_the_handle_store(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """The rewrite of kvferry_handles_pinned, with one handle held and one unused."""
    client = await make_sidecar(skip_prefill_below_tokens=10)
    conv = Conversation(client, session_id="a")
    resp, _ = await conv.ask(LONG_QUESTION)
    assert outcome(resp) == "no-handle"
    for p in engines.prefill:
        p.fail_statuses = [500]  # turn 1's handle, dropped by the short turn 2, stays
    resp, _ = await conv.ask("and you")
    assert outcome(resp) == "skipped-prefill"
    await releases_done(client)
    sc = sidecar_of(client)
    held_age = max(sc.store.ages())  # read first: the store's clock runs
    s = await scrape(client)
    assert s.total("kvferry_pinned_unused_handles") == 1
    assert s.total("kvferry_pinned_handles") == 2
    assert s.total("kvferry_pinned_handles") - s.total("kvferry_pinned_unused_handles") == len(
        sc.store
    )
    # The unused handle (session a) is older than the held one, and counts.
    assert s.total("kvferry_pinned_oldest_age_seconds") > held_age


async def test_tokens_by_index_sum_to_every_turns_tokens(
    make_sidecar: MakeSidecar, caplog: pytest.LogCaptureFixture
) -> None:
    """The rewrites of kvferry_prompt_tokens_total and kvferry_reused_tokens_total:
    summed over the turn index, the tokens the turn log lines name."""
    client = await make_sidecar()
    with caplog.at_level(logging.INFO, logger="kvferry_sidecar.turn"):
        for session in ("a", "b"):
            conv = Conversation(client, session_id=session, stream=True)
            for question in (LONG_QUESTION, "and then", "and after that"):
                await conv.ask(question)
    lines = [r.getMessage() for r in caplog.records if r.name == "kvferry_sidecar.turn"]
    assert len(lines) == 6

    def logged(key: str) -> int:
        return sum(int(re.search(rf" {key}=(\d+)", line)[1]) for line in lines)

    s = await scrape(client)
    reused = s.total("kvferry_reused_tokens_by_index")
    assert s.total("kvferry_prompt_tokens_by_index") == logged("prompt_tokens") > 0
    assert reused == logged("reused") > 0
    assert reused == s.total("kvferry_reused_tokens_by_index", turn="2") + s.total(
        "kvferry_reused_tokens_by_index", turn="3"
    )


async def test_taken_handles_are_counted_by_their_turns_outcome(
    make_sidecar: MakeSidecar,
) -> None:
    """The rewrite of kvferry_handle_drops_total{fate="taken"}: turns 2 and 3 each took
    one handle, counted by what the pull made of it."""
    client = await make_sidecar()
    conv = Conversation(client, session_id="s", stream=True)
    for question in (LONG_QUESTION, "and then", "and after that"):
        await conv.ask(question)
    s = await scrape(client)
    assert sum(s.total("kvferry_handle_fates", fate=f) for f in TAKEN_FATES) == 2
    assert s.total("kvferry_handle_fates", fate="consumed") == 2


async def test_inter_turn_gap_sees_the_gap_the_handle_did_not_survive(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """What kvferry_turn_gap_seconds never saw: a gap longer than the retention."""
    client = await make_sidecar()
    conv = Conversation(client, session_id="s")
    await conv.ask(LONG_QUESTION)
    engines.clock.advance(700.0)  # past the fake D's 480 s TTL
    resp, _ = await conv.ask("and then")
    assert outcome(resp) == "expired"
    s = await scrape(client)
    assert s.total("kvferry_inter_turn_gap_seconds_count") == 1
    assert 700.0 <= s.total("kvferry_inter_turn_gap_seconds_sum") < 705.0
    assert s.total("kvferry_inter_turn_gap_seconds_bucket", le="600.0") == 0
