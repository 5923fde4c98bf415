"""The images, built here and run as the cluster would run them.

Built by hack/images.sh (buildah, runc, a local Debian base, the session's wheel and
dependency wheels installed offline), then run with podman: the operator image with
the chart's Deployment (user, read-only root, dropped capabilities, environment, TLS
Secret, the /tmp emptyDir, the in-cluster ServiceAccount token of the chart's RBAC)
against the session's API server until a server is Ready and a report lands; the
sidecar image with the renderer's sidecar container against fake engines. The only
changes to what the pod specs say: host networking (ports moved to free ones) and the
API server's address (this machine's loopback, as KUBERNETES_SERVICE_HOST)."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.artifacts.conftest import (
    FakeEngines,
    public_readyz_says_only_ready,
    rendered_sidecar,
    serve_one_turn,
    wait_http_ready,
)
from tests.artifacts.pods import (
    SA_MOUNT,
    from_pod_spec,
    own_files,
    podman,
    podman_argv,
    secret_files,
    service_account_files,
)
from tests.cluster.test_chart import _push
from tests.cluster.test_operator import CHILDREN, wait_ready
from tests.cluster.test_reports import bound_token, decode_report
from tests.helm import CHART, helm
from tests.images import IMAGES_SH, Images
from tests.kube import PORT, Kubectl, Operator, free_port, wait_until
from tests.manifests import server


def python_in(image: str, code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            *("bash", str(IMAGES_SH), "run", "--rm", "--passwd=false", "--read-only"),
            *("--user", "65532:65532"),
            *("--entrypoint", "/opt/kvferry/bin/python", image, "-c", code),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_images_run_as_65532_and_carry_only_their_role(images: Images):
    for image in (images.operator, images.sidecar):
        config = yaml.safe_load(podman("image", "inspect", image).stdout)[0]["Config"]
        assert config["User"] == "65532:65532", image
    assert python_in(images.operator, "import kopf, kubernetes, celpy, jsonschema").returncode == 0
    for module in ("zmq", "cbor2"):
        proc = python_in(images.operator, f"import {module}")
        assert f"No module named '{module}'" in proc.stderr, proc.stderr
    assert python_in(images.sidecar, "import zmq, cbor2, prometheus_client").returncode == 0
    for module in ("kopf", "kubernetes", "celpy"):
        proc = python_in(images.sidecar, f"import {module}")
        assert f"No module named '{module}'" in proc.stderr, proc.stderr


def test_the_sidecar_image_adds_only_its_venv_to_the_slim_base(images: Images):
    # One small image for every engine version (images/README.md): the base and the
    # sidecar's venv, 63 MB here; an image carrying vLLM or torch would add gigabytes.
    base = subprocess.run(
        ["bash", str(IMAGES_SH), "base"], capture_output=True, text=True, timeout=600, check=True
    ).stdout.split()[-1]

    def size(image: str) -> int:
        return int(yaml.safe_load(podman("image", "inspect", image).stdout)[0]["Size"])

    added = size(images.sidecar) - size(base)
    assert 0 < added < 150_000_000, f"the sidecar image adds {added / 1e6:.0f} MB to its base"


# ------------------------------------------------------------------ the operator image

RELEASE = "kvferry-image"


@dataclass
class ChartInstall:
    namespace: str
    deployment: dict[str, Any]
    secret: dict[str, Any]
    service_host: str


@pytest.fixture
def chart_install(kubectl: Kubectl, images: Images) -> Iterator[ChartInstall]:
    """The chart's objects, except the Deployment (podman runs that), applied to the
    session's API server in a namespace of their own."""
    namespace = f"kvferry-img-{uuid.uuid4().hex[:6]}"
    repo_op, tag_op = images.operator.rsplit(":", 1)
    repo_sc, tag_sc = images.sidecar.rsplit(":", 1)
    text = helm(
        "template",
        RELEASE,
        str(CHART),
        "-n",
        namespace,
        "--set",
        f"image.repository={repo_op},image.tag={tag_op}",
        "--set",
        f"sidecarImage.repository={repo_sc},sidecarImage.tag={tag_sc}",
    ).stdout
    objs = [d for d in yaml.safe_load_all(text) if d]
    (deployment,) = [o for o in objs if o["kind"] == "Deployment"]
    (secret,) = [o for o in objs if o["kind"] == "Secret"]
    rest = [o for o in objs if o["kind"] != "Deployment"]
    kubectl.run("create", "namespace", namespace)
    kubectl.apply(rest, "--server-side")
    try:
        yield ChartInstall(namespace, deployment, secret, f"{RELEASE}.{namespace}.svc")
    finally:
        kubectl.delete(rest)
        kubectl.run("delete", "namespace", namespace, "--wait=false", check=False)


def api_server_ca(kubeconfig: Path) -> bytes:
    cluster = yaml.safe_load(kubeconfig.read_text())["clusters"][0]["cluster"]
    return Path(cluster["certificate-authority"]).read_bytes()


