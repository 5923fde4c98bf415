"""What each container of a server's pods asks the node for, and how long it may start.

Pure: spec in, core/v1 ``resources`` and probe dicts out. The rules:

1. **The engine's cpu and memory** are ``spec.<role>.resources.cpu`` / ``.memory``
   (request and limit alike) or, unset, the device's default:

   - gpu: ``GPU_CPUS_PER_GPU`` CPUs and ``GPU_MEMORY_GIB_PER_GPU`` GiB per GPU plus
     ``network.sharedMemorySize``, requests equal to limits. Whole CPUs and equal
     amounts make the pod Guaranteed with the sidecar's defaults (rule 3): the last the
     kubelet evicts under memory pressure, and the only pods the static CPU manager
     gives cores of their own. Per GPU: a worker process, its share of the API server,
     the engine loop and NIXL's progress threads (each polls most of a core); small
     enough that a one-GPU pod fits an 8-vCPU, 32 GiB node.
   - cpu: requests only, ``CPU_DEFAULT_CPUS`` and the KV cache space plus
     ``CPU_WEIGHTS_AND_RUNTIME_GIB`` plus ``sharedMemorySize``. No CPU limit: the
     OpenMP threads share the pod's CPUs with NIXL's polling threads, and a CFS quota
     stalls every OpenMP thread when one is throttled. No memory limit: the weights are
     the model's size, which the default cannot know.

   ``sharedMemorySize`` is in both memory defaults because /dev/shm is a memory-backed
   emptyDir: what it holds counts against the container's memory (its pages are the
   engine's), so a request without it lets a full /dev/shm push the pod past its
   request, the first pods the kubelet evicts.
2. **Then the spec's maps**: ``resources.requests`` and ``resources.limits`` win key
   by key (a request below its limit, hugepages, RDMA or device resources); GPUs,
   the RDMA resource and the hub download's ephemeral storage are added before them.
   A cpu or memory limit in the map without a request (map or field) is the request
   too, as Kubernetes defaults it: a default request never ends above it.
3. **The sidecar** gets ``spec.<role>.sidecarResources``; with no limit set, its limits
   are its requests (the CRD defaults only the requests), so its container has requests
   equal to limits unless the spec sets a limit (then an unset memory limit is the
   memory request, an unset CPU limit stays unset).
4. **Startup**: the engine's startup probe allows ``spec.<role>.startupSeconds``, or
   by source ``STARTUP_SECONDS_HUB`` (the hub downloads the weights at least once) or
   ``STARTUP_SECONDS_LOCAL``. The sidecar's startup probe asks ``/healthz``, which it
   answers as soon as it serves: a native sidecar's startup probe holds the engine's
   start, so a probe that needs the engine (``/readyz``) would never pass.
"""

from __future__ import annotations

import math
from typing import Any

from . import api
from .api import Role, ServerSpec

Obj = dict[str, Any]

# What a CPU engine asks the scheduler for when spec.<role>.resources leaves it unset:
# 2 CPUs (one OpenMP thread, one for the API server, the engine loop and NIXL's
# busy-polling progress thread) and its KV cache space plus room for a small model's
# weights and the runtime (resources.py adds /dev/shm). Requests only, no limits: a
# limit would throttle the threads or OOM-kill a larger model the user did not size for.
CPU_DEFAULT_CPUS = "2"
CPU_WEIGHTS_AND_RUNTIME_GIB = 4

# A GPU engine's defaults per GPU (rule 1).
# 4 and 8: a 1-GPU pod (engine and sidecar: 4.5 CPUs, 25Gi with the default /dev/shm)
# fits the common 8-vCPU, 32 GiB one-GPU cloud nodes; examples/rdma.yaml gives 4 per GPU.
GPU_CPUS_PER_GPU = 4
GPU_MEMORY_GIB_PER_GPU = 8

# The engine's startup budgets when spec.<role>.startupSeconds is unset (rule 4).
STARTUP_SECONDS_LOCAL = 1800
STARTUP_SECONDS_HUB = 7200
# The engine's startup probe period: the budget is failureThreshold periods.
ENGINE_STARTUP_PERIOD = 10

# The sidecar starts serving within its first engine and peer probes (a connect
# timeout of 3 s); 60 s covers a slow node importing Python. Probed every second: the
# engine starts only once this probe passes.
SIDECAR_STARTUP_PERIOD = 1
SIDECAR_STARTUP_FAILURES = 60

_GIB = 1024**3


def format_bytes(n: int) -> str:
    """A memory quantity for ``n`` bytes in the largest binary unit that divides it."""
    for suffix, size in reversed(api.BINARY_MEMORY_UNITS):
        if n % size == 0:
            return f"{n // size}{suffix}"
    return str(n)


def shared_memory_bytes(spec: ServerSpec) -> int:
    """``network.sharedMemorySize`` in bytes; 0 for a value that is no quantity, which
    the API server refuses in the volume's sizeLimit anyway (the server's status names
    the StatefulSet it refused), so the memory default need not fail first."""
    try:
        return api.memory_bytes(spec.network.shared_memory_size)
    except ValueError:
        return 0


