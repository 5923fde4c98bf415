"""Heavy work off the event loop, one piece at a time.

The event loop serves every stream, ``/healthz`` and the background loops. A big
turn's JSON costs tens to hundreds of milliseconds a piece: the client's body parsed
and checked, each engine leg's body written, the ``/tokenize`` answer and D's answer
(a long prompt's token ids) read and rewritten. Such a piece runs in the one thread
this module keeps:

- **off the loop**: while the thread runs Python the loop gets the GIL back every
  switch interval, and whenever one of its C calls (``json.loads``) returns;
- **one at a time**: CPython hands a released GIL to any thread that waits for it,
  so with several threads of heavy work the loop waited behind a whole queue of C
  calls (``/healthz`` 7.96 s, a steady stream 17.3 s, under 24 concurrent 2.9 MiB
  bodies: ``bench/hostile.py``); with one, it waits for one piece at most. More
  threads would not parse faster under the GIL anyway.

A piece below ``HEAVY_BYTES`` runs inline: the hop to the thread costs more than it
does. What waits here is still counted by the bytes-in-flight budget
(``limits.InflightBudget``): a turn holds its body's share until it is over.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final, TypeVar

from .limits import PARSE_IN_THREAD_BYTES

HEAVY_BYTES: Final = PARSE_IN_THREAD_BYTES
# A token id list this long is per-token work worth the hop (~1 MiB of JSON).
HEAVY_IDS: Final = 65536

_LANE = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvferry-heavy")

T = TypeVar("T")


async def run(fn: Callable[..., T], /, *args: Any) -> T:
    """``fn(*args)`` in the heavy-work thread, after the pieces queued before it."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_LANE, functools.partial(fn, *args))


async def maybe(heavy: bool, fn: Callable[..., T], /, *args: Any) -> T:
    """``fn(*args)`` in the heavy-work thread when ``heavy``, else inline."""
    return await run(fn, *args) if heavy else fn(*args)
