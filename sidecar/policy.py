"""The policy in force: retention, recompute threshold, skip-prefill and prefill
placement, changed live.

The operator sends its server's policy in the answer to each report push
(``kvferry_wire.policy``); ``LivePolicy`` holds what this sidecar applies. Rules (each
has a test named after it, ``tests/unit/sidecar/test_policy.py``):

- config until told: before any policy arrives the settings file's values are in
  force (the operator renders the spec's values there), source ``config``;
- field by field: a policy's good fields are applied, each refused one is logged
  with its name and reason and keeps its last good value (logged again only when the
  refusals change: every push answer carries the policy);
- under the ceiling: the retention is at most the pod's ceiling (D's
  ``decoder_kv_blocks_ttl``, the ``retentionCeilingSeconds`` setting): D frees a
  handle's blocks at the ceiling whatever the policy says, so a longer retention
  would only offer handles D no longer holds (a pod started before the ceiling was
  lowered runs the older one until it restarts);
- nothing new, nothing done: a policy equal to the one in force changes nothing and
  logs nothing (every push answer carries it).

Readers ask for the values at the moment they decide (``plan.Rules`` per turn, the
handle store's expiry test), so a change reaches the next turn and the handles held
now: a lower retention lets held handles go at the next purge, a higher one keeps them
longer (up to D's own deadline).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvferry_wire import policy as wire

log = logging.getLogger(__name__)

SOURCE_CONFIG = "config"  # the settings file's values: no policy heard yet
SOURCE_OPERATOR = "operator"
REVISION_UNKNOWN = "unknown"


@dataclass(frozen=True)
class InForce:
    """The values in force and where they came from."""

    retention_seconds: float
    recompute_threshold: int
    skip_prefill_below_tokens: int
    revision: str  # the operator's, or "config"
    source: str
    prefill_placement: str = wire.PLACEMENT_MEASURED


class LivePolicy:
    def __init__(
        self,
        *,
        retention_seconds: float,
        recompute_threshold: int,
        skip_prefill_below_tokens: int,
        ceiling_seconds: float,
        prefill_placement: str = wire.PLACEMENT_MEASURED,
        on_change: Callable[[InForce], None] | None = None,
    ) -> None:
        self.ceiling_seconds = ceiling_seconds
        self._on_change = on_change
        self.refusals = 0  # policy fields refused (for tests and the log's count)
        self._clamped_from: float | None = None  # logged once per value over the ceiling
        self._last_errors: dict[str, str] = {}  # logged once until they change
        self.current = InForce(
            min(retention_seconds, ceiling_seconds),
            recompute_threshold,
            skip_prefill_below_tokens,
            SOURCE_CONFIG,
            SOURCE_CONFIG,
            prefill_placement,
        )

    @property
    def retention_seconds(self) -> float:
        return self.current.retention_seconds

    @property
    def recompute_threshold(self) -> int:
        return self.current.recompute_threshold

    @property
    def skip_prefill_below_tokens(self) -> int:
        return self.current.skip_prefill_below_tokens

    @property
    def prefill_placement(self) -> str:
        return self.current.prefill_placement

    def offer(self, raw: Any) -> dict[str, str]:
        """Apply what is good in a policy from the operator; returns the refused
        fields with their reasons (each also logged, naming the field)."""
        decoded = wire.decode(raw)
        self.refusals += len(decoded.errors)
        if decoded.errors != self._last_errors:
            for name, why in decoded.errors.items():
                log.warning("policy field refused field=%s err=%s; keeping the last", name, why)
            self._last_errors = decoded.errors
        fields = decoded.fields
        old = self.current
        retention = float(fields.get(wire.K_RETENTION, old.retention_seconds))
        if retention > self.ceiling_seconds:
            if retention != self._clamped_from:
                log.info(
                    "policy retentionSeconds=%s above this pod's ceiling=%s; holding for %s",
                    retention,
                    self.ceiling_seconds,
                    self.ceiling_seconds,
                )
            self._clamped_from = retention
            retention = self.ceiling_seconds
        new = InForce(
            retention,
            int(fields.get(wire.K_THRESHOLD, old.recompute_threshold)),
            int(fields.get(wire.K_SKIP, old.skip_prefill_below_tokens)),
            # A refused revision with good values: they are in force, unnamed.
            (decoded.revision or REVISION_UNKNOWN) if fields else old.revision,
            SOURCE_OPERATOR if fields else old.source,
            # Optional on the wire: an older operator's policy leaves it as it is.
            str(fields.get(wire.K_PLACEMENT, old.prefill_placement)),
        )
        if new != old:
            self.current = new
            log.info(
                "policy in force revision=%s retention_s=%s recompute_threshold=%s "
                "skip_prefill_below_tokens=%s prefill_placement=%s",
                new.revision,
                new.retention_seconds,
                new.recompute_threshold,
                new.skip_prefill_below_tokens,
                new.prefill_placement,
            )
            if self._on_change is not None:
                self._on_change(new)
        return decoded.errors
