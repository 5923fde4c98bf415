"""The per-tier wall times printed at the end of a run (tests/tiertimes.py)."""

from __future__ import annotations

from pathlib import Path

from tests import tiertimes


def test_a_test_belongs_to_the_tier_folder_it_sits_in() -> None:
    root = tiertimes.ROOT
    assert tiertimes.tier_of(root / "engine" / "test_turns.py") == "engine"
    assert tiertimes.tier_of(root / "unit" / "sidecar" / "test_push.py") == "unit"
    assert tiertimes.tier_of(Path("/elsewhere/test_x.py")) == "other"


def test_a_tier_spans_from_its_first_start_to_its_last_end() -> None:
    class Item:
        def __init__(self, tier: str) -> None:
            self.path = tiertimes.ROOT / tier / "test_x.py"

    saved = dict(tiertimes._spans)
    tiertimes._spans.clear()
    try:
        tiertimes.record(Item("cluster"), 10.0, 12.0)  # type: ignore[arg-type]
        tiertimes.record(Item("cluster"), 12.0, 70.0)  # type: ignore[arg-type]
        tiertimes.record(Item("engine"), 70.0, 71.0)  # type: ignore[arg-type]
        assert tiertimes._spans == {"cluster": [10.0, 70.0], "engine": [70.0, 71.0]}
    finally:
        tiertimes._spans.clear()
        tiertimes._spans.update(saved)
