"""checkov, the scanner platform teams run on manifests in CI and admission, over what
kvferry ships: ``kvferry-operator render`` of every example and ``helm template`` of
the chart (default values). Every check passes, or the object says why it does not
apply with a ``checkov.io/skipN: CKV_K8S_xx=reason`` annotation.

checkov lives in its own venv (hack/checkov.sh, pinned, cached under
~/.cache/kvferry). Where it cannot be installed the test fails in CI and skips with
the reason elsewhere. Warm: 16-22 s a scan on the loaded 2-core machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from kvferry_operator import cli
from tests.helm import template_text
from tests.manifests import EXAMPLES, ROOT
from tests.progress import say, step

CHECKOV_SH = ROOT / "hack" / "checkov.sh"


@pytest.fixture(scope="module")
def checkov() -> str:
    with step("checkov (hack/checkov.sh build; the first run on a machine installs it, ~2 min)"):
        proc = subprocess.run(
            ["bash", str(CHECKOV_SH), "build"], capture_output=True, text=True, timeout=1200
        )
    if proc.returncode != 0:
        why = f"hack/checkov.sh build failed:\n{proc.stderr[-3000:]}"
        if os.environ.get("CI") == "true":
            pytest.fail(why)  # CI must scan: a skipped scan would pass anything
        say(f"SKIPPED the checkov scan: {why}")
        pytest.skip(why)
    return proc.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def manifests(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One file per example as ``kvferry-operator render`` prints it, and the chart."""
    out = tmp_path_factory.mktemp("checkov")
    for example in EXAMPLES:
        with open(example) as f:
            objects, errors = cli.render_documents(f)
        assert not errors, f"{example.name}: {errors}"
        with open(out / f"render-{example.name}", "w") as f:
            cli.dump_yaml(objects, f)
    (out / "chart.yaml").write_text(template_text())
    return out


@pytest.fixture(scope="module")
def report(checkov: str, manifests: Path) -> dict[str, Any]:
    return scan(checkov, manifests)


def scan(checkov: str, folder: Path) -> dict[str, Any]:
    started = time.monotonic()
    proc = subprocess.run(
        # --skip-download: no network (checkov would fetch its guideline links).
        [checkov, "-d", str(folder), "--framework", "kubernetes", "--skip-download", "-o", "json"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd="/",  # not the clone: its operator/ folder shadows the stdlib module
    )
    say(f"checkov scanned {folder.name} in {time.monotonic() - started:.1f} s")
    # checkov exits 1 when a check failed; anything else but 0 is checkov failing.
    assert proc.returncode in (0, 1), f"checkov exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    report = json.loads(proc.stdout)
    assert isinstance(report, dict), "one framework, one report"
    return report


def describe(check: dict[str, Any]) -> str:
    return (
        f"{check['check_id']} {check['check_name']}: {Path(check['file_path']).name} "
        f"{check['resource']}"
    )


def test_checkov_finds_no_failed_check(report: dict[str, Any], manifests: Path) -> None:
    """0 failed checks on every rendered example and the chart (each failure listed)."""
    failed = sorted(describe(c) for c in report["results"]["failed_checks"])
    if failed:
        pytest.fail(f"{len(failed)} failed checkov checks:\n" + "\n".join(failed), pytrace=False)
    # Not vacuous: every file was read and every workload checked.
    files = {Path(c["file_path"]).name for c in report["results"]["passed_checks"]}
    assert files == {p.name for p in manifests.iterdir()}
    assert report["summary"]["parsing_errors"] == 0
    assert report["summary"]["passed"] > 500


def test_every_skipped_check_says_why(report: dict[str, Any]) -> None:
    """A skip annotation without '=reason' reads 'No comment provided': refused."""
    skipped = report["results"]["skipped_checks"]
    assert skipped, "the engines' skips (root user, writable root) are not seen"
    bare = [
        describe(c)
        for c in skipped
        if c["check_result"].get("suppress_comment") in (None, "", "No comment provided")
    ]
    assert not bare, "skipped without a reason:\n" + "\n".join(bare)
