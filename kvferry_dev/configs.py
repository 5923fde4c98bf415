"""What the local P/D pair and its sidecar run: a small DisaggregatedServer for the
tiny model, and the engines' ``--kv-transfer-config`` as the operator renders it."""

from __future__ import annotations

from typing import Any

from kvferry_operator.api import Server, parse_server
from kvferry_operator.engine_config import build_kv_transfer_config

SERVED_MODEL_NAME = "tiny-llama"
# A second name the engines serve the same weights under: to a client (and to the
# sidecar's KV identity) another model, e.g. a LoRA adapter's name.
SERVED_MODEL_ALIAS = "tiny-llama-b"

# Defaults for local runs (see tests/engine/README.md for why).
BLOCK_SIZE = 32
MAX_MODEL_LEN = 4096
# The retention and, by default, the ceiling (decoder_kv_blocks_ttl): short, so a pinned
# handle stops D spinning soon.
DECODE_RETENTION_SECONDS = 45


def tiny_server_manifest(
    *,
    decode_retention_seconds: int = DECODE_RETENTION_SECONDS,
    recompute_threshold: int = 64,
    lease_seconds: int = 30,
    bidirectional: bool = True,
    skip_prefill_below_tokens: int = 256,
    name: str = "tiny-llama",
    max_retention_seconds: int | None = None,
    prefill_placement: str | None = None,
) -> dict[str, Any]:
    """A DisaggregatedServer for the tiny model, 1 P + 1 D, as a user would write it.

    ``max_retention_seconds`` is the ceiling, D's ``decoder_kv_blocks_ttl``; by default
    the retention itself, so D frees a handle no release reached at the retention (short:
    a pinned handle keeps vLLM 0.32's engine loop busy) rather than the CRD's 1800 s.
    ``prefill_placement``: ``routing.prefillPlacement`` (None: the CRD's default,
    Measured)."""
    routing: dict[str, Any] = {
        "skipPrefillBelowTokens": skip_prefill_below_tokens,
        # The harness reads the per-turn X-Kvferry-* headers (off by default).
        "diagnosticHeaders": True,
    }
    if prefill_placement is not None:
        routing["prefillPlacement"] = prefill_placement
    return {
        "apiVersion": "kvferry.io/v1alpha1",
        "kind": "DisaggregatedServer",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "model": {
                "name": SERVED_MODEL_NAME,
                "source": {"image": {"path": "/models/tiny-llama"}},
                "dtype": "float32",
                "maxModelLen": MAX_MODEL_LEN,
            },
            # vLLM's CPU build: the operator renders kv_buffer_device cpu and the CPU
            # environment for it (the harness sets its own cores and KV space).
            "engine": {"device": "cpu", "image": "kvferry-vllm-cpu:v0.32.0"},
            "prefill": {"replicas": 1},
            "decode": {"replicas": 1},
            "kvTransfer": {
                "bidirectional": bidirectional,
                "recomputeThreshold": recompute_threshold,
                "leaseSeconds": lease_seconds,
                "decodeRetentionSeconds": decode_retention_seconds,
            },
            "cacheTuning": {
                "maxRetentionSeconds": max_retention_seconds or decode_retention_seconds
            },
            "routing": routing,
        },
    }


def tiny_server(**kwargs: Any) -> Server:
    """``kvferry_operator.api.Server`` of ``tiny_server_manifest(**kwargs)`` (defaulted)."""
    return parse_server(tiny_server_manifest(**kwargs))


def kv_transfer_config(role: str, server: Server | None = None) -> dict[str, Any]:
    """The operator's ``--kv-transfer-config`` for `role` ("prefill" | "decode") of a CPU
    server (``spec.engine.device: cpu``: ``kv_buffer_device: cpu``), unmodified."""
    server = server if server is not None else tiny_server()
    if not server.spec.engine.on_cpu:
        raise ValueError("the local engines are vLLM's CPU build: the server needs device cpu")
    return build_kv_transfer_config(server, role)
