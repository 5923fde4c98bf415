"""Processes and ports of the dev harness: free loopback ports, process groups that
are always stopped, and the one error type every harness failure raises."""

from __future__ import annotations

import atexit
import contextlib
import os
import random
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any


class EngineError(RuntimeError):
    """An engine or sidecar did not start, died, or answered with an error."""


_taken_ports: set[int] = set()
_ports_lock = threading.Lock()
_port_rng = random.Random(f"{os.getpid()}-{time.time_ns()}")


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A free loopback TCP port, never the same twice in this process.

    Picked below the kernel's ephemeral range: a port from bind(0) is released before the
    engine binds it, and vLLM's own startup (ZMQ, torch.distributed, get_open_port) takes
    ephemeral ports meanwhile, so a bind(0) port can be gone by then (seen here).
    """
    lo, _ = _ephemeral_range()
    start = 20000 if lo > 21000 else 10000
    with _ports_lock:
        for _ in range(500):
            port = _port_rng.randrange(start, lo if lo > start + 1000 else start + 10000)
            if port in _taken_ports:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _taken_ports.add(port)
            return port
    raise EngineError("no free port found")


LIVE: set[Any] = set()  # Engine | SidecarProcess not stopped yet


def stop_all() -> None:
    """Stop every process this module started and nobody stopped (atexit safety net)."""
    for p in list(LIVE):
        p.stop()


atexit.register(stop_all)


def stop_group(proc: subprocess.Popen, timeout: float, sig: int = signal.SIGTERM) -> None:
    """Signal `proc`'s process group, SIGKILL it after `timeout`, wait until it is gone."""
    pgid = proc.pid  # start_new_session: the group id is the leader's pid
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=timeout)
    # The group may outlive its leader (engine core, resource tracker): kill the rest.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def tail(text: str, lines: int) -> str:
    return "\n".join(text.splitlines()[-lines:])
