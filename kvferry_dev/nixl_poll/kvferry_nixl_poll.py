"""Imported at start-up by every Python process of a test engine (sitecustomize.py
beside it, whose folder leads the harness's engine PYTHONPATH: kvferry_dev/engines.py;
a .pth line in the node tier's engine image: images/engine-cpu-test/Dockerfile):
NIXL's UCX progress thread made to sleep in ``poll()`` instead of spinning. Test
engines only: nothing the operator renders or ships sets it.

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
_DELAY_US = int(os.environ.get("KVFERRY_NIXL_PTHR_DELAY_US", "1000"))


def _patch(bindings: Any) -> None:
    real = bindings.nixlAgent

    def nixlAgent(name: str, config: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(config, "useProgThread", False) and config.pthrDelay == 0:
            config.pthrDelay = _DELAY_US
        return real(name, config, *args, **kwargs)

    bindings.nixlAgent = nixlAgent


class _Loader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        _patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in _TARGETS:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


if _DELAY_US > 0:
    sys.meta_path.insert(0, _Finder())
