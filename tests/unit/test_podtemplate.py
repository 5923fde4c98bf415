"""spec.<role>.podTemplate: the strategic merge, its shape checks and what the operator's
settings refuse (kvferry_operator.podtemplate, one test per rule of its docstring)."""

from __future__ import annotations

import copy

import pytest

from kvferry_operator import api, hostpaths, podtemplate, render
from kvferry_operator.settings import Settings
from tests.manifests import merge, server

BASE = {
    "metadata": {"labels": {"a": "1"}, "annotations": {"x": "1"}},
    "spec": {
        "enableServiceLinks": False,
        "containers": [
            {
                "name": "engine",
                "image": "vllm",
                "env": [{"name": "A", "value": "1"}],
                "ports": [{"name": "engine", "containerPort": 8200}],
                "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
                "securityContext": {"capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]}},
            }
        ],
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}],
        "tolerations": [{"key": "gpu", "operator": "Exists"}],
        "topologySpreadConstraints": [
            {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "A"}
        ],
    },
}


def merged(overlay):
    return podtemplate.merge(BASE, overlay)


def engine(template):
    return template["spec"]["containers"][0]


# ------------------------------------------------------------------ the merge


def test_maps_merge_key_by_key():
    out = merged({"metadata": {"labels": {"b": "2"}}, "spec": {"serviceAccountName": "sa"}})
    assert out["metadata"]["labels"] == {"a": "1", "b": "2"}
    assert out["spec"]["serviceAccountName"] == "sa"
    assert out["spec"]["enableServiceLinks"] is False


def test_a_null_removes_the_key():
    out = merged({"spec": {"enableServiceLinks": None}, "metadata": {"annotations": {"x": None}}})
    assert "enableServiceLinks" not in out["spec"]
    assert out["metadata"]["annotations"] == {}


def test_containers_merge_by_name_and_their_mounts_by_mount_path():
    out = merged(
        {
            "spec": {
                "containers": [
                    {"name": "engine", "volumeMounts": [{"name": "cache", "mountPath": "/c"}]},
                    {"name": "logs", "image": "fluent-bit"},
                ]
            }
        }
    )
    assert [c["name"] for c in out["spec"]["containers"]] == ["engine", "logs"]
    assert engine(out)["image"] == "vllm"  # kept
    assert engine(out)["volumeMounts"] == [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "cache", "mountPath": "/c"},
    ]


def test_env_merges_by_name_and_ports_by_container_port():
    out = merged(
        {
            "spec": {
                "containers": [
                    {
                        "name": "engine",
                        "env": [{"name": "A", "value": "2"}, {"name": "B", "value": "3"}],
                        "ports": [{"containerPort": 8200, "protocol": "TCP"}],
                    }
                ]
            }
        }
    )
    assert engine(out)["env"] == [{"name": "A", "value": "2"}, {"name": "B", "value": "3"}]
    assert engine(out)["ports"] == [{"name": "engine", "containerPort": 8200, "protocol": "TCP"}]


def test_a_volume_replaces_its_namesake_whole():
    # core/v1 volumes are retainKeys: two sources in one volume would be refused.
    out = merged({"spec": {"volumes": [{"name": "dshm", "hostPath": {"path": "/x"}}]}})
    assert out["spec"]["volumes"] == [{"name": "dshm", "hostPath": {"path": "/x"}}]


def test_new_volumes_are_appended_in_the_overlays_order():
    out = merged({"spec": {"volumes": [{"name": "b", "emptyDir": {}}, {"name": "a"}]}})
    assert [v["name"] for v in out["spec"]["volumes"]] == ["dshm", "b", "a"]


