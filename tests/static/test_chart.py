"""The Helm chart (charts/kvferry), rendered by a real helm built from hack/helm.

RBAC is checked against a table of the operator's API call sites; the table is
itself checked against the code (kopf registrations, rendered child kinds, the
methods of ``Kube``), so a new API call without a rule fails here, and so does a
rule nothing needs. Also: CRD copies, values schema and docs, the Deployment's
security, TLS, optional objects, strict 1.37 schemas, the plain-manifest file,
and the security of the server pods the operator renders.
"""

from __future__ import annotations

import base64
import inspect
import json
import math
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kopf
import kubernetes_validate
import pytest
import yaml

from kvferry_operator import api, handlers, kube, render
from kvferry_wire import protocol
from tests.helm import (
    CHART,
    NAMESPACE,
    RELEASE,
    helm,
    one,
    operator_container,
    set_args,
    template,
)
from tests.manifests import EXAMPLES, ROOT, load_example

K8S_VERSION = "1.37.0"
# The namespaces of the chart's namespaced mode, wherever a test renders it.
WATCHED = ("team-a", "team-b")
# Every optional part on (ServiceMonitor is a CRD kind: not in the built-in schemas).
ALL_OPTIONS = [
    "watchNamespaces={team-a,team-b}",
    "serviceMonitor.enabled=true",
    "podMonitor.enabled=true",
    "grafanaDashboard.enabled=true",
    "networkPolicy.enabled=true",
    "settings.hostPathPrefixes={/var/cache/kvferry}",
    "settings.podTemplateAllow={privileged}",
    "networkPolicy.metricsClients[0].namespaceSelector.matchLabels.team=monitoring",
]


# ------------------------------------------------------------------ RBAC table


ANY = "*"  # a grant's namespace or object name when RBAC does not restrict it


@dataclass(frozen=True)
class Call:
    site: str  # where the code makes the call
    group: str
    resource: str  # plural, or plural/subresource
    verbs: tuple[str, ...]
    restricted_only: bool = False  # only when the operator watches a namespace list
    # Where it is made: "served", the namespaces the operator serves (all of them when it
    # watches the cluster); "cluster", cluster-wide (cluster-scoped resources); "release",
    # the release namespace alone.
    where: str = "served"
    name: str = ANY  # the one object it is made on, where RBAC can hold it to that name


# Kind -> (API group, plural) for the objects the operator applies.
KINDS = {
    "StatefulSet": ("apps", "statefulsets"),
    "Service": ("", "services"),
    "ConfigMap": ("", "configmaps"),
    "PodDisruptionBudget": ("policy", "poddisruptionbudgets"),
    "NetworkPolicy": ("networking.k8s.io", "networkpolicies"),
    api.STATUS_KIND: (api.GROUP, api.STATUS_PLURAL),
    api.SERVER_KIND: (api.GROUP, api.SERVER_PLURAL),
}

