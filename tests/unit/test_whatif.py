"""``kvferry-operator what-if`` (operator/whatif.py, cli.py): the four answers on traces
small enough to check by hand, the same cost model as the tuner, and errors that name
the flag or the trace line."""

from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvferry_operator import cli, tune, whatif
from kvferry_operator.traces import Turn
from kvferry_wire import costfit

COSTS = whatif.Costs(
    recompute_seconds_per_token=1e-3,
    bytes_per_token=1000.0,
    transfer_bytes_per_second=1e7,  # 0.1 ms per token: saves 0.9 ms a token
    pull_fixed_seconds=0.009,  # -> break-even 10 tokens
)

# Session A: 100 tokens, then 30 s later 150 (100 repeated + 50 new, answer 20 kept
# -> D holds 120, so 100 reusable), then 200 s later 250 (150 + 20 answer + 80 new).
# Session B: one turn only.
TRACE = [
    Turn("A", 0.0, prompt_tokens=100, new_tokens=100, output_tokens=20),
    Turn("A", 30.0, prompt_tokens=150, new_tokens=50, output_tokens=20),
    Turn("B", 40.0, prompt_tokens=500, new_tokens=500, output_tokens=0),
    Turn("A", 230.0, prompt_tokens=250, new_tokens=80, output_tokens=10),
]


def test_break_even_is_the_tuners() -> None:
    """The tuner, fed the prefill legs a server with these costs would time, puts the
    threshold where the what-if's model does."""
    fit = costfit.empty(costfit.PREFILL_LEG)
    for n in (8, 16, 32, 64, 128, 256, 512, 1024, 2048) * 3:
        for pulled in (0, n):
            x = {costfit.PULL: 1.0 if pulled else 0.0, costfit.PULLED_TOKENS: pulled}
            x[costfit.COMPUTED_TOKENS] = n + 16 - pulled
            tail = COSTS.recompute(n + 16 - pulled)
            seconds = 0.05 + tail + (COSTS.pull(pulled) if pulled else 0.0)
            costfit.observe(fit, costfit.PREFILL_LEG, x, seconds, n)
    inputs = tune.TuningInputs(
        gaps=None,
        current_retention=45,
        coverage=0.95,
        min_retention=30,
        max_retention=1800,
        prefill_leg=fit,
    )
    assert COSTS.break_even_tokens() == tune.recommend_threshold(inputs).value == 10


def test_a_link_slower_than_recomputing_never_wins() -> None:
    slow = whatif.Costs(1e-3, 1000.0, 1e6, 0.0)  # 1 ms a token either way
    assert slow.break_even_tokens() is None
    assert whatif.Costs(1e-3, 1000.0, 1e7, 1.0).bandwidth_to_win(500) is None  # fixed > 0.5 s


def test_later_turns_hold_what_d_kept_and_no_more() -> None:
    later, held = whatif.later_turns(TRACE)
    assert [(x.turn.t, x.number, x.gap, x.reusable) for x in later] == [
        (30.0, 2, 30.0, 100),  # its prefix (100) < what D kept (120)
        (230.0, 3, 200.0, 170),  # prefix 170 = D's 150 + 20
    ]
    assert sorted((t.t, gap) for t, gap in held) == [
        (0.0, 30.0),
        (30.0, 200.0),
        (40.0, None),
        (230.0, None),
    ]


def test_a_prefix_longer_than_what_d_kept_counts_only_what_d_kept() -> None:
    turns = [Turn("S", 0, 100, 100, 0), Turn("S", 5, 300, 10, 0)]  # claims 290 repeated
    (later,), _ = whatif.later_turns(turns)
    assert later.reusable == 100


def test_pinned_bytes_by_hand() -> None:
    # Retention 60 s: A's turn 1 (120 tokens) 0..30, A's turn 2 (170) 30..90, B (500)
    # 40..100, A's turn 3 (260) 230..290. Peak 170 + 500 = 670 tokens at 40..90.
    peak, mean = whatif.pinned_bytes(whatif.later_turns(TRACE)[1], 60, 1000.0)
    assert peak == 670_000
    area = 120 * 30 + 170 * 60 + 500 * 60 + 260 * 60  # token-seconds
    assert mean == pytest.approx(area * 1000 / 290)


