"""Releasing handles nobody reads: the request P gets, and the ledger of what stays."""

from __future__ import annotations

from kvferry_sidecar.release import (
    PINNED_NO_PREFILL,
    PINNED_RELEASING,
    Ledger,
    release_body,
    release_params,
)
from kvferry_sidecar.types import PREFILL_REQUEST_PARAMS, KVHandle, token_array

PARAMS = {
    "do_remote_prefill": False,
    "do_remote_decode": True,
    "remote_block_ids": [[7, 8, 9]],
    "remote_engine_id": "d",
    "remote_request_id": "d-req-1",
    "remote_host": "10.0.0.2",
    "remote_port": 5600,
    "remote_num_tokens": 90,
    "remote_blocks_expiry_time": 1234.5,
}


def handle(created: float = 100.0, expires: float | None = 580.0, **params: object) -> KVHandle:
    return KVHandle(
        session="s",
        params={**PARAMS, **params},
        token_ids=token_array([5, 6, 7]),
        num_tokens=90,
        engine_build=None,
        created_at=created,
        expires_at=expires,
    )


def test_release_params_leave_nothing_to_pull() -> None:
    """P's pull count is min(remote_num_tokens, prompt) - cached: 0 makes it register an
    empty pull, which only notifies D; D's coordinates and expiry go as they came."""
    params = release_params(PARAMS)
    assert params["remote_num_tokens"] == 0
    assert {k: v for k, v in params.items() if k != "remote_num_tokens"} == {
        **PREFILL_REQUEST_PARAMS,
        **{k: v for k, v in PARAMS.items() if k != "remote_num_tokens"},
    }
    assert PARAMS["remote_num_tokens"] == 90  # the handle itself is not edited


def test_release_body_is_a_one_token_completion() -> None:
    body = release_body(handle(), "m")
    assert body["prompt"] == [5] and body["max_tokens"] == 1 and body["stream"] is False
    assert body["model"] == "m"
    assert body["kv_transfer_params"] == release_params(PARAMS)


def test_ledger_counts_blocks_until_the_deadline() -> None:
    ledger = Ledger()
    ledger.add_handle(handle(), PINNED_RELEASING, retention_s=480)
    ledger.add_handle(
        handle(expires=None, remote_request_id="other"), PINNED_NO_PREFILL, retention_s=480
    )
    figures = ledger.figures(now=200.0)
    assert (figures.handles, figures.blocks, figures.oldest_age_seconds) == (2, 6, 100.0)
    assert ledger.by_reason(200.0) == {PINNED_RELEASING: 1, PINNED_NO_PREFILL: 1}
    assert ledger.figures(now=581.0).handles == 0  # D's deadlines (580 s) have passed
    assert ledger.purge(581.0) == 2 and len(ledger) == 0


def test_ledger_entry_is_replaced_not_doubled() -> None:
    """A handle whose release failed moves from releasing to failed, once."""
    ledger = Ledger()
    ledger.add_handle(handle(), PINNED_RELEASING, retention_s=480)
    ledger.add_handle(handle(), PINNED_NO_PREFILL, retention_s=480)
    assert ledger.by_reason(200.0) == {PINNED_NO_PREFILL: 1}
    assert ledger.remove(handle()) and not ledger.remove(handle())
