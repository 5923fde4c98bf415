"""Alignment guard: may this turn's prompt use the session's handle, and how much of it?

vLLM does not check that turn N+1's tokens extend the handle's tokens; a client that
rewrites history (strips reasoning, edits a message) would get KV of other tokens,
silently. So before a handle goes to P:

1. ``aligned`` = common prefix of the new prompt's ids (D's /tokenize) and the
   handle's ids (previous prompt + generated, from return_token_ids).
2. Fully aligned (the prompt extends all ``remote_num_tokens`` and is longer): the
   handle is used as D returned it.
3. Otherwise only the aligned prefix is used, rounded down to whole KV blocks and
   at most prompt length - 1 (P must compute the last prompt token itself):
   ``remote_num_tokens`` is lowered to it **and ``remote_block_ids`` is cut to the
   same number of blocks**. The cut is needed because vLLM's reader matches remote
   blocks to its local ones from the end (``_apply_prefix_caching`` end-trims the
   remote list): with the full list it would read D's last blocks into the prefix.
   Every other field, ``remote_blocks_expiry_time`` included, is forwarded as is.
   A partial prefix needs the block size and one block list per KV group of equal
   length (sliding-window groups are clipped by vLLM and cannot be cut safely);
   without those the handle is dropped.
4. Less than the recompute threshold left: drop the handle (recompute).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvferry_wire.protocol import Outcome

from .types import K_REMOTE_BLOCK_IDS, K_REMOTE_NUM_TOKENS, KVHandle, token_array

# Compare this many tokens at a time (C-speed slice equality) before going one by one.
_CHUNK = 256


def _same_kind(a: Sequence[int], b: Sequence[int]) -> tuple[Sequence[int], Sequence[int]]:
    # Slices compare at C speed only between sequences of one type.
    if type(a) is type(b):
        return a, b
    try:
        return token_array(a), token_array(b)
    except (OverflowError, TypeError):
        return list(a), list(b)


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    a, b = _same_kind(a, b)
    n = min(len(a), len(b))
    i = 0
    while i < n:
        j = min(i + _CHUNK, n)
        if a[i:j] == b[i:j]:
            i = j
            continue
        while i < j and a[i] == b[i]:
            i += 1
        return i
    return n


def round_down(tokens: int, block_size: int) -> int:
    return (tokens // block_size) * block_size


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def cut_block_ids(block_ids: Any, n_blocks: int) -> Any | None:
    """The first ``n_blocks`` of each KV group, or None when that is not safe.

    vLLM sends either one flat list or one list per KV cache group.
    """
    if not isinstance(block_ids, list):
        return None
    if all(isinstance(b, int) for b in block_ids):
        return block_ids[:n_blocks] if len(block_ids) >= n_blocks else None
    if not all(isinstance(g, list) for g in block_ids) or not block_ids:
        return None
    lengths = {len(g) for g in block_ids}
    if len(lengths) != 1 or lengths.pop() < n_blocks:
        return None  # clipped (sliding-window) groups: position i is not block i
    return [list(g[:n_blocks]) for g in block_ids]


@dataclass(frozen=True)
class Alignment:
    outcome: Outcome  # REUSED, MISALIGNED or BELOW_THRESHOLD
    aligned_tokens: int  # common prefix length
    usable_tokens: int  # tokens P will be told to pull (0 when dropped)
    params: Mapping[str, Any] | None  # kv_transfer_params for P, None when dropped
    partial: bool = False


def align(
    prompt_ids: Sequence[int],
    handle: KVHandle,
    *,
    block_size: int | None,
    threshold: int,
) -> Alignment:
    remote = handle.num_tokens
    aligned = common_prefix_len(prompt_ids, handle.token_ids)
    prompt_len = len(prompt_ids)
    full = aligned >= remote and prompt_len > remote
    params: dict[str, Any] | None = dict(handle.params)
    if full:
        usable = remote
        if block_size is not None:
            # Normalise: exactly the blocks that hold `remote` tokens (a no-op for
            # what vLLM returns today; protects against a trailing lookahead block).
            cut = cut_block_ids(params.get(K_REMOTE_BLOCK_IDS), blocks_for(remote, block_size))
            if cut is not None:
                params[K_REMOTE_BLOCK_IDS] = cut
    elif block_size is None:
        usable = 0
    else:
        usable = round_down(min(aligned, remote, prompt_len - 1), block_size)
        cut = cut_block_ids(params.get(K_REMOTE_BLOCK_IDS), usable // block_size)
        if cut is None:
            usable = 0
        else:
            params[K_REMOTE_BLOCK_IDS] = cut
            params[K_REMOTE_NUM_TOKENS] = usable
    if usable <= 0 or usable < threshold:
        diverged = aligned < min(len(handle.token_ids), prompt_len)
        outcome = Outcome.MISALIGNED if diverged and not full else Outcome.BELOW_THRESHOLD
        return Alignment(outcome, aligned, 0, None, partial=not full)
    return Alignment(Outcome.REUSED, aligned, usable, params, partial=not full)


def held_by_decode(alignment: Alignment, handle: KVHandle, block_size: int | None) -> int:
    """Prompt tokens the local D still holds for this session (its pinned handle blocks
    are in its prefix cache), as D's block-granular prefix cache will find them."""
    held = min(alignment.aligned_tokens, handle.num_tokens)
    return held if block_size is None else round_down(held, block_size)
