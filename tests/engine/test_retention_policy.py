"""Engine tier: the decode sidecar's retention policy holds a handle to the ceiling.

The handle store holds the retention policy (``kvferry_wire.retention``); the sidecar's
background loop applies it each probe interval. The retention in force is the policy's
floor, not a handle's end (``retention.Wiring``): here it is short (21 s) and D's
``decoder_kv_blocks_ttl``, the ceiling, is the harness's 45 s. So a turn well past the
old end (the retention less the 15 s margin: 6 s) still reuses its history, and a turn
past the ceiling less the margin (30 s) is told ``expired`` and recomputes the same
answer as one engine alone; the sidecar counts that end under ``evictions.retention``
and D frees the blocks at its own deadline (no release request needed).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvferry_dev.configs import DECODE_RETENTION_SECONDS
from kvferry_dev.engines import Engine, EnginePair
from kvferry_dev.sidecars import SidecarProcess, start_sidecar
from tests.engine.helpers import (
    assert_recomputed,
    assistant,
    pinned_on_decode,
    reference,
    send,
    user_message,
)
from tests.kube import wait_until
from tests.progress import say

pytestmark = pytest.mark.engine

RETENTION_S = 21.0
MARGIN_S = 15.0  # kvferry_wire.protocol.HANDLE_EXPIRY_MARGIN_SECONDS
HOLD_S = RETENTION_S - MARGIN_S  # the old end: the retention less the margin
CEILING_S = float(DECODE_RETENTION_SECONDS)  # the harness's ceiling, D's TTL
PROBE_S = 0.5  # the background loop's period: the policy is applied this often


@pytest.fixture(scope="module")
def short_sidecar(
    engine_pair: EnginePair, server: Any, engine_log_dir: Path
) -> Iterator[SidecarProcess]:
    """The tier's decode sidecar with a short retention in force and a quick loop."""
    sc = start_sidecar(
        engine_pair,
        server,
        engine_log_dir,
        name="sidecar-retention-policy",
        overrides={"decodeRetentionSeconds": RETENTION_S, "probeIntervalSeconds": PROBE_S},
    )
    yield sc
    sc.stop()


def test_a_handle_is_held_past_the_retention_and_ends_at_the_ceiling(
    short_sidecar: SidecarProcess, prefill: Engine, decode: Engine
) -> None:
    # Earlier tests' sessions may still pin handles on D until their end.
    wait_until(lambda: pinned_on_decode(decode) == 0, 90, "D to pin nothing before the test")
    session = "retention-policy-1"
    messages = [user_message(41, 0)]
    first = send(short_sidecar, prefill, messages, session)
    assert first.reply.route == "remote", first.why()
    assert short_sidecar.residency()["pinned"]["handles"] == 1

    # Past the old end (retention less margin), inside the floor: still offered.
    time.sleep(HOLD_S + 2)
    messages = [*messages, assistant(first.reply), user_message(41, 1)]
    second = send(short_sidecar, prefill, messages, session)
    assert second.reply.outcome == "reused", second.why()
    kept_at = time.monotonic()
    assert second.reply.token_ids == reference(prefill, messages), second.why()

    # Past the ceiling less the margin: no longer offered; D frees it at its deadline.
    def ended() -> dict[str, Any]:
        rep = short_sidecar.residency()
        ok = rep["evictions"]["retention"] >= 1 and rep["pinned"]["handles"] == 0
        assert ok, (rep["pinned"], rep["evictions"])
        return rep

    rep = wait_until(ended, CEILING_S - MARGIN_S + 30, "the handle to end at the ceiling")
    held_for = time.monotonic() - kept_at
    assert held_for >= CEILING_S - MARGIN_S - 1, f"ended {held_for:.1f}s after, before the ceiling"
    assert rep["handles"].get("expired", 0) >= 1, rep["handles"]
    wait_until(lambda: pinned_on_decode(decode) == 0, 60, "D to free the blocks at its deadline")
    messages = [*messages, assistant(second.reply), user_message(41, 2)]
    third = send(short_sidecar, prefill, messages, session)
    assert third.reply.outcome == "expired", third.why()
    assert_recomputed(third)
    assert third.reply.token_ids == reference(prefill, messages), third.why()
    say(
        f"retention policy: reused {HOLD_S + 2:.0f}s after a {RETENTION_S:.0f}s retention, "
        f"not offered past the ceiling less the margin, D freed it {held_for:.1f}s after "
        f"its keeping (ceiling {CEILING_S:.0f}s); "
        f"evictions {rep['evictions']}"
    )
