"""bench/eviction.py's simulator on a trace small enough to answer by hand, and its
trace reader's refusals."""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path

import pytest

from bench import eviction as ev

# Capacity for six 32-token blocks. B's first handle (3 blocks) is read 400 s later; A's
# turns are 5 s apart and grow (2, then 4, then 5 blocks). At t=105 B's 3 blocks and A's
# new 4 do not both fit: a fixed TTL cannot release B, so A's next turn finds nothing;
# a policy that can release goes for B (no gaps of its own, 105 s old) and keeps A's.
HAND = [
    ev.Turn("B", 0.0, prompt_tokens=96, new_tokens=96, output_tokens=0),  # 3 blocks
    ev.Turn("A", 100.0, prompt_tokens=32, new_tokens=32, output_tokens=32),  # 2 blocks
    ev.Turn("A", 105.0, prompt_tokens=96, new_tokens=32, output_tokens=32),  # reuses 64; 4 blocks
    ev.Turn("A", 110.0, prompt_tokens=160, new_tokens=32, output_tokens=0),  # reuses 128; 5
    ev.Turn("B", 400.0, prompt_tokens=128, new_tokens=32, output_tokens=0),  # reuses 96
]
CAPACITY = 6


def test_fixed_ttls_keep_what_they_hold_and_refuse_the_new() -> None:
    # A@105 reads 64; A's new handle and then A@110's find no room; B@400 reads 96.
    for usable in (ev.VLLM_TTL_S - ev.VLLM_READ_MARGIN_S, ev.PROXY_TTL_S):
        s = ev.run_fixed(HAND, CAPACITY, usable)
        assert (s.tokens_saved, s.hits) == (64 + 96, 2)
        assert dict(s.evictions) == {ev.REASON_NO_ROOM: 2}
        assert s.restarts == 0


def test_a_gap_past_the_ttl_is_a_miss() -> None:
    s = ev.run_fixed(HAND, CAPACITY, 399.0)  # B's 400 s gap is past it
    assert s.tokens_saved == 64
    assert s.evictions[ev.REASON_TTL] == 1


def test_the_quantile_tuner_restarts_and_throws_the_kv_away() -> None:
    # At the 120 s tick: two no-room turns (preemptions on a real D), 2 gaps (< 20):
    # tune halves 480 to 240 and Auto rolls decode: B's handle (3 blocks) is lost.
    s = ev.run_tuner(HAND, CAPACITY)
    assert s.tokens_saved == 64
    assert (s.restarts, s.restart_handles) == (1, 1)
    assert s.restart_bytes == 3 * 32 * ev.BYTES_PER_TOKEN
    assert s.evictions[ev.REASON_RESTART] == 1


def test_the_value_policy_releases_the_handle_least_likely_to_pay() -> None:
    # A@105 reads 64, B goes under pressure, A@110 reads 128; B@400 finds nothing.
    s = ev.run_value(HAND, CAPACITY)
    assert (s.tokens_saved, s.hits) == (64 + 128, 2)
    assert s.evictions[ev.REASON_NO_ROOM] == 0
    assert s.evictions["pressure"] >= 1
    assert s.restarts == 0


def test_the_oracle_bound_is_the_lp_and_the_integer_optimum_beside_it() -> None:
    # Candidates: B [0, 400) 3 blocks saving 96; A1 [100, 105) 2 blocks 64; A2 [105, 110)
    # 4 blocks 128. Only t=105 is over the capacity: 3 x_B + 4 x_A2 <= 6. B and A2 both
    # save 32 tokens per block, so the LP fills the 6 blocks: 64 + 6 x 32 = 256; whole
    # handles: A1 + A2 = 192.
    bound = ev.oracle(HAND, CAPACITY, 1785.0)
    assert bound.tokens == pytest.approx(256.0)
    assert bound.exact_tokens == pytest.approx(192.0)
    assert (bound.candidates, bound.constraints) == (3, 1)


def test_every_policy_stays_under_the_bound_on_the_generators() -> None:
    turns = ev.mixed_trace(12, 600.0, seed=5)
    stats, bound = ev.simulate(turns, 600)
    for name, s in stats.items():
        assert s.tokens_saved <= bound.tokens + 1e-6, name
    assert bound.exact_tokens is None or bound.exact_tokens <= bound.tokens + 1e-6