def test_a_spread_of_the_same_topology_key_merges_into_ours():
    spread = {"topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "DoNotSchedule"}
    out = merged({"spec": {"topologySpreadConstraints": [spread]}})
    assert out["spec"]["topologySpreadConstraints"] == [
        {
            "maxSkew": 1,
            "topologyKey": "kubernetes.io/hostname",
            "whenUnsatisfiable": "DoNotSchedule",
        }
    ]


def test_patch_delete_removes_our_item_of_that_key():
    gone = {"topologyKey": "kubernetes.io/hostname", "$patch": "delete"}
    out = merged({"spec": {"topologySpreadConstraints": [gone]}})
    assert out["spec"]["topologySpreadConstraints"] == []


def test_lists_without_a_merge_key_replace_ours():
    out = merged(
        {
            "spec": {
                "tolerations": [{"key": "other", "operator": "Exists"}],
                "containers": [
                    {"name": "engine", "securityContext": {"capabilities": {"add": ["SYS_NICE"]}}}
                ],
            }
        }
    )
    assert out["spec"]["tolerations"] == [{"key": "other", "operator": "Exists"}]
    assert engine(out)["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["SYS_NICE"]}


def test_neither_input_changes():
    base, overlay = copy.deepcopy(BASE), {"spec": {"containers": [{"name": "engine", "a": 1}]}}
    kept = copy.deepcopy(overlay)
    podtemplate.merge(base, overlay)
    assert base == BASE and overlay == kept


def test_no_overlay_is_the_base():
    assert podtemplate.merge(BASE, None) == BASE


# ------------------------------------------------------------------ shape


@pytest.mark.parametrize(
    "overlay, fragment",
    [
        ([], "must be a pod template"),
        ({"kind": "Pod"}, "takes metadata and spec only"),
        ({"spec": []}, "spec.decode.podTemplate.spec must be a map"),
        (
            {"spec": {"volumes": [{"emptyDir": {}}]}},
            "spec.decode.podTemplate.spec.volumes[0] has no name",
        ),
        (
            {"spec": {"containers": [{"name": "engine", "env": [{"value": "1"}]}]}},
            "spec.decode.podTemplate.spec.containers[0].env[0] has no name",
        ),
    ],
)
def test_what_cannot_be_merged_is_refused_naming_the_field(overlay, fragment):
    with pytest.raises(ValueError) as err:
        podtemplate.check("decode", overlay)
    assert fragment in str(err.value)


def test_parse_spec_makes_a_shape_error_a_spec_error():
    bad = server({"prefill": {"podTemplate": {"spec": {"volumes": [{}]}}}})
    with pytest.raises(api.SpecError, match=r"spec\.prefill\.podTemplate\.spec\.volumes\[0\]"):
        api.parse_server(bad)


# ------------------------------------------------------------------ refusals

NONE = frozenset()


def forbidden(spec, allow=NONE, prefixes=()):
    return podtemplate.forbidden(
        "decode", {"spec": spec}, allow, lambda p: hostpaths.allowed(p, prefixes)
    )


def _engine_adds(*capabilities):
    return {
        "containers": [
            {"name": "engine", "securityContext": {"capabilities": {"add": [*capabilities]}}}
        ]
    }


P = "spec.decode.podTemplate.spec"
EVERY = frozenset(podtemplate.ALLOWS)
HOST_NS = frozenset({"hostNamespaces"})

# (spec, where, the rule that refuses it, what allows it: a setting or host-path prefixes).
REFUSED = [
    *(
        pytest.param({name: True}, f"{P}.{name}", "hostNamespaces", HOST_NS, (), id=name)
        for name in ("hostNetwork", "hostPID", "hostIPC")
    ),
    pytest.param(
        {"containers": [{"name": "exporter", "ports": [{"containerPort": 9, "hostPort": 9}]}]},
        f"{P}.containers[name=exporter].ports[0].hostPort",
        "hostNamespaces",
        HOST_NS,
        (),
        id="hostPort",
    ),
    *(
        pytest.param(
            {"initContainers": [{"name": "setup", "securityContext": {name: True}}]},
            f"{P}.initContainers[name=setup].securityContext.{name}",
            "privileged",
            frozenset({"privileged"}),
            (),
            id=name,
        )
        for name in ("privileged", "allowPrivilegeEscalation")
    ),
    pytest.param(
        _engine_adds("NET_ADMIN"),
        f"{P}.containers[name=engine].securityContext.capabilities.add",
        "capabilities",
        frozenset({"capabilities"}),
        (),
        id="capabilities-beyond-ipc-lock",
    ),
    pytest.param(
        {"volumes": [{"name": "nvme", "hostPath": {"path": "/mnt/nvme/cache"}}]},
        f"{P}.volumes[name=nvme].hostPath.path",
        "prefixes",
        NONE,
        ("/mnt/nvme",),
        id="hostPath-outside-the-prefixes",
    ),
]


@pytest.mark.parametrize("spec, where, rule, allow, prefixes", REFUSED)
def test_what_the_settings_do_not_allow_is_refused_until_they_do(
    spec, where, rule, allow, prefixes
):
    assert forbidden(spec) == [(where, rule)]
    assert forbidden(spec, allow, prefixes) == []


# What no setting needs to allow, and what no setting allows.
NOT_REFUSED = [
    *(
        pytest.param({name: False}, id=f"{name}-false")
        for name in ("hostNetwork", "hostPID", "hostIPC")
    ),
    pytest.param(_engine_adds("IPC_LOCK"), id="ipc-lock"),
    # A container of the user's own may be deleted (it is not in kvferry's template).
    pytest.param({"containers": [{"name": "logs", "$patch": "delete"}]}, id="delete-own-container"),
]


@pytest.mark.parametrize("spec", NOT_REFUSED)
def test_what_needs_no_setting_is_never_refused(spec):
    assert forbidden(spec) == []


def test_a_host_path_climbing_out_of_an_allowed_prefix_is_refused():
    spec = {"volumes": [{"name": "x", "hostPath": {"path": "/mnt/nvme/../../etc"}}]}
    assert forbidden(spec, prefixes=("/mnt/nvme",))


@pytest.mark.parametrize(
    "spec, where",
    [
        ({"containers": [{"name": "engine", "$patch": "delete"}]}, "containers[0].$patch"),
        (
            {"containers": [{"name": "engine", "securityContext": None}]},
            "containers[0].securityContext",
        ),
        ({"volumes": None}, "volumes"),
    ],
    ids=["delete-engine", "null-engine-security-context", "null-volumes"],
)
def test_deleting_or_nulling_what_is_kvferrys_is_refused_whatever_the_settings(spec, where):
    assert forbidden(spec, EVERY) == [(f"{P}.{where}", "kvferry")]


@pytest.mark.parametrize(
    "spec, where",
    [
        ({"tolerations": [], "$patch": "replace"}, "spec.$patch"),
        ({"$setElementOrder/containers": [{"name": "engine"}]}, "spec.$setElementOrder/containers"),
        ({"volumes": [{"$patch": "replace", "name": "v"}]}, "spec.volumes[0].$patch"),
        ({"affinity": {"$patch": "delete"}}, "spec.affinity.$patch"),
    ],
)
def test_a_directive_the_merge_does_not_take_is_refused_whatever_the_settings(spec, where):
    # CEL cannot see `$` keys: the API server stores them, the operator refuses them.
    every = frozenset(podtemplate.ALLOWS)
    assert forbidden(spec, every) == [(f"spec.decode.podTemplate.{where}", "directive")]
    why = podtemplate.refusal({"decode": {"spec": spec}}, every, (), lambda p: True)
    assert why == (
        f"spec.decode.podTemplate.{where}: only $patch: delete on an item of a list merged "
        "by key is supported (e.g. a topologySpreadConstraints entry): the StatefulSets are "
        "not applied. Write the value whole instead"
    )


HOOKS = [
    pytest.param(
        "containers",
        "engine",
        {"preStop": {"httpGet": {"path": "/healthz", "port": 8001}}},
        id="engine-prestop-path",
    ),
    pytest.param(
        "containers", "engine", {"preStop": {"exec": {"command": ["true"]}}}, id="engine-exec"
    ),
    pytest.param(
        "containers", "engine", {"postStart": {"sleep": {"seconds": 1}}}, id="engine-poststart"
    ),
    pytest.param("containers", "engine", {}, id="engine-empty"),
    pytest.param(
        "initContainers",
        "kvferry-sidecar",
        {"preStop": {"sleep": {"seconds": 600}}},
        id="sidecar-prestop",
    ),
]


@pytest.mark.parametrize("kind, name, lifecycle", HOOKS)
def test_the_lifecycle_hooks_of_kvferrys_containers_are_refused_whatever_the_settings(
    kind, name, lifecycle
):
    """The engine's preStop is the drain: an overlay pointing it at /healthz (or any
    other hook) would stop the engine with turns in flight. Once only deleting it was
    refused; the CRD refuses it first (tests/manifests.py, pod-template-engine-lifecycle)."""
    spec = {kind: [{"name": name, "lifecycle": lifecycle}]}
    where = f"{P}.{kind}[name={name}].lifecycle"
    assert forbidden(spec, EVERY) == [(where, "hook")]
    why = podtemplate.refusal({"decode": {"spec": spec}}, EVERY, (), lambda p: True)
    assert why is not None
    assert why.startswith(f"{where}: the lifecycle hooks of kvferry's containers are kvferry's")
    assert "the StatefulSets are not applied" in why
    assert "Remove lifecycle from the pod template" in why
    assert "spec.decode.drainSeconds" in why


def test_a_lifecycle_on_a_container_of_ones_own_is_no_refusal():
    assert forbidden({"containers": [{"name": "logs", "lifecycle": {"preStop": {}}}]}) == []


def test_an_engine_hook_is_refused_through_the_servers_overlays():
    hook = {"preStop": {"httpGet": {"path": "/healthz", "port": 8001}}}
    spec = {
        "prefill": {
            "podTemplate": {"spec": {"containers": [{"name": "engine", "lifecycle": hook}]}}
        }
    }
    parsed = api.parse_server(server(spec))
    allowing = Settings(
        sidecar_image="", resync_seconds=60, pod_template_allow=frozenset(podtemplate.ALLOWS)
    )
    assert "spec.prefill.podTemplate.spec.containers[name=engine].lifecycle" in (
        allowing.pod_template_refusal(parsed) or ""
    )


RESERVED_ANNOTATIONS = [
    pytest.param({"k8s.v1.cni.cncf.io/networks": "other-tenant/net"}, id="networks"),
    pytest.param({"kvferry.io/config-hash": "x"}, id="rollout-hash"),
    pytest.param({"kvferry.io/anything": "x", "example.com/mine": "1"}, id="kvferry-io"),
]


@pytest.mark.parametrize("annotations", RESERVED_ANNOTATIONS)
@pytest.mark.parametrize(
    "role_patch, where",
    [
        (lambda a: {"podAnnotations": a}, "spec.decode.podAnnotations"),
        (
            lambda a: {"podTemplate": {"metadata": {"annotations": a}}},
            "spec.decode.podTemplate.metadata.annotations",
        ),
    ],
    ids=["podAnnotations", "podTemplate"],
)
def test_reserved_pod_annotations_are_refused_wherever_they_are_written(
    annotations, role_patch, where
):
    """spec.<role>.podAnnotations once landed a Multus network of another tenant and
    kvferry.io/* on the pods, which the pod-template rule refuses: one rule for both,
    the CRD's (tests/manifests.py, pod-annotations-*) and the operator's for objects
    stored before it, with the same message."""
    with pytest.raises(api.SpecError) as err:
        api.parse_server(server({"decode": role_patch(annotations)}))
    reserved = sorted(k for k in annotations if not k.startswith("example.com/"))
    assert str(err.value) == f"{where}: {', '.join(reserved)}: {podtemplate.ANNOTATIONS_MESSAGE}"


def test_annotations_of_ones_own_are_kept():
    mine = {"example.com/team": "llm", "prometheus.io/scrape": "true"}
    parsed = api.parse_server(
        server(
            {"decode": {"podAnnotations": mine, "podTemplate": {"metadata": {"annotations": mine}}}}
        )
    )
    assert parsed.spec.role("decode").pod_annotations == mine


def test_the_crd_refuses_pod_annotations_with_the_operators_rule_and_message():
    roles = api.openapi_schema(api.SERVER_KIND)["properties"]["spec"]["properties"]
    for role in ("prefill", "decode"):
        props = roles[role]["properties"]
        template = props["podTemplate"]["properties"]["metadata"]["properties"]["annotations"]
        for node in (props["podAnnotations"], template):
            (rule,) = node["x-kubernetes-validations"]
            assert rule["rule"] == podtemplate.ANNOTATIONS_RULE
            assert " ".join(rule["message"].split()) == podtemplate.ANNOTATIONS_MESSAGE


def test_patch_delete_on_an_item_of_a_keyed_list_is_no_directive_refused():
    spread = {"topologySpreadConstraints": [{"topologyKey": "x", "$patch": "delete"}]}
    assert forbidden(spread) == []


def test_the_refusal_names_every_field_and_the_setting_that_allows_it():
    why = podtemplate.refusal(
        {
            "prefill": {"spec": {"hostNetwork": True}},
            "decode": {"spec": {"volumes": [{"name": "v", "hostPath": {"path": "/etc"}}]}},
        },
        NONE,
        (),
        lambda p: False,
    )
    assert why is not None
    assert why.startswith(
        "spec.prefill.podTemplate.spec.hostNetwork, "
        "spec.decode.podTemplate.spec.volumes[name=v].hostPath.path: not allowed by the "
        "operator's settings"
    )
    assert "the StatefulSets are not applied" in why
    assert "settings.podTemplateAllow: [hostNamespaces] in the chart" in why
    assert "KVFERRY_POD_TEMPLATE_ALLOW" in why
    assert "settings.hostPathPrefixes (KVFERRY_HOST_PATH_PREFIXES); allowed now: none" in why


def test_no_overlay_is_never_refused():
    assert podtemplate.refusal({"prefill": None, "decode": {}}, NONE, (), lambda p: False) is None


def test_settings_refuse_through_the_servers_overlays():
    spec = {"decode": {"podTemplate": {"spec": {"hostPID": True}}}}
    parsed = api.parse_server(server(spec))
    plain = Settings(sidecar_image="", resync_seconds=60)
    allowing = Settings(
        sidecar_image="", resync_seconds=60, pod_template_allow=frozenset({"hostNamespaces"})
    )
    assert "spec.decode.podTemplate.spec.hostPID" in (plain.pod_template_refusal(parsed) or "")
    assert allowing.pod_template_refusal(parsed) is None


@pytest.mark.parametrize(
    "text, allowed",
    [("", frozenset()), ("privileged, capabilities", frozenset({"privileged", "capabilities"}))],
)
def test_the_allow_setting_parses_names(text, allowed):
    assert podtemplate.parse_allow(text) == allowed


def test_an_unknown_allow_name_is_a_startup_error_naming_the_variable():
    with pytest.raises(ValueError, match=r"KVFERRY_POD_TEMPLATE_ALLOW: hostpath is not one of"):
        podtemplate.parse_allow("hostpath")


# ------------------------------------------------------------------ names kept in step


def test_kvferrys_names_are_those_render_uses():
    # With a token Secret: its volume is kvferry's too.
    hub = {"model": {"source": {"hub": {"tokenSecret": {"name": "hf", "key": "token"}}}}}
    objects = render.render(api.parse_server(merge(server(), {"spec": hub})))
    pvc = render.render(api.parse_server(server()))
    pods = [o["spec"]["template"]["spec"] for o in objects + pvc if o["kind"] == "StatefulSet"]
    volumes = {v["name"] for p in pods for v in p["volumes"]}
    assert volumes == set(podtemplate.KVFERRY_VOLUMES)
    assert {c["name"] for p in pods for c in p["containers"]} == {podtemplate.ENGINE_CONTAINER}
    assert {c["name"] for p in pods for c in p["initContainers"]} == {podtemplate.SIDECAR_CONTAINER}


def test_the_crd_rules_name_kvferrys_volumes():
    rules = api.openapi_schema(api.SERVER_KIND)["properties"]["spec"]["properties"]["decode"]
    spec_rules = rules["properties"]["podTemplate"]["properties"]["spec"][
        "x-kubernetes-validations"
    ]
    volume_rule = next(r["rule"] for r in spec_rules if "self.volumes" in r["rule"])
    for name in podtemplate.KVFERRY_VOLUMES:
        assert f"'{name}'" in volume_rule


def test_the_host_path_setting_named_is_hostpaths():
    assert f"{hostpaths.CHART_VALUE} ({hostpaths.ENV})" == podtemplate.HOST_PATH_SETTING
