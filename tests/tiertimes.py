"""Each tier's wall time (tests/<tier>/: from its first test's setup to its last test's
teardown, fixtures included), printed at the end of the run: where a slow CI run spent
its time, without a second run to find out."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

ROOT = Path(__file__).parent
_spans: dict[str, list[float]] = {}


def tier_of(path: Path) -> str:
    try:
        return path.relative_to(ROOT).parts[0]
    except (ValueError, IndexError):
        return "other"


def record(item: pytest.Item, started: float, ended: float) -> None:
    span = _spans.setdefault(tier_of(Path(str(item.path))), [started, ended])
    span[0], span[1] = min(span[0], started), max(span[1], ended)


def report(reporter: pytest.TerminalReporter) -> None:
    if not _spans:
        return
    reporter.section("time per tier (wall clock, fixtures included)")
    for tier, (start, end) in sorted(_spans.items(), key=lambda kv: kv[1][0]):
        reporter.write_line(f"{tier:10} {(end - start) / 60:6.1f} min")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):  # type: ignore[no-untyped-def]
    started = time.monotonic()
    yield
    record(item, started, time.monotonic())


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    report(terminalreporter)
