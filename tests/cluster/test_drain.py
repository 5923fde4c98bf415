"""The drain on the real API server: what spec.<role>.drainSeconds takes, and the pods
the operator renders from it (the engine's preStop on the sidecar's /drain, the grace
of the drain plus a margin) as the API server stores them. The pods are kwok's: no
container runs, so the drain itself is the unit tier's (tests/unit/sidecar/test_drain.py)
and the real-node tier's.

Why the engine's preStop and not the sidecar's own SIGTERM: docs/production.md (Drain)."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest

from kvferry_operator import api, render
from kvferry_wire import protocol
from tests.cluster.conftest import Kubectl, Operator, wait_until
from tests.cluster.test_operator import make, wait_ready
from tests.manifests import INVALID, Invalid, merge, server

REFUSED = [c for c in INVALID if "-drain-" in c.id]


def dry_run(kubectl: Kubectl, spec: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    manifest = merge(server(spec), {"metadata": {"namespace": "default"}})
    return kubectl.apply(manifest, "--server-side", "--dry-run=server", "-o", "json", check=False)


@pytest.mark.parametrize("value", [0, 120, 3600])
def test_drain_seconds_round_trips(kubectl: Kubectl, value: int):
    proc = dry_run(kubectl, {"decode": {"drainSeconds": value}})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["spec"]["decode"]["drainSeconds"] == value


def test_unset_drain_seconds_stays_unset(kubectl: Kubectl):
    # The default depends on the role (render.drain_seconds): no schema default.
    proc = dry_run(kubectl, {})
    assert proc.returncode == 0, proc.stderr
    stored = json.loads(proc.stdout)["spec"]
    assert "drainSeconds" not in stored["decode"] and "drainSeconds" not in stored["prefill"]


def test_refused_cases_are_the_drain_ones():
    assert len(REFUSED) == 3


@pytest.mark.parametrize("case", REFUSED, ids=lambda c: c.id)
def test_anything_else_is_refused_naming_the_field(kubectl: Kubectl, case: Invalid):
    # Created (a JSON POST), so the schema answers: a server-side apply of a string
    # where an integer belongs fails earlier, building its typed patch, without a path.
    manifest = merge(case.manifest, {"metadata": {"namespace": "default"}})
    proc = kubectl.run(
        "create", "--dry-run=server", "-f", "-", input=json.dumps(manifest), check=False
    )
    out = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode != 0, f"accepted: {out}"
    assert f"{case.path}: Invalid value" in out, out
    assert case.message in out, out


def test_the_stored_pods_carry_the_drain_and_its_grace(
    kubectl: Kubectl, operator: Operator, ns: str
):
    kubectl.apply(make(ns, spec={"decode": {"drainSeconds": 120}}), "--server-side")
    wait_ready(kubectl, ns)
    stored = kubectl.get("dserver", "tiny", ns)
    objs = render.render(api.parse_server(stored))
    for role, grace in (("decode", 180), ("prefill", 60)):
        want = next(
            o["spec"]["template"]["spec"]
            for o in objs
            if o["kind"] == "StatefulSet" and o["metadata"]["name"] == f"tiny-{role}"
        )
        pod = wait_until(
            lambda role=role: kubectl.get("pod", f"tiny-{role}-0", ns), 30, f"tiny-{role}-0"
        )
        spec = pod["spec"]
        # As rendered: a field the API server pruned or defaulted otherwise would differ.
        assert (
            spec["terminationGracePeriodSeconds"] == grace == want["terminationGracePeriodSeconds"]
        )
        (engine,) = spec["containers"]
        assert engine["lifecycle"] == want["containers"][0]["lifecycle"]
        assert engine["lifecycle"]["preStop"]["httpGet"] == {
            "path": protocol.DRAIN_PATH,
            "port": protocol.SIDECAR_INTERNAL_PORT,
            "scheme": "HTTP",
        }
        (sidecar,) = spec["initContainers"]
        assert sidecar["args"] == want["initContainers"][0]["args"]
        drain = sidecar["args"][sidecar["args"].index("--drain-seconds") + 1]
        assert int(drain) == grace - render.DRAIN_MARGIN_SECONDS