def test_ttft_pulls_only_what_is_held_and_worth_it() -> None:
    report = whatif.analyse(TRACE, COSTS, retention=60)
    # Turn at 30 s: held (30 <= 60), 100 >= 10 -> pulls; turn at 230 s: gap 200 > 60.
    assert report.ttft["laterTurnsPulled"] == 1
    on = 50 * 1e-3 + 0.009 + 100 * 1e-4
    off = [0.150, 0.250]
    assert report.ttft["withoutReuseSeconds"]["p50"] == pytest.approx(sum(off) / 2)
    assert report.ttft["withReuseSeconds"]["p50"] == pytest.approx((on + 0.250) / 2)
    rows = {r["retentionSeconds"]: r for r in report.retention["byRetention"]}
    assert rows[60]["laterTurnsHeld"] == 0.5 and rows[480]["laterTurnsHeld"] == 1.0
    assert report.bandwidth["breakEvenTokens"] == 10
    assert report.reuse[0] == {
        "turn": "2",
        "turns": 1,
        "promptTokensP50": 150,
        "reusableTokensP50": 100,
        "reusableShare": pytest.approx(100 / 150),
    }


turns_st = st.lists(
    st.tuples(
        st.sampled_from("abc"),
        st.floats(0, 1000, allow_nan=False),
        st.integers(0, 5000),
        st.integers(0, 5000),
        st.integers(0, 500),
    ),
    min_size=1,
    max_size=40,
)


@given(turns_st, st.floats(1, 2000))
def test_reuse_never_slows_a_turn_and_never_holds_more_than_the_prompt(raw, retention) -> None:
    seen: set[tuple[str, float]] = set()
    turns = []
    for s, t, prompt, new, out in raw:
        if (s, t) in seen:
            continue
        seen.add((s, t))
        turns.append(Turn(s, t, prompt, min(new, prompt), out))
    later, _ = whatif.later_turns(turns)
    assert all(0 <= x.reusable <= x.turn.prompt_tokens for x in later)
    report = whatif.analyse(turns, COSTS, retention)
    speed = report.ttft["speedup"]["p50"]
    assert speed is None or speed >= 1.0 - 1e-9
    for row in report.retention["byRetention"]:
        assert row["pinnedBytesMean"] <= row["pinnedBytesPeak"] + 1e-6
        assert math.isfinite(row["pinnedBytesPeak"])


# ------------------------------------------------------------------ the command line


def write(path: Path, turns: list[Turn]) -> Path:
    from kvferry_operator.traces import write_trace

    write_trace(turns, path)
    return path


FLAGS = [
    "--recompute-us-per-token",
    "1000",
    "--bytes-per-token",
    "1000",
    "--bandwidth-gbps",
    "0.01",
]


def test_cli_prints_the_four_answers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = write(tmp_path / "t.jsonl", TRACE)
    assert cli.main(["what-if", "--trace", str(trace), *FLAGS, "--pull-fixed-ms", "9"]) == 0
    out = capsys.readouterr().out
    for heading in ("1. reuse", "2. bandwidth", "3. retention", "4. TTFT"):
        assert heading in out, out
    assert "pulls win from 10 tokens of history" in out, out


