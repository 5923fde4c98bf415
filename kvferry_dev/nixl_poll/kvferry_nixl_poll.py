"""Imported at start-up by every Python process of an engine the harness starts
(sitecustomize.py beside it, whose folder leads their PYTHONPATH: kvferry_dev/engines.py):
NIXL's UCX progress thread made to sleep in ``poll()`` instead of spinning. The
harness's engines only: the node tier's pods and everything the operator renders run
NIXL as shipped.

NIXL's Python API builds every agent with ``pthrDelay = 0`` (nixl_cu1X/_api.py, 1.5.1),
and its UCX backend's shared progress thread uses that delay as ``poll()``'s timeout:
0 ms, a busy loop that takes a whole core while nothing moves. vLLM 0.32 offers no way
to set it. Here each engine has one core, shared by its compute and that thread, so
the harness asks for 1 ms: the thread still wakes on UCX's event fds at once (the
backend arms them; the timeout is only NIXL's fallback for a missed wake-up) and
otherwise sleeps. Nothing else about the engine changes. ``KVFERRY_NIXL_PTHR_DELAY_US``
sets the delay (``0``: NIXL's own busy loop).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from typing import Any

_TARGETS = ("nixl_cu12._bindings", "nixl_cu13._bindings", "nixl_rocm._bindings")
# What a test engine's log says when the hook took effect (tests/engine checks it).
APPLIED = "kvferry_nixl_poll: NIXL progress-thread poll 0 -> {} us"


def delay_us(raw: str | None) -> int:
    """``KVFERRY_NIXL_PTHR_DELAY_US``: unset -> 1000; 0 -> NIXL's own busy loop.
    NIXL rounds it up to whole ms and casts it to an int: kept to 0..1 s."""
    try:
        value = int(raw) if raw not in (None, "") else 1000
    except ValueError:
        sys.stderr.write(
            f"kvferry_nixl_poll: KVFERRY_NIXL_PTHR_DELAY_US={raw!r} is no integer: 1000 us\n"
        )
        return 1000
    return min(max(value, 0), 1_000_000)


def patch(bindings: Any, delay: int) -> bool:
    """Wrap ``bindings.nixlAgent`` so that an agent with the progress thread on and a
    0 ms poll gets ``delay``. False, and NIXL left as it is, where it is not the NIXL
    this knows (a test engine must still start: only the speed-up is lost, and the
    engine tier's check of the log line says so)."""
    real = getattr(bindings, "nixlAgent", None)
    if real is None:
        sys.stderr.write("kvferry_nixl_poll: no nixlAgent in NIXL's bindings: left as it is\n")
        return False

    def nixlAgent(name: Any, config: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            if getattr(config, "useProgThread", False) and config.pthrDelay == 0:
                config.pthrDelay = delay
                sys.stderr.write(APPLIED.format(delay) + "\n")
        except (AttributeError, TypeError) as exc:
            sys.stderr.write(f"kvferry_nixl_poll: NIXL's config changed ({exc}): left as it is\n")
        return real(name, config, *args, **kwargs)

    bindings.nixlAgent = nixlAgent
    return True


class _Loader(importlib.abc.Loader):
    def __init__(self, loader: Any, delay: int) -> None:
        self._loader = loader
        self._delay = delay

    def __getattr__(self, name: str) -> Any:  # get_filename, is_package, ...
        return getattr(self._loader, name)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        patch(module, self._delay)


class Finder(importlib.abc.MetaPathFinder):
    def __init__(self, delay: int) -> None:
        self._delay = delay

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in _TARGETS:
            return None
        # The bindings are files on sys.path: the path finder alone finds them (asking
        # every other finder could reach another wrapper like this one).
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader, self._delay)
        return spec


def install() -> None:
    delay = delay_us(os.environ.get("KVFERRY_NIXL_PTHR_DELAY_US"))
    if delay > 0 and not any(isinstance(f, Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, Finder(delay))


install()
