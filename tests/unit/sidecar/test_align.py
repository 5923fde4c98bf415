"""The alignment guard: which part of a handle a new prompt may use."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry_sidecar.align import align, common_prefix_len, cut_block_ids, held_by_decode
from kvferry_sidecar.types import KVHandle, token_array
from kvferry_wire.protocol import Outcome

BS = 4
THRESHOLD = 8
EXPIRY = 123456.789


def make_handle(token_ids: list[int], block_size: int = BS, **params: Any) -> KVHandle:
    num = len(token_ids) - 1
    blocks = -(-num // block_size)
    base = {
        "do_remote_prefill": False,
        "do_remote_decode": True,
        "remote_block_ids": [list(range(100, 100 + blocks))],
        "remote_engine_id": "d0",
        "remote_request_id": "r1",
        "remote_host": "10.0.0.2",
        "remote_port": 5601,
        "tp_size": 1,
        "remote_num_tokens": num,
        "remote_blocks_expiry_time": EXPIRY,
        "transfer_mode": "pull",
    }
    base.update(params)
    return KVHandle(
        session="s",
        params=base,
        token_ids=token_array(token_ids),
        num_tokens=num,
        engine_build=None,
        created_at=0.0,
        expires_at=None,
    )


# Turn N: prompt 1..20 + answer 21..25 (25 ids, KV for the first 24).
TURN_N = list(range(1, 26))
HANDLE = make_handle(TURN_N)


def test_alignment_prompt_extends_handle_uses_it_whole() -> None:
    """A prompt that extends every handle token gets the handle as D returned it."""
    prompt = [*TURN_N, 90, 91, 92]
    result = align(prompt, HANDLE, block_size=BS, threshold=THRESHOLD)
    assert result.outcome is Outcome.REUSED
    assert result.usable_tokens == 24
    assert result.params == HANDLE.params
    assert not result.partial


def test_alignment_whole_handle_keeps_expiry_and_fields() -> None:
    """Every field of the handle reaches P, remote_blocks_expiry_time included."""
    # Bug prevented: a handle without its deadline let P read freed blocks silently.
    result = align([*TURN_N, 90], HANDLE, block_size=BS, threshold=THRESHOLD)
    assert result.params is not None
    assert result.params["remote_blocks_expiry_time"] == EXPIRY
    assert set(result.params) == set(HANDLE.params)


def test_alignment_does_not_mutate_handle() -> None:
    """Lowering remote_num_tokens edits a copy, never the stored handle."""
    prompt = [*TURN_N[:13], 77, 78, 79, 80]
    align(prompt, HANDLE, block_size=BS, threshold=THRESHOLD)
    assert HANDLE.params["remote_num_tokens"] == 24
    assert HANDLE.params["remote_block_ids"] == [[100, 101, 102, 103, 104, 105]]


def test_alignment_rewritten_history_uses_block_rounded_prefix() -> None:
    """History rewritten at token 13: only the first 12 tokens (3 blocks) are pulled."""
    # Bug prevented: vLLM never checks alignment; the stripped-reasoning client would
    # get KV of other tokens for positions 13.. and a wrong answer.
    prompt = [*TURN_N[:13], 77, 78, 79, 80]
    result = align(prompt, HANDLE, block_size=BS, threshold=THRESHOLD)
    assert result.outcome is Outcome.REUSED
    assert result.partial
    assert result.aligned_tokens == 13
    assert result.usable_tokens == 12
    assert result.params is not None
    assert result.params["remote_num_tokens"] == 12
    assert result.params["remote_blocks_expiry_time"] == EXPIRY


def test_alignment_partial_prefix_cuts_block_list() -> None:
    """A lowered remote_num_tokens comes with the first blocks only."""
    # Bug prevented: vLLM matches remote blocks to local ones from the END of the
    # list; with D's full list P would load D's last blocks into the prefix.
    prompt = [*TURN_N[:13], 77, 78, 79, 80]
    result = align(prompt, HANDLE, block_size=BS, threshold=THRESHOLD)
    assert result.params is not None
    assert result.params["remote_block_ids"] == [[100, 101, 102]]


def test_alignment_partial_block_is_rounded_down() -> None:
    """An aligned prefix of 11 tokens uses 8 (two whole blocks)."""
    prompt = [*TURN_N[:11], 60, 61, 62]
    result = align(prompt, HANDLE, block_size=BS, threshold=THRESHOLD)
    assert result.usable_tokens == 8
    assert result.params is not None
    assert result.params["remote_block_ids"] == [[100, 101]]


def test_alignment_early_divergence_is_misaligned() -> None:
    """Divergence before the threshold drops the handle as misaligned."""
    prompt = [1, 2, 3, 4, 5, 99, 98, 97, 96, 95, 94]
    result = align(prompt, HANDLE, block_size=BS, threshold=THRESHOLD)
    assert result.outcome is Outcome.MISALIGNED
    assert result.params is None
    assert result.usable_tokens == 0


def test_alignment_short_handle_is_below_threshold() -> None:
    """A fully aligned handle shorter than the threshold is dropped (recompute is cheaper)."""
    short = make_handle([1, 2, 3, 4, 5, 6])
    result = align([1, 2, 3, 4, 5, 6, 7, 8], short, block_size=BS, threshold=THRESHOLD)
    assert result.outcome is Outcome.BELOW_THRESHOLD
    assert result.params is None


def test_alignment_prompt_not_longer_than_handle_leaves_last_token_to_p() -> None:
    """Resending the previous prompt (a retry) pulls at most prompt length - 1, rounded."""
    prompt = TURN_N[:20]
    result = align(prompt, HANDLE, block_size=BS, threshold=THRESHOLD)
    assert result.outcome is Outcome.REUSED
    assert result.usable_tokens == 16
    assert result.params is not None
    assert result.params["remote_block_ids"] == [[100, 101, 102, 103]]


def test_alignment_unknown_block_size_drops_partial_prefix() -> None:
    """Without the block size a partial prefix cannot be cut safely: dropped."""
    prompt = [*TURN_N[:13], 77, 78, 79, 80]
    result = align(prompt, HANDLE, block_size=None, threshold=THRESHOLD)
    assert result.params is None
    assert result.outcome is Outcome.MISALIGNED


def test_alignment_unknown_block_size_still_uses_whole_handle() -> None:
    """Without the block size a fully aligned handle is still used, untouched."""
    result = align([*TURN_N, 90], HANDLE, block_size=None, threshold=THRESHOLD)
    assert result.outcome is Outcome.REUSED
    assert result.params == HANDLE.params


def test_alignment_clipped_groups_drop_partial_prefix() -> None:
    """Unequal KV groups (sliding window, clipped by vLLM) cannot be cut: dropped."""
    handle = make_handle(TURN_N, remote_block_ids=[[100, 101, 102, 103, 104, 105], [7, 8]])
    prompt = [*TURN_N[:13], 77, 78]
    assert align(prompt, handle, block_size=BS, threshold=THRESHOLD).params is None


def test_alignment_flat_block_list_is_cut() -> None:
    """A flat remote_block_ids list (one KV group) is cut like a grouped one."""
    handle = make_handle(TURN_N, remote_block_ids=[100, 101, 102, 103, 104, 105])
    prompt = [*TURN_N[:13], 77, 78]
    result = align(prompt, handle, block_size=BS, threshold=THRESHOLD)
    assert result.params is not None
    assert result.params["remote_block_ids"] == [100, 101, 102]


@pytest.mark.parametrize(
    ("block_ids", "n", "expected"),
    [
        pytest.param([1, 2, 3], 2, [1, 2], id="flat"),
        pytest.param([[1, 2, 3]], 2, [[1, 2]], id="one-group"),
        pytest.param([[1, 2, 3], [4, 5, 6]], 1, [[1], [4]], id="equal-groups"),
        pytest.param([[1, 2, 3], [4]], 1, None, id="clipped-groups"),
        pytest.param([1, 2], 3, None, id="too-short"),
        pytest.param(None, 1, None, id="missing"),
    ],
)
def test_cut_block_ids(block_ids: Any, n: int, expected: Any) -> None:
    assert cut_block_ids(block_ids, n) == expected


def test_held_by_decode_is_block_granular() -> None:
    """D's prefix cache finds whole blocks of the aligned part only."""
    prompt = [*TURN_N[:13], 77]
    result = align(prompt, HANDLE, block_size=BS, threshold=THRESHOLD)
    assert held_by_decode(result, HANDLE, BS) == 12
    assert held_by_decode(result, HANDLE, None) == 13