def default_engine_amounts(spec: ServerSpec, role: Role) -> tuple[Obj, Obj]:
    """Rule 1: the engine's (requests, limits) of cpu and memory, from the spec's
    ``cpu``/``memory`` where set, else the device's default."""
    shm = shared_memory_bytes(spec)
    if spec.engine.on_cpu:
        memory = format_bytes(
            (spec.engine.cpu_kv_cache_space_gib + CPU_WEIGHTS_AND_RUNTIME_GIB) * _GIB + shm
        )
        requests: Obj = {"cpu": CPU_DEFAULT_CPUS, "memory": memory}
        limits: Obj = {}
    else:
        gpus = max(1, role.resources.gpus)
        memory = format_bytes(gpus * GPU_MEMORY_GIB_PER_GPU * _GIB + shm)
        requests = {"cpu": str(gpus * GPU_CPUS_PER_GPU), "memory": memory}
        limits = dict(requests)
    for key, value in (("cpu", role.resources.cpu), ("memory", role.resources.memory)):
        if value is not None:
            requests[key] = limits[key] = value
        elif key in role.resources.limits:
            # As Kubernetes defaults a request: a limit set alone is the request too
            # (never a default request above the user's limit).
            requests[key] = role.resources.limits[key]
    return requests, limits


def _raise_default_limits(role: Role, requests: Obj, limits: Obj) -> None:
    """A request from ``resources.requests`` above a limit the user never wrote (the
    device's default) raises that limit to it: the API server refuses a request above
    its limit, and the user asked for more, not for an ApplyFailed."""
    for key, parse in (("cpu", api.cpu_millis), ("memory", api.memory_bytes)):
        asked = role.resources.requests.get(key)
        written = getattr(role.resources, key) is not None or key in role.resources.limits
        if asked is None or written or key not in limits:
            continue
        try:
            if parse(str(asked)) > parse(str(limits[key])):
                limits[key] = asked
        except (ValueError, OverflowError):
            continue  # not a quantity this parses: the API server says which field


def build_engine_resources(spec: ServerSpec, role: Role) -> Obj:
    requests, limits = default_engine_amounts(spec, role)
    if role.resources.gpus:
        limits[role.resources.gpu_resource_name] = role.resources.gpus
    rdma = spec.network.rdma
    if rdma.enabled and rdma.resource_name:
        limits[rdma.resource_name] = rdma.count
    hub = spec.model.hub
    if hub and not (hub.cache.pvc_claim_name or hub.cache.host_path):
        # The download lands on the node's disk: place pods where it fits.
        requests["ephemeral-storage"] = hub.cache.ephemeral_storage
    requests.update(role.resources.requests)
    limits.update(role.resources.limits)
    _raise_default_limits(role, requests, limits)
    out: Obj = {"limits": limits}
    if requests:
        out["requests"] = requests
    return out


def build_sidecar_resources(role: Role) -> Obj:
    """Rule 3: spec.<role>.sidecarResources; with no limit set at all, the limits are the
    requests (a Guaranteed pod). Once a limit is set, an unset memory limit is still the
    memory request (the sidecar's memory is always bounded), an unset CPU limit stays
    unset: a server stored by the old CRD (a 1Gi memory limit, no CPU limit) must not get
    its 250m CPU request as a limit that throttles every turn."""
    amounts = role.sidecar_resources
    requests = {
        k: v for k, v in (("cpu", amounts.requests.cpu), ("memory", amounts.requests.memory)) if v
    }
    limits = {
        k: v for k, v in (("cpu", amounts.limits.cpu), ("memory", amounts.limits.memory)) if v
    }
    if not limits:
        limits = {**requests}
    elif "memory" not in limits and "memory" in requests:
        limits["memory"] = requests["memory"]
    out: Obj = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def startup_seconds(spec: ServerSpec, role: Role) -> int:
    """Rule 4: the engine's startup budget."""
    if role.startup_seconds is not None:
        return role.startup_seconds
    return STARTUP_SECONDS_HUB if spec.model.hub else STARTUP_SECONDS_LOCAL


def http_probe(path: str, port: str, period: int, failures: int) -> Obj:
    """An HTTP probe with every field the API server would default written out, so the
    StatefulSet reads back as rendered."""
    return {
        "httpGet": {"path": path, "port": port, "scheme": "HTTP"},
        "periodSeconds": period,
        "failureThreshold": failures,
        "successThreshold": 1,
        "timeoutSeconds": 5,
    }


def build_engine_probes(spec: ServerSpec, role: Role) -> Obj:
    """The engine's probes, all on vLLM's /health: liveness only once startup passed."""
    failures = math.ceil(startup_seconds(spec, role) / ENGINE_STARTUP_PERIOD)
    return {
        "startupProbe": http_probe("/health", "engine", ENGINE_STARTUP_PERIOD, failures),
        "readinessProbe": http_probe("/health", "engine", 5, 3),
        "livenessProbe": http_probe("/health", "engine", 10, 6),
    }


def build_sidecar_probes() -> Obj:
    """The sidecar's probes: started and alive on /healthz (the process serves), ready
    on /readyz (its engine answers /health)."""
    return {
        "startupProbe": http_probe(
            "/healthz", "http", SIDECAR_STARTUP_PERIOD, SIDECAR_STARTUP_FAILURES
        ),
        "readinessProbe": http_probe("/readyz", "http", 5, 3),
        "livenessProbe": http_probe("/healthz", "http", 10, 6),
    }
