"""How deep a JSON text nests, measured before anything parses it. Pure.

Both the operator's report decoder and the sidecar's request reader refuse JSON
nested past a fixed depth: a depth the parser survives can still be one its later
re-encoding does not, and Python's recursion limit is no contract.
"""

from __future__ import annotations

import re

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
