"""The Helm chart on the real control plane: server-side dry runs, install, a no-op
upgrade, the operator running as the chart's ServiceAccount (its RBAC suffices
for a server to become Ready and for reports to land, and it is not cluster-admin),
the leader's label on its own pod routing the Service, and the Deployment's two
replicas under the real Deployment and disruption controllers."""

from __future__ import annotations

import base64
import http.client
import json
import re
import socket
import ssl
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvferry_operator.leader import LEADER_LABEL
from tests.cluster.conftest import Kubectl, Operator, wait_until
from tests.cluster.test_operator import CHILDREN, make, wait_ready
from tests.cluster.test_reports import bound_token, decode_report
from tests.helm import CHART, RELEASE, helm, set_args

TLS_FILES = ("ca.crt", "tls.crt", "tls.key")


def helm_on(kubeconfig: Path, *args: str, check: bool = True):
    return helm(*args, "--kubeconfig", str(kubeconfig), check=check)


def chart_objects(kubeconfig: Path, namespace: str) -> list[dict[str, Any]]:
    manifest = helm_on(kubeconfig, "get", "manifest", RELEASE, "-n", namespace).stdout
    return [d for d in yaml.safe_load_all(manifest) if d]


def resource_versions(kubectl: Kubectl, objs: list[dict[str, Any]]) -> dict[str, str]:
    out = {}
    for o in objs:
        meta = o["metadata"]
        group = o["apiVersion"].rpartition("/")[0]  # "" for the core group ("v1")
        resource = f"{o['kind'].lower()}.{group}" if group else o["kind"].lower()
        ns = ["-n", meta["namespace"]] if "namespace" in meta else []
        got = kubectl.json("get", resource, meta["name"], *ns)
        out[f"{resource}/{meta.get('namespace', '')}/{meta['name']}"] = got["metadata"][
            "resourceVersion"
        ]
    return out


@pytest.fixture(scope="module")
def release(kubectl: Kubectl, kubeconfig: Path) -> Iterator[str]:
    """The chart installed with default values into a namespace of its own."""
    namespace = f"kvferry-{uuid.uuid4().hex[:6]}"
    helm_on(
        kubeconfig,
        "install",
        RELEASE,
        str(CHART),
        "-n",
        namespace,
        "--create-namespace",
        "--wait",
        "--timeout",
        "90s",
    )
    yield namespace
    helm_on(kubeconfig, "uninstall", RELEASE, "-n", namespace, "--wait", check=False)
    kubectl.run("delete", "namespace", namespace, "--wait=false", check=False)


