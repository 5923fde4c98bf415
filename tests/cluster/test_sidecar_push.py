"""Real sidecar processes push residency reports to the real operator, authenticated
by tokens bound to the kwok pods they stand in for, configured from the ConfigMap
the operator rendered."""

from __future__ import annotations

import json
import os
import subprocess
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvferry_dev.sidecars import sidecar_running
from kvferry_sidecar.promtext import Scrape
from tests.cluster.conftest import Kubectl, Operator, free_port, wait_until
from tests.cluster.test_operator import make, wait_ready
from tests.cluster.test_reports import bound_token


@contextmanager
def sidecar_process(
    kubectl: Kubectl, ns: str, pod: str, token: str, folder: Path, metrics_port: int | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """`kvferry-sidecar --role decode` as the pod `pod` would run it, minus the engine."""
    cm = kubectl.get("configmap", "tiny-sidecar", ns)["data"]
    settings = json.loads(cm["sidecar.json"])
    assert settings["operatorUrl"].startswith("https://127.0.0.1:")
    (folder / "operator-ca.crt").write_text(cm["operator-ca.crt"])
    settings.update(
        operatorCaFile=str(folder / "operator-ca.crt"), reportIntervalSeconds=1, kvEvents=""
    )
    (folder / "sidecar.json").write_text(json.dumps(settings))
    (folder / "token").write_text(token)
    env = {
        **os.environ,
        "POD_NAME": pod,
        "POD_NAMESPACE": ns,
        "KVFERRY_SERVER": "tiny",
        "KVFERRY_TOKEN_FILE": str(folder / "token"),
    }
    flags = [
        *("--host", "127.0.0.1"),
        *("--port", str(free_port())),
        *("--internal-port", str(free_port())),
        # The rendered 8002 would collide on this machine.
        *("--metrics-port", str(metrics_port or free_port())),
        *("--engine-url", f"http://127.0.0.1:{free_port()}"),
    ]
    with sidecar_running(folder / "sidecar.json", folder / "sidecar.log", env, flags=flags) as proc:
        yield proc


def pod_rows(kubectl: Kubectl, ns: str) -> dict[str, dict]:
    status = kubectl.get("kvcachestatus", "tiny", ns).get("status") or {}
    return {p["name"]: p for p in status.get("pods") or []}


def test_real_sidecars_report_and_forged_ones_do_not(
    kubectl: Kubectl, operator: Operator, ns: str, tmp_path: Path
):
    kubectl.apply(make(ns, spec={"decode": {"replicas": 2}}), "--server-side")
    wait_ready(kubectl, ns)
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.mkdir()
    bad.mkdir()
    token = bound_token(kubectl, ns, "tiny-decode-0")
    with (
        sidecar_process(kubectl, ns, "tiny-decode-0", token, good),
        sidecar_process(kubectl, ns, "tiny-decode-1", "forged." + "x" * 40, bad),
    ):
        wait_until(
            lambda: "tiny-decode-0" in pod_rows(kubectl, ns),
            40,
            "the real sidecar's report in KVCacheStatus",
        )
        # The forged sidecar has pushed several times by now; none may have landed.
        wait_until(
            lambda: (
                b"401" in (bad / "sidecar.log").read_bytes()
                or b"rejected" in (bad / "sidecar.log").read_bytes()
            ),
            20,
            "the forged sidecar's push refused",
        )
    rows = pod_rows(kubectl, ns)
    assert set(rows) == {"tiny-decode-0"}
    assert rows["tiny-decode-0"]["role"] == "decode"
    assert kubectl.get("kvcachestatus", "tiny", ns)["status"]["phase"] == "Reporting"


def test_a_real_sidecar_takes_a_spec_change_of_the_policy_live(
    kubectl: Kubectl, operator: Operator, ns: str, tmp_path: Path
):
    """The whole channel: spec -> publisher -> report answer -> the sidecar process's
    policy in force, on its /metrics, with the process never restarted."""
    kubectl.apply(make(ns), "--server-side")
    wait_ready(kubectl, ns)
    token = bound_token(kubectl, ns, "tiny-decode-0")
    port = free_port()

    def scrape() -> Scrape:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
                return Scrape(resp.read().decode())
        except OSError:  # not listening yet: nothing to read
            return Scrape("")

    with sidecar_process(kubectl, ns, "tiny-decode-0", token, tmp_path, port) as proc:
        wait_until(
            lambda: scrape().total("kvferry_policy_info", source="operator") == 1,
            40,
            "the operator's policy in force in the sidecar",
        )
        assert scrape().total("kvferry_retention_seconds") == 480
        patch = {"spec": {"kvTransfer": {"decodeRetentionSeconds": 120}}}
        kubectl.run(
            "patch", "dserver", "tiny", "-n", ns, "--type", "merge", "-p", json.dumps(patch)
        )
        wait_until(
            lambda: scrape().total("kvferry_retention_seconds") == 120,
            40,
            "the new retention in force in the sidecar",
        )
        assert scrape().total("kvferry_retention_ceiling_seconds") == 1800
        assert proc.poll() is None  # the same process all along
