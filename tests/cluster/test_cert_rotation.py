"""Rotating the report endpoint's certificate while real sidecars push.

The operator reads its certificate from files (a Secret volume in a cluster); the
sidecars trust the CA the operator renders into each server's ConfigMap. Here the
files are swapped the way the kubelet swaps a Secret volume (a new folder, one
rename), and a stand-in for the kubelet copies the ConfigMap's CA into the
sidecar's file, as a ConfigMap volume update does. Two rotations: a renewed
certificate from the same CA (what cert-manager does on renewal), then a new CA.
After each, new TLS connections get the new certificate and the sidecar's pushes
go on landing, with the operator never restarted. (A push may time out now and then
on a busy machine: the test pushes every second with a one-second deadline, so it
counts pushes that land rather than pushes that fail.)
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import ssl
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvferry_dev.sidecars import sidecar_running
from tests.cluster.conftest import Kubectl, Operator, free_port, wait_until
from tests.cluster.test_operator import make, wait_ready
from tests.cluster.test_reports import bound_token
from tests.kube import make_ca, signed_cert

PUSHES = re.compile(r'^kvferry_report_pushes_total\{result="(ok|error)"\} ([0-9.e+]+)$', re.M)


def install(live: Path, ca: Path, cert: Path, key: Path) -> None:
    """Replace the live folder's ca.crt, tls.crt and tls.key at once."""
    staged = live.parent / f"{live.name}.staged"
    staged.mkdir()
    for src, name in ((ca, "ca.crt"), (cert, "tls.crt"), (key, "tls.key")):
        shutil.copy(src, staged / name)
    if live.exists():
        old = live.parent / f"{live.name}.old"
        os.rename(live, old)
        os.rename(staged, live)
        shutil.rmtree(old)
    else:
        os.rename(staged, live)


class ConfigMapSync(threading.Thread):
    """The kubelet's part: keep the sidecar's CA file equal to the ConfigMap's key."""

    def __init__(self, kubectl: Kubectl, ns: str, target: Path) -> None:
        super().__init__(daemon=True)
        self.kubectl, self.ns, self.target = kubectl, ns, target
        self.stopped = threading.Event()

    def sync(self) -> None:
        cm = self.kubectl.get("configmap", "tiny-sidecar", self.ns)
        pem = (cm or {}).get("data", {}).get("operator-ca.crt")
        if pem and (not self.target.exists() or self.target.read_text() != pem):
            tmp = self.target.with_suffix(".tmp")
            tmp.write_text(pem)
            os.replace(tmp, self.target)

    def run(self) -> None:
        while not self.stopped.wait(0.5):
            # The API server may be busy for a moment: the next round tries again.
            with contextlib.suppress(Exception):
                self.sync()


@contextmanager
def decode_sidecar(kubectl: Kubectl, ns: str, folder: Path, token: str) -> Iterator[str]:
    """The real sidecar of tiny-decode-0, pushing every second; yields its /metrics URL."""
    cm = kubectl.get("configmap", "tiny-sidecar", ns)["data"]
    settings = json.loads(cm["sidecar.json"])
    settings.update(
        operatorCaFile=str(folder / "operator-ca.crt"), reportIntervalSeconds=1, kvEvents=""
    )
    (folder / "sidecar.json").write_text(json.dumps(settings))
    (folder / "token").write_text(token)
    sync = ConfigMapSync(kubectl, ns, folder / "operator-ca.crt")
    sync.sync()
    sync.start()
    port, internal = free_port(), free_port()
    env = {
        **os.environ,
        "POD_NAME": "tiny-decode-0",
        "POD_NAMESPACE": ns,
        "KVFERRY_SERVER": "tiny",
        "KVFERRY_TOKEN_FILE": str(folder / "token"),
    }
    flags = [
        "--host=127.0.0.1",
        f"--port={port}",
        f"--internal-port={internal}",
        f"--metrics-port={free_port()}",  # the rendered 8002 would collide on this machine
        f"--engine-url=http://127.0.0.1:{free_port()}",
    ]
    try:
        with sidecar_running(folder / "sidecar.json", folder / "sidecar.log", env, flags=flags):
            yield f"http://127.0.0.1:{internal}/metrics"  # /metrics: the internal port only
    finally:
        sync.stopped.set()


