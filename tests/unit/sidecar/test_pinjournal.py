"""The pin journal: what D pins for a sidecar, read back by the sidecar's next process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry_sidecar import pinjournal
from kvferry_sidecar.pinjournal import COMPACT_SLACK, Pin, PinJournal

NOW = 1_000_000.0


def pin(key: str, *, deadline: float = NOW + 600, engine: float | None = 7.0, blocks: int = 3):
    return Pin(
        key=key,
        blocks=blocks,
        deadline=deadline,
        params={"remote_request_id": key, "remote_block_ids": [[1, 2, 3]]},
        token=5,
        model="m",
        engine=engine,
    )


def raw(**fields: object) -> str:
    """One journal line as JSON, valid but for ``fields``."""
    line = {"type": "pin", "key": "k", "blocks": 1, "deadline": NOW + 9, "params": {}, "token": 1}
    return json.dumps({**line, **fields})


def journal(path: Path, **kw: object) -> PinJournal:
    return PinJournal(path, wall=lambda: NOW, **kw)  # type: ignore[arg-type]


def test_what_was_pinned_and_not_gone_comes_back_as_orphans(tmp_path: Path) -> None:
    path = tmp_path / "pins.jsonl"
    first = journal(path)
    assert first.recover(engine=7.0).orphans == []  # no file yet
    for key in ("a", "b", "c"):
        first.pinned(pin(key))
    first.pinned(pin("a"))  # noted once
    first.gone("b")
    first.gone("never-pinned")  # nothing written
    first.close()
    assert len(path.read_text().splitlines()) == 4

    found = journal(path).recover(engine=7.0)
    assert [p.key for p in found.orphans] == ["a", "c"]
    assert found.orphans[0] == pin("a")
    assert (found.expired, found.void, found.bad_lines) == (0, 0, 0)


def test_past_its_deadline_or_another_engines_is_not_an_orphan(tmp_path: Path) -> None:
    """D freed a pin past its deadline, and a restarted D everything: neither is
    released. A pin whose engine was not known is (releasing a freed one costs P a
    token; keeping one pinned costs D its blocks to the ceiling)."""
    path = tmp_path / "pins.jsonl"
    j = journal(path)
    j.recover(engine=None)
    j.pinned(pin("late", deadline=NOW - 1))
    j.pinned(pin("other", engine=6.0))
    j.pinned(pin("unknown", engine=None))
    j.pinned(pin("live"))
    j.close()
    found = journal(path).recover(engine=7.0)
    assert sorted(p.key for p in found.orphans) == ["live", "unknown"]
    assert (found.expired, found.void) == (1, 1)
    # The file now holds the orphans alone (they stay pinned until released).
    assert sorted(json.loads(x)["key"] for x in path.read_text().splitlines()) == [
        "live",
        "unknown",
    ]


def test_torn_and_hostile_lines_are_skipped_and_nothing_else_is_lost(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "pins.jsonl"
    good = pinjournal._encode(pin("good")).decode()
    lines = [
        good,
        "not json",
        raw(key="x" * 600),  # longer than a key may be
        raw(blocks=-1),
        raw(type="evil"),
        raw(shell="rm -rf /"),  # a field no pin has
        good[: len(good) // 2],  # the torn last line of a crash
    ]
    path.write_text("\n".join(lines))
    found = journal(path).recover(engine=7.0)
    assert [p.key for p in found.orphans] == ["good"]
    assert found.bad_lines == 6
    assert "line=2" in caplog.text and "line=7" not in caplog.text  # the first five named


def test_the_file_is_rewritten_to_what_is_live(tmp_path: Path) -> None:
    """Turns pin and free handles all day: the file stays near twice the live lines."""
    path = tmp_path / "pins.jsonl"
    j = journal(path)
    j.recover(engine=7.0)
    j.pinned(pin("kept"))
    for n in range(3 * COMPACT_SLACK):
        j.pinned(pin(f"k{n}"))
        j.gone(f"k{n}")
        lines = len(path.read_text().splitlines())
        assert lines <= 2 * len(j.live) + COMPACT_SLACK + 1
    j.close()
    assert [p.key for p in journal(path).recover(engine=7.0).orphans] == ["kept"]


def test_a_full_journal_notes_no_more_and_an_unwritable_one_stops_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "pins.jsonl"
    line = len(pinjournal._encode(pin("k0"))) + 1
    monkeypatch.setattr(pinjournal, "MAX_FILE_BYTES", 2 * line + 2)
    j = journal(path)
    j.recover(engine=7.0)
    for n in range(3):
        j.pinned(pin(f"k{n}"))
    assert sorted(j.live) == ["k0", "k1"] and j.unnoted == 1
    j.gone("k0")  # after a rewrite there is room again
    j.pinned(pin("k3"))
    assert "k3" in j.live

    errors: list[int] = []
    broken = PinJournal(
        tmp_path / "no" / "such" / "dir" / "pins.jsonl", on_error=lambda: errors.append(1)
    )
    broken.recover(engine=7.0)
    broken.pinned(pin("a"))
    broken.gone("a")
    assert broken.errors >= 2 and len(errors) == broken.errors


OPS = st.lists(
    st.tuples(st.sampled_from(["pin", "gone"]), st.integers(min_value=0, max_value=15)),
    max_size=200,
)


@settings(max_examples=60, deadline=None)
@given(ops=OPS, restart_at=st.integers(min_value=0, max_value=200))
def test_recovery_matches_a_model_of_what_d_still_pins(
    tmp_path_factory: pytest.TempPathFactory, ops: list[tuple[str, int]], restart_at: int
) -> None:
    """Any sequence of pins and frees, with a restart of the sidecar anywhere in it:
    the last process reads back exactly the pins not freed."""
    path = tmp_path_factory.mktemp("j") / "pins.jsonl"
    model: dict[str, Pin] = {}
    j = journal(path)
    j.recover(engine=7.0)
    for n, (op, k) in enumerate(ops):
        if n == restart_at:
            j.close()
            j = journal(path)
            assert {p.key for p in j.recover(engine=7.0).orphans} == set(model)
        key = f"k{k}"
        if op == "pin":
            j.pinned(pin(key))
            model.setdefault(key, pin(key))
        else:
            j.gone(key)
            model.pop(key, None)
    j.close()
    assert {p.key for p in journal(path).recover(engine=7.0).orphans} == set(model)


# Hostile lines, generated: each must be skipped and counted, whatever it holds.
FIELDS = ("type", "key", "blocks", "deadline", "params", "token", "model", "engine")


def nested(depth: int, kind: str) -> str:
    """A JSON value nested ``depth`` deep: lists, maps, or both in turn."""
    if kind == "list":
        return "[" * depth + "]" * depth
    if kind == "map":
        return '{"a":' * depth + "1" + "}" * depth
    return '[{"a":' * (depth // 2) + "1" + "}]" * (depth // 2)


def with_field(name: str, value: str) -> str:
    """A valid line but for ``name``, whose JSON text is ``value`` (put in raw)."""
    line = json.loads(raw(model="m", engine=7.0))
    line[name] = "@@"
    return json.dumps(line).replace('"@@"', value)


DEEP = st.builds(
    nested,
    st.integers(min_value=2_000, max_value=100_000),
    st.sampled_from(["list", "map", "both"]),
)
HUGE_INT = st.integers(min_value=20, max_value=5_000).map(lambda digits: "9" * digits)
# Per field, values of a type (or a range) no pin has there.
WRONG = {
    "type": ['"evil"', "1", "null", "[]"],
    "key": ['""', "1", "null", "[]", '"' + "k" * 600 + '"'],
    "blocks": ["-1", '"3"', "1.5", "null", "4294967296", "true"],
    "deadline": ['"soon"', "null", "[]", "1e999", "true"],
    "params": ["[]", '"x"', "null", "1", "true"],
    "token": ["-1", '"5"', "null", "{}", "2.5"],
    "model": ["1", "[]", "{}", '"' + "m" * 2000 + '"', "false"],
    "engine": ['"7"', "[]", "{}", "1e999", "true"],
}
WRONG_TYPE = st.sampled_from([(name, value) for name, values in WRONG.items() for value in values])
HOSTILE_LINE = st.one_of(
    # deep nesting of lists and maps: in params, at any field, or as the whole line
    st.builds(lambda d: with_field("params", '{"a":' + d + "}"), DEEP),
    st.builds(with_field, st.sampled_from(FIELDS), DEEP),
    DEEP,
    # huge ints: in params (no id D hands out is past 64 bits), and where a count,
    # a string or an object belongs
    st.builds(lambda n: with_field("params", '{"remote_block_ids":[[1,' + n + "]]}"), HUGE_INT),
    st.builds(lambda n: with_field("params", '{"remote_port":-' + n + "}"), HUGE_INT),
    st.builds(
        with_field, st.sampled_from(["type", "key", "blocks", "token", "model", "params"]), HUGE_INT
    ),
    # wrong types at every field
    WRONG_TYPE.map(lambda nv: with_field(*nv)),
)


@settings(max_examples=40, deadline=None)
@given(hostile=st.lists(HOSTILE_LINE, min_size=1, max_size=4))
def test_any_hostile_line_is_skipped_and_counted_never_raised(
    tmp_path_factory: pytest.TempPathFactory, hostile: list[str]
) -> None:
    """A line nested 100,000 deep once made recover() raise RecursionError: the
    sidecar's start-up stopped, and every restart read the same emptyDir file."""
    path = tmp_path_factory.mktemp("j") / "pins.jsonl"
    good = pinjournal._encode(pin("good")).decode()
    path.write_text("\n".join([*hostile, good, *hostile]) + "\n")
    found = journal(path).recover(engine=7.0)
    assert [p.key for p in found.orphans] == ["good"]
    assert found.bad_lines == 2 * len(hostile)


def test_a_line_nested_past_the_limit_is_skipped_one_within_it_is_read(tmp_path: Path) -> None:
    path = tmp_path / "pins.jsonl"
    within = pinjournal.MAX_DEPTH - 2  # the line and params are two levels
    path.write_text(
        "\n".join(
            [
                with_field("params", '{"a":' + nested(within, "list") + "}"),
                with_field("params", '{"a":' + nested(100_000, "map") + "}"),
            ]
        )
    )
    found = journal(path).recover(engine=7.0)
    assert (len(found.orphans), found.bad_lines) == (1, 1)