# Every API call the operator makes, by call site. Server-side apply is a PATCH that
# creates the object when it does not exist yet, which the API server authorizes as
# `create` too. Keep in step with the code: the tests below check it from both sides.
CALLS = [
    # kopf indexes and event handlers (handlers.py): list + watch per resource.
    Call("kopf watch: handlers.servers/server_changed", "kvferry.io", "disaggregatedservers",
         ("list", "watch")),
    Call("kopf watch: handlers.statefulsets/child-statefulsets", "apps", "statefulsets",
         ("list", "watch")),
    Call("kopf watch: child-services", "", "services", ("list", "watch")),
    Call("kopf watch: child-configmaps", "", "configmaps", ("list", "watch")),
    Call("kopf watch: child-poddisruptionbudgets", "policy", "poddisruptionbudgets",
         ("list", "watch")),
    Call("kopf watch: child-networkpolicies", "networking.k8s.io", "networkpolicies",
         ("list", "watch")),
    Call("kopf watch: child-kvcachestatuses", "kvferry.io", "kvcachestatuses",
         ("list", "watch")),
    Call("kopf watch: handlers.pods/pod_changed", "", "pods", ("list", "watch")),
    Call("kopf watch: handlers.rolescalers/child-rolescalers", "kvferry.io", "rolescalers",
         ("list", "watch")),
    # Cluster-scoped: status says when pods sit on a node that is gone or not Ready.
    Call("kopf watch: handlers.nodes/node_changed", "", "nodes", ("list", "watch"),
         where="cluster"),
    # Kube.apply (handlers.apply_children): every rendered child.
    Call("Kube.apply StatefulSet", "apps", "statefulsets", ("create", "patch")),
    Call("Kube.apply Service", "", "services", ("create", "patch")),
    Call("Kube.apply ConfigMap", "", "configmaps", ("create", "patch")),
    Call("Kube.apply PodDisruptionBudget", "policy", "poddisruptionbudgets",
         ("create", "patch")),
    Call("Kube.apply NetworkPolicy", "networking.k8s.io", "networkpolicies",
         ("create", "patch")),
    Call("Kube.apply KVCacheStatus", "kvferry.io", "kvcachestatuses", ("create", "patch")),
    # Kube.patch_status (handlers.refresh_status, apply_children, publisher.Publisher).
    Call("Kube.patch_status DisaggregatedServer", "kvferry.io", "disaggregatedservers/status",
         ("patch",)),
    Call("Kube.patch_status KVCacheStatus", "kvferry.io", "kvcachestatuses/status",
         ("patch",)),
    Call("Kube.patch_status RoleScaler", "kvferry.io", "rolescalers/status", ("patch",)),
    # RoleScalers (handlers.resolve_scalers): read, created once, deleted back in Static.
    Call("Kube.get RoleScaler", "kvferry.io", "rolescalers", ("get",)),
    Call("Kube.create RoleScaler", "kvferry.io", "rolescalers", ("create",)),
    Call("Kube.delete RoleScaler", "kvferry.io", "rolescalers", ("delete",)),
    # Kube.get (publisher.Publisher, handlers.retry_apply).
    Call("Kube.get DisaggregatedServer", "kvferry.io", "disaggregatedservers", ("get",)),
    Call("Kube.get KVCacheStatus", "kvferry.io", "kvcachestatuses", ("get",)),
    # Kube.get of a child not known to be ours (handlers.apply_children): is its name
    # free, or held by an object the server does not control (ownership.py).
    Call("Kube.get Service", "", "services", ("get",)),
    Call("Kube.get ConfigMap", "", "configmaps", ("get",)),
    Call("Kube.get PodDisruptionBudget", "policy", "poddisruptionbudgets", ("get",)),
    Call("Kube.get NetworkPolicy", "networking.k8s.io", "networkpolicies", ("get",)),
    # Kube.list_servers (handlers.safety_pass).
    Call("Kube.list_servers", "kvferry.io", "disaggregatedservers", ("list",)),
    # Kube.list_labelled (handlers.safety_pass): every child kind, labelled as ours.
    Call("Kube.list_labelled StatefulSet", "apps", "statefulsets", ("list",)),
    Call("Kube.list_labelled Service", "", "services", ("list",)),
    Call("Kube.list_labelled ConfigMap", "", "configmaps", ("list",)),
    Call("Kube.list_labelled PodDisruptionBudget", "policy", "poddisruptionbudgets", ("list",)),
    Call("Kube.list_labelled NetworkPolicy", "networking.k8s.io", "networkpolicies", ("list",)),
    Call("Kube.list_labelled KVCacheStatus", "kvferry.io", "kvcachestatuses", ("list",)),
    # Kube.list_metadata (ownership.NameLookup): what holds the names of a burst of new
    # servers' children, every object of the kind in the namespace (metadata only).
    Call("Kube.list_metadata StatefulSet", "apps", "statefulsets", ("list",)),
    Call("Kube.list_metadata Service", "", "services", ("list",)),
    Call("Kube.list_metadata ConfigMap", "", "configmaps", ("list",)),
    Call("Kube.list_metadata PodDisruptionBudget", "policy", "poddisruptionbudgets", ("list",)),
    Call("Kube.list_metadata NetworkPolicy", "networking.k8s.io", "networkpolicies", ("list",)),
    Call("Kube.list_metadata KVCacheStatus", "kvferry.io", "kvcachestatuses", ("list",)),
    # Kube.review_token / Kube.get_pod (endpoint: authenticating a report).
    Call("Kube.review_token", "authentication.k8s.io", "tokenreviews", ("create",),
         where="cluster"),
    Call("Kube.get_pod", "", "pods", ("get",)),
    # The prerequisite probe (probe.PrerequisiteProbe, from handlers.refresh_status):
    # nodes' GPU/RDMA resources, the namespace's Pod Security label, Multus networks.
    Call("Kube.list_nodes", "", "nodes", ("list",), where="cluster"),
    Call("Kube.get_namespace", "", "namespaces", ("get",), where="cluster"),
    Call("Kube.crd_exists", "apiextensions.k8s.io", "customresourcedefinitions", ("get",),
         where="cluster"),
    Call("Kube.get_network_attachment_definition", "k8s.cni.cncf.io",
         "network-attachment-definitions", ("get",)),
    # Kube.get StatefulSet (endpoint: is the reporting pod a member of our StatefulSet).
    Call("Kube.get StatefulSet", "apps", "statefulsets", ("get",)),
    # Kube.create_event (publisher.Publisher) and kopf's event poster (kopf.info/warn).
    Call("Kube.create_event", "", "events", ("create",)),
    Call("kopf posting: kopf.info/kopf.warn", "", "events", ("create",)),
    # kopf's observation (kopf/_core/reactor/observation.py): CRD changes always,
    # namespace changes only when restricted to namespaces. Peering: none (--standalone).
    Call("kopf resource_observer", "apiextensions.k8s.io", "customresourcedefinitions",
         ("list", "watch"), where="cluster"),
    Call("kopf namespace_observer", "", "namespaces", ("list", "watch"), restricted_only=True,
         where="cluster"),
    # Leader election (--leader-elect): the Lease KVFERRY_LEADER_ELECTION_ID, the chart's
    # fullname (RELEASE for this release name), in the pod's namespace. A create cannot be
    # held to a name: the API server authorizes it before the object has one.
    Call("Kube.get_lease", "coordination.k8s.io", "leases", ("get",), where="release",
         name=RELEASE),
    Call("Kube.create_lease", "coordination.k8s.io", "leases", ("create",), where="release"),
    Call("Kube.replace_lease", "coordination.k8s.io", "leases", ("update",), where="release",
         name=RELEASE),
    # leader.PodMark: the leader's label on its own pod (KVFERRY_POD_NAME, named at random).
    Call("Kube.label_pod", "", "pods", ("patch",), where="release"),
]  # fmt: skip

Verb = tuple[str, str, str]  # (group, resource, verb)
# (group, resource, verb, namespace or ANY, object name or ANY): a verb, and where and on
# what RBAC allows it.
Grant = tuple[str, str, str, str, str]


def needed(restricted: bool) -> set[Grant]:
    """What the calls need, and where: the served namespaces are WATCHED when restricted."""
    out: set[Grant] = set()
    for c in CALLS:
        if c.restricted_only and not restricted:
            continue
        if c.where == "release":
            places: tuple[str, ...] = (NAMESPACE,)
        elif c.where == "served" and restricted:
            places = WATCHED
        else:
            places = (ANY,)
        out |= {(c.group, c.resource, v, p, c.name) for v in c.verbs for p in places}
    return out