# ------------------------------------------------------------------ properties

ids_st = st.lists(st.integers(min_value=0, max_value=7), min_size=1, max_size=80)


@settings(max_examples=200, deadline=None)
@given(a=ids_st, b=ids_st)
def test_common_prefix_len_matches_naive(a: list[int], b: list[int]) -> None:
    naive = 0
    while naive < min(len(a), len(b)) and a[naive] == b[naive]:
        naive += 1
    assert common_prefix_len(a, b) == naive
    assert common_prefix_len(token_array(a), b) == naive


@settings(max_examples=300, deadline=None)
@given(
    history=st.lists(st.integers(min_value=1, max_value=5), min_size=2, max_size=120),
    keep=st.integers(min_value=0, max_value=130),
    tail=st.lists(st.integers(min_value=6, max_value=9), min_size=0, max_size=20),
    block_size=st.sampled_from([1, 2, 4, 16]),
    threshold=st.integers(min_value=0, max_value=32),
)
def test_alignment_properties(
    history: list[int], keep: int, tail: list[int], block_size: int, threshold: int
) -> None:
    """Whatever the prompt: never more than aligned, prompt - 1 or the handle; whole
    blocks when lowered; block list matches; expiry untouched; threshold honoured."""
    handle = make_handle(history, block_size)
    prompt = [*history[:keep], *tail]
    if not prompt:
        return
    result = align(prompt, handle, block_size=block_size, threshold=threshold)
    if result.params is None:
        assert result.usable_tokens == 0
        return
    usable = result.usable_tokens
    assert result.outcome is Outcome.REUSED
    assert 0 < usable <= handle.num_tokens
    assert usable >= threshold
    assert usable <= result.aligned_tokens
    assert usable <= len(prompt) - 1
    assert prompt[:usable] == history[:usable]
    assert result.params["remote_blocks_expiry_time"] == EXPIRY
    assert result.params["remote_num_tokens"] == usable
    blocks = result.params["remote_block_ids"][0]
    assert len(blocks) == -(-usable // block_size)
    assert blocks == handle.params["remote_block_ids"][0][: len(blocks)]
    if result.partial:
        assert usable % block_size == 0
