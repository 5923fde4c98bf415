"""A real CRD schema change through the documented upgrade, on a cluster whose CRDs
Helm created (a bare control plane: no CRDs until `helm install` makes them).

Helm installs charts/kvferry/crds/ once, as field manager "helm", and never
updates it. A server-side apply of changed CRDs then conflicts on every field
whose value changed (a description, a default), because "helm" owns it; the
documented command takes those fields over with --force-conflicts. This test runs
the command as the docs print it (tests/static/test_docs.py checks every doc that
mentions the upgrade prints the same one).
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

import yaml

from tests.cluster.conftest import Kubectl
from tests.helm import CHART, RELEASE, helm
from tests.kube import bare_control_plane
from tests.manifests import ROOT, server

# What every doc tells a user to run before `helm upgrade` (from the release's source).
UPGRADE_CRDS = "kubectl apply --server-side --force-conflicts -f crds/"
CRD_FILE = "kvferry.io_disaggregatedservers.yaml"


def older_crd() -> dict[str, Any]:
    """The DisaggregatedServer CRD as a previous release had it: no
    engine.imagePullSecrets, another maxRestartsPerDay default, another description."""
    crd = yaml.safe_load((ROOT / "crds" / CRD_FILE).read_text())
    old = copy.deepcopy(crd)
    spec = old["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    del spec["properties"]["engine"]["properties"]["imagePullSecrets"]
    tuning = spec["properties"]["cacheTuning"]["properties"]
    tuning["maxRestartsPerDay"]["default"] = 3
    tuning["maxRestartsPerDay"]["description"] = "Restarts a day (older wording)."
    return old


def old_chart(tmp_path: Path) -> Path:
    chart = tmp_path / "kvferry"
    shutil.copytree(CHART, chart)
    (chart / "crds" / CRD_FILE).write_text(yaml.safe_dump(older_crd(), sort_keys=False))
    return chart


def field(kubectl: Kubectl, path: str) -> Any:
    crd = kubectl.json("get", "crd", "disaggregatedservers.kvferry.io")
    node = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for part in path.split("."):
        node = node["properties"][part]
    return node


def test_a_crd_schema_change_goes_through_the_documented_upgrade(tmp_path: Path):
    with bare_control_plane(offset=20, label="crd-upgrade") as kubeconfig:
        kubectl = Kubectl(kubeconfig)
        ns = "kvferry-system"
        helm(
            "install", RELEASE, str(old_chart(tmp_path)), "-n", ns, "--create-namespace",
            "--kubeconfig", str(kubeconfig),
        )  # fmt: skip
        kubectl.run("wait", "--for=condition=Established", "crd/disaggregatedservers.kvferry.io")
        managers = {
            f["manager"]
            for f in kubectl.json(
                "get", "crd", "disaggregatedservers.kvferry.io", "--show-managed-fields"
            )["metadata"]["managedFields"]
        }
        assert "helm" in managers
        kubectl.run("create", "namespace", "serving")
        old_server = server(name="before", namespace="serving")
        kubectl.apply(old_server, "--server-side")
        new_field = server(
            {"engine": {"imagePullSecrets": [{"name": "regcred"}]}},
            name="after",
            namespace="serving",
        )
        refused = kubectl.apply(new_field, "--server-side", check=False)
        assert refused.returncode != 0 and "imagePullSecrets" in refused.stderr

        crds = tmp_path / "release"
        shutil.copytree(ROOT / "crds", crds / "crds")
        # Without --force-conflicts: refused, naming helm as the owner of the changed fields.
        naive = kubectl.run("apply", "--server-side", "-f", str(crds / "crds"), check=False)
        assert naive.returncode != 0
        assert "conflict" in naive.stderr.lower() and '"helm"' in naive.stderr, naive.stderr

        # The documented command, run from the release's source folder.
        args = UPGRADE_CRDS.split()[1:]
        kubectl.run(*[str(crds / "crds") if a == "crds/" else a for a in args])
        assert field(kubectl, "spec.cacheTuning.maxRestartsPerDay")["default"] == 2
        assert "imagePullSecrets" in field(kubectl, "spec.engine")["properties"]
        kubectl.apply(new_field, "--server-side")
        # Existing servers read with the new schema's defaults.
        before = kubectl.get("dserver", "before", "serving")
        assert before["spec"]["engine"]["imagePullSecrets"] == []
        assert before["spec"]["cacheTuning"]["maxRestartsPerDay"] == 3  # stored at creation

        # helm upgrade leaves the CRDs alone; the next release's apply conflicts no more.
        version = kubectl.get("crd", "disaggregatedservers.kvferry.io", "")["metadata"][
            "resourceVersion"
        ]
        helm("upgrade", RELEASE, str(CHART), "-n", ns, "--kubeconfig", str(kubeconfig))
        crd = kubectl.get("crd", "disaggregatedservers.kvferry.io", "")
        assert crd["metadata"]["resourceVersion"] == version
        again = kubectl.run("apply", "--server-side", "-f", str(crds / "crds"), check=False)
        assert again.returncode == 0, again.stderr