def grants(rules: list[dict[str, Any]]) -> set[Verb]:
    return {
        (g, r, v)
        for rule in rules
        for g in rule.get("apiGroups", [])
        for r in rule.get("resources", [])
        for v in rule.get("verbs", [])
    }


def verbs_of(table: set[Grant]) -> set[Verb]:
    """The verbs alone, wherever they are allowed."""
    return {g[:3] for g in table}


def granted(
    objs: list[dict[str, Any]], *, sa: str = RELEASE, namespace: str = NAMESPACE
) -> set[Grant]:
    """What the chart's ServiceAccount may do, and where (the union over its bindings): a
    ClusterRoleBinding everywhere, a RoleBinding in its own namespace; a rule with
    resourceNames on those objects alone."""
    roles = {
        (o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]): o
        for o in objs
        if o["kind"] in ("ClusterRole", "Role")
    }
    out: set[Grant] = set()
    for b in objs:
        if b["kind"] not in ("ClusterRoleBinding", "RoleBinding"):
            continue
        assert b["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": namespace}]
        where = b["metadata"]["namespace"] if b["kind"] == "RoleBinding" else ANY
        ref = b["roleRef"]
        # A Role is found in the binding's namespace; a ClusterRole has none.
        role = roles[(ref["kind"], where if ref["kind"] == "Role" else None, ref["name"])]
        for rule in role["rules"]:
            out |= {
                (*verb, where, name)
                for verb in grants([rule])
                for name in rule.get("resourceNames", [ANY])
            }
    return out


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    """Name -> value, or the valueFrom of a variable the kubelet fills in."""
    return {e["name"]: e["value"] if "value" in e else e["valueFrom"] for e in container["env"]}


def kopf_resources() -> dict[tuple[str, str], set[str]]:
    """(group, plural) of every kopf registration -> what kind of handler."""
    registry = kopf.get_default_registry()
    out: dict[tuple[str, str], set[str]] = {}
    for kind in ("_indexing", "_watching", "_changing", "_spawning", "_webhooks"):
        for h in getattr(registry, kind).get_all_handlers():
            sel = h.selector
            out.setdefault((sel.group, sel.plural or sel.any_name), set()).add(kind)
    return out


class TestRbacMatchesTheCode:
    def test_kopf_registrations_are_in_the_table(self):
        assert handlers.SERVER  # the registrations happen on import
        table = verbs_of(needed(restricted=False))
        for (group, plural), kinds in kopf_resources().items():
            assert {(group, plural, "list"), (group, plural, "watch")} <= table, plural
            # Change handlers, timers and daemons make kopf write finalizers and
            # progress annotations: those would need patch on the resource itself.
            if kinds & {"_changing", "_spawning"}:
                assert (group, plural, "patch") in table, plural

    @pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
    def test_every_rendered_child_kind_can_be_applied(self, path: Path):
        table = verbs_of(needed(restricted=False))
        for child in render.render(api.parse_server(load_example(path))):
            assert child["kind"] in KINDS, f"add {child['kind']} to KINDS and CALLS"
            group, plural = KINDS[child["kind"]]
            # get: a child not known to be ours is read before it is applied.
            verbs = {(group, plural, v) for v in ("get", "create", "patch")}
            assert verbs <= table

    def test_every_kube_method_has_a_call_site_row(self):
        # A new API call in kube.py must come with its row (and rule).
        methods = {
            n
            for n, f in inspect.getmembers(kube.Kube, inspect.isfunction)
            if not n.startswith("_") and n != "close"
        }
        sites = {
            c.site.split()[0].removeprefix("Kube.") for c in CALLS if c.site.startswith("Kube.")
        }
        assert methods == sites

    @pytest.mark.parametrize("restricted", [False, True], ids=["clusterwide", "namespaces"])
    def test_chart_grants_exactly_what_the_code_calls(self, restricted: bool):
        objs = template(*([f"watchNamespaces={{{','.join(WATCHED)}}}"] if restricted else []))
        have, want = granted(objs), needed(restricted)
        assert want - have == set(), "missing: the operator would be forbidden"
        assert have - want == set(), "granted but never used (or too widely): remove it"

    @pytest.mark.parametrize(
        "sets, namespace, name",
        [
            ([], NAMESPACE, RELEASE),
            ([f"watchNamespaces={{{','.join(WATCHED)}}}"], NAMESPACE, RELEASE),
            (["fullnameOverride=ferry"], "ops", "ferry"),
        ],
        ids=["clusterwide", "namespaces", "other-name-and-namespace"],
    )
    def test_the_lease_is_granted_by_name_in_the_release_namespace_alone(
        self, sets: list[str], namespace: str, name: str
    ):
        objs = template(*sets, namespace=namespace)
        lease = ("coordination.k8s.io", "leases")
        have = {g for g in granted(objs, sa=name, namespace=namespace) if g[:2] == lease}
        assert have == {
            (*lease, "create", namespace, ANY),
            (*lease, "get", namespace, name),
            (*lease, "update", namespace, name),
        }
        # ... the Lease the operator is told to hold: that name, in its pod's namespace,
        # which is the release's.
        env = env_of(operator_container(objs))
        assert env["KVFERRY_LEADER_ELECTION_ID"] == name
        assert env["KVFERRY_LEADER_ELECTION_NAMESPACE"] == {
            "fieldRef": {"fieldPath": "metadata.namespace"}
        }
        assert one(objs, "Deployment")["metadata"]["namespace"] == namespace

    def test_namespace_editors_may_scale_rolescalers_and_nothing_more(self):
        # `kubectl scale rolescaler` by a namespace's edit/admin users; the HPA
        # controller has */scale already. Bound to no one: aggregated by label.
        role = one(template(), "ClusterRole", f"{RELEASE}-rolescaler-edit")
        labels = role["metadata"]["labels"]
        assert labels["rbac.authorization.k8s.io/aggregate-to-edit"] == "true"
        assert labels["rbac.authorization.k8s.io/aggregate-to-admin"] == "true"
        assert grants(role["rules"]) == {
            ("kvferry.io", "rolescalers", v) for v in ("get", "list", "watch")
        } | {("kvferry.io", "rolescalers/scale", v) for v in ("get", "update", "patch")}

    def test_no_wildcards_anywhere(self):
        for objs in (template(), template(*ALL_OPTIONS)):
            for role in (o for o in objs if o["kind"] in ("ClusterRole", "Role")):
                for rule in role["rules"]:
                    for key in ("apiGroups", "resources", "verbs"):
                        assert "*" not in rule.get(key, []), (role["metadata"]["name"], rule)
                    assert "nonResourceURLs" not in rule

    def test_namespaced_mode_binds_only_the_listed_namespaces(self):
        objs = template("watchNamespaces={team-a,team-b}")
        workload = [
            o for o in objs if o["kind"] == "RoleBinding" and o["roleRef"]["name"] == RELEASE
        ]
        assert sorted(o["metadata"]["namespace"] for o in workload) == ["team-a", "team-b"]
        crbs = [o["roleRef"]["name"] for o in objs if o["kind"] == "ClusterRoleBinding"]
        assert crbs == [f"{RELEASE}-cluster"]
        cluster = grants(one(objs, "ClusterRole", f"{RELEASE}-cluster")["rules"])
        assert {r for _, r, _ in cluster} == {
            "tokenreviews",
            "customresourcedefinitions",
            "namespaces",
            "nodes",
        }

    def test_the_check_catches_a_removed_verb(self):
        # The exactness test is only as good as `granted`: prove it sees a removal.
        objs = template()
        role = one(objs, "ClusterRole", RELEASE)
        role["rules"] = [r for r in role["rules"] if r["resources"] != ["pods"]]
        assert ("", "pods", "get", ANY, ANY) in needed(False) - granted(objs)

    def test_the_check_catches_a_lease_grant_for_any_name_or_namespace(self):
        # ... and a grant wider than the call: every Lease, or the Lease elsewhere.
        objs = template()
        role = one(objs, "Role", f"{RELEASE}-leader-election")
        for rule in role["rules"]:
            rule.pop("resourceNames", None)
        lease = ("coordination.k8s.io", "leases")
        assert (*lease, "get", NAMESPACE, ANY) in granted(objs) - needed(False)
        objs = template()
        for kind in ("Role", "RoleBinding"):
            one(objs, kind, f"{RELEASE}-leader-election")["metadata"]["namespace"] = "default"
        assert (*lease, "update", NAMESPACE, RELEASE) in needed(False) - granted(objs)


