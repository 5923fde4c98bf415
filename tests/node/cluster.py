"""hack/node.sh driven from the tests: its state folder and port, and the session's nodes."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.kube import Kubectl
from tests.manifests import ROOT
from tests.node.machine import Machine

SCRIPT = ROOT / "hack" / "node.sh"
STATE = Path(os.environ.get("KVFERRY_TEST_NODE_DIR", f"/tmp/kvferry-node-test-{os.getpid()}"))
PORT = os.environ.get("KVFERRY_TEST_NODE_PORT", "27443")
NAMESPACE = "node-tier"


def cannot_run() -> str | None:
    """Why this machine cannot run real nodes, or None."""
    if os.geteuid() != 0:
        return "the node tier needs root (bridge, routes, mounts, cgroups): run it as root"
    cgroup = Path("/sys/fs/cgroup")
    if not cgroup.is_dir() or not any(cgroup.iterdir()):
        return "the node tier needs a cgroup file system at /sys/fs/cgroup (none here)"
    return None


class NodeCluster:
    """hack/node.sh's nodes for the session: its kubectl, the machine before `up`."""

    def __init__(self, kubeconfig: Path, before: Machine, bin_dir: Path, image: str) -> None:
        self.kubeconfig = kubeconfig
        self.kubectl = Kubectl(kubeconfig)
        self.before = before
        self.bin_dir = bin_dir
        self.image = image
        self.is_down = False

    containerd_socket = STATE / "node1" / "containerd.sock"

    def crictl(self, *args: str) -> str:
        proc = subprocess.run(
            [str(self.bin_dir / "crictl"), "-r", f"unix://{self.containerd_socket}", *args],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert proc.returncode == 0, f"crictl {' '.join(args)}: {proc.stderr}"
        return proc.stdout

    def process_ids(self) -> list[int]:
        """Every PID hack/node.sh and hack/controlplane.sh recorded."""
        found = [int(p.read_text()) for p in (STATE / "pids").glob("*")]
        cp = STATE / "cp" / "pids"
        if cp.exists():
            found += [int(line.split()[1]) for line in cp.read_text().splitlines() if line.strip()]
        return found

    def load(self, *images: str) -> None:
        """Put local podman images on every node (`hack/node.sh load`)."""
        check(node_sh("load", *images, timeout=600), f"hack/node.sh load {' '.join(images)}")

    def down(self) -> subprocess.CompletedProcess[str]:
        self.is_down = True
        return node_sh("down", timeout=300)


def node_sh(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KVFERRY_NODE_DIR": str(STATE), "KVFERRY_NODE_PORT": PORT}
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=timeout
    )


def check(proc: subprocess.CompletedProcess[str], what: str) -> str:
    if proc.returncode != 0:
        raise AssertionError(f"{what} failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}")
    return proc.stdout