def pushes(metrics_url: str) -> dict[str, float]:
    """The sidecar's push counters by result; {} while it is still starting."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=5) as resp:
            text = resp.read().decode()
    except urllib.error.URLError:
        return {}
    return {result: float(n) for result, n in PUSHES.findall(text)}


def der(cert: Path) -> bytes:
    return ssl.PEM_cert_to_DER_cert(cert.read_text())


def served_certificate(port: int) -> bytes:
    """The certificate a new TLS connection to the endpoint is shown (unverified)."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as sock,
        ctx.wrap_socket(sock) as tls,
    ):
        return tls.getpeercert(binary_form=True) or b""


def handshake_ok(port: int, ca: Path) -> bool:
    """A new TLS connection to the endpoint, verified against ``ca``."""
    ctx = ssl.create_default_context(cafile=str(ca))
    try:
        with urllib.request.urlopen(
            f"https://127.0.0.1:{port}/healthz", context=ctx, timeout=5
        ) as resp:
            return resp.status == 200
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, ssl.SSLCertVerificationError):
            return False
        raise


@pytest.fixture
def rotating_operator(
    kubectl: Kubectl, operator: Operator, kubeconfig: Path, tmp_path: Path
) -> Iterator[tuple[Operator, Path]]:
    """An operator serving the certificate in tmp_path/live (the tier's operator
    is stopped meanwhile: two operators would both reconcile)."""
    live = tmp_path / "live"
    ca = make_ca(tmp_path / "ca1", "kvferry-ca-1")
    install(live, ca[0], *signed_cert(tmp_path / "leaf1", ca))
    operator.stop()
    op = Operator(kubeconfig, tmp_path / "operator.log")
    op.cert, op.key, op.ca = live / "tls.crt", live / "tls.key", live / "ca.crt"
    op.start()
    try:
        yield op, tmp_path
    finally:
        op.stop()
        operator.start()


def test_certificate_rotation_keeps_reports_flowing(
    kubectl: Kubectl, rotating_operator: tuple[Operator, Path], ns: str
):
    op, tmp = rotating_operator
    live = tmp / "live"
    kubectl.apply(make(ns), "--server-side")
    wait_ready(kubectl, ns)
    side = tmp / "sidecar"
    side.mkdir()
    token = bound_token(kubectl, ns, "tiny-decode-0")
    with decode_sidecar(kubectl, ns, side, token) as metrics:
        wait_until(lambda: pushes(metrics).get("ok", 0) >= 2, 40, "pushes accepted")
        pid = op.proc.pid

        # 1. Renewal: a new certificate from the same CA. Nothing may fail.
        ca1 = (tmp / "ca1" / "ca.crt", tmp / "ca1" / "ca.key")
        renewed = signed_cert(tmp / "leaf1b", ca1)
        before = pushes(metrics)
        install(live, ca1[0], *renewed)
        wait_until(
            lambda: served_certificate(op.report_port) == der(renewed[0]),
            20,
            "the renewed certificate served to a new connection",
        )
        assert "serving certificate reloaded" in op.log()
        # The sidecars' CA (unchanged) verifies it on new connections: nothing to wait for.
        assert handshake_ok(op.report_port, ca1[0])
        wait_until(
            lambda: pushes(metrics).get("ok", 0) >= before["ok"] + 3, 30, "pushes after renewal"
        )

        # 2. A new CA: the operator serves the new certificate to new connections at
        # once, and the sidecars trust it once the ConfigMap carries the new CA.
        ca2 = make_ca(tmp / "ca2", "kvferry-ca-2")
        install(live, ca2[0], *signed_cert(tmp / "leaf2", ca2))
        wait_until(lambda: handshake_ok(op.report_port, ca2[0]), 20, "the new certificate")
        assert not handshake_ok(op.report_port, ca1[0])
        new_ca = ca2[0].read_text()
        wait_until(
            lambda: (
                kubectl.get("configmap", "tiny-sidecar", ns)["data"]["operator-ca.crt"] == new_ca
            ),
            30,
            "the new CA in the server's ConfigMap",
        )
        wait_until(
            lambda: (side / "operator-ca.crt").read_text() == new_ca, 10, "the sidecar's CA file"
        )
        # Pushes on new connections (the old CA's context is gone) land again.
        after_ca = pushes(metrics)
        wait_until(
            lambda: pushes(metrics).get("ok", 0) >= after_ca["ok"] + 3,
            30,
            "pushes verified against the new CA",
        )
        assert op.proc is not None and op.proc.pid == pid, "the operator was restarted"
    rows = kubectl.get("kvcachestatus", "tiny", ns)["status"]["pods"]
    assert [r["name"] for r in rows] == ["tiny-decode-0"]
