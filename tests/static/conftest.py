"""The static tier: the repository read as documents and artifacts rather than run as
logic. The Helm chart rendered by a helm built from Go modules (``test_chart.py``), the
docs checked against the code (``test_docs.py`` for names, ``test_doc_claims.py``
for claims about rendered objects), each role's imports against its
declared install (``test_packaging.py``), the import contracts (``test_layering.py``)
and checkov's scan of the rendered examples and the chart (``test_checkov.py``). The
first run on a machine builds helm (~3.5 min) and installs checkov (~2 min);
``pytest tests/unit`` needs none of it."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/static/" in str(item.fspath):
            item.add_marker(pytest.mark.static)
