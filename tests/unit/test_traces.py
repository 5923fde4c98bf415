"""kvferry_operator.traces: the formats users already hold (Mooncake / aiperf, Qwen-
Bailian) converted to turns, and hostile or huge input refused fast, by its line."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path

import pytest

from kvferry_operator import traces
from kvferry_operator.traces import TraceError, Turn

REPO = Path(__file__).resolve().parents[2]
AIPERF = REPO / "bench" / "traces" / "aiperf-agentic-code.jsonl"


def lines(path: Path, *rows: object) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def by_session(turns: list[Turn]) -> dict[str, list[Turn]]:
    out: dict[str, list[Turn]] = {}
    for x in turns:
        out.setdefault(x.session, []).append(x)
    return out


# ---------------------------------------------------------------- the aiperf trace


def test_the_committed_aiperf_trace_reads_as_sessions_that_reuse() -> None:
    """bench/traces/aiperf-agentic-code.jsonl (aiperf 0.13 synthesize agentic-code,
    seed 42): its delta rows rebuilt into whole prompts, as aiperf replays them."""
    turns = traces.read_trace(AIPERF)
    sessions = by_session(turns)
    assert (len(turns), len(sessions)) == (931, 50)
    assert turns[0].t == 0.0
    assert any(x.new_tokens < x.prompt_tokens for x in turns)
    for ts in sessions.values():
        assert ts[0].new_tokens == ts[0].prompt_tokens
        for prev, nxt in pairwise(ts):  # history + its answer repeated
            assert nxt.prefix == prev.kept_tokens
            assert nxt.t >= prev.t
    # Its first two rows by hand: 53238 tokens (answer 80), then 673 new 19358.3 ms on.
    first = json.loads(AIPERF.read_text().splitlines()[0])
    one = sessions[first["session_id"]]
    assert (one[0].prompt_tokens, one[0].output_tokens) == (53238, 80)
    assert (one[1].prompt_tokens, one[1].new_tokens) == (53238 + 80 + 673, 673)
    assert one[1].t == pytest.approx(19.3583)


# ---------------------------------------------------------------- mooncake


def test_mooncake_rows_without_a_session_are_sessions_of_their_own(tmp_path: Path) -> None:
    path = lines(
        tmp_path / "m.jsonl",
        {"timestamp": 5000, "input_length": 300, "output_length": 40, "hash_ids": [1, 2]},
        {"timestamp": 6500, "input_length": 300, "output_length": 4, "hash_ids": [1, 2]},
    )
    a, b = traces.read_trace(path)
    assert (a.t, b.t) == (0.0, 1.5)  # ms; the first turn at 0
    assert a.session != b.session
    assert (a.prompt_tokens, a.new_tokens, b.new_tokens, b.output_tokens) == (300, 300, 300, 4)


def test_mooncake_whole_prompts_share_their_common_blocks(tmp_path: Path) -> None:
    rows = [
        {"session_id": "s", "timestamp": 0, "input_length": 1100, "output_length": 9,
         "hash_ids": [7, 8, 9]},
        # Two blocks in common: 1024 of its 1500 tokens repeated.
        {"session_id": "s", "delay": 250, "input_length": 1500, "output_length": 9,
         "hash_ids": [7, 8, 5]},
    ]  # fmt: skip
    _, b = traces.read_trace(lines(tmp_path / "m.jsonl", *rows))
    assert (b.t, b.prompt_tokens, b.new_tokens) == (0.25, 1500, 1500 - 1024)
    _, b = traces.read_trace(tmp_path / "m.jsonl", "mooncake", block_tokens=100)
    assert b.new_tokens == 1300
    # More common blocks than tokens: nothing new, never below 0.
    rows[1]["input_length"] = 700
    _, b = traces.read_trace(lines(tmp_path / "m.jsonl", *rows))
    assert (b.prompt_tokens, b.new_tokens) == (700, 0)


def test_mooncake_delta_rows_grow_the_prompt_by_history_and_answer(tmp_path: Path) -> None:
    """aiperf's own example: a session's later row is its new input."""
    path = lines(
        tmp_path / "m.jsonl",
        {"session_id": "abc-123", "timestamp": 0, "input_length": 300, "output_length": 40},
        {"session_id": "abc-123", "delay": 2, "input_length": 150, "output_length": 20},
        {"session_id": "abc-123", "delay": 0, "input_length": 10, "output_length": 1},
    )
    _, b, c = traces.read_trace(path)
    assert (b.prompt_tokens, b.new_tokens, b.t) == (490, 150, 0.002)
    assert (c.prompt_tokens, c.new_tokens, c.t) == (520, 10, 0.002)  # a delay of 0: same time


@pytest.mark.parametrize(
    ("rows", "match"),
    [
        ([{"input_length": 3, "output_length": 1}], r":1: field 'timestamp' is missing"),
        (
            [
                {"session_id": "s", "timestamp": 0, "input_length": 3, "output_length": 1},
                {"session_id": "s", "input_length": 3, "output_length": 1},
            ],
            r":2: field 'timestamp' or 'delay' is missing",
        ),
        (
            [
                {"session_id": "s", "timestamp": 900, "input_length": 3, "output_length": 1},
                {"session_id": "s", "timestamp": 100, "input_length": 3, "output_length": 1},
            ],
            r":2: field 'timestamp' \(0.1 s\) is before the session's previous turn",
        ),
        ([{"timestamp": 0, "input_length": 3}], r":1: field 'output_length' is missing"),
        ([{"timestamp": 0, "session_id": 5, "input_length": 3, "output_length": 1}], "session_id"),
        (
            [{"timestamp": 0, "input_length": 3, "output_length": 1, "hash_ids": [1, -2]}],
            "hash_ids",
        ),
        ([{"timestamp": 0, "input_length": 3, "output_length": 1, "hash_ids": [True]}], "hash_ids"),
        (
            [
                {"session_id": "s", "timestamp": 0, "input_length": 9_000_000, "output_length": 9},
                {"session_id": "s", "delay": 1, "input_length": 1_000_000, "output_length": 1},
            ],
            r":2: the session's prompt .* passes 10,000,000 tokens",
        ),
    ],
)
def test_a_bad_mooncake_row_is_refused_with_its_line(tmp_path: Path, rows, match) -> None:
    with pytest.raises(TraceError, match=match):
        traces.read_trace(lines(tmp_path / "m.jsonl", *rows))


# ---------------------------------------------------------------- bailian


def test_bailian_sessions_are_parent_chains(tmp_path: Path) -> None:
    path = lines(
        tmp_path / "b.jsonl",
        {"chat_id": 159, "parent_chat_id": -1, "timestamp": 61.114, "input_length": 521,
         "output_length": 132, "type": "text", "turn": 1, "hash_ids": [1089, 1090, 1091]},
        {"chat_id": 7, "timestamp": 62.0, "input_length": 50, "output_length": 5, "turn": 1},
        # 2 of its 16-token blocks are its parent's.
        {"chat_id": 160, "parent_chat_id": 159, "timestamp": 62.5, "input_length": 400,
         "output_length": 80, "type": "text", "turn": 2, "hash_ids": [1089, 1090, 4]},
        # Its parent has no hash ids: new = past the parent's prompt and answer.
        {"chat_id": 8, "parent_chat_id": 7, "timestamp": 70, "input_length": 80,
         "output_length": 1, "turn": 2},
        {"chat_id": 9, "parent_chat_id": 12345, "timestamp": 71, "input_length": 8,
         "output_length": 1, "turn": 5},  # its parent is not in the file: a session
    )  # fmt: skip
    turns = traces.read_trace(path)
    got = [(x.session, round(x.t, 3), x.prompt_tokens, x.new_tokens) for x in turns]
    assert got == [
        ("159", 0.0, 521, 521),
        ("7", 0.886, 50, 50),
        ("159", 1.386, 400, 400 - 32),
        ("7", 8.886, 80, 25),
        ("9", 9.886, 8, 8),
    ]
    assert traces.read_trace(path, block_tokens=100)[2].new_tokens == 200


@pytest.mark.parametrize(
    ("row", "match"),
    [
        ({"chat_id": 1, "timestamp": 0, "input_length": 5, "output_length": 1}, "appears twice"),
        ({"chat_id": -4, "timestamp": 0, "input_length": 5, "output_length": 1}, "'chat_id'"),
        ({"chat_id": 2, "timestamp": 0, "input_length": 5}, "'output_length' is missing"),
        ({"chat_id": 2, "parent_chat_id": 1, "timestamp": 0.5, "input_length": 5,
          "output_length": 1}, r"'timestamp' \(0.5\) is before its parent's"),
        ({"chat_id": 2, "parent_chat_id": "1", "timestamp": 2, "input_length": 5,
          "output_length": 1}, "'parent_chat_id'"),
    ],
)  # fmt: skip
def test_a_bad_bailian_row_is_refused_with_its_line(tmp_path: Path, row, match) -> None:
    first = {"chat_id": 1, "timestamp": 1, "input_length": 5, "output_length": 1}
    with pytest.raises(TraceError, match=match) as e:
        traces.read_trace(lines(tmp_path / "b.jsonl", first, row))
    assert f"{tmp_path / 'b.jsonl'}:2:" in str(e.value)


def test_the_format_is_detected_per_file_or_given(tmp_path: Path) -> None:
    own = lines(
        tmp_path / "k.jsonl",
        {"session": "a", "t": 3, "prompt_tokens": 5, "new_tokens": 5, "output_tokens": 1},
    )
    assert traces.read_trace(own) == [Turn("a", 0.0, 5, 5, 1)]
    with pytest.raises(TraceError, match=r":1: field 'chat_id' is missing"):
        traces.read_trace(own, "bailian")
    with pytest.raises(TraceError, match="format 'csv'"):
        traces.read_trace(own, "csv")
    assert traces.detect({"chat_id": 1}) == "bailian"
    assert traces.detect({"input_length": 1}) == "mooncake"
    assert traces.detect([1]) == "kvferry"


# ---------------------------------------------------------------- hostile input

GOOD = {
    "kvferry": {"session": "z", "t": 0, "prompt_tokens": 1, "new_tokens": 1, "output_tokens": 0},
    "mooncake": {"timestamp": 0, "input_length": 1, "output_length": 0},
    "bailian": {"chat_id": 0, "timestamp": 0, "input_length": 1, "output_length": 0},
}
TIME = {"kvferry": "t", "mooncake": "timestamp", "bailian": "timestamp"}
TOKENS = {"kvferry": "prompt_tokens", "mooncake": "input_length", "bailian": "input_length"}


def hostile_lines(fmt: str) -> Iterator[tuple[str, bytes, str]]:
    """(what, a second line for a trace of ``fmt``, what its refusal says): a hand
    generator of what a fuzzer would find, no hypothesis needed."""

    def row(**changes: object) -> dict[str, object]:
        out = dict(GOOD[fmt])
        if fmt == "bailian":
            out["chat_id"] = 1
        return out | changes

    def raw(obj: dict[str, object], **literal: str) -> bytes:
        text = json.dumps(obj)
        for name, value in literal.items():
            text = text.replace(f'"{name}": "@"', f'"{name}": {value}')
        return text.encode()

    t, n = TIME[fmt], TOKENS[fmt]
    yield "deep nesting", b"[" * 100_000 + b"]" * 100_000, "nested too deep"
    yield (
        "deep nesting in a field",
        raw(row(**{n: "@"}), **{n: "[" * 50_000 + "]" * 50_000}),
        ("nested too deep"),
    )
    yield "a 10**400 count", raw(row(**{n: "@"}), **{n: str(10**400)}), f"'{n}'"
    yield "a 5000-digit int", raw(row(**{n: "@"}), **{n: "9" * 5000}), "not JSON"
    yield "tokens past any model", raw(row(**{n: traces.MAX_TOKENS + 1})), f"'{n}'"
    for literal in ("NaN", "Infinity", "-Infinity"):
        yield f"{literal} time", raw(row(**{t: "@"}), **{t: literal}), "not a JSON number"
        yield f"{literal} count", raw(row(**{n: "@"}), **{n: literal}), "not a JSON number"
    yield "t 1e300", raw(row(**{t: 1e300})), f"'{t}'"
    yield "t 10**400", raw(row(**{t: "@"}), **{t: str(10**400)}), f"'{t}'"
    yield "t 1.7e308", raw(row(**{t: 1.7e308})), f"'{t}'"
    yield "t -1", raw(row(**{t: -1})), f"'{t}'"
    yield "not UTF-8", raw(row()).replace(b"}", b', "x": "\xff\xfe"}'), "not UTF-8"
    yield "a lone surrogate byte", b'{"x": "\xed\xa0\x80"}', "not UTF-8"
    yield "not an object", b'"a string"', "object"


@pytest.mark.parametrize("fmt", sorted(GOOD))
def test_hostile_lines_are_refused_fast_with_their_line(tmp_path: Path, fmt: str) -> None:
    path = tmp_path / "h.jsonl"
    seen = 0
    for what, line, says in hostile_lines(fmt):
        path.write_bytes(json.dumps(GOOD[fmt]).encode() + b"\n" + line + b"\n")
        started = time.monotonic()
        with pytest.raises(TraceError) as e:
            traces.read_trace(path)
        assert time.monotonic() - started < 2, what
        assert f"{path}:2:" in str(e.value) and says in str(e.value), (what, str(e.value))
        seen += 1
    assert seen > 15


def test_epoch_times_cost_nothing_and_start_at_zero(tmp_path: Path) -> None:
    """200 turns stamped with Unix time: read from the first turn, so the eviction
    bench's tuner (a tuning every simulated minute from t = 0) runs minutes, not the
    28 million it ran before (> 60 s)."""
    rows = []
    for s in range(40):
        for k in range(5):
            prompt = 100 * (k + 1)
            rows.append(
                {"session": f"s{s}", "t": 1.7e9 + s * 7 + k * 30.5, "prompt_tokens": prompt,
                 "new_tokens": 100, "output_tokens": 0}
            )  # fmt: skip
    turns = traces.read_trace(lines(tmp_path / "e.jsonl", *rows))
    assert len(turns) == 200 and turns[0].t == 0.0 and turns[-1].t == 39 * 7 + 4 * 30.5
    from bench import eviction as ev

    started = time.monotonic()
    ev.run_tuner(turns, 2048)
    assert time.monotonic() - started < 10


def test_a_trace_spanning_past_the_bound_is_refused_at_its_line(tmp_path: Path) -> None:
    far = dict(GOOD["kvferry"], session="far", t=traces.MAX_SPAN_SECONDS + 1)
    with pytest.raises(TraceError, match=r":2: the trace spans more than"):
        traces.read_trace(lines(tmp_path / "s.jsonl", GOOD["kvferry"], far))
    # Either order: the first line read is not the trace's origin.
    with pytest.raises(TraceError, match=r":2: the trace spans more than"):
        traces.read_trace(lines(tmp_path / "s.jsonl", far, GOOD["kvferry"]))


def test_sessions_past_the_bound_are_refused_not_kept(tmp_path: Path, monkeypatch) -> None:
    """10**7 one-turn sessions would keep 10**7 turns: the reader stops at MAX_TURNS
    (here lowered to 100) and says where."""
    monkeypatch.setattr(traces, "MAX_TURNS", 100)
    path = tmp_path / "many.jsonl"
    with path.open("w") as f:
        for i in range(1000):
            f.write(json.dumps(dict(GOOD["kvferry"], session=f"s{i}", t=i)) + "\n")
    with pytest.raises(TraceError, match=r"many.jsonl:101: more than 100 turns"):
        traces.read_trace(path)


def test_hash_ids_kept_are_bounded(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(traces, "MAX_KEPT_HASH_IDS", 10)
    rows = [
        {"session_id": f"s{i}", "timestamp": 0, "input_length": 5, "output_length": 0,
         "hash_ids": [1, 2, 3, 4]}
        for i in range(5)
    ]  # fmt: skip
    with pytest.raises(TraceError, match=r":3: more than 10 hash ids"):
        traces.read_trace(lines(tmp_path / "m.jsonl", *rows))
    # A session's later turn replaces what it kept: one session never runs out.
    one = [dict(r, session_id="s") for r in rows]
    assert len(traces.read_trace(lines(tmp_path / "m.jsonl", *one))) == 5


def test_a_line_past_the_bound_is_refused_unread(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(traces, "MAX_LINE_BYTES", 1000)
    path = tmp_path / "long.jsonl"
    path.write_bytes(json.dumps(GOOD["kvferry"]).encode() + b"\n" + b" " * 5000)
    with pytest.raises(TraceError, match=r"long.jsonl:2: line longer than 1,000 bytes"):
        traces.read_trace(path)


def test_a_byte_order_mark_is_read_and_turns_keep_no_dict(tmp_path: Path) -> None:
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(GOOD["kvferry"]).encode() + b"\n")
    (turn,) = traces.read_trace(path)
    assert not hasattr(turn, "__dict__")  # slots: a million turns stay small