def test_cli_json_reads_the_fitted_costs_from_a_kv_cache_status(tmp_path: Path, capsys) -> None:
    """status.costs (the tuner's fit of the pods' prefill legs) gives the recompute
    cost, a pulled token's seconds (as a bandwidth) and a pull's fixed cost: the same
    break-even the tuner recommends, no flag needed."""
    trace = write(tmp_path / "t.jsonl", TRACE)
    status = tmp_path / "status.json"
    status.write_text(
        json.dumps(
            {
                "kind": "KVCacheStatus",
                "status": {
                    "transfer": {"bytesPerToken": 1000, "gigabytesPerSecond": 5.0},
                    "costs": {
                        "pullFixedSeconds": 0.009,
                        "pullSecondsPerToken": 1e-4,
                        "recomputeSecondsPerToken": 1e-3,
                    },
                    "retention": {"appliedSeconds": 60},
                },
            }
        )
    )
    argv = ["what-if", "--trace", str(trace), "--status", str(status)]
    assert cli.main([*argv, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["retentionSeconds"] == 60
    assert got["costs"]["pullFixedLatencySeconds"] == 0.009
    assert got["bandwidth"]["breakEvenTokens"] == 10


def test_cli_reads_an_older_status_by_nixl_s_bandwidth(tmp_path: Path, capsys) -> None:
    """A status without costs (an operator from before): NIXL's GB/s, no fixed cost,
    and the recompute cost must be given."""
    trace = write(tmp_path / "t.jsonl", TRACE)
    status = tmp_path / "status.json"
    status.write_text(
        json.dumps({"status": {"transfer": {"bytesPerToken": 1000, "gigabytesPerSecond": 0.01}}})
    )
    argv = ["what-if", "--trace", str(trace), "--status", str(status)]
    assert cli.main([*argv, "--json"]) == 2
    assert "--recompute-us-per-token" in capsys.readouterr().err
    assert cli.main([*argv, "--recompute-us-per-token", "1000", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["costs"]["pullFixedLatencySeconds"] == 0
    assert got["costs"]["transferBytesPerSecond"] == 1e7


@pytest.mark.parametrize(
    ("drop", "named"),
    [
        ("--recompute-us-per-token", "--recompute-us-per-token"),
        ("--bytes-per-token", "--bytes-per-token"),
        ("--bandwidth-gbps", "--bandwidth-gbps"),
    ],
)
def test_cli_names_the_missing_cost(tmp_path: Path, capsys, drop: str, named: str) -> None:
    trace = write(tmp_path / "t.jsonl", TRACE)
    i = FLAGS.index(drop)
    flags = FLAGS[:i] + FLAGS[i + 2 :]
    assert cli.main(["what-if", "--trace", str(trace), *flags]) == 2
    assert named in capsys.readouterr().err


def test_cli_names_the_bad_trace_line_and_field(tmp_path: Path, capsys) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"session": "a", "t": 0, "prompt_tokens": 10, "new_tokens": 10, "output_tokens": 1}\n'
        '{"session": "a", "t": 5, "prompt_tokens": 10, "new_tokens": 20, "output_tokens": 1}\n'
    )
    assert cli.main(["what-if", "--trace", str(trace), *FLAGS]) == 2
    err = capsys.readouterr().err
    assert f"{trace}:2: field 'new_tokens' must not exceed 'prompt_tokens'" in err, err


def test_cli_refuses_a_deeply_nested_line_without_a_traceback(tmp_path: Path, capsys) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    assert cli.main(["what-if", "--trace", str(trace), *FLAGS]) == 2
    assert f"{trace}:1: not a turn (JSON nested too deep)" in capsys.readouterr().err


# ------------------------------------------------------------------ hostile input


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    code = cli.main(argv)
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (["--retention", "nan"], "--retention"),
        (["--retention", "inf"], "--retention"),
        (["--retention", "-1"], "--retention"),
        (["--retention", "1e300"], "--retention"),
        (["--bandwidth-gbps", "nan"], "--bandwidth-gbps"),
        (["--bandwidth-gbps", "1e-300"], "--bandwidth-gbps"),
        (["--bytes-per-token", "inf"], "--bytes-per-token"),
        (["--recompute-us-per-token", "nan"], "--recompute-us-per-token"),
        (["--pull-fixed-ms=-inf"], "--pull-fixed-ms"),
        (["--also", "inf"], "--also"),
        (["--also", "60", "--also", "nan"], "--also"),
        (["--block-tokens", "0"], "--block-tokens"),
    ],
)
def test_cli_refuses_a_non_finite_or_absurd_flag_by_name(
    tmp_path: Path, capsys, extra: list[str], named: str
) -> None:
    trace = write(tmp_path / "t.jsonl", TRACE)
    code, err = run_cli(["what-if", "--trace", str(trace), *FLAGS, *extra], capsys)
    assert code == 2 and named in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("[" * 100_000 + "]" * 100_000, "nested too deep"),
        ('{"status": ' * 5000 + "{}" + "}" * 5000, "nested too deep"),
        ("[]", "not a KVCacheStatus"),
        ("5", "not a KVCacheStatus"),
        ('"status"', "not a KVCacheStatus"),
        ('{"status": {"transfer": {"bytesPerToken": NaN}}}', "NaN"),
        ('{"status": {"transfer": {"bytesPerToken": Infinity}}}', "Infinity"),
        ('{"status": {"transfer": {"bytesPerToken": 1' + "0" * 400 + "}}}", "bytesPerToken"),
        ('{"status": {"costs": {"pullFixedSeconds": -1' + "0" * 400 + "}}}", "--status"),
        ('{"status": {"transfer": {"gigabytesPerSecond": 1e-300}}}', "--bandwidth-gbps"),
    ],
)
def test_cli_refuses_a_hostile_status_file_naming_it(
    tmp_path: Path, capsys, text: str, says: str
) -> None:
    trace = write(tmp_path / "t.jsonl", TRACE)
    status = tmp_path / "status.json"
    status.write_text(text)
    argv = ["what-if", "--trace", str(trace), "--status", str(status)]
    code, err = run_cli(
        [*argv, "--recompute-us-per-token", "1000", "--bytes-per-token", "1"], capsys
    )
    assert code == 2 and says in err and ("--status" in err or "--bandwidth-gbps" in err), err


def test_cli_refuses_a_non_utf8_trace_by_its_line(tmp_path: Path, capsys) -> None:
    trace = tmp_path / "t.jsonl"
    good = '{"session": "a", "t": 0, "prompt_tokens": 1, "new_tokens": 1, "output_tokens": 0}\n'
    trace.write_bytes(good.encode() + b'{"session": "\xff"}\n')
    code, err = run_cli(["what-if", "--trace", str(trace), *FLAGS], capsys)
    assert code == 2 and f"{trace}:2: not UTF-8" in err, err


