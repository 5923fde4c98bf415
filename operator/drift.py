"""Whether a child as observed still holds what the operator would apply. Pure.

Every watch event of a child (its own creation, each status update the controllers
write, a user's edit) used to re-apply it. A server-side apply of unchanged fields
writes nothing, but it is still a request: at 100 servers those no-op re-applies
were most of the operator's API traffic (docs/performance.md, operator scale), and
with a blocking client they queue behind each other, so servers became Ready later.

``covers(observed, desired)`` is True when every field the operator renders is
present in the observed object with the same value; fields the API server or other
managers added are ignored (server-side apply leaves them alone anyway). It errs on
the side of re-applying: a value the server normalised (``1`` rendered, ``"1"``
stored for a quantity is treated as equal; ``1Gi`` vs ``1024Mi`` is not) only costs
one apply, as before.
"""

from __future__ import annotations

from typing import Any


def covers(observed: Any, desired: Any) -> bool:
    if isinstance(desired, dict):
        if not isinstance(observed, dict):
            return False
        return all(
            (observed.get(key) is None)
            if value is None
            else (key in observed and covers(observed[key], value))
            for key, value in desired.items()
        )
    if isinstance(desired, list):
        if not isinstance(observed, list) or len(observed) != len(desired):
            return False
        return all(covers(o, d) for o, d in zip(observed, desired, strict=True))
    if isinstance(desired, bool) or isinstance(observed, bool):
        return desired is observed
    if isinstance(desired, int | float) and isinstance(observed, str):
        # Quantities: rendered as numbers, stored as strings.
        return str(desired) == observed
    return bool(desired == observed)
