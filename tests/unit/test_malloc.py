"""The operator bounds glibc's malloc arenas (operator/malloc.py): counted by glibc's
own malloc_info, in a fresh interpreter whose threads each allocate."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvferry_operator import malloc

# Eight threads allocate at once; then glibc's malloc_info lists the heaps (arenas).
PROBE = """
import ctypes, os, sys, tempfile, threading
from kvferry_operator import malloc
if sys.argv[1] == "limit":
    print("bound", malloc.limit_arenas({}))
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
go = threading.Barrier(8)
def work():
    go.wait()
    blocks = [libc.malloc(64 * 1024) for _ in range(16)]
    go.wait()
threads = [threading.Thread(target=work) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
path = tempfile.mktemp()
libc.fopen.restype = ctypes.c_void_p
libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
libc.fclose.argtypes = [ctypes.c_void_p]
fp = libc.fopen(path.encode(), b"w")
libc.malloc_info(0, fp)
libc.fclose(fp)
print("heaps", open(path).read().count("<heap nr="))
os.unlink(path)
"""


def heaps(mode: str) -> tuple[str, int]:
    env = {"PATH": "/usr/bin:/bin"}  # no MALLOC_ARENA_MAX from the caller
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, env=env, check=True
    ).stdout.split("\n")
    bound = next((line for line in out if line.startswith("bound")), "")
    return bound, int(next(line for line in out if line.startswith("heaps")).split()[1])


def glibc() -> bool:
    import ctypes

    try:
        ctypes.CDLL(None).malloc_info  # noqa: B018 - glibc alone has it
    except AttributeError:
        return False
    return True


@pytest.mark.skipif(not glibc(), reason="not glibc: no malloc_info to count arenas with")
def test_threads_share_two_arenas_once_bounded_and_many_without():
    bound, limited = heaps("limit")
    assert bound == "bound 2"
    assert limited <= malloc.ARENAS
    _, free = heaps("none")
    assert free > malloc.ARENAS  # without it, glibc gives the threads arenas of their own


def test_a_bound_the_user_set_is_left_alone():
    assert malloc.limit_arenas({"MALLOC_ARENA_MAX": "4"}) is None