# ------------------------------------------------------------------ chart files


def test_chart_crds_are_byte_identical_copies_of_crds_dir():
    top = sorted(p.name for p in (ROOT / "crds").glob("*.yaml"))
    assert sorted(p.name for p in (CHART / "crds").glob("*.yaml")) == top
    for name in top:
        assert (CHART / "crds" / name).read_bytes() == (ROOT / "crds" / name).read_bytes(), (
            f"cp crds/{name} charts/kvferry/crds/"
        )


@pytest.mark.parametrize("sets", [[], ALL_OPTIONS], ids=["defaults", "all-options"])
def test_helm_lint_strict_passes(sets: list[str]):
    out = helm("lint", "--strict", str(CHART), *set_args(sets)).stdout
    assert "0 chart(s) failed" in out


def _leaves(values: Any, prefix: str = "") -> list[str]:
    if isinstance(values, dict) and values:
        return [p for k, v in values.items() for p in _leaves(v, f"{prefix}.{k}" if prefix else k)]
    return [prefix]


def test_every_value_is_commented():
    lines = (CHART / "values.yaml").read_text().splitlines()
    for i, line in enumerate(lines):
        stripped = line.strip()
        if not stripped or stripped.startswith("#") or stripped.startswith("- "):
            continue
        assert lines[i - 1].strip().startswith("#"), f"values.yaml:{i + 1} has no comment: {line}"


def test_every_value_is_used_by_a_template():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    text = "".join(p.read_text() for p in (CHART / "templates").iterdir())
    for leaf in _leaves(values):
        parts = leaf.split(".")
        # A value is used when the template names it or a map above it (toYaml).
        used = any(f".Values.{'.'.join(parts[:n])}" in text for n in range(len(parts), 0, -1))
        assert used, f"values.yaml {leaf} is not used by any template"


