"""Bound glibc's malloc arenas in the operator process (issue 23, item 4).

glibc gives each new thread an arena of its own, up to 8 per core, and an arena keeps
the pages it once held: freed memory stays in the arena that allocated it. The
operator's handlers run on 32 threads (handlers.py: kopf's executor), each parsing API
answers of many KB. Two arenas bound that part; Python's own small objects are not
affected (its allocator takes them from pools of its own). What it saves is not
measured apart from the noise: at 300 servers glibc's heaps held 49-59 MB, 27 MB of it
free, of a 380 MB peak, and one run with two arenas peaked at 194 MB against 266 MB
without, where two runs of the same code differed as much (docs/performance.md, "1,000
servers"). Kept because it costs nothing: the handlers hold the GIL while they
allocate, so two arenas add no contention.

``MALLOC_ARENA_MAX`` set in the environment (glibc reads it at start) is left as it is.
Not glibc (musl, another platform): nothing to do.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from collections.abc import Mapping

log = logging.getLogger(__name__)

M_ARENA_MAX = -8  # glibc's malloc.h
ARENAS = 2


def limit_arenas(env: Mapping[str, str] = os.environ, arenas: int = ARENAS) -> int | None:
    """Set glibc's arena bound to ``arenas`` for the arenas created from here on (call
    before the threads start). The bound set, or None when left alone."""
    if "MALLOC_ARENA_MAX" in env or not sys.platform.startswith("linux"):
        return None
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    if mallopt(M_ARENA_MAX, arenas) != 1:
        log.debug("mallopt(M_ARENA_MAX) refused: not glibc")
        return None
    return arenas
