"""Run a container exactly as a pod spec describes it, without a kubelet.

The chart's operator Deployment and the operator's rendered sidecar container are
turned into a :class:`Container` (command, args, environment, files per mount, user,
read-only root, capabilities, temp dirs), then run either with podman (the image) or
as a process of a virtual environment (the wheel), so a change to the chart or the
renderer changes what these tests run. Only what a kubelet would supply is filled in
here: ``valueFrom`` field references, volume contents, and the ServiceAccount token
mount (for the in-cluster API configuration).
"""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvferry_operator import api
from tests.manifests import ROOT

IMAGES_SH = ROOT / "hack" / "images.sh"
SA_MOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"


@dataclass(frozen=True)
class Container:
    command: list[str]
    args: list[str]
    env: dict[str, str]
    # container path -> host folder holding the volume's files
    mounts: dict[str, Path]
    user: int | None = None
    group: int | None = None
    read_only_root: bool = False
    cap_drop: list[str] = field(default_factory=list)
    no_new_privileges: bool = False
    # container paths of emptyDir volumes (tmpfs under podman, a temp folder locally)
    scratch: list[str] = field(default_factory=list)

    def with_env(self, **env: str) -> Container:
        return replace(self, env={**self.env, **env})


VolumeFiles = Callable[[dict[str, Any]], dict[str, bytes] | None]


def from_pod_spec(
    pod_spec: dict[str, Any],
    container: dict[str, Any],
    workdir: Path,
    volume_files: VolumeFiles,
    fields: dict[str, str],
) -> Container:
    """``container`` of ``pod_spec`` as podman would need it.

    ``volume_files(volume)`` gives the files of a Secret/ConfigMap/projected volume
    (None for an emptyDir); ``fields`` the values of ``valueFrom.fieldRef`` paths.
    """
    volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
    mounts: dict[str, Path] = {}
    scratch: list[str] = []
    for m in container.get("volumeMounts", []):
        vol = volumes[m["name"]]
        if "emptyDir" in vol:
            scratch.append(m["mountPath"])
            continue
        files = volume_files(vol)
        assert files is not None, f"no files for volume {m['name']}"
        folder = workdir / m["name"]
        folder.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            (folder / name).write_bytes(data)
        mounts[m["mountPath"]] = folder
    env: dict[str, str] = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = str(e["value"])
        elif "resourceFieldRef" in e["valueFrom"]:
            # As the kubelet resolves it (divisor 1): the container's own limit, in bytes.
            ref = e["valueFrom"]["resourceFieldRef"]
            kind, _, resource = ref["resource"].partition(".")
            quantity = container["resources"][kind][resource]
            env[e["name"]] = str(api.memory_bytes(quantity))
        else:
            env[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
    pod_sec = pod_spec.get("securityContext", {})
    sec = {**pod_sec, **container.get("securityContext", {})}
    return Container(
        command=list(container.get("command", [])),
        args=list(container.get("args", [])),
        env=env,
        mounts=mounts,
        user=sec.get("runAsUser"),
        group=sec.get("runAsGroup"),
        read_only_root=bool(sec.get("readOnlyRootFilesystem")),
        cap_drop=list(sec.get("capabilities", {}).get("drop", [])),
        no_new_privileges=sec.get("allowPrivilegeEscalation") is False,
        scratch=scratch,
    )


def secret_files(secret: dict[str, Any]) -> dict[str, bytes]:
    return {k: base64.b64decode(v) for k, v in (secret.get("data") or {}).items()}


def service_account_files(token: str, ca: bytes, namespace: str) -> dict[str, bytes]:
    """What the kubelet mounts at SA_MOUNT for ``automountServiceAccountToken``."""
    return {"token": token.encode(), "ca.crt": ca, "namespace": namespace.encode()}


def own_files(folder: Path, uid: int | None, gid: int | None, mode: int = 0o440) -> None:
    """Like a Secret volume with fsGroup: readable by the pod's user and nobody else."""
    for path in folder.iterdir():
        if uid is not None:
            os.chown(path, uid, gid if gid is not None else uid)
        path.chmod(mode)
    if uid is not None:
        os.chown(folder, uid, gid if gid is not None else uid)


def podman_argv(c: Container, image: str, name: str) -> list[str]:
    """``hack/images.sh run ...`` (podman with this machine's flags) for ``c``."""
    # --passwd=false: podman adds a passwd entry for --user, the kubelet does not.
    argv = [
        *("bash", str(IMAGES_SH), "run", "--rm", "--passwd=false"),
        *("--name", name, "--network", "host"),
    ]
    if c.user is not None:
        argv += ["--user", f"{c.user}:{c.group if c.group is not None else c.user}"]
    if c.read_only_root:
        argv.append("--read-only")
    for cap in c.cap_drop:
        argv += ["--cap-drop", cap]
    if c.no_new_privileges:
        argv += ["--security-opt", "no-new-privileges"]
    for path in c.scratch:
        argv += ["--tmpfs", f"{path}:rw,mode=1777"]
    for path, folder in c.mounts.items():
        argv += ["-v", f"{folder}:{path}:ro"]
    for key, value in c.env.items():
        argv += ["-e", f"{key}={value}"]
    if c.command:
        argv += ["--entrypoint", c.command[0]]
    argv.append(image)
    return argv + c.command[1:] + c.args


def local_argv(
    c: Container, bin_dir: Path, entrypoint: str, workdir: Path
) -> tuple[list[str], dict[str, str]]:
    """``c`` as a process of the venv in ``bin_dir`` (``entrypoint``: the image's, for a
    container without a command): mount paths in the arguments and the environment
    point at the host folders, emptyDirs at folders under ``workdir``."""
    paths = dict(c.mounts)
    for path in c.scratch:
        folder = workdir / ("scratch" + path.replace("/", "-"))
        folder.mkdir(parents=True, exist_ok=True)
        paths[path] = folder

    def local(value: str) -> str:
        for path, folder in sorted(paths.items(), key=lambda kv: -len(kv[0])):
            if value == path or value.startswith(path + "/"):
                return str(folder) + value[len(path) :]
        return value

    first, *rest = c.command or [entrypoint]
    command = [str(bin_dir / Path(first).name), *rest]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVFERRY_", "POD_"))}
    env.pop("PYTHONPATH", None)
    env.update({k: local(v) for k, v in c.env.items()})
    return [*command, *(local(a) for a in c.args)], env


def podman(*args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        ["podman", *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} failed: {proc.stderr}{proc.stdout}")
    return proc


def have_podman() -> bool:
    return shutil.which("podman") is not None
