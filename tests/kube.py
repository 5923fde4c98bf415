"""Cluster fixtures and helpers (registered in tests/conftest.py for every tier).

The cluster tier: a real kube-apiserver (+ etcd, controller-manager, scheduler,
kwok fake GPU nodes) from hack/controlplane.sh, the real operator process and
real kubectl. Nothing here is skipped: if the control plane cannot start, the
tier fails with the log tail."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from kvferry_dev.audit import AuditedRequest, read_audit
from kvferry_dev.certs import self_signed_cert
from tests.manifests import ROOT
from tests.progress import step

SCRIPT = ROOT / "hack" / "controlplane.sh"
STATE = Path(os.environ.get("KVFERRY_TEST_CP_DIR", f"/tmp/kvferry-cp-test-{os.getpid()}"))
PORT = os.environ.get("KVFERRY_TEST_CP_PORT", "26443")
# The API server's audit log records one user alone: an operator a test runs under a
# client certificate of that name (audited_kubeconfig), to count its requests. Nobody
# else is recorded, so the log stays small and costs the other tests nothing.
AUDITED_USER = "kvferry-operator-audited"
AUDIT_DIR = Path(f"{STATE}-audit")
AUDIT_LOG = AUDIT_DIR / "audit.log"
AUDIT_POLICY = f"""apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
- level: Metadata
  users: [{AUDITED_USER}]
- level: None
"""


def cp_env() -> dict[str, str]:
    """hack/controlplane.sh's environment for the session's control plane (also for
    a kube-apiserver a test stops and starts: it keeps its audit log)."""
    AUDIT_DIR.mkdir(parents=True, exist_ok=True)
    policy = AUDIT_DIR / "policy.yaml"
    policy.write_text(AUDIT_POLICY)
    return {
        **os.environ,
        "KVFERRY_CP_DIR": str(STATE),
        "KVFERRY_CP_PORT": PORT,
        "KVFERRY_CP_APISERVER_ARGS": (
            f"--audit-policy-file={policy} --audit-log-path={AUDIT_LOG} "
            "--audit-log-format=json --audit-log-maxsize=0"
        ),
    }


class Kubectl:
    def __init__(self, kubeconfig: Path) -> None:
        self.env = {**os.environ, "KUBECONFIG": str(kubeconfig)}

    def run(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            ["kubectl", *args],
            input=input,
            capture_output=True,
            text=True,
            env=self.env,
            timeout=timeout,
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed: {proc.stderr}{proc.stdout}")
        return proc

    def json(self, *args: str) -> Any:
        return json.loads(self.run(*args, "-o", "json").stdout)

    def get(self, kind: str, name: str, ns: str) -> dict[str, Any] | None:
        proc = self.run("get", kind, name, "-n", ns, "-o", "json", check=False)
        return json.loads(proc.stdout) if proc.returncode == 0 else None

    def apply(
        self, obj: dict[str, Any] | list[dict[str, Any]], *args: str, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        if isinstance(obj, list):
            body = json.dumps({"apiVersion": "v1", "kind": "List", "items": obj})
        else:
            body = json.dumps(obj)
        return self.run("apply", "-f", "-", *args, input=body, check=check)

    def delete(self, objs: list[dict[str, Any]]) -> subprocess.CompletedProcess[str]:
        body = json.dumps({"apiVersion": "v1", "kind": "List", "items": objs})
        return self.run(
            "delete", "-f", "-", "--wait=false", "--ignore-not-found", input=body, check=False
        )


def wait_until(check: Callable[[], Any], timeout: float, what: str, interval: float = 0.5) -> Any:
    """Poll ``check`` until it returns something truthy; fail naming ``what``."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except AssertionError as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")


@pytest.fixture(scope="package")
def kubeconfig() -> Iterator[Path]:
    env = cp_env()
    what = (
        f"starting the local control plane on port {PORT} (hack/controlplane.sh up; the "
        "first run on a machine builds it from Go modules, ~8 min on 2 cores)"
    )
    with step(what):
        proc = subprocess.run(
            ["bash", str(SCRIPT), "up"], capture_output=True, text=True, env=env, timeout=3600
        )
    if proc.returncode != 0:
        pytest.fail(f"local control plane did not start:\n{proc.stderr[-6000:]}", pytrace=False)
    yield STATE / "kubeconfig"
    subprocess.run(["bash", str(SCRIPT), "down"], env=env, capture_output=True, timeout=120)
    shutil.rmtree(AUDIT_DIR, ignore_errors=True)


