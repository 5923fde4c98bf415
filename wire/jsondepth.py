"""How deep a JSON text nests, measured before anything parses it. Pure.

Both the operator's report decoder and the sidecar's request reader refuse JSON
nested past a fixed depth: a depth the parser survives can still be one its later
re-encoding does not, and Python's recursion limit is no contract. So do the
sidecar's pin journal and its settings files; a YAML file is measured once parsed
(``value_deeper_than``), its parser's RecursionError taken as too deep.
"""

from __future__ import annotations

import re
from typing import Any

# Strings, then everything that is not a bracket: what is left is the nesting.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')  # unrolled: linear time
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
_OPENING = frozenset(b"[{")


def nested_deeper_than(raw: bytes, limit: int) -> bool:
    """Whether the JSON in ``raw`` nests arrays and objects deeper than ``limit``.

    Checked before decoding: a JSON parser's own bound is the interpreter's
    recursion limit (json and msgspec raise RecursionError), which depends on the
    caller's stack, and re-encoding a value nested just below it fails later,
    deeper in the stack. A deep body is refused at the bracket past ``limit``; a
    long flat one costs one step per bracket."""
    depth = 0
    for byte in _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS):
        depth += 1 if byte in _OPENING else -1
        if depth > limit:
            return True
    return False


def value_deeper_than(value: Any, limit: int) -> bool:
    """Whether a parsed value nests lists and mappings deeper than ``limit`` (the
    value itself at depth 1 when it is one). Iterative, and a container shared under
    many keys (a YAML alias) is walked again only when reached deeper than before:
    at most ``limit`` visits of each."""
    seen: dict[int, int] = {}
    todo: list[tuple[Any, int]] = [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        if depth > limit:
            return True
        if seen.get(id(item), 0) >= depth:
            continue
        seen[id(item)] = depth
        todo.extend((child, depth + 1) for child in children)
    return False
