"""Generated residency report bodies (hypothesis), shared by the unit tier (against
``kvferry_wire.report.decode`` and the endpoint in process) and the cluster tier
(against the real operator): a good report with fields replaced by junk or removed,
junk bytes, and nesting far past any parser's stack, at the top and inside a field."""

from __future__ import annotations

import copy
import json
from typing import Any

from hypothesis import strategies as st

# Nesting depths: 50 stays within every decoder's stack; 1,000 and more do not
# (msgspec raised RecursionError at 1,000 and the endpoint answered 500).
DEEP = (1_000, 10_000, 100_000)


def report_leaves(raw: Any, path: tuple = ()) -> list[tuple]:
    out = [path]
    if isinstance(raw, dict):
        for k, v in raw.items():
            out += report_leaves(v, (*path, k))
    return out


def nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


def _deep_mark(depth: int) -> str:
    """A string put where a deep value goes; replaced in the dumped bytes, since
    json.dumps itself cannot write values nested past its stack."""
    return f"\x00deep:{depth}\x00"


def _splice_deep(text: str) -> str:
    for depth in DEEP:
        text = text.replace(json.dumps(_deep_mark(depth)), "[" * depth + "1" + "]" * depth)
    return text


REPORT_JUNK = st.one_of(
    st.sampled_from(
        [None, -1, -0.5, 2**64, 1e308, "x" * 2000, "", True, [], {}, {"x": 1}, nested(50)]
    ),
    st.sampled_from([_deep_mark(d) for d in DEEP]),
    st.integers(-5, 2**60),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=30),
    st.dictionaries(st.text(max_size=12), st.integers(-2, 5), max_size=5),
)


@st.composite
def report_bodies(draw: st.DrawFn, base: dict[str, Any]) -> bytes:
    """``base`` (a good report, decoded) mutated, or junk in its place."""
    choice = draw(st.integers(0, 19))
    if choice == 0:
        return draw(st.binary(max_size=200))
    if choice == 1:
        depth = draw(st.sampled_from([100, *DEEP]))
        return b"[" * depth + b"1" + b"]" * depth
    raw = copy.deepcopy(base)
    paths = report_leaves(raw)[1:]
    if draw(st.integers(0, 9)) == 0:
        paths.append(("x-unknown-field",))  # unknown fields are skipped, deep or not
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(paths))
        node = raw
        for part in path[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            continue
        if draw(st.booleans()) and draw(st.booleans()):
            node.pop(path[-1], None)
        else:
            node[path[-1]] = draw(REPORT_JUNK)
    return _splice_deep(json.dumps(raw)).encode()
