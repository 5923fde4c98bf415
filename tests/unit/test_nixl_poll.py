"""The harness's NIXL poll hook (kvferry_dev/nixl_poll/kvferry_nixl_poll.py) on a fake
``nixl_cu12._bindings``: it sets the delay only where NIXL's Python API left 0 with the
progress thread on, and a NIXL it does not know still imports and runs unchanged."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvferry_dev.nixl_poll import kvferry_nixl_poll as hook

BINDINGS = """
class nixlAgentConfig:
    def __init__(self):
        self.useProgThread = True
        self.pthrDelay = 0

def nixlAgent(name, config):
    return (name, config.useProgThread, config.pthrDelay)
"""


@pytest.fixture
def fake_nixl(tmp_path: Path) -> Iterator[Path]:
    pkg = tmp_path / "nixl_cu12"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    sys.path.insert(0, str(tmp_path))
    finder = hook.Finder(1000)
    sys.meta_path.insert(0, finder)
    try:
        yield pkg
    finally:
        sys.meta_path.remove(finder)
        sys.path.remove(str(tmp_path))
        for name in [n for n in sys.modules if n.split(".")[0] == "nixl_cu12"]:
            del sys.modules[name]


def test_a_busy_progress_thread_gets_the_delay(fake_nixl: Path, capsys) -> None:
    (fake_nixl / "_bindings.py").write_text(BINDINGS)
    import nixl_cu12._bindings as b  # type: ignore[import-not-found]

    assert b.nixlAgent("a", b.nixlAgentConfig()) == ("a", True, 1000)
    assert hook.APPLIED.format(1000) in capsys.readouterr().err
    off = b.nixlAgentConfig()
    off.useProgThread = False
    assert b.nixlAgent("b", off) == ("b", False, 0)  # no progress thread: left alone
    given = b.nixlAgentConfig()
    given.pthrDelay = 7
    assert b.nixlAgent("c", given) == ("c", True, 7)  # a delay someone chose: kept


def test_a_nixl_it_does_not_know_still_imports_and_runs(fake_nixl: Path, capsys) -> None:
    (fake_nixl / "_bindings.py").write_text(
        "class Config:\n    useProgThread = True\n\ndef nixlAgent(name, config):\n    return name\n"
    )
    import nixl_cu12._bindings as b  # type: ignore[import-not-found]

    assert b.nixlAgent("a", b.Config()) == "a"  # no pthrDelay: the call goes through
    assert "NIXL's config changed" in capsys.readouterr().err


def test_bindings_without_nixl_agent_import_unchanged(fake_nixl: Path, capsys) -> None:
    (fake_nixl / "_bindings.py").write_text("VALUE = 1\n")
    import nixl_cu12._bindings as b  # type: ignore[import-not-found]

    assert b.VALUE == 1
    assert "no nixlAgent" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("raw", "want"),
    [
        (None, 1000),
        ("", 1000),
        ("0", 0),
        ("2500", 2500),
        ("x", 1000),
        ("-5", 0),
        ("9" * 12, 1_000_000),
    ],
)
def test_the_delay_setting(raw: str | None, want: int) -> None:
    assert hook.delay_us(raw) == want
