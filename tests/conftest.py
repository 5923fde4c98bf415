"""Fixtures shared by the tiers: what ships (the wheel, the images), built once per
session. The control plane and the operator (tests/kube.py) are registered by each tier
that uses them (artifacts, cluster, engine) and scoped to it: a tier's processes end
with the tier, so none runs on through the next tier on a 2-core machine."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests import progress
from tests.images import image_context, images, wheel  # noqa: F401 - fixtures

pytest_plugins = ["tests.tiertimes"]


def pytest_configure(config: pytest.Config) -> None:
    progress.attach(config)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    op = getattr(item, "funcargs", {}).get("operator")
    if report.when == "call" and report.failed and hasattr(op, "log"):
        report.sections.append(("operator log (last 6000 chars)", op.log()[-6000:]))