def test_cli_reads_200_epoch_stamped_turns_fast(tmp_path: Path, capsys) -> None:
    turns = [
        Turn(f"s{s}", 1.7e9 + s * 11 + k * 45.25, 100 * (k + 1), 100, 0)
        for s in range(40)
        for k in range(5)
    ]
    trace = write(tmp_path / "t.jsonl", turns)
    started = time.monotonic()
    assert cli.main(["what-if", "--trace", str(trace), *FLAGS, "--json"]) == 0
    assert time.monotonic() - started < 10
    got = json.loads(capsys.readouterr().out)
    assert (got["turns"], got["sessions"]) == (200, 40)
    assert got["retention"]["gapSeconds"]["p50"] == pytest.approx(45.25)


def test_cli_refuses_turns_too_far_apart_and_the_model_stays_finite(tmp_path: Path, capsys) -> None:
    far = [Turn("a", 0.0, 100, 100, 10), Turn("a", 1.7e308, 200, 90, 10)]
    trace = write(tmp_path / "t.jsonl", far)
    code, err = run_cli(["what-if", "--trace", str(trace), *FLAGS], capsys)
    assert code == 2 and f"{trace}:2: field 't'" in err, err
    # Handed such turns directly, the figures stay numbers: no inf, no nan.
    report = whatif.analyse(
        [*far, Turn("b", 0.0, 5, 5, 0), Turn("b", 1e308, 50, 10, 0)], COSTS, 480
    )
    text = whatif.render_text(report)
    assert "inf" not in text.lower() and "nan" not in text.lower(), text
    json.dumps(report.as_dict(), allow_nan=False)


def test_cli_reads_the_aiperf_trace_and_takes_a_format(tmp_path: Path, capsys) -> None:
    aiperf = Path(__file__).resolve().parents[2] / "bench" / "traces" / "aiperf-agentic-code.jsonl"
    assert cli.main(["what-if", "--trace", str(aiperf), *FLAGS, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert (got["sessions"], got["turns"], got["laterTurns"]) == (50, 931, 881)
    assert got["reuse"][0]["reusableShare"] > 0.5
    code, err = run_cli(["what-if", "--trace", str(aiperf), *FLAGS, "--format", "bailian"], capsys)
    assert code == 2 and ":1: field 'chat_id' is missing" in err, err


def test_what_if_at_a_capacity_equals_the_bench_on_the_same_trace(tmp_path: Path) -> None:
    """what-if --capacity-blocks replays the trace as make bench-eviction's value policy
    does (the sidecar's policy and wiring, kvferry_wire.replay): the same hits and
    tokens saved on the same trace, capacity and costs."""
    from bench import eviction as ev

    turns = ev.mixed_trace(10, 600.0, seed=3)
    path = tmp_path / "mixed.jsonl"
    ev.write_trace(turns, path)
    turns = ev.read_trace(path)
    out = tmp_path / "out.json"
    for capacity in (ev.sweep(turns)[0], 4000):
        argv = [
            "what-if", "--trace", str(path), "--json", "--retention", "480",
            "--recompute-us-per-token", "2017", "--bytes-per-token", str(ev.BYTES_PER_TOKEN),
            "--bandwidth-gbps", "0.3", "--capacity-blocks", str(capacity),
            "--kv-block-tokens", str(ev.BLOCK_TOKENS),
        ]  # fmt: skip
        with out.open("w") as f, contextlib.redirect_stdout(f):
            assert cli.main(argv) == 0
        cap = json.loads(out.read_text())["capacity"]
        bench = ev.run_value(turns, capacity)
        assert cap["tokensSaved"] == bench.tokens_saved
        later = len(turns) - len({t.session for t in turns})
        assert cap["laterTurnsHeld"] == pytest.approx(bench.hits / later)
        assert sum(cap["releases"].values()) == sum(bench.evictions.values())


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (["--capacity-gb", "nan"], "--capacity-gb"),
        (["--capacity-gb", "0"], "--capacity-gb"),
        (["--capacity-blocks", "0"], "--capacity-blocks"),
        (["--capacity-blocks", "10", "--capacity-gb", "1"], "give one"),
        (["--capacity-blocks", "10", "--kv-block-tokens", "0"], "--kv-block-tokens"),
    ],
)
def test_a_bad_capacity_is_refused_by_its_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], match: str
) -> None:
    from bench import eviction as ev

    path = tmp_path / "t.jsonl"
    ev.write_trace(ev.chat_trace(2, 60.0, seed=1), path)
    argv = [
        "what-if", "--trace", str(path), "--recompute-us-per-token", "2017",
        "--bytes-per-token", "16531", "--bandwidth-gbps", "0.3", *flags,
    ]  # fmt: skip
    assert cli.main(argv) == 2
    assert match in capsys.readouterr().err
