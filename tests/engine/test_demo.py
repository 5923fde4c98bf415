"""Engine tier: the README's first command, `make demo` (``python -m kvferry_dev.demo``),
run as a user runs it, shorter (3 turns, 2 runs per mode). It starts its own P and D
and needs none of the tier's fixtures that start engines, so it runs first, with the
cores to itself.

What it must show, whatever the machine's speed: every turn after the first reused
what D held (in every run: a later run must not be served from an earlier run's
prefix cache instead), P pulled it, and every greedy answer equals the reuse-off one.
The TTFT ratios are the benchmark's business (docs/performance.md), not a test's.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.manifests import ROOT
from tests.progress import step

pytestmark = pytest.mark.engine

ROW = re.compile(
    r"^\s*(?P<turn>\d+)\s+(?P<prompt>\d+)\s+(?P<reused>\d+)\s+(?P<pulled>\d+)\s+"
    r"(?P<outcome>\S+)\s+[\d.]+\s+[\d.]+\s+[\d.]+x\s+(?P<same>yes|NO)\s*$"
)


@pytest.mark.parametrize("extra", [[], ["--stream", "--repeat", "1"]], ids=["json", "streamed"])
def test_make_demo_shows_reuse_with_answers_equal_to_reuse_off(
    engine_python: Path, tiny_model: Path, tmp_path: Path, extra: list[str]
) -> None:
    """The streamed run (``--stream``, one run per mode) shows the same: every later
    streamed turn pulls what D holds (vLLM 0.32: the re-anchored turn)."""
    argv = [sys.executable, "-m", "kvferry_dev.demo", "--turns", "3", "--repeat", "2", *extra]
    with step(f"the demo, shortened ({' '.join(argv[1:])})"):
        proc = subprocess.run(
            [*argv, "--log-dir", str(tmp_path / "demo")],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
        )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    rows = [m.groupdict() for line in out.splitlines() if (m := ROW.match(line))]
    assert [int(r["turn"]) for r in rows] == [1, 2, 3], out[-4000:]
    assert all(r["same"] == "yes" for r in rows), out[-4000:]
    assert rows[0]["outcome"] == "no-handle", out[-4000:]
    for r in rows[1:]:
        # The outcomes of both runs, joined: "reused" alone, in every run.
        assert r["outcome"] == "reused", out[-4000:]
        assert int(r["pulled"]) > 0 and int(r["reused"]) > 0, out[-4000:]
