"""The cluster tier: tests against the real API server from hack/controlplane.sh.

Fixtures live in tests/kube.py (registered here, scoped to this tier: its control plane
and operator stop when its last test ends); the names below are re-exported for the
tests that import them from here.
"""

from __future__ import annotations

import pytest

from tests.kube import Kubectl, Operator, free_port, kubeconfig, kubectl, ns, operator, wait_until  # noqa: F401 - fixtures, package-scoped

__all__ = ["Kubectl", "Operator", "free_port", "wait_until"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/cluster/" in str(item.fspath):
            item.add_marker(pytest.mark.cluster)
