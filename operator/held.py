"""Which children were last seen holding our fields, so that a status update of one
is not checked again. Pure.

Every StatefulSet and PodDisruptionBudget gets several status updates from its
controller on its way to Ready (1,000 new servers: tens of thousands of events), and
each event used to render the whole server to ask ``drift.covers`` whether the child
still holds what we apply. A status update changes nothing that check reads. So the
answer is kept per child under a fingerprint of everything it does read: the child
without its status and the metadata the API server rewrites on every write, and what
the render reads of the owner (``api.parse_server``: not its status patches, save the
retention Auto applied and the ceiling gate's hold) with the replicas its RoleScalers
set. The same fingerprint gives the same answer; anything else is checked again, so a
miss only costs the render it always cost. An apply that lands records its answer as
holding: the watch event of our own write, and the status updates after it, need no
render at all.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Mapping
from typing import Any

# Rewritten by the API server on writes that change nothing we render.
_VOLATILE_METADATA = ("resourceVersion", "managedFields", "generation")

Key = tuple[str, str, str]  # kind, namespace, name


def fingerprint(
    child: Mapping[str, Any], owner: Mapping[str, Any], scaled: Mapping[str, int]
) -> bytes:
    meta = {k: v for k, v in (child.get("metadata") or {}).items() if k not in _VOLATILE_METADATA}
    seen = {k: v for k, v in child.items() if k not in ("status", "metadata")}
    owner_meta = owner.get("metadata") or {}
    text = json.dumps(
        [
            meta,
            seen,
            # What api.parse_server reads of the owner: its status patches change none.
            owner_meta.get("uid"),
            owner_meta.get("generation"),
            owner_meta.get("labels"),
            owner.get("spec"),
            ((owner.get("status") or {}).get("retention") or {}).get("applied"),
            ((owner.get("status") or {}).get("retention") or {}).get("ceilingHeld"),
            sorted(scaled.items()),
        ],
        sort_keys=True,
        default=str,
    )
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


class Held:
    """child key -> the fingerprint at which it was last found holding our fields.
    Safe from any thread (the child handler's check runs on the event loop, its
    record on a thread)."""

    def __init__(self) -> None:
        self._held: dict[Key, bytes] = {}
        self._lock = threading.Lock()
        self.hits = 0  # checks skipped (for tests and the benchmark)

    def still(self, key: Key, print_: bytes) -> bool:
        with self._lock:
            hit = self._held.get(key) == print_
            self.hits += hit
            return hit

    def record(self, key: Key, print_: bytes) -> None:
        with self._lock:
            self._held[key] = print_

    def forget(self, key: Key) -> None:
        with self._lock:
            self._held.pop(key, None)

    def __len__(self) -> int:
        return len(self._held)