@pytest.mark.parametrize(
    "sets, message",
    [
        (["replicas=0"], "/replicas"),
        (["nope=1"], "additional properties 'nope' not allowed"),
        (["image.tagg=x"], "additional properties 'tagg' not allowed"),
        (["watchNamespaces={Bad_NS}"], "/watchNamespaces/0"),
        (["image.pullPolicy=Sometimes"], "/image/pullPolicy"),
        # A relative folder, or one with ':' (the variable's separator).
        (["settings.hostPathPrefixes={var/cache}"], "/settings/hostPathPrefixes/0"),
        (["settings.hostPathPrefixes={/a:/b}"], "/settings/hostPathPrefixes/0"),
        (["settings.podTemplateAllow={hostPath}"], "/settings/podTemplateAllow/0"),
        # 0 would block every drain of an operator's node.
        (["podDisruptionBudget.maxUnavailable=0"], "/podDisruptionBudget/maxUnavailable"),
        (["podDisruptionBudget.maxUnavailable=150%"], "/podDisruptionBudget/maxUnavailable"),
    ],
    ids=[
        "replicas-0",
        "unknown-top-key",
        "typo-nested",
        "bad-namespace",
        "bad-enum",
        "host-path-prefix-relative",
        "host-path-prefix-colon",
        "pod-template-allow-unknown",
        "budget-blocks-every-drain",
        "budget-over-100-percent",
    ],
)
def test_values_schema_rejects(sets: list[str], message: str):
    proc = helm("template", RELEASE, str(CHART), *set_args(sets), check=False)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr


@pytest.mark.parametrize("sets", [[], ALL_OPTIONS], ids=["defaults", "all-options"])
def test_builtin_objects_pass_strict_kubernetes_schema(sets: list[str]):
    for obj in template(*sets):
        if obj["apiVersion"].startswith("monitoring.coreos.com"):
            continue  # a CRD kind, checked by shape below
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_optional_objects_are_off_by_default_and_the_operators_policy_on():
    # The NetworkPolicy is on: a scanner (checkov CKV2_K8S_6) refuses a pod no policy
    # selects, and the report endpoint needs no client but kvferry's own pods.
    kinds = sorted(o["kind"] for o in template())
    assert kinds == sorted(
        [
            "ClusterRole",
            "ClusterRole",
            "ClusterRole",  # rolescaler-edit, aggregated into edit and admin
            "ClusterRoleBinding",
            "ClusterRoleBinding",
            "Role",  # the Lease, in the release namespace
            "RoleBinding",
            "Deployment",
            "NetworkPolicy",
            "PodDisruptionBudget",
            "Secret",
            "Service",
            "ServiceAccount",
        ]
    )
    assert "NetworkPolicy" not in {o["kind"] for o in template("networkPolicy.enabled=false")}


