"""Values in the sidecar's log lines, one field each. Pure.

The sidecar's lines are ``event key=value ...``, which log pipelines read as logfmt.
A value a client controls (its ``X-Request-Id``, the request path, an error that
quotes what it sent) could otherwise pose as more fields (``a status=500``) or more
lines (a line break, U+2028), or write terminal escapes. :func:`value` leaves a plain
token bare and writes anything else as a JSON string: ASCII only, quotes, backslashes,
line breaks and every control character escaped, so a logfmt reader gets the one
field and its text back whole (``json.loads``).
"""

from __future__ import annotations

import json
import re

# Bare when it is only these: no space, '=', quote, backslash, control or non-ASCII.
_PLAIN = re.compile(r"[A-Za-z0-9._:/@+,-]+")
NONE = "-"


def value(text: object) -> str:
    """``text`` as one logfmt value: bare when plain, else a JSON string; None is "-"."""
    if text is None:
        return NONE
    text = str(text)
    if _PLAIN.fullmatch(text):
        return text
    # ensure_ascii escapes C1 controls, U+2028/2029 and the rest; DEL is left to us.
    return json.dumps(text).replace("\x7f", "\\u007f")
