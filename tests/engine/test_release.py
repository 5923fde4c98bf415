"""Engine tier: handles nobody reads do not stay pinned on D.

vLLM frees a decode-side handle only when a P reads it, registers an empty pull for
it, or at ``decoder_kv_blocks_ttl``. The sidecar releases every handle it drops
unread through P (``kvferry_sidecar.release``): riding on the turn's own prefill when
the turn goes to P, else with a one-token release request. D's own view of what it
pins is its KV usage (pinned blocks are in use while no request runs), read from its
/metrics and compared with the sidecar's residency report.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import pytest

from kvferry_dev.client import filler_text
from kvferry_dev.engines import Engine
from kvferry_dev.sidecars import SidecarProcess
from tests.engine.helpers import (
    assert_recomputed,
    assistant,
    cpu_share,
    pinned_on_decode,
    reference,
    send,
    user_message,
)
from tests.kube import wait_until
from tests.progress import say

pytestmark = pytest.mark.engine

# A follow-up short enough that D prefills it alone (below skipPrefillBelowTokens, 256).
SHORT_WORDS = 40


def short_message(seed: int) -> dict[str, str]:
    return {"role": "user", "content": filler_text(f"short-{seed}", SHORT_WORDS)}


def residency(sc: SidecarProcess) -> dict[str, Any]:
    return sc.residency()


def test_unread_handles_are_released_and_pinned_figures_match_decode(
    sidecar: SidecarProcess,
    sidecar_off: SidecarProcess,
    prefill: Engine,
    decode: Engine,
) -> None:
    """A misaligned turn releases the handle it could not read (riding on its own
    prefill), so D pins only the one kept for the next turn, exactly as many blocks as
    the residency reports say. Short turns D prefills alone keep a handle of their own
    (a prefill-side request, which vLLM tracks and frees) and release the one before:
    still exactly the kept handle pinned. When the sidecar stops, D pins nothing
    within 5 s: no turn left blocks that nothing frees."""
    # Earlier tests' sessions may still pin handles on D until their retention ends.
    wait_until(lambda: pinned_on_decode(decode) == 0, 60, "D to pin nothing before the test")
    session = "release-1"
    messages = [user_message(31, 0)]
    first = send(sidecar, prefill, messages, session)
    assert first.reply.route == "remote", first.why()

    messages = [*copy.deepcopy(messages), assistant(first.reply), user_message(31, 1)]
    words = messages[0]["content"].split()
    words[2] = "rewritten"  # diverges within the first block
    messages[0]["content"] = " ".join(words)
    second = send(sidecar, prefill, messages, session)
    assert second.reply.outcome == "misaligned", second.why()
    assert_recomputed(second)
    off = send(sidecar_off, prefill, messages, f"{session}-off")
    assert second.reply.token_ids == off.reply.token_ids, second.why()

    def one_kept() -> dict[str, Any]:
        on, rest = residency(sidecar), residency(sidecar_off)
        pinned = on["pinned"]
        on_decode = pinned_on_decode(decode)
        reported = pinned["blocks"] + rest["pinned"]["blocks"]
        ok = pinned["unusedHandles"] == 0 and pinned["handles"] == 1
        # A falsy-looking dict would end the wait early: the test's own condition.
        assert ok and on_decode == reported, (on_decode, pinned, rest["pinned"], on["releases"])
        return on

    started = time.monotonic()
    rep = wait_until(one_kept, 5, "D to pin only the kept handle, as the reports say")
    kept_after = time.monotonic() - started
    assert rep["releases"]["rider"] >= 1, rep["releases"]  # turn 1's handle, unread
    pinned_cpu = cpu_share(decode)

    # Two short follow-ups: D holds the prefix and prefills the tail alone, as a
    # prefill-side request: each keeps D's handle of its own turn and releases the one
    # before (a release request through P: nothing rides, no prefill was sent).
    for n in (2, 3):
        messages = [*copy.deepcopy(messages), assistant(second.reply), short_message(n)]
        second = send(sidecar, prefill, messages, session)
        assert second.reply.outcome == "skipped-prefill", second.why()
        assert second.reply.token_ids == reference(prefill, messages)
        started = time.monotonic()
        rep = wait_until(one_kept, 5, f"D to pin only short turn {n}'s handle")
    local_after = time.monotonic() - started
    assert rep["releases"]["request"] >= 2, rep["releases"]

    # The session's next long turn pulls the last short turn's handle through P.
    messages = [*copy.deepcopy(messages), assistant(second.reply), user_message(31, 4)]
    long = send(sidecar, prefill, messages, session)
    assert long.reply.outcome == "reused", long.why()
    assert long.reply.reused_tokens > 0 and long.p.pulled_tokens > 0, long.why()
    assert long.reply.token_ids == reference(prefill, messages)
    wait_until(one_kept, 5, "D to pin only the long turn's handle")

    # Stopping the sidecar releases what it holds; D then pins nothing.
    sidecar.stop()
    started = time.monotonic()

    def none_pinned() -> bool:
        on_decode = pinned_on_decode(decode)
        assert on_decode == 0, on_decode
        return True

    wait_until(none_pinned, 5, "D to pin nothing once the sidecar stopped")
    zero_after = time.monotonic() - started
    idle_cpu = cpu_share(decode)
    say(
        f"release: D pinned only the kept handle {kept_after:.2f}s after the misaligned "
        f"turn, {local_after:.2f}s after a short turn D prefilled alone, nothing "
        f"{zero_after:.2f}s after the sidecar stopped; D CPU share with one handle pinned "
        f"{pinned_cpu:.2f}, with none {idle_cpu:.2f}; releases {rep['releases']}"
    )