def audited_kubeconfig(kubeconfig: Path, folder: Path) -> Path:
    """The admin's kubeconfig with a client certificate of AUDITED_USER (in
    system:masters too), signed by the control plane's CA."""
    pki = STATE / "pki"
    key, csr, crt = (folder / f"audited.{x}" for x in ("key", "csr", "crt"))
    ext = folder / "audited.ext"
    ext.write_text("extendedKeyUsage=clientAuth\n")
    _openssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr),
        "-subj", f"/O=system:masters/CN={AUDITED_USER}",
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", str(csr), "-CA", str(pki / "ca.crt"), "-CAkey",
        str(pki / "ca.key"), "-CAcreateserial", "-out", str(crt), "-days", "2",
        "-extfile", str(ext),
    )  # fmt: skip
    text = kubeconfig.read_text()
    text = text.replace(str(pki / "admin.crt"), str(crt)).replace(str(pki / "admin.key"), str(key))
    path = folder / "audited.kubeconfig"
    path.write_text(text)
    return path


def audited_requests(since: float = 0.0, until: float = float("inf")) -> list[AuditedRequest]:
    """AUDITED_USER's requests received in [since, until), one per audit ID."""
    return [r for r in read_audit(AUDIT_LOG, AUDITED_USER) if since <= r.at < until]


@contextmanager
def bare_control_plane(offset: int, label: str) -> Iterator[Path]:
    """A second control plane without kvferry's CRDs, as a user's cluster is before
    installing kvferry; ``offset`` keeps its ports apart from the session's."""
    state = Path(f"{STATE}-{label}")
    env = {
        **os.environ,
        "KVFERRY_CP_DIR": str(state),
        "KVFERRY_CP_PORT": str(int(PORT) + offset),
        "KVFERRY_CP_CRDS": "0",
    }
    proc = subprocess.run(
        ["bash", str(SCRIPT), "up"], capture_output=True, text=True, env=env, timeout=3600
    )
    if proc.returncode != 0:
        pytest.fail(f"bare control plane did not start:\n{proc.stderr[-6000:]}", pytrace=False)
    try:
        yield state / "kubeconfig"
    finally:
        subprocess.run(["bash", str(SCRIPT), "down"], env=env, capture_output=True, timeout=120)