def test_generators_are_seeded_and_shaped() -> None:
    a = ev.agent_trace(5, 100.0, seed=1)
    assert a == ev.agent_trace(5, 100.0, seed=1)
    per = {s: [t for t in a if t.session == s] for s in {t.session for t in a}}
    assert all(20 <= len(ts) <= 100 for ts in per.values())
    for ts in per.values():  # the context grows by the last answer and the new tail
        assert all(n.prefix == p.kept_tokens for p, n in pairwise(ts))
    c = ev.chat_trace(30, 100.0, seed=1)
    gaps = []
    for s in {t.session for t in c}:
        ts = [t for t in c if t.session == s]
        gaps += [n.t - p.t for p, n in pairwise(ts)]
    gaps.sort()
    assert gaps and gaps[len(gaps) // 2] > 30  # a person's minutes, not seconds


def test_a_trace_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    ev.write_trace(HAND, path)
    assert ev.read_trace(path) == HAND


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("[1, 2]", "a JSON object"),
        (
            '{"session": "a", "t": 1, "prompt_tokens": 3, "new_tokens": 1}',
            "'output_tokens' is missing",
        ),
        (
            '{"session": "", "t": 1, "prompt_tokens": 3, "new_tokens": 1, "output_tokens": 0}',
            "'session'",
        ),
        (
            '{"session": "a", "t": -1, "prompt_tokens": 3, "new_tokens": 1, "output_tokens": 0}',
            "'t'",
        ),
        (
            '{"session": "a", "t": 1, "prompt_tokens": 3.5, "new_tokens": 1, "output_tokens": 0}',
            "'prompt_tokens'",
        ),
        (
            '{"session": "a", "t": 1, "prompt_tokens": 3, "new_tokens": 4, "output_tokens": 0}',
            "'new_tokens' must not exceed",
        ),
        (
            '{"session": "a", "t": 1, "prompt_tokens": 3, "new_tokens": 1, "output_tokens": true}',
            "'output_tokens'",
        ),
        ("{not json", "not JSON"),
    ],
)
def test_a_bad_line_is_refused_with_its_number_and_field(tmp_path: Path, line, match) -> None:
    path = tmp_path / "t.jsonl"
    good = {"session": "z", "t": 0, "prompt_tokens": 1, "new_tokens": 1, "output_tokens": 0}
    path.write_text(json.dumps(good) + "\n" + line + "\n")
    with pytest.raises(ev.TraceError, match=match) as e:
        ev.read_trace(path)
    assert f"{path}:2:" in str(e.value)


def test_a_session_going_back_in_time_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    rows = [
        {"session": "a", "t": 5, "prompt_tokens": 1, "new_tokens": 1, "output_tokens": 0},
        {"session": "a", "t": 5, "prompt_tokens": 2, "new_tokens": 1, "output_tokens": 0},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ev.TraceError, match=r":2: field 't' \(5\) must be after"):
        ev.read_trace(path)


def test_main_reads_a_trace_and_writes_its_json(tmp_path: Path, capsys) -> None:
    path = tmp_path / "hand.jsonl"
    ev.write_trace(HAND, path)
    assert (
        ev.main(["--trace", str(path), "--capacity-blocks", str(CAPACITY), "--out", str(tmp_path)])
        == 0
    )
    data = json.loads((tmp_path / "eviction.json").read_text())
    at = data["results"]["hand.jsonl"]["capacities"][str(CAPACITY)]
    # The oracle keeps handles in all of D's blocks, each from its answer's end.
    bound = ev.oracle(HAND, CAPACITY, 1785.0)
    assert at["oracle"]["shareBlocks"] == 5  # what the sidecar's policy fills (90 %)
    assert at["oracle"]["tokens"] == pytest.approx(bound.tokens)
    assert set(at["policies"]) == set(ev.POLICIES)
    assert "recompute 2,017 us/token" in capsys.readouterr().out


def test_main_names_a_bad_trace(tmp_path: Path, capsys) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"session": "a"}\n')
    assert ev.main(["--trace", str(path), "--out", str(tmp_path)]) == 2
    assert "bad.jsonl:1: field 't' is missing" in capsys.readouterr().err


def test_the_model_check_prices_the_model_at_one_length_and_checks_the_others() -> None:
    """bench/eviction_model.py's verdict: the model's N x (recompute - pull), at the
    per-token costs measured at the calibration length, against the measured computed
    leg less the pulling leg at every other length, within 20 %."""
    from bench import eviction_model as em

    def row(n: int, recompute: float, pull: float) -> em.Row:
        tail = 0.05
        return em.Row(n, tail + n * recompute, tail + n * pull, tail, samples=3)

    linear = [row(n, 1e-3, 5e-5) for n in (512, 1024, 2048)]
    cal = em.calibration(linear, 1024)
    assert cal.recompute_per_token == pytest.approx(1e-3)
    assert cal.pull_per_token == pytest.approx(5e-5)
    verdicts = em.targets(linear, 1024)
    assert [("N=512" in t.name, "N=2048" in t.name) for t in verdicts] == [
        (True, False),
        (False, True),
    ]
    assert all(t.met for t in verdicts)
    # Per-token costs that grow with the history: the held-out lengths miss.
    growing = [row(512, 0.7e-3, 5e-5), row(1024, 1e-3, 5e-5), row(2048, 1.4e-3, 5e-5)]
    assert [t.met for t in em.targets(growing, 1024)] == [False, False]
    # Nothing saved at a length: off by 100 %, never met.
    worse = [row(512, 1e-3, 2e-3), *linear[1:]]
    assert not em.targets(worse, 1024)[0].met
    with pytest.raises(ValueError, match="--calibrate-at 999"):
        em.calibration(linear, 999)
    # Beside the targets: the form fitted over every N, and the built-in constants.
    lines = em.notes(linear)
    assert len(lines) == 6 and all("off by" in line for line in lines)
    assert em.fitted_saving_per_token(linear) == pytest.approx(1e-3 - 5e-5)


def test_the_simulator_prices_its_savings_at_a_calibration(tmp_path: Path, capsys) -> None:
    cal = tmp_path / "eviction-model.json"
    cal.write_text(
        json.dumps(
            {
                "results": {
                    "calibration": {"recomputeSecondsPerToken": 1e-3, "pullSecondsPerToken": 5e-5}
                }
            }
        )
    )
    assert ev.costs_from(cal) == (1e-3, 5e-5)
    cal.write_text("{}")
    with pytest.raises(ev.TraceError, match=r"no results\.calibration"):
        ev.costs_from(cal)
    assert ev.main(["--costs", str(cal), "--out", str(tmp_path)]) == 2
    assert "no results.calibration" in capsys.readouterr().err
