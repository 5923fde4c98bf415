"""Engine tier: a decode sidecar killed while it holds a handle leaves D pinning it; the
sidecar's next process reads its pin journal, releases the handle through P and
accounts for it (``orphans`` in its report), so D pins nothing long before the ceiling.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest

from kvferry_dev.engines import Engine, EnginePair
from kvferry_dev.procs import LIVE
from kvferry_dev.sidecars import start_sidecar
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


def test_a_killed_sidecars_handle_is_released_by_its_next_process(
    engine_pair: EnginePair, server: Any, engine_log_dir: Any, prefill: Engine, decode: Engine
) -> None:
    # Earlier tests' sessions may still pin handles on D until their retention ends.
    wait_until(lambda: pinned_on_decode(decode) == 0, 60, "D to pin nothing before the test")
    sc = start_sidecar(engine_pair, server, engine_log_dir, name="sidecar-orphans")
    try:
        session = "orphans-1"
        messages = [user_message(51, 0)]
        first = send(sc, prefill, messages, session)
        assert first.reply.route == "remote", first.why()
        held = sc.residency()["pinned"]
        blocks = pinned_on_decode(decode)
        assert held["handles"] == 1 and blocks == held["blocks"] > 0, (held, blocks)

        # Killed: no drain, no release. D keeps the blocks (its TTL is the ceiling).
        assert sc.proc is not None
        os.killpg(os.getpgid(sc.proc.pid), signal.SIGKILL)
        sc.proc.wait(30)
        sc.proc = None
        LIVE.discard(sc)
        assert pinned_on_decode(decode) == blocks

        started = time.monotonic()
        sc.start()

        def released() -> dict[str, Any]:
            rep = sc.residency()
            on_decode = pinned_on_decode(decode)
            orphans = rep["orphans"]
            ok = (
                orphans == {"found": 1, "foundBlocks": blocks, "released": 1, "void": 0}
                and rep["pinned"]["orphanedHandles"] == 0
                and rep["releases"]["request"] == 1
                and on_decode == 0
            )
            assert ok, (on_decode, orphans, rep["pinned"], rep["releases"])
            return rep

        # Bounded: releaseAfterSeconds (2 s) waiting for a ride, then the one-token
        # release request on a busy 2-core machine.
        wait_until(released, 30, "the restarted sidecar to release its predecessor's handle")
        gone_after = time.monotonic() - started

        # The new process holds nothing for the session: its next turn recomputes.
        messages = [*messages, assistant(first.reply), user_message(51, 1)]
        second = send(sc, prefill, messages, session)
        assert second.reply.outcome == "no-handle", second.why()
        assert_recomputed(second)
        assert second.reply.token_ids == reference(prefill, messages), second.why()
        say(
            f"orphans: a killed sidecar left {blocks} blocks pinned on D; its next "
            f"process released them {gone_after:.2f}s after it was started"
        )
    finally:
        sc.stop()