@pytest.fixture(scope="package")
def kubectl(kubeconfig: Path) -> Kubectl:
    return Kubectl(kubeconfig)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def make_ca(folder: Path, name: str) -> tuple[Path, Path]:
    """A throwaway CA: (ca.crt, ca.key) in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    cert, key = folder / "ca.crt", folder / "ca.key"
    _openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
        "-keyout", str(key), "-out", str(cert), "-subj", f"/CN={name}",
    )  # fmt: skip
    return cert, key


def signed_cert(folder: Path, ca: tuple[Path, Path]) -> tuple[Path, Path]:
    """A serving certificate for 127.0.0.1 signed by ``ca``: (tls.crt, tls.key)."""
    folder.mkdir(parents=True, exist_ok=True)
    cert, key, csr = folder / "tls.crt", folder / "tls.key", folder / "tls.csr"
    ext = folder / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
    _openssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr),
        "-subj", "/CN=kvferry-operator",
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]),
        "-CAcreateserial", "-out", str(cert), "-days", "2", "-extfile", str(ext),
    )  # fmt: skip
    return cert, key


class Operator:
    """The real operator as a separate process, restartable, with its report endpoint.

    ``command`` runs another build of it (the wheel's console script, say); default:
    this tree's, with the test interpreter."""

    def __init__(self, kubeconfig: Path, log_path: Path, command: list[str] | None = None) -> None:
        self.kubeconfig = kubeconfig
        self.log_path = log_path
        self.command = command or [sys.executable, "-m", "kvferry_operator.cli"]
        self.proc: subprocess.Popen[bytes] | None = None
        self.cert, self.key = self_signed_cert(log_path.parent)
        # The CA the rendered ConfigMaps carry (the self-signed certificate is its own).
        self.ca: Path | None = None
        self.extra_env: dict[str, str] = {}
        self.args: list[str] = []  # after `run --standalone` (--leader-elect, say)
        self.report_port = free_port()
        self.report_url = f"https://127.0.0.1:{self.report_port}/v1/reports"
        self.metrics_port = free_port()
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}/metrics"

    def start(self) -> None:
        env = {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "KVFERRY_RESYNC_SECONDS": "5",
            "KVFERRY_TLS_CERT_FILE": str(self.cert),
            "KVFERRY_TLS_KEY_FILE": str(self.key),
            "KVFERRY_REPORT_HOST": "127.0.0.1",
            "KVFERRY_REPORT_PORT": str(self.report_port),
            "KVFERRY_METRICS_HOST": "127.0.0.1",
            "KVFERRY_METRICS_PORT": str(self.metrics_port),
            "KVFERRY_PUBLISH_SECONDS": "1",
            "KVFERRY_MIN_STATUS_WRITE_SECONDS": "1",
            # What the rendered ConfigMaps tell sidecars (the chart sets the Service URL).
            "KVFERRY_REPORT_URL": self.report_url,
            "KVFERRY_TLS_CA_FILE": str(self.ca or self.cert),
            "KVFERRY_PREREQUISITES_CACHE_SECONDS": "1",
            **self.extra_env,
        }
        log = open(self.log_path, "ab")  # noqa: SIM115 - the process owns it
        self.proc = subprocess.Popen(
            [*self.command, "run", "--standalone", *self.args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self.proc = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@pytest.fixture(scope="package")
def operator(kubeconfig: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Operator]:
    op = Operator(kubeconfig, tmp_path_factory.mktemp("operator") / "operator.log")
    op.start()
    yield op
    op.stop()
    print(f"\noperator log: {op.log_path}", file=sys.stderr)


@pytest.fixture
def ns(kubectl: Kubectl, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace with a bound `models` PVC (kwok has no volume provisioner)."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    kubectl.run("create", "namespace", name)
    kubectl.apply(
        [
            {
                "apiVersion": "v1",
                "kind": "PersistentVolume",
                "metadata": {"name": f"models-{name}"},
                "spec": {
                    "capacity": {"storage": "1Gi"},
                    "accessModes": ["ReadOnlyMany"],
                    "hostPath": {"path": "/tmp/kvferry-models"},
                    "claimRef": {"namespace": name, "name": "models"},
                },
            },
            {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "metadata": {"name": "models", "namespace": name},
                "spec": {
                    "accessModes": ["ReadOnlyMany"],
                    "resources": {"requests": {"storage": "1Gi"}},
                    "volumeName": f"models-{name}",
                    "storageClassName": "",
                },
            },
        ]
    )
    yield name
    kubectl.run("delete", "namespace", name, "--wait=false", check=False)
    kubectl.run("delete", "pv", f"models-{name}", "--wait=false", check=False)


def condition_of(obj: dict[str, Any] | None, ctype: str) -> dict[str, Any]:
    """The condition ``ctype`` of a DisaggregatedServer as read; {} when it has none."""
    conditions = ((obj or {}).get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c.get("type") == ctype), {})


def condition(kubectl: Kubectl, ns: str, name: str, ctype: str) -> dict[str, Any]:
    """The server's condition ``ctype`` now (one read); {} when it has none."""
    return condition_of(kubectl.get("dserver", name, ns), ctype)


def watch_server(
    kubectl: Kubectl,
    ns: str,
    name: str,
    check: Callable[[dict[str, Any]], Any],
    timeout: float,
    what: str,
) -> Any:
    """Watch the server ``ns/name`` until ``check(server)`` is truthy; that value. A
    watch shows every change, so a state that lasts a moment (a reason the next write
    replaces) is seen too, where a poll between two writes would miss it. The watch
    starts with the server as it is, if it exists; fails naming ``what``."""
    from kubernetes import client, config, watch

    from kvferry_operator import api

    api_client = config.new_client_from_config(config_file=kubectl.env["KUBECONFIG"])
    objects = client.CustomObjectsApi(api_client)
    deadline = time.monotonic() + timeout
    last: dict[str, Any] | None = None
    try:
        # The API server ends a watch at timeout_seconds: a new one starts from the
        # state as it is then (no resourceVersion), so nothing is missed for the check.
        while (left := deadline - time.monotonic()) > 0:
            stream = watch.Watch().stream(
                objects.list_namespaced_custom_object,
                api.GROUP,
                api.VERSION,
                ns,
                api.SERVER_PLURAL,
                field_selector=f"metadata.name={name}",
                timeout_seconds=max(1, int(left)),
                _request_timeout=left + 10,
            )
            for event in stream:
                if event["type"] not in ("ADDED", "MODIFIED"):
                    continue  # DELETED, BOOKMARK, ERROR (a new watch follows)
                last = event["object"]
                found = check(last)
                if found:
                    return found
                if time.monotonic() > deadline:
                    break
    finally:
        api_client.close()
    seen = ((last or {}).get("status") or {}).get("conditions")
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last conditions: {seen}")


def wait_condition(
    kubectl: Kubectl,
    ns: str,
    name: str,
    ctype: str,
    reason: str | None = None,
    status: str | None = None,
    timeout: float = 60,
) -> dict[str, Any]:
    """The server's condition ``ctype`` once it has ``reason`` and/or ``status``, as a
    watch shows it (watch_server): the condition."""

    def check(obj: dict[str, Any]) -> dict[str, Any] | None:
        c = condition_of(obj, ctype)
        matches = reason in (None, c.get("reason")) and status in (None, c.get("status"))
        return c if c and matches else None

    wanted = ", ".join(f"{k} {v}" for k, v in (("reason", reason), ("status", status)) if v)
    return watch_server(kubectl, ns, name, check, timeout, f"{ns}/{name} {ctype} with {wanted}")


def wait_for_event(kubectl: Kubectl, ns: str, name: str, reason: str, timeout: float = 15) -> Any:
    """Events are posted after the status write they explain; give them a moment."""
    return wait_until(
        lambda: kubectl.json(
            "get",
            "events",
            "-n",
            ns,
            "--field-selector",
            f"involvedObject.name={name},reason={reason}",
        )["items"],
        timeout,
        f"a {reason} event on {name}",
    )