@pytest.fixture(scope="module")
def sa_kubeconfig(
    kubectl: Kubectl, kubeconfig: Path, release: str, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """A kubeconfig that authenticates as the chart's ServiceAccount (a minted token)."""
    token = kubectl.run(
        "create", "token", RELEASE, "-n", release, "--duration", "1h"
    ).stdout.strip()
    admin = yaml.safe_load(kubeconfig.read_text())
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "local", "cluster": admin["clusters"][0]["cluster"]}],
        "users": [{"name": "operator", "user": {"token": token}}],
        "contexts": [{"name": "sa", "context": {"cluster": "local", "user": "operator"}}],
        "current-context": "sa",
    }
    path = tmp_path_factory.mktemp("sa") / "kubeconfig"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.parametrize(
    "sets",
    [[], ["networkPolicy.enabled=true", "tls.existingSecret=mine"], "namespaced"],
    ids=["defaults", "netpol-existing-secret", "namespaced-all-options"],
)
def test_rendered_chart_passes_server_side_dry_run(kubectl: Kubectl, ns: str, sets: Any):
    if sets == "namespaced":
        sets = [
            f"watchNamespaces={{{ns}}}",
            "networkPolicy.enabled=true",
            "networkPolicy.metricsClients[0].podSelector.matchLabels.app=prometheus",
            "settings.hostPathPrefixes={/var/cache/kvferry}",
        ]
    # The operator pod must meet the restricted Pod Security Standard: the API server
    # warns about workloads that would violate it in a namespace labelled so.
    kubectl.run("label", "namespace", ns, "pod-security.kubernetes.io/warn=restricted")
    # A release name of its own: nothing here may touch the installed release.
    text = helm(
        "template", "dryrun", str(CHART), "-n", ns, "--include-crds", *set_args(sets)
    ).stdout
    proc = kubectl.run("apply", "--dry-run=server", "-f", "-", input=text, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "PodSecurity" not in proc.stderr, proc.stderr
    kinds = {line.split("/")[0] for line in proc.stdout.splitlines()}
    assert "deployment.apps" in kinds and "customresourcedefinition.apiextensions.k8s.io" in kinds


def test_helm_install_then_unchanged_upgrade_changes_no_object(
    kubectl: Kubectl, kubeconfig: Path, release: str
):
    objs = chart_objects(kubeconfig, release)
    assert {o["kind"] for o in objs} >= {"Deployment", "Secret", "Service", "ClusterRole"}
    before = resource_versions(kubectl, objs)
    secret_before = kubectl.get("secret", f"{RELEASE}-tls", release)["data"]
    out = helm_on(
        kubeconfig, "upgrade", RELEASE, str(CHART), "-n", release, "--wait", "--timeout", "60s"
    ).stdout
    assert "has been upgraded" in out
    assert "helm upgrade` does not update CRDs" in out  # NOTES.txt warns on upgrade
    # ... and prints a command that applies the chart's CRDs, CHART being the chart's
    # folder (a server-side dry run: the CRDs stay as installed for the other tests).
    (command,) = re.findall(r"^\s*kubectl (apply .* -f CHART/\S+)$", out, re.M)
    args = command.replace("CHART", str(CHART)).split()
    applied = kubectl.run(*args, "--dry-run=server").stdout
    # Every CRD of the chart: servers, KV cache statuses, RoleScalers.
    assert applied.count("serverside-applied") == len(list((CHART / "crds").glob("*.yaml")))
    assert applied.count("serverside-applied") == 3, applied
    history = json.loads(
        helm_on(kubeconfig, "history", RELEASE, "-n", release, "-o", "json").stdout
    )
    assert [h["revision"] for h in history] == [1, 2]
    # Nothing was written: not even the generated certificate (kept through `lookup`).
    assert resource_versions(kubectl, objs) == before
    assert kubectl.get("secret", f"{RELEASE}-tls", release)["data"] == secret_before


def test_chart_service_account_is_not_cluster_admin(sa_kubeconfig: Path, release: str):
    sa = Kubectl(sa_kubeconfig)
    who = f"system:serviceaccount:{release}:{RELEASE}"

    def can(*args: str) -> str:
        return sa.run("auth", "can-i", *args, check=False).stdout.strip()

    assert can("create", "statefulsets", "-n", "default") == "yes"  # it is who we think
    assert can("delete", "nodes") == "no"
    assert can("*", "*") == "no"
    assert can("get", "secrets", "-n", release) == "no"
    assert can("delete", "statefulsets", "-n", "default") == "no"
    assert can("create", "pods", "-n", "default") == "no"
    # Leader election: its own Lease, in the release namespace, and no other.
    lease = "leases.coordination.k8s.io"
    assert can("create", lease, "-n", release) == "yes"
    for verb in ("get", "update"):
        assert can(verb, f"{lease}/{RELEASE}", "-n", release) == "yes"
        assert can(verb, f"{lease}/someone-else", "-n", release) == "no"
        assert can(verb, f"{lease}/{RELEASE}", "-n", "default") == "no"
    assert can("create", lease, "-n", "default") == "no"
    assert can("delete", f"{lease}/{RELEASE}", "-n", release) == "no"
    # The leader's label on its own pod: patch, in the release namespace alone.
    assert can("patch", "pods", "-n", release) == "yes"
    assert can("patch", "pods", "-n", "default") == "no"
    assert can("delete", "pods", "-n", release) == "no"
    # Real requests, refused by the API server.
    for args in (
        ("get", "secrets", "-n", release),
        ("delete", "node", "gpu-node-0", "--dry-run=server"),
        ("create", "namespace", "not-allowed", "--dry-run=server"),
    ):
        proc = sa.run(*args, check=False)
        assert proc.returncode != 0, args
        assert "forbidden" in proc.stderr and who in proc.stderr, proc.stderr


def _push(port: int, host: str, ca: Path, body: bytes, token: str) -> int:
    """POST a report to 127.0.0.1:port, verifying the certificate for ``host``."""
    ctx = ssl.create_default_context(cafile=str(ca))

    class Conn(http.client.HTTPSConnection):
        def connect(self) -> None:
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            self.sock = ctx.wrap_socket(sock, server_hostname=host)

    conn = Conn(host, port, context=ctx, timeout=10)
    try:
        conn.request(
            "POST",
            "/v1/reports",
            body=body,
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        )
        return conn.getresponse().status
    finally:
        conn.close()


def test_operator_as_chart_service_account_makes_a_server_ready(
    kubectl: Kubectl,
    operator: Operator,
    sa_kubeconfig: Path,
    release: str,
    ns: str,
    tmp_path: Path,
):
    # The tier's operator runs as cluster-admin: stop it so it cannot do the work.
    operator.stop()
    try:
        # The chart's certificate (Operator() makes its own in tmp_path: another folder).
        tls = tmp_path / "chart-tls"
        tls.mkdir()
        secret = kubectl.get("secret", f"{RELEASE}-tls", release)["data"]
        for key in TLS_FILES:
            (tls / key).write_bytes(base64.b64decode(secret[key]))
        sa_op = Operator(sa_kubeconfig, tmp_path / "sa-operator.log")
        sa_op.cert, sa_op.key = tls / "tls.crt", tls / "tls.key"
        # As the chart runs it: elected on the chart's Lease, as one of the chart's pods
        # (kwok's fakes, with addresses), which it labels for the Service as the leader.
        (pod, *_) = [
            p["metadata"]["name"]
            for p in kubectl.json(
                "get", "pods", "-n", release, "-l", f"app.kubernetes.io/instance={RELEASE}"
            )["items"]
        ]
        sa_op.args = ["--leader-elect"]
        sa_op.extra_env = {
            "KVFERRY_LEADER_ELECTION_NAMESPACE": release,
            "KVFERRY_LEADER_ELECTION_ID": RELEASE,
            "KVFERRY_POD_NAME": pod,
            "KVFERRY_POD_NAMESPACE": release,
        }
        sa_op.start()
        try:
            wait_until(
                lambda: (
                    kubectl.get("pod", pod, release)["metadata"]["labels"].get(LEADER_LABEL)
                    == "true"
                ),
                60,
                "the leader labelling its pod as the ServiceAccount",
            )
            ip = kubectl.get("pod", pod, release)["status"]["podIP"]
            wait_until(
                lambda: _service_addresses(kubectl, release) == {ip},
                60,
                "the Service routing to the leader's pod alone",
            )
            kubectl.apply(make(ns), "--server-side")
            try:
                wait_ready(kubectl, ns)
            except AssertionError as exc:
                raise AssertionError(f"{exc}\noperator log:\n{sa_op.log()[-4000:]}") from exc
            for kind, pattern in CHILDREN:
                assert kubectl.get(kind, pattern.format(n="tiny"), ns), kind
            # The report endpoint with the chart's certificate, for the Service's name:
            # TokenReview and the pod lookup run as the ServiceAccount too.
            host = f"{RELEASE}.{release}.svc"
            token = bound_token(kubectl, ns, "tiny-decode-0")
            body = decode_report(ns, "tiny", "tiny-decode-0")
            assert _push(sa_op.report_port, host, tls / "ca.crt", body, token) == 202
            wait_until(
                lambda: kubectl.get("kvcachestatus", "tiny", ns)["status"]["phase"] == "Reporting",
                30,
                "KVCacheStatus Reporting (status patch as the ServiceAccount)",
            )
            log = sa_op.log()
            # RBAC refusals only: the operator watches every namespace of the shared
            # control plane, and an Event for another test's namespace that is being
            # deleted is refused as "forbidden ... being terminated" too.
            refused = [
                line
                for line in log.splitlines()
                if "forbidden" in line.lower() and "being terminated" not in line
            ]
            assert not refused, "\n".join(refused[-20:])
            assert "Traceback" not in log, log[-4000:]
        finally:
            sa_op.stop()
        # A clean stop takes the label off (the Service routes nowhere until the next
        # leader labels itself) and releases the Lease.
        assert LEADER_LABEL not in kubectl.get("pod", pod, release)["metadata"]["labels"]
        lease = kubectl.get("lease", RELEASE, release)["spec"]
        assert not lease.get("holderIdentity"), lease
    finally:
        operator.start()


def _service_addresses(kubectl: Kubectl, namespace: str) -> set[str]:
    slices = kubectl.json(
        "get", "endpointslices", "-n", namespace, "-l", f"kubernetes.io/service-name={RELEASE}"
    )["items"]
    return {a for s in slices for e in s.get("endpoints") or [] for a in e["addresses"]}


def _not_ready(kubectl: Kubectl, namespace: str, pod: str) -> None:
    """The pod as a crash-looping replica looks to the controllers: not Ready. kwok
    runs no probes: it makes a pod Ready once and leaves it so."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    conditions = [
        {"type": kind, "status": "False", "lastTransitionTime": now}
        for kind in ("Ready", "ContainersReady")
    ]
    kubectl.run(
        *("patch", "pod", pod, "-n", namespace, "--subresource=status", "--type=strategic"),
        *("-p", json.dumps({"status": {"conditions": conditions}})),
    )


def _evict(kubectl: Kubectl, namespace: str, pod: str) -> subprocess.CompletedProcess[str]:
    """A drain's eviction of ``pod``, as a dry run: the API server applies the budgets."""
    eviction = {
        "apiVersion": "policy/v1",
        "kind": "Eviction",
        "metadata": {"name": pod, "namespace": namespace},
        "deleteOptions": {"dryRun": ["All"]},
    }
    return kubectl.run(
        *("create", "--raw", f"/api/v1/namespaces/{namespace}/pods/{pod}/eviction"),
        *("-f", "-"),
        input=json.dumps(eviction),
        check=False,
    )


def test_the_budget_lets_a_drain_take_one_replica_and_never_blocks_on_a_broken_one(
    kubectl: Kubectl, kubeconfig: Path
):
    """Two replicas (the default), both Ready, one budget: a drain may evict either one,
    not both at once; a replica that is not Ready may always go and then holds the
    healthy one. An upgrade whose new pods never become Ready stops no old one."""
    name = "ha"  # a release of its own: its cluster-wide objects are ha-kvferry-*
    namespace = f"kvferry-ha-{uuid.uuid4().hex[:6]}"
    selector = f"app.kubernetes.io/instance={name}"

    def pods() -> list[dict[str, Any]]:
        return kubectl.json("get", "pods", "-n", namespace, "-l", selector)["items"]

    def budget() -> dict[str, Any]:
        return kubectl.get("pdb", f"{name}-kvferry", namespace) or {}

    try:
        helm_on(
            kubeconfig,
            *("install", name, str(CHART), "-n", namespace, "--create-namespace"),
            *("--wait", "--timeout", "90s"),
        )
        first, second = sorted(p["metadata"]["name"] for p in pods())
        wait_until(
            lambda: budget().get("status", {}).get("disruptionsAllowed") == 1,
            30,
            "the budget allowing one disruption of two Ready replicas",
        )
        for pod in (first, second):
            proc = _evict(kubectl, namespace, pod)
            assert proc.returncode == 0, proc.stderr
        # One replica broken: it may go, and the healthy one must stay.
        _not_ready(kubectl, namespace, second)
        wait_until(
            lambda: budget().get("status", {}).get("currentHealthy") == 1,
            30,
            "the budget counting one healthy replica",
        )
        assert _evict(kubectl, namespace, second).returncode == 0
        refused = _evict(kubectl, namespace, first)
        assert refused.returncode != 0 and "disruption budget" in refused.stderr, refused.stderr
        # An upgrade whose new pods cannot become Ready (here they cannot be scheduled):
        # one surge pod, and the old replicas run on (the controller scales the old
        # ReplicaSet down in the same pass in which it adds the new pod, so once that
        # pod counts, the old one's size is final).
        old_hash = kubectl.get("pod", first, namespace)["metadata"]["labels"]["pod-template-hash"]
        helm_on(
            kubeconfig,
            *("upgrade", name, str(CHART), "-n", namespace, "--reuse-values"),
            *("--set-string", "nodeSelector.kvferry-test/nowhere=true"),
        )
        wait_until(
            lambda: (
                kubectl.get("deployment", f"{name}-kvferry", namespace)["status"].get(
                    "updatedReplicas"
                )
                == 1
            ),
            60,
            "the rollout's one surge pod",
        )
        old_set = kubectl.get("replicaset", f"{name}-kvferry-{old_hash}", namespace)
        assert old_set["spec"]["replicas"] == 2, old_set["spec"]
    finally:
        helm_on(kubeconfig, "uninstall", name, "-n", namespace, "--wait", check=False)
        kubectl.run("delete", "namespace", namespace, "--wait=false", check=False)
