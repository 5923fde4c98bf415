"""helm, built from hack/helm (Go modules, cached under ~/.cache/kvferry), and the
chart it renders: for the static tier's chart checks and the cluster, engine and
artifact tiers that install the chart."""

from __future__ import annotations

import functools
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import yaml

from tests.manifests import ROOT
from tests.progress import step

CHART = ROOT / "charts" / "kvferry"
HELM_SH = ROOT / "hack" / "helm.sh"
RELEASE = "kvferry"
NAMESPACE = "kvferry-system"


@functools.cache
def helm_binary() -> str:
    """Build (once, cached under ~/.cache/kvferry) and return the helm binary."""
    with step("helm (hack/helm.sh build; the first run on a machine builds it, ~3.5 min)"):
        proc = subprocess.run(
            ["bash", str(HELM_SH), "build"], capture_output=True, text=True, timeout=1800
        )
    assert proc.returncode == 0, f"hack/helm.sh build failed:\n{proc.stderr[-4000:]}"
    return proc.stdout.strip().splitlines()[-1]


def helm_env() -> dict[str, str]:
    """helm's own config/cache/data folders out of $HOME."""
    base = Path(tempfile.gettempdir()) / f"kvferry-helm-home-{os.getuid()}"
    return {
        **os.environ,
        "HELM_CONFIG_HOME": str(base / "config"),
        "HELM_CACHE_HOME": str(base / "cache"),
        "HELM_DATA_HOME": str(base / "data"),
    }


def helm(*args: str, check: bool = True, **kw: Any) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [helm_binary(), *args], capture_output=True, text=True, env=helm_env(), timeout=120, **kw
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{proc.stderr}{proc.stdout}")
    return proc


def set_args(sets: list[str]) -> list[str]:
    return [a for s in sets for a in ("--set", s)]


def template_text(*sets: str, namespace: str = NAMESPACE, crds: bool = False) -> str:
    args = ["template", RELEASE, str(CHART), "--namespace", namespace, *set_args(list(sets))]
    return helm(*args, *(["--include-crds"] if crds else [])).stdout


def template(*sets: str, namespace: str = NAMESPACE) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(template_text(*sets, namespace=namespace)) if d]


def one(objs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    assert len(found) == 1, f"{kind} {name}: {len(found)} found"
    return found[0]


def operator_container(objs: list[dict[str, Any]]) -> dict[str, Any]:
    return one(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
