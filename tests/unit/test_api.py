"""The API module: defaults come from the CRD schema and match the typed spec."""

from __future__ import annotations

import dataclasses
import re

import pytest

from kvferry_operator import api
from tests.manifests import MINIMAL, server

SPEC_SCHEMA = api.openapi_schema(api.SERVER_KIND)["properties"]["spec"]


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p.title() for p in rest)


def test_minimal_spec_gets_schema_defaults():
    spec = api.parse_spec(MINIMAL["spec"])
    assert spec.engine.image == "vllm/vllm-openai:v0.33.0"
    assert spec.prefill.replicas == 1 and spec.decode.replicas == 1
    assert spec.kv_transfer.bidirectional is True
    assert spec.kv_transfer.decode_retention_seconds == 480
    assert spec.kv_transfer.recompute_threshold == 64
    assert spec.kv_transfer.lease_seconds == 30
    assert spec.kv_transfer.backends == ("UCX",)
    assert spec.network.transport == "auto"
    assert spec.network.shared_memory_size == "16Gi"
    assert spec.network.rdma.enabled is False
    assert spec.routing.session_keys == (
        "session_id",
        "conversation_id",
        "header:X-Session-Id",
        "user",
    )
    assert spec.routing.skip_prefill_below_tokens == 256
    assert spec.cache_tuning.mode == "Recommend"
    assert spec.cache_tuning.coverage == 0.95
    assert (spec.cache_tuning.min_retention_seconds, spec.cache_tuning.max_retention_seconds) == (
        30,
        1800,
    )


def test_a_spec_with_only_the_model_name_loads_it_from_the_hub():
    # `vllm serve NAME`: the CRD defaults source to {hub: {}}, hub.id to model.name.
    spec = api.parse_spec({"model": {"name": "Qwen/Qwen3-0.6B"}})
    # The hub's download cache defaults inside the defaulted source (an
    # ephemeral-storage request: the pods download to their node's disk).
    hub_default = api.HubSource(id="Qwen/Qwen3-0.6B", cache=api.HubCache(ephemeral_storage="100Gi"))
    assert spec.model.hub == hub_default
    assert spec.model.pvc is None and spec.model.image is None
    defaulted = api.apply_defaults(SPEC_SCHEMA, {"model": {"name": "x"}})
    assert defaulted["model"]["source"] == {"hub": {"cache": {"ephemeralStorage": "100Gi"}}}


def test_an_explicit_hub_id_wins_over_the_model_name():
    spec = api.parse_spec({"model": {"name": "served", "source": {"hub": {"id": "org/m"}}}})
    assert spec.model.hub is not None and spec.model.hub.id == "org/m"


def test_the_engine_image_defaults_by_device():
    # No schema default (it cannot depend on engine.device): the device picks the image.
    engine_schema = SPEC_SCHEMA["properties"]["engine"]["properties"]
    assert "default" not in engine_schema["image"]
    assert engine_schema["device"]["default"] == api.DEVICE_GPU
    gpu = api.parse_spec(MINIMAL["spec"]).engine
    cpu_spec = server({"engine": {"device": "cpu", "image": "kvferry-vllm-cpu:v0.32.0"}})
    cpu = api.parse_spec(cpu_spec["spec"]).engine
    assert (gpu.device, gpu.image) == ("gpu", "vllm/vllm-openai:v0.33.0")
    assert (cpu.device, cpu.image) == ("cpu", "kvferry-vllm-cpu:v0.32.0")
    assert cpu.on_cpu and not gpu.on_cpu
    assert cpu.cpu_kv_cache_space_gib == 2
    # The CRD's description names the GPU default and why a CPU server has none.
    described = " ".join(engine_schema["image"]["description"].split())
    for image in api.DEFAULT_ENGINE_IMAGES.values():
        assert image in described
    assert "Required for device cpu" in described and "ships no NIXL" in described
    # vLLM's CPU images ship without NIXL: no default to fall back on (the CRD refuses
    # it; a server stored before it did gets the same words as an InvalidSpec).
    with pytest.raises(api.SpecError, match=r"spec\.engine\.image is required"):
        api.parse_spec(server({"engine": {"device": "cpu"}})["spec"])


def test_a_cpu_server_requests_no_gpus():
    spec = api.parse_spec(
        server({"engine": {"device": "cpu", "image": "kvferry-vllm-cpu:v0.32.0"}})["spec"]
    )
    assert spec.prefill.resources.gpus == 0 and spec.decode.resources.gpus == 0


