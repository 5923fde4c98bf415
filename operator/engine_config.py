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

from . import api
from .api import Role, Server, ServerSpec

MODELS_MOUNT = "/models"

# UCX transport lists per network.transport. "auto" leaves UCX_TLS unset so UCX
# picks the best it finds and the sidecar reports what it negotiated. cuda_copy
# and cuda_ipc stay in both lists: without them UCX cannot move GPU memory.
UCX_TLS = {
    "tcp": "tcp,cuda_copy,cuda_ipc,sm,self",
    "rdma": "ib,cuda_copy,cuda_ipc,gdr_copy,sm,self",
}

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


def build_kv_transfer_config(server: Server, role: str) -> Obj:
    """vLLM 0.32's ``--kv-transfer-config`` for one role (NixlConnector, pull mode).

    ``decoder_kv_blocks_ttl`` matters only on decode; prefill keeps the spec's
    value so that Auto tuning restarts decode pods alone.
    """
    kv = server.spec.kv_transfer
    ttl = (
        server.decode_retention_seconds if role == api.ROLE_DECODE else kv.decode_retention_seconds
    )
    return {
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
            "kv_recompute_threshold": kv.recompute_threshold,
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


def model_path(spec: ServerSpec) -> str:
    m = spec.model
    if m.pvc:
        return f"{MODELS_MOUNT}/{m.pvc.path}".rstrip("/")
    if m.image:
        return m.image.path
    assert m.hub
    return m.hub.id


def build_engine_args(server: Server, role: Role) -> list[str]:
    spec = server.spec
    m = spec.model
    args = [
        model_path(spec),
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
    if net.transport in UCX_TLS:
        env.append({"name": "UCX_TLS", "value": UCX_TLS[net.transport]})
    if net.rdma.enabled and net.rdma.devices:
        env.append({"name": "UCX_NET_DEVICES", "value": ",".join(net.rdma.devices)})
    if net.rdma.enabled and net.rdma.gid_index is not None:
        env.append({"name": "UCX_IB_GID_INDEX", "value": str(net.rdma.gid_index)})
    hub = spec.model.hub
    if hub and hub.token_secret_name:
        env.append(
            {
                "name": "HF_TOKEN",
                "valueFrom": {
                    "secretKeyRef": {"name": hub.token_secret_name, "key": hub.token_secret_key}
                },
            }
        )
    # The user's entries win over ours, name by name.
    user = {e["name"] for e in role.env}
    return [e for e in env if e["name"] not in user] + [dict(e) for e in role.env]
