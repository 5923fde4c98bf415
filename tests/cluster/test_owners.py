"""spec.owners through the real API server and the real operator: what is accepted is
rendered into the decode sidecars' settings as written, and stored without defaults
(so GitOps tools see no drift). Refusals are in tests/manifests.py INVALID (owner-*),
run here by tests/cluster/test_operator.py::test_invalid_spec_is_rejected_by_the_api_server."""

from __future__ import annotations

import json
from typing import Any

from tests.cluster.conftest import Kubectl, Operator, wait_until
from tests.cluster.test_operator import make

OWNERS = {"header": "X-Authenticated-User", "maxHandles": 16}


def sidecar_settings(kubectl: Kubectl, ns: str) -> dict[str, Any] | None:
    cm = kubectl.get("configmap", "tiny-sidecar", ns)
    return json.loads(cm["data"]["sidecar.json"]) if cm else None


def test_owners_reach_the_sidecar_settings_as_written(
    kubectl: Kubectl, operator: Operator, ns: str
):
    kubectl.apply(make(ns, spec={"owners": OWNERS}), "--server-side")
    settings = wait_until(
        lambda: (s := sidecar_settings(kubectl, ns)) and "ownerHeader" in s and s,
        60,
        f"{ns}/tiny-sidecar with ownerHeader",
    )
    assert {k: v for k, v in settings.items() if k.startswith("owner")} == {
        "ownerHeader": "X-Authenticated-User",
        "ownerMaxHandles": 16,
    }
    # Stored as written: no default added for the unset cap (the sidecar derives it).
    assert kubectl.get("dserver", "tiny", ns)["spec"]["owners"] == OWNERS