def test_operator_image_run_as_the_chart_runs_it_makes_a_server_ready(
    images: Images,
    chart_install: ChartInstall,
    kubectl: Kubectl,
    kubeconfig: Path,
    operator: Operator,
    ns: str,
    tmp_path: Path,
):
    pod_spec = chart_install.deployment["spec"]["template"]["spec"]
    (container,) = pod_spec["containers"]
    sa = pod_spec["serviceAccountName"]
    token = kubectl.run(
        "create", "token", sa, "-n", chart_install.namespace, "--duration", "1h"
    ).stdout.strip()

    def files(volume: dict[str, Any]) -> dict[str, bytes] | None:
        if "secret" in volume:
            assert volume["secret"]["secretName"] == chart_install.secret["metadata"]["name"]
            return secret_files(chart_install.secret)
        return None

    pod_name = f"kvferry-operator-{uuid.uuid4().hex[:6]}"
    # The downward API, as the kubelet fills it in: the Lease's namespace and holder.
    fields = {"metadata.namespace": chart_install.namespace, "metadata.name": pod_name}
    c = from_pod_spec(pod_spec, container, tmp_path / "pod", files, fields)
    # What the kubelet adds: the ServiceAccount token and the API server's address.
    sa_dir = tmp_path / "pod" / "serviceaccount"
    sa_dir.mkdir()
    for name, data in service_account_files(
        token, api_server_ca(kubeconfig), chart_install.namespace
    ).items():
        (sa_dir / name).write_bytes(data)
    report_port = free_port()
    c = c.with_env(
        KUBERNETES_SERVICE_HOST="127.0.0.1",
        KUBERNETES_SERVICE_PORT=PORT,
        KVFERRY_REPORT_PORT=str(report_port),  # host network: a free port, not 8443
    )
    c = replace(c, mounts={**c.mounts, SA_MOUNT: sa_dir})
    for folder in c.mounts.values():
        own_files(folder, pod_spec["securityContext"]["fsGroup"], c.group)
    assert c.user == 65532 and c.read_only_root and c.cap_drop == ["ALL"], c
    assert c.scratch == ["/tmp"], c.scratch

    name = pod_name
    log_path = tmp_path / "operator-image.log"
    # The tier's operator (this tree) must not do the work.
    operator.stop()
    try:
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                podman_argv(c, images.operator, name), stdout=log, stderr=subprocess.STDOUT
            )
        try:
            kubectl.apply(server(name="tiny", namespace=ns), "--server-side")
            try:
                wait_ready(kubectl, ns)
            except AssertionError as exc:
                raise AssertionError(f"{exc}\nimage log:\n{log_path.read_text()[-4000:]}") from exc
            for kind, pattern in CHILDREN:
                assert kubectl.get(kind, pattern.format(n="tiny"), ns), kind
            # The report endpoint: the chart's certificate, checked for the Service's name.
            ca = tmp_path / "ca.crt"
            ca.write_bytes(secret_files(chart_install.secret)["ca.crt"])
            body = decode_report(ns, "tiny", "tiny-decode-0")
            status = _push(
                report_port,
                chart_install.service_host,
                ca,
                body,
                bound_token(kubectl, ns, "tiny-decode-0"),
            )
            assert status == 202, log_path.read_text()[-4000:]
            wait_until(
                lambda: kubectl.get("kvcachestatus", "tiny", ns)["status"]["phase"] == "Reporting",
                30,
                "KVCacheStatus Reporting",
            )
            log_text = log_path.read_text()
            assert "Traceback" not in log_text, log_text[-4000:]
            assert "forbidden" not in log_text.lower(), log_text[-4000:]
        finally:
            podman("stop", "-t", "10", name, check=False, timeout=60)
            proc.wait(30)
        # SIGTERM from podman stop: kopf shuts down cleanly.
        assert proc.returncode == 0, log_path.read_text()[-4000:]
    finally:
        operator.start()


# ------------------------------------------------------------------ the sidecar image


def test_sidecar_image_run_as_the_operator_renders_it_serves_a_turn(
    images: Images, fake_engines: FakeEngines, tmp_path: Path
):
    port, internal = free_port(), free_port()
    c = rendered_sidecar(tmp_path / "pod", fake_engines, port, internal)
    assert c.user == 65532 and c.read_only_root and c.cap_drop == ["ALL"], c
    name = f"kvferry-sidecar-{uuid.uuid4().hex[:6]}"
    log_path = tmp_path / "sidecar-image.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            podman_argv(c, images.sidecar, name), stdout=log, stderr=subprocess.STDOUT
        )
    try:
        url = f"http://127.0.0.1:{port}"
        ready = wait_http_ready(f"http://127.0.0.1:{internal}", proc, log_path)
        assert ready["engine_version"] == fake_engines.decode.version, ready
        assert ready["prefill_engines_ready"] == 1, ready
        public_readyz_says_only_ready(url)
        serve_one_turn(url, fake_engines)
    finally:
        podman("stop", "-t", "10", name, check=False, timeout=60)
        proc.wait(30)
