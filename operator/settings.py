"""Operator-wide settings, read once from the environment (the chart sets them)."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Settings:
    # Image for the kvferry-sidecar when a server does not name one; the chart
    # sets it to the sidecar image released with this operator.
    sidecar_image: str
    # Safety-net reconcile: re-applies children (drift) and refreshes status
    # even when no watch event arrived (a missed event, a lost connection).
    resync_seconds: float
    # Child events arrive in bursts (a rollout touches pods many times a
    # second); a short idle delay folds a burst into one reconcile.
    child_event_debounce_seconds: float


def from_env() -> Settings:
    return Settings(
        sidecar_image=os.environ.get("KVFERRY_SIDECAR_IMAGE", ""),
        resync_seconds=float(os.environ.get("KVFERRY_RESYNC_SECONDS", "60")),
        child_event_debounce_seconds=float(os.environ.get("KVFERRY_DEBOUNCE_SECONDS", "0.5")),
    )
