"""bench.eviction_replay's pure parts: the trace, the measured turns as the simulator's,
and the side-by-side comparison (the engine tier runs the real thing)."""

from __future__ import annotations

from bench import eviction_replay as er
from kvferry_wire import replay as rpl
from kvferry_wire import retention as rp


def _m(session: str, t: float, prompt: int, reused: int = 0, pulled: float = 0.0) -> er.Measured:
    return er.Measured(session, t, prompt, reused, 16, pulled, None, None, 1.0)


def test_plan_trace_is_seeded_sorted_and_sized() -> None:
    plan = er.plan_trace(36)
    assert plan == er.plan_trace(36)
    assert len(plan) == er.SESSIONS * er.TURNS and len({p.session for p in plan}) == er.SESSIONS
    assert [p.at for p in plan] == sorted(p.at for p in plan)
    assert er.plan_trace(36) != er.plan_trace(37)


def test_replay_turns_take_the_measured_reuse_and_the_rule_for_misses() -> None:
    measured = [
        _m("a", 0.0, 330),
        _m("a", 5.0, 660, reused=320, pulled=320),  # a hit: its measured reuse
        _m("a", 9.0, 990),  # a miss: the rule, (660 + 16 - 1) // 32 * 32
    ]
    turns, exact, hits = er.replay_turns(measured, 32)
    assert [t.prefix for t in turns] == [0, 320, 672]
    assert [t.kept_tokens for t in turns] == [346, 676, 1006]
    assert (exact, hits) == (1, 1)  # (330 + 16 - 1) // 32 * 32 == 320


def test_compare_maps_the_policys_reasons_to_the_reports() -> None:
    figures = rpl.Figures(tokens_saved=90)
    figures.releases.update({rp.REASON_CEILING: 2, rp.REASON_CAP: 1})
    before = {"evictions": {"retention": 1, "storeCap": 0}, "handles": {"consumed": 0}}
    after = {"evictions": {"retention": 3, "storeCap": 1}, "handles": {"consumed": 1}}
    c = er.compare([_m("a", 0, 100, 100, 100.0)], before, after, figures)
    assert c.releases == {"retention": 2, "storeCap": 1}
    assert c.simulated_releases == {"retention": 2, "storeCap": 1}
    assert c.kinds[0] == c.kinds[1]
    assert abs(c.ratio - 0.9) < 1e-9 and abs(c.off_by - 0.1) < 1e-9
    assert [t.met for t in er.targets(c)] == [True, True]
    assert "tokens P pulled" in er.side_by_side(c)