def test_deploy_manifest_is_current():
    proc = subprocess.run(
        ["bash", str(ROOT / "deploy" / "render.sh"), "-"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == (ROOT / "deploy" / "kvferry.yaml").read_text(), "run deploy/render.sh"
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    assert "Secret" not in {d["kind"] for d in docs}  # no shared private key in git
    assert [d["kind"] for d in docs[:3]] == [
        "Namespace",
        "CustomResourceDefinition",
        "CustomResourceDefinition",
    ]


# ------------------------------------------------------------------ the Deployment


def _scaled(value: int | str, replicas: int, round_up: bool) -> int:
    """A rollingUpdate bound as the Deployment controller reads it (intstr: a percentage
    of the replicas, maxSurge rounded up, maxUnavailable down)."""
    if isinstance(value, int):
        return value
    share = int(value.removesuffix("%")) * replicas / 100
    return math.ceil(share) if round_up else math.floor(share)


class TestOperatorDeployment:
    @pytest.mark.parametrize("replicas", [1, 2, 3])
    def test_runs_standalone_and_leader_elected_clusterwide_with_any_replicas(self, replicas):
        # One replica elects itself too: a rollout runs the old and the new pod at once.
        c = operator_container(template(f"replicas={replicas}"))
        assert c["command"] == ["kvferry-operator"]
        assert c["args"] == ["run", "--standalone", "--leader-elect"]

    def test_watch_namespaces_become_namespace_flags(self):
        c = operator_container(template("watchNamespaces={team-a,team-b}"))
        assert c["args"] == [
            "run",
            "--standalone",
            "--leader-elect",
            "--namespace=team-a",
            "--namespace=team-b",
        ]

    def test_two_replicas_by_default_one_on_request(self):
        assert one(template(), "Deployment")["spec"]["replicas"] == 2
        assert one(template("replicas=1"), "Deployment")["spec"]["replicas"] == 1
        assert one(template("replicas=3"), "Deployment")["spec"]["replicas"] == 3

    @pytest.mark.parametrize("replicas", [1, 2, 3])
    def test_a_rollout_starts_a_new_replica_before_it_stops_an_old_one(self, replicas: int):
        """Every live replica is Ready (the Service picks the leader by label), so a
        rollout may wait for new pods: never fewer replicas than asked, one more at a
        time. The Lease keeps the new ones from working while the old leader runs."""
        dep = one(template(f"replicas={replicas}"), "Deployment")
        strategy = dep["spec"]["strategy"]
        assert strategy["type"] == "RollingUpdate"
        bounds = strategy["rollingUpdate"]
        assert _scaled(bounds["maxUnavailable"], replicas, round_up=False) == 0, bounds
        assert _scaled(bounds["maxSurge"], replicas, round_up=True) >= 1, bounds

    @pytest.mark.parametrize("sets", [[], ["replicas=1"], ["replicas=3"], ALL_OPTIONS])
    def test_a_disruption_budget_covers_the_operators_pods_and_never_blocks_a_drain(
        self, sets: list[str]
    ):
        """One replica at a time, counted over the Deployment's pods; an unhealthy one
        may always go (it would use up the budget and hold the healthy one's drain)."""
        objs = template(*sets)
        dep = one(objs, "Deployment")
        budget = one(objs, "PodDisruptionBudget")
        assert budget["spec"]["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
        assert budget["metadata"]["namespace"] == dep["metadata"]["namespace"]
        assert budget["spec"]["maxUnavailable"] == 1
        assert budget["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
        assert "minAvailable" not in budget["spec"]

    def test_the_disruption_budget_is_optional_and_sized_by_values(self):
        assert "PodDisruptionBudget" not in {
            o["kind"] for o in template("podDisruptionBudget.enabled=false")
        }
        budget = one(template("podDisruptionBudget.maxUnavailable=50%"), "PodDisruptionBudget")
        assert budget["spec"]["maxUnavailable"] == "50%"

    def test_the_service_routes_to_the_leaders_label_alone(self):
        """Both replicas are Ready; reports and the ServiceMonitor's scrape must reach
        the Lease's holder, which labels its own pod (leader.LEADER_LABEL)."""
        from kvferry_operator import leader

        objs = template()
        selector = one(objs, "Service")["spec"]["selector"]
        labels = one(objs, "Deployment")["spec"]["template"]["metadata"]["labels"]
        assert selector.pop(leader.LEADER_LABEL) == "true"
        assert leader.LEADER_LABEL not in labels  # the leader adds it, the template never
        assert selector.items() <= labels.items()

    def test_replicas_prefer_different_nodes_unless_affinity_is_set(self):
        objs = template()
        pod = one(objs, "Deployment")["spec"]["template"]
        (term,) = pod["spec"]["affinity"]["podAntiAffinity"][
            "preferredDuringSchedulingIgnoredDuringExecution"
        ]
        assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
        selector = term["podAffinityTerm"]["labelSelector"]["matchLabels"]
        # The operator's pods, and the same ones the Deployment owns.
        assert selector.items() <= pod["metadata"]["labels"].items()
        assert selector == one(objs, "Deployment")["spec"]["selector"]["matchLabels"]
        assert pod["spec"]["affinity"].keys() == {"podAntiAffinity"}
        mine = "affinity.nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution[0]"
        objs = template(
            f"{mine}.weight=1",
            f"{mine}.preference.matchExpressions[0].key=pool",
            f"{mine}.preference.matchExpressions[0].operator=Exists",
        )
        affinity = one(objs, "Deployment")["spec"]["template"]["spec"]["affinity"]
        assert affinity == {
            "nodeAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "weight": 1,
                        "preference": {"matchExpressions": [{"key": "pool", "operator": "Exists"}]},
                    }
                ]
            }
        }

    def test_leader_election_env_names_the_lease_and_the_pod(self):
        for sets, name in (([], RELEASE), (["fullnameOverride=ferry"], "ferry")):
            env = env_of(operator_container(template(*sets)))
            assert env["KVFERRY_LEADER_ELECTION_ID"] == name
            assert env["KVFERRY_LEADER_ELECTION_NAMESPACE"] == {
                "fieldRef": {"fieldPath": "metadata.namespace"}
            }
            assert env["KVFERRY_POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
            assert env["KVFERRY_POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}

    def test_non_root_read_only_no_privileges(self):
        pod = one(template(), "Deployment")["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] != 0
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        sec = pod["containers"][0]["securityContext"]
        assert sec == {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        }
        # Read-only root: the kubernetes client's discovery cache needs a writable /tmp.
        assert {"name": "tmp", "mountPath": "/tmp"} in pod["containers"][0]["volumeMounts"]

    def test_operator_settings_come_from_values(self):
        c = operator_container(
            template(
                "sidecarImage.tag=9.9",
                "reportEndpoint.containerPort=9443",
                "settings.resyncSeconds=30",
                "settings.reportStaleSeconds=45",
                "settings.publishSeconds=5",
                "settings.hostPathPrefixes={/var/cache/kvferry,/mnt/models}",
                "settings.podTemplateAllow={capabilities,privileged}",
            )
        )
        env = env_of(c)
        assert env == {
            "KVFERRY_LEADER_ELECTION_NAMESPACE": {"fieldRef": {"fieldPath": "metadata.namespace"}},
            "KVFERRY_LEADER_ELECTION_ID": RELEASE,
            "KVFERRY_POD_NAME": {"fieldRef": {"fieldPath": "metadata.name"}},
            "KVFERRY_POD_NAMESPACE": {"fieldRef": {"fieldPath": "metadata.namespace"}},
            "KVFERRY_SIDECAR_IMAGE": "ghcr.io/kvferry/kvferry-sidecar:9.9",
            "KVFERRY_REPORT_PORT": "9443",
            "KVFERRY_TLS_CERT_FILE": "/etc/kvferry/tls/tls.crt",
            "KVFERRY_TLS_KEY_FILE": "/etc/kvferry/tls/tls.key",
            "KVFERRY_REPORT_URL": f"https://{RELEASE}.{NAMESPACE}.svc:8443/v1/reports",
            "KVFERRY_TLS_CA_FILE": "/etc/kvferry/tls/ca.crt",
            "KVFERRY_RESYNC_SECONDS": "30",
            "KVFERRY_REPORT_STALE_SECONDS": "45",
            "KVFERRY_PUBLISH_SECONDS": "5",
            "KVFERRY_HOST_PATH_PREFIXES": "/var/cache/kvferry:/mnt/models",
            "KVFERRY_METRICS_CLIENTS": "[]",
            "KVFERRY_POD_TEMPLATE_ALLOW": "capabilities,privileged",
            "KVFERRY_METRICS_PORT": "8080",
        }
        assert c["ports"] == [
            {"name": "reports", "containerPort": 9443, "protocol": "TCP"},
            {"name": "metrics", "containerPort": 8080, "protocol": "TCP"},
        ]

    def test_probes_hit_the_report_endpoint_health_over_https(self):
        c = operator_container(template())
        # Alive and Ready: leader and standby alike (the Service selects the leader's
        # label; a standby answers reports 503).
        for probe, path in (
            ("startupProbe", "/healthz"),
            ("readinessProbe", "/healthz"),
            ("livenessProbe", "/healthz"),
        ):
            assert c[probe]["httpGet"] == {"path": path, "port": "reports", "scheme": "HTTPS"}
        assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]

    def test_report_service_forwards_8443_to_the_container(self):
        objs = template("reportEndpoint.containerPort=9443")
        svc = one(objs, "Service")
        assert svc["spec"]["ports"] == [
            {"name": "reports", "port": 8443, "targetPort": "reports", "protocol": "TCP"},
            {"name": "metrics", "port": 8080, "targetPort": "metrics", "protocol": "TCP"},
        ]
        labels = one(objs, "Deployment")["spec"]["template"]["metadata"]["labels"]
        selector = {
            k: v for k, v in svc["spec"]["selector"].items() if k != "kvferry.io/operator-leader"
        }
        assert selector.items() <= labels.items()


# ------------------------------------------------------------------ TLS


def _openssl(*args: str, input: bytes | None = None) -> str:
    proc = subprocess.run(["openssl", *args], input=input, capture_output=True, check=True)
    return proc.stdout.decode()


class TestTls:
    def test_generated_certificate_is_signed_by_the_ca_for_the_service_names(self, tmp_path: Path):
        secret = one(template(), "Secret")
        assert secret["type"] == "kubernetes.io/tls"
        for key in ("ca.crt", "tls.crt", "tls.key"):
            (tmp_path / key).write_bytes(base64.b64decode(secret["data"][key]))
        verified = _openssl(
            "verify", "-CAfile", str(tmp_path / "ca.crt"), str(tmp_path / "tls.crt")
        )
        assert verified.strip().endswith("OK")
        text = _openssl(
            "x509", "-noout", "-ext", "subjectAltName", "-in", str(tmp_path / "tls.crt")
        )
        for name in (
            f"{RELEASE}.{NAMESPACE}.svc",
            f"{RELEASE}.{NAMESPACE}.svc.cluster.local",
        ):
            assert f"DNS:{name}" in text
        # The key belongs to the certificate.
        pub_cert = _openssl("x509", "-noout", "-pubkey", "-in", str(tmp_path / "tls.crt"))
        pub_key = _openssl("pkey", "-pubout", "-in", str(tmp_path / "tls.key"))
        assert pub_cert == pub_key

    def test_existing_secret_is_mounted_and_none_is_generated(self):
        objs = template("tls.existingSecret=my-cert")
        assert not [o for o in objs if o["kind"] == "Secret"]
        volumes = one(objs, "Deployment")["spec"]["template"]["spec"]["volumes"]
        assert volumes[0]["secret"]["secretName"] == "my-cert"


# ------------------------------------------------------------------ optional objects


class TestOptionalObjects:
    def test_service_monitor_scrapes_the_role_services_metrics(self):
        sm = one(template("serviceMonitor.enabled=true"), "ServiceMonitor", f"{RELEASE}-sidecars")
        assert sm["apiVersion"] == "monitoring.coreos.com/v1"
        assert sm["spec"]["namespaceSelector"] == {"any": True}
        # It selects the headless per-role Services the operator renders, not the client one.
        objs = render.render(api.parse_server(load_example(EXAMPLES[0])))
        services = [o for o in objs if o["kind"] == "Service"]
        sel = sm["spec"]["selector"]
        picked = [
            s["metadata"]["name"]
            for s in services
            if sel["matchLabels"].items() <= s["metadata"]["labels"].items()
            and api.LABEL_ROLE in s["metadata"]["labels"]
        ]
        assert sorted(picked) == sorted(
            s["metadata"]["name"] for s in services if s["spec"].get("clusterIP") == "None"
        )
        # The sidecars' scrape-only port (their series and their engines'): a scraper
        # needs no peer's port (internal 8001, engine 8200).
        assert [(e["port"], e["path"]) for e in sm["spec"]["endpoints"]] == [
            ("metrics", "/metrics"),
        ]
        assert all(
            "metrics" in {p["name"] for p in s["spec"]["ports"]}
            for s in services
            if s["metadata"]["name"] in picked
        )

    def test_operator_metrics_are_scraped_with_their_own_labels(self):
        for kind, sets, key in (
            ("ServiceMonitor", "serviceMonitor.enabled=true", "endpoints"),
            ("PodMonitor", "podMonitor.enabled=true", "podMetricsEndpoints"),
        ):
            objs = template(sets)
            mon = one(objs, kind, f"{RELEASE}-operator")
            (endpoint,) = mon["spec"][key]
            # The operator's series carry namespace/server of the servers they describe.
            assert (endpoint["port"], endpoint["honorLabels"]) == ("metrics", True)
            target = one(objs, "Service" if kind == "ServiceMonitor" else "Deployment")
            labels = (
                target["metadata"]["labels"]
                if kind == "ServiceMonitor"
                else target["spec"]["template"]["metadata"]["labels"]
            )
            assert mon["spec"]["selector"]["matchLabels"].items() <= labels.items()

    def test_pod_monitor_scrapes_the_ports_the_operator_renders(self):
        pm = one(template("podMonitor.enabled=true"), "PodMonitor", f"{RELEASE}-servers")
        assert pm["spec"]["namespaceSelector"] == {"any": True}
        objs = render.render(api.parse_server(load_example(EXAMPLES[0])))
        for sts in (o for o in objs if o["kind"] == "StatefulSet"):
            pod = sts["spec"]["template"]
            labels = pod["metadata"]["labels"]
            assert pm["spec"]["selector"]["matchLabels"].items() <= labels.items()
            containers = pod["spec"]["containers"] + pod["spec"]["initContainers"]
            ports = {p["name"]: p["containerPort"] for c in containers for p in c["ports"]}
            endpoints = pm["spec"]["podMetricsEndpoints"]
            # The sidecar's scrape-only port serves the engine's series too.
            assert [ports[e["port"]] for e in endpoints] == [protocol.SIDECAR_METRICS_PORT]
            # The dashboard's server and role labels come from labels the pods carry.
            for e in endpoints:
                sources = {r["sourceLabels"][0]: r["targetLabel"] for r in e["relabelings"]}
                assert sources == {
                    "__meta_kubernetes_pod_label_kvferry_io_role": "role",
                    "__meta_kubernetes_pod_label_kvferry_io_server": "server",
                }
                assert {api.LABEL_ROLE, api.LABEL_SERVER} <= labels.keys()

    def test_dashboard_configmap_carries_the_generated_dashboard(self):
        cm = one(template("grafanaDashboard.enabled=true"), "ConfigMap")
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        shipped = (CHART / "dashboards" / "kvferry.json").read_text()
        assert cm["data"]["kvferry.json"] == shipped.rstrip("\n")
        assert json.loads(cm["data"]["kvferry.json"])["uid"] == "kvferry-reuse"
        elsewhere = template("grafanaDashboard.enabled=true", "grafanaDashboard.namespace=grafana")
        assert one(elsewhere, "ConfigMap")["metadata"]["namespace"] == "grafana"

    def test_dashboard_json_is_generated_from_code(self):
        from kvferry_dev import dashboard

        assert dashboard.render() == (CHART / "dashboards" / "kvferry.json").read_text(), (
            "run python -m kvferry_dev.dashboard"
        )

    def test_network_policy_lets_metrics_clients_scrape_the_operator(self):
        objs = template(
            "networkPolicy.enabled=true",
            "networkPolicy.metricsClients[0].namespaceSelector.matchLabels.team=monitoring",
        )
        monitoring = [{"namespaceSelector": {"matchLabels": {"team": "monitoring"}}}]
        _, metrics = one(objs, "NetworkPolicy", RELEASE)["spec"]["ingress"]
        assert metrics == {"from": monitoring, "ports": [{"port": "metrics", "protocol": "TCP"}]}

    @pytest.mark.parametrize("enabled", ["true", "false"])
    def test_metrics_clients_reach_the_operator_for_every_servers_policy(self, enabled):
        """The operator renders them into each server's NetworkPolicy, on the sidecars'
        metrics port, whether or not the chart's own policy is on."""
        objs = template(
            f"networkPolicy.enabled={enabled}",
            "networkPolicy.metricsClients[0].namespaceSelector.matchLabels.team=monitoring",
        )
        env = {e["name"]: e.get("value") for e in operator_container(objs)["env"]}
        assert json.loads(env["KVFERRY_METRICS_CLIENTS"]) == [
            {"namespaceSelector": {"matchLabels": {"team": "monitoring"}}}
        ]

    def test_the_chart_renders_no_policy_for_server_pods(self):
        """The operator renders one per server (render.build_network_policy): a chart
        policy per namespace would admit every kvferry pod of the namespace to every
        server's engines, and policies add up."""
        objs = template("networkPolicy.enabled=true")
        assert [o["metadata"]["name"] for o in objs if o["kind"] == "NetworkPolicy"] == [RELEASE]

    def test_network_policy_report_endpoint_only_from_kvferry_pods(self):
        objs = template("networkPolicy.enabled=true")
        pol = one(objs, "NetworkPolicy")
        assert pol["metadata"]["namespace"] == NAMESPACE
        (rule,) = pol["spec"]["ingress"]
        assert rule["from"] == [
            {"namespaceSelector": {}, "podSelector": {"matchLabels": {api.LABEL_NAME: "kvferry"}}}
        ]
        assert rule["ports"] == [{"port": "reports", "protocol": "TCP"}]
        # The operator pod itself is not app.kubernetes.io/name=kvferry (not a server pod).
        pod_labels = one(objs, "Deployment")["spec"]["template"]["metadata"]["labels"]
        assert pod_labels[api.LABEL_NAME] != "kvferry"


# ------------------------------------------------------------------ server pods


def _pod_specs(path: Path) -> list[dict[str, Any]]:
    objs = render.render(api.parse_server(load_example(path)))
    return [o["spec"]["template"]["spec"] for o in objs if o["kind"] == "StatefulSet"]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_rendered_server_pods_have_no_host_access_or_privilege(path: Path):
    rdma = bool(load_example(path)["spec"].get("network", {}).get("rdma", {}).get("enabled"))
    for pod in _pod_specs(path):
        for key in ("hostNetwork", "hostPID", "hostIPC"):
            assert not pod.get(key), key
        assert pod["automountServiceAccountToken"] is False
        assert not [v for v in pod["volumes"] if "hostPath" in v]
        for c in pod["initContainers"] + pod["containers"]:
            sec = c["securityContext"]
            assert not sec.get("privileged"), c["name"]
            assert sec["allowPrivilegeEscalation"] is False, c["name"]
            adds = set(sec.get("capabilities", {}).get("add", []))
            # IPC_LOCK (pinning RDMA memory) is the only capability ever added.
            assert adds == ({"IPC_LOCK"} if rdma and c["name"] == "engine" else set()), c["name"]
        (engine,) = pod["containers"]
        assert engine["securityContext"]["capabilities"]["drop"] == ["ALL"]
        assert engine["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        (sidecar,) = pod["initContainers"]
        assert sidecar["securityContext"]["runAsNonRoot"] is True
        assert sidecar["securityContext"]["readOnlyRootFilesystem"] is True
        assert sidecar["securityContext"]["capabilities"]["drop"] == ["ALL"]
