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
import os
import time
from typing import Any

import pytest

from kvferry_dev.client import filler_text
from kvferry_dev.engines import Engine
from kvferry_dev.sidecars import SidecarProcess
from tests.engine.helpers import (
    assert_recomputed,
    assistant,
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


def pinned_on_decode(decode: Engine) -> int:
    """Blocks D holds while no request runs: the pinned handles' (D's own view)."""
    scrape = decode.metrics()
    assert scrape.total("vllm:num_requests_running") == 0, "D is still running a request"
    info = next(s for s in scrape.samples if s.name == "vllm:cache_config_info")
    total = int(info.labels["num_gpu_blocks"])
    return round(scrape.total("vllm:kv_cache_usage_perc") * total)


def group_cpu_seconds(engine: Engine) -> float:
    """CPU seconds used so far by the engine's process group (API server + core)."""
    assert engine.proc is not None
    ticks = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == engine.proc.pid:  # process group
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def cpu_share(engine: Engine, seconds: float = 3.0) -> float:
    before = group_cpu_seconds(engine)
    time.sleep(seconds)
    return (group_cpu_seconds(engine) - before) / seconds


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
    the residency reports say; a skip-prefill turn that keeps none (D prefilled it
    alone) releases the last one with a release request: D pins nothing within 5 s,
    and nothing after a further short turn D serves from its prefix cache."""
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

    # A short follow-up: D holds the prefix and prefills the tail alone. The turn keeps
    # no handle (vLLM 0.32 cannot free a locally prefilled request's blocks), so the
    # kept one is released by a one-token request through P.
    messages = [*copy.deepcopy(messages), assistant(second.reply), short_message(2)]
    last = send(sidecar, prefill, messages, session)
    assert last.reply.outcome == "skipped-prefill", last.why()
    assert last.reply.token_ids == reference(prefill, messages)
    started = time.monotonic()

    def none_pinned() -> bool:
        on_decode = pinned_on_decode(decode)
        assert on_decode == 0, (on_decode, residency(sidecar)["pinned"])
        return True

    wait_until(none_pinned, 5, "D to pin nothing after the last turn")
    zero_after = time.monotonic() - started
    # Another short one: no handle now, D's prefix cache serves it; still nothing pinned.
    messages = [*copy.deepcopy(messages), assistant(last.reply), short_message(3)]
    again = send(sidecar, prefill, messages, session)
    assert again.reply.outcome == "cached-on-decode", again.why()
    assert again.reply.token_ids == reference(prefill, messages)
    wait_until(none_pinned, 5, "D to pin nothing after a cached-on-decode turn")
    rep = residency(sidecar)
    assert rep["pinned"]["handles"] == 0 and rep["pinned"]["blocks"] == 0, rep["pinned"]
    assert rep["releases"]["request"] >= 1, rep["releases"]
    idle_cpu = cpu_share(decode)
    say(
        f"release: D pinned only the kept handle {kept_after:.2f}s after the misaligned "
        f"turn, nothing {zero_after:.2f}s after the skip-prefill one; D CPU share with one "
        f"handle pinned {pinned_cpu:.2f}, with none {idle_cpu:.2f}; releases {rep['releases']}"
    )
