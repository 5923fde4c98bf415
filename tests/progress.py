"""Progress lines on the terminal from inside fixtures, past pytest's output capture.

A one-time build (the control plane, helm, the engine venv, the images) can take
minutes inside a fixture; without a word the run looks hung. ``say`` writes one line
to the terminal at once, with or without ``-s``, and ``step`` times what follows.
tests/conftest.py hands the session's config to :func:`attach`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

_config: pytest.Config | None = None


def attach(config: pytest.Config) -> None:
    global _config
    _config = config


def say(message: str) -> None:
    line = f"[kvferry] {message}"
    config = _config
    capman = config.pluginmanager.getplugin("capturemanager") if config else None
    reporter = config.pluginmanager.getplugin("terminalreporter") if config else None
    if capman is None or reporter is None:
        print(line, file=sys.stderr, flush=True)
        return
    with capman.global_and_fixture_disabled():
        reporter.ensure_newline()
        reporter.write_line(line)
        reporter.flush()


@contextmanager
def step(what: str) -> Iterator[None]:
    """``what...`` now, ``what: done in N s`` after."""
    say(f"{what}...")
    started = time.monotonic()
    yield
    say(f"{what}: done in {time.monotonic() - started:.0f} s")
