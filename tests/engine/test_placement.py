"""Engine tier: measured prefill placement on the real pair (the operator's default,
``routing.prefillPlacement: Measured``).

Two conversations, interleaved, alternate long new tails (above
``skipPrefillBelowTokens``: the rule sends them through P) and short ones (D alone).
The sidecar times every leg into its cost fits; once both can say what each way
costs, the next turns go where the costs and D's load say, not where the rule would.
Every greedy answer, whichever way its prefill went, equals the answer of one engine
computing the whole prompt.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvferry_dev.client import filler_text
from kvferry_dev.configs import tiny_server
from kvferry_dev.engines import Engine, EnginePair
from kvferry_dev.sidecars import SidecarProcess, start_sidecar
from kvferry_sidecar import placement
from kvferry_wire import costfit
from tests.engine.helpers import assistant, reference, send

pytestmark = pytest.mark.engine

LONG_WORDS = 280  # ~300 tokens: above skipPrefillBelowTokens (256)
SHORT_WORDS = 30
TURNS = 10  # per conversation


@pytest.fixture(scope="module")
def measured(engine_pair: EnginePair, engine_log_dir: Path) -> Iterator[SidecarProcess]:
    """A decode sidecar of the default server: prefillPlacement Measured."""
    server = tiny_server()
    assert server.spec.routing.prefill_placement == "Measured"
    sc = start_sidecar(engine_pair, server, engine_log_dir, name="sidecar-placement")
    yield sc
    sc.stop()


def fits_solve(report: dict) -> tuple[bool, bool]:
    """Whether the report's prefill and decode fits say what each way costs, as the
    sidecar's placement reads them."""
    legs = report["costs"]
    prefill = costfit.LinearFit(**_snake(legs["prefillLeg"]))
    decode = costfit.LinearFit(**_snake(legs["decodeLeg"]))
    return (
        isinstance(
            costfit.solve(prefill, costfit.PREFILL_LEG, placement.PREFILL_NEEDS), costfit.Solved
        ),
        isinstance(
            costfit.solve(decode, costfit.DECODE_LEG, placement.DECODE_NEEDS), costfit.Solved
        ),
    )


def _snake(fit: dict) -> dict:
    return {
        "features": fit["features"],
        "observations": fit["observations"],
        "weight": fit["weight"],
        "xx": fit["xx"],
        "xy": fit["xy"],
        "yy": fit["yy"],
        "nonzero": fit["nonzero"],
    }


def by_costs(sc: SidecarProcess) -> tuple[float, float]:
    """Turns placed by the costs so far: (on P, on D alone)."""
    scrape = sc.metrics()
    return (
        scrape.total("kvferry_placements_total", placement="prefill", decided_by="costs"),
        scrape.total("kvferry_placements_total", placement="decode", decided_by="costs"),
    )


def test_turns_go_where_the_measured_costs_say_and_answer_as_a_recompute(
    measured: SidecarProcess, prefill: Engine
) -> None:
    conversations: dict[str, list[dict]] = {"place-a": [], "place-b": []}
    placed = (0.0, 0.0)
    for k in range(TURNS):
        for session, messages in conversations.items():
            words = LONG_WORDS if k % 2 == 0 else SHORT_WORDS
            messages.append({"role": "user", "content": filler_text(f"{session}-{k}", words)})
            turn = send(measured, prefill, messages, session)
            now = by_costs(measured)
            if now[0] > placed[0]:  # the costs chose P for this turn
                assert turn.reply.route == "remote", turn.why()
            if now[1] > placed[1]:  # the costs chose D alone
                assert turn.reply.route == "skip", turn.why()
            placed = now
            assert turn.reply.token_ids == reference(prefill, messages), turn.why()
            messages.append(assistant(turn.reply))
    report = measured.residency()
    assert fits_solve(report) == (True, True), report["costs"]
    placements = report["placements"]
    # The rule placed the first turns (cold), the costs the last ones.
    assert placements["prefillByColdRule"] + placements["decodeByColdRule"] >= 10, placements
    assert placements["prefillByCosts"] + placements["decodeByCosts"] >= 2, placements
    assert sum(placed) == placements["prefillByCosts"] + placements["decodeByCosts"]
    # Each choice by the costs logged its figures.
    figures = re.findall(
        r" placed_by=costs p_path_s=([0-9.]+) alone_s=([0-9.]+) interference_s=([0-9.]+) ",
        measured.log_path.read_text(),
    )
    assert len(figures) == sum(placed), figures
