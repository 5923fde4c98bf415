"""Fixtures shared by the tiers. The control plane and the operator are session-wide:
the cluster tier and the engine tier's end-to-end test use the same ones."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests import progress
from tests.images import image_context, images, wheel  # noqa: F401 - fixtures
from tests.kube import kubeconfig, kubectl, ns, operator  # noqa: F401 - fixtures


def pytest_configure(config: pytest.Config) -> None:
    progress.attach(config)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    op = getattr(item, "funcargs", {}).get("operator")
    if report.when == "call" and report.failed and op is not None:
        report.sections.append(("operator log (last 6000 chars)", op.log()[-6000:]))
