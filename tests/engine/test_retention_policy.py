"""Engine tier: the decode sidecar's retention policy lets a handle go at its time.

The handle store holds the retention policy (``kvferry_sidecar.retention``); the
sidecar's background loop applies it each probe interval, and what it lets go is
released on D through P (``kvferry_sidecar.release``). Here the retention in force is
short (21 s less the 15 s expiry margin: a handle is held 6 s), so the policy's end
comes well inside the test: D's own view of what it pins (its KV usage while no
request runs) must drop to nothing after that end and not before, the sidecar must
count the release under ``evictions.retention``, and the session's next turn must be
told ``expired`` and recompute the same answer as one engine alone.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

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
HOLD_S = RETENTION_S - MARGIN_S
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


def test_a_handle_is_released_on_d_at_the_policys_time(
    short_sidecar: SidecarProcess, prefill: Engine, decode: Engine
) -> None:
    """Turn 1 leaves a handle; D pins it until the policy's end (receipt + 6 s), then
    the sidecar releases it through P (a release request: nothing rides) and D pins
    nothing; the report counts it as ``retention``. Turn 2 finds it expired and
    recomputes the reference answer."""
    # Earlier tests' sessions may still pin handles on D until their retention ends.
    wait_until(lambda: pinned_on_decode(decode) == 0, 60, "D to pin nothing before the test")
    session = "retention-policy-1"
    messages = [user_message(41, 0)]
    sent_at = time.monotonic()  # the handle is received after this
    first = send(short_sidecar, prefill, messages, session)
    assert first.reply.route == "remote", first.why()
    answered = time.monotonic() - sent_at

    held = short_sidecar.residency()
    assert held["pinned"]["handles"] == 1, held["pinned"]
    assert pinned_on_decode(decode) > 0  # D holds the handle's blocks

    def released() -> dict[str, Any]:
        rep = short_sidecar.residency()
        on_decode = pinned_on_decode(decode)
        ok = (
            rep["evictions"]["retention"] == 1
            and rep["releases"]["request"] >= 1
            and rep["pinned"]["handles"] == 0
            and on_decode == 0
        )
        assert ok, (on_decode, rep["pinned"], rep["evictions"], rep["releases"])
        return rep

    # Bounded: the end, a probe interval, releaseAfterSeconds (2 s) waiting for a ride,
    # and the one-token release request on a busy 2-core machine.
    rep = wait_until(released, HOLD_S + 30, "the policy to release the handle on D")
    gone_after = time.monotonic() - sent_at
    assert gone_after >= HOLD_S, f"released {gone_after:.2f}s after the turn, before its end"
    assert rep["handles"].get("expired") == 1, rep["handles"]

    messages = [*messages, assistant(first.reply), user_message(41, 1)]
    second = send(short_sidecar, prefill, messages, session)
    assert second.reply.outcome == "expired", second.why()
    assert_recomputed(second)
    assert second.reply.token_ids == reference(prefill, messages), second.why()
    say(
        f"retention policy: turn answered in {answered:.2f}s, handle held {HOLD_S:.0f}s, "
        f"D pinned nothing {gone_after:.2f}s after the turn was sent; "
        f"evictions {rep['evictions']} releases {rep['releases']}"
    )