@pytest.mark.parametrize("cpu", ["4 cores", "inf", ""])
def test_a_cpu_servers_cpu_quantity_is_checked_when_parsed(cpu):
    # Not at render time: the handlers turn a SpecError from parsing into an InvalidSpec
    # event; one from render failed the handler and rendered nothing.
    with pytest.raises(api.SpecError, match=r"spec\.prefill\.resources\.cpu is "):
        api.parse_spec(
            server(
                {
                    "engine": {"device": "cpu", "image": "kvferry-vllm-cpu:v0.32.0"},
                    "prefill": {"resources": {"cpu": cpu}},
                }
            )["spec"]
        )
    # GPU servers pass it through to the pod as before.
    api.parse_spec(server({"prefill": {"resources": {"cpu": cpu}}})["spec"])


@pytest.mark.parametrize(("quantity", "cores"), [("1", 1), ("500m", 1), ("3500m", 3), ("16", 16)])
def test_cpu_cores_of_a_quantity(quantity, cores):
    assert api.cpu_cores(quantity) == cores


def test_gpus_default_to_tensor_parallel_size():
    spec = api.parse_spec(server({"decode": {"tensorParallelSize": 4}})["spec"])
    assert spec.decode.resources.gpus == 4
    assert spec.prefill.resources.gpus == 1


def test_explicit_values_override_defaults():
    spec = api.parse_spec(
        server({"kvTransfer": {"decodeRetentionSeconds": 60, "bidirectional": False}})["spec"]
    )
    assert spec.kv_transfer.decode_retention_seconds == 60
    assert spec.kv_transfer.bidirectional is False


def test_defaulting_does_not_mutate_the_input():
    raw = server()
    before = repr(raw)
    api.parse_spec(raw["spec"])
    assert repr(raw) == before


def test_nested_defaults_apply_under_a_defaulted_parent():
    # `network: {}` defaulted must still get network.rdma.count, as the API server does.
    out = api.apply_defaults(SPEC_SCHEMA, {"model": {}})
    assert out["network"]["rdma"]["count"] == 1
    assert out["network"]["rdma"]["networks"] == []


# core/v1 types the typed spec keeps whole (a dict passed to the pods as it is, or
# merged into them: podTemplate).
CORE_TYPES = {"prefill.affinity", "decode.affinity", "prefill.podTemplate", "decode.podTemplate"}


def _schema_leaf_paths(schema, path=""):
    # An object that keeps unknown fields but declares some (model.source) has leaves.
    props = schema.get("properties")
    if not props or path in CORE_TYPES:
        return [path]
    out = []
    for name, sub in props.items():
        out += _schema_leaf_paths(sub, f"{path}.{name}" if path else name)
    return out


# Schema paths the typed spec folds into other fields, and why.
FOLDED = {
    "model.source.pvc.claimName": "model.pvc.claim_name",
    "model.source.pvc.path": "model.pvc.path",
    "model.source.hub.id": "model.hub.id",
    "model.source.hub.revision": "model.hub.revision",
    "model.source.hub.tokenSecret.name": "model.hub.token_secret_name",
    "model.source.hub.tokenSecret.key": "model.hub.token_secret_key",
    "model.source.image.path": "model.image.path",
    "model.source.hub.cache.pvc.claimName": "model.hub.cache.pvc_claim_name",
    "model.source.hub.cache.hostPath.path": "model.hub.cache.host_path",
    "model.source.hub.cache.ephemeralStorage": "model.hub.cache.ephemeral_storage",
    "engine.cpu.kvCacheSpaceGiB": "engine.cpu_kv_cache_space_gib",
    "prefill.scaling.mode": "prefill.scaling_mode",
    "decode.scaling.mode": "decode.scaling_mode",
}


def _dataclass_paths(cls, path=""):
    out = []
    for f in dataclasses.fields(cls):
        sub = f"{path}.{f.name}" if path else f.name
        inner = re.findall(r"\b([A-Z][A-Za-z]+)\b", str(f.type))
        nested = [getattr(api, n) for n in inner if dataclasses.is_dataclass(getattr(api, n, None))]
        if nested:
            out += _dataclass_paths(nested[0], sub)
        else:
            out.append(sub)
    return out


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_every_schema_field_has_a_typed_field(role):
    # Keeps api.py and the CRD from drifting: a field added to one must reach the other.
    typed = set(_dataclass_paths(api.ServerSpec))
    for path in _schema_leaf_paths(SPEC_SCHEMA):
        if path in FOLDED:
            assert FOLDED[path] in typed, path
            continue
        snake = ".".join(re.sub(r"(?<!^)(?=[A-Z])", "_", p).lower() for p in path.split("."))
        assert snake in typed, f"spec.{path} has no field in kvferry_operator.api"


def test_every_typed_field_is_in_the_schema():
    schema_paths = set(_schema_leaf_paths(SPEC_SCHEMA)) | set(FOLDED.values())
    camel = {".".join(_camel(p) for p in t.split(".")) for t in _dataclass_paths(api.ServerSpec)}
    folded_typed = {".".join(_camel(p) for p in v.split(".")) for v in FOLDED.values()}
    extra = camel - {p for p in schema_paths} - folded_typed - {"prefill.name", "decode.name"}
    assert sorted(extra) == []
