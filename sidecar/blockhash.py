"""vLLM's prefix-cache block hashes, recomputed outside vLLM (``sha256_cbor``).

The operator starts engines with ``--prefix-caching-hash-algo sha256_cbor``, which
makes block hashes reproducible in any process (vLLM 0.32,
``v1/core/kv_cache_utils.py``):

- ``NONE_HASH = sha256(cbor(seed))``, seed ``"vllm-none-hash"`` (``PYTHONHASHSEED``
  overrides it in the engine; the operator never sets it);
- block ``i`` (full blocks only): ``sha256(cbor((parent, tuple(tokens_i), extra)))``
  with ``parent`` the previous block's 32-byte digest (``NONE_HASH`` for the first)
  and ``extra`` None for plain text (salt, LoRA and media add extra keys: callers
  only hash plain-text prompts, see ``identity.plain_text``);
- ``cbor`` is ``cbor2.dumps(value, canonical=True)``;
- KV events carry the low 64 bits of the big-endian digest
  (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``, the default).

With these, the sidecar can ask its ``BlockIndex`` (fed by D's KV events) how many
leading blocks of a new prompt D still holds, without asking D.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence

import cbor2

# vLLM's name for the algorithm (``--prefix-caching-hash-algo``, and the engine's
# ``vllm:cache_config_info{prefix_caching_hash_algo}``): the only one reproduced here.
HASH_ALGO = "sha256_cbor"
NONE_HASH_SEED = "vllm-none-hash"
_LOW_64 = (1 << 64) - 1


def sha256_cbor(value: object) -> bytes:
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


@functools.cache
def none_hash(seed: str = NONE_HASH_SEED) -> bytes:
    return sha256_cbor(seed)


def event_hash(digest: bytes) -> int:
    """The block hash as KV events publish it (low 64 bits)."""
    return int.from_bytes(digest, "big") & _LOW_64


def prefix_block_hashes(
    token_ids: Sequence[int], block_size: int, *, seed: str = NONE_HASH_SEED
) -> list[int]:
    """Event hashes of every full block of ``token_ids``, first block first."""
    parent = none_hash(seed)
    out: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = sha256_cbor((parent, tuple(token_ids[start : start + block_size]), None))
        out.append(event_hash(parent))
    return out
