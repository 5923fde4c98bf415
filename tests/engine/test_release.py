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
    """Skip-prefill and misaligned turns release the handle they did not read, so D
    pins only the one handle kept for the next turn; a last turn that keeps none
    leaves D pinning nothing within 5 s. The report's pinned blocks are D's."""
    # Earlier tests' sessions may still pin handles on D until their retention ends.
    wait_until(lambda: pinned_on_decode(decode) == 0, 60, "D to pin nothing before the test")
    session = "release-1"
    messages = [user_message(31, 0)]
    turns = [send(sidecar, prefill, messages, session)]
    plan = ["skip", "misaligned", "skip"]
    for i, kind in enumerate(plan, 1):
        messages = [*copy.deepcopy(messages), assistant(turns[-1].reply)]
        if kind == "skip":
            messages.append(short_message(i))
        else:
            messages.append(user_message(31, i))
            words = messages[0]["content"].split()
            words[2] = "rewritten"  # diverges within the first block
            messages[0]["content"] = " ".join(words)
        turn = send(sidecar, prefill, messages, session)
        expected = "skipped-prefill" if kind == "skip" else "misaligned"
        assert turn.reply.outcome == expected, turn.why()
        if kind == "misaligned":
            assert_recomputed(turn)
        off = send(sidecar_off, prefill, messages, f"{session}-off-{i}")
        assert turn.reply.token_ids == off.reply.token_ids, turn.why()
        turns.append(turn)

    # One handle is kept for the next turn; every older one was released.
    def one_kept() -> dict[str, Any]:
        rep = residency(sidecar)
        pinned = rep["pinned"]
        on_decode = pinned_on_decode(decode)
        ok = pinned["unusedHandles"] == 0 and pinned["handles"] == 1
        # A falsy-looking dict would end the wait early: the test's own condition.
        assert ok and on_decode == pinned["blocks"], (on_decode, pinned, rep["releases"])
        return rep

    started = time.monotonic()
    rep = wait_until(one_kept, 5, "D to pin only the kept handle, as the report says")
    kept_after = time.monotonic() - started
    assert rep["releases"]["request"] >= 2, rep["releases"]  # the two skip-prefill turns
    assert rep["releases"]["rider"] >= 1, rep["releases"]  # the misaligned turn
    pinned_cpu = cpu_share(decode)

    # A last turn that keeps no handle (it asks for truncation): the kept handle and
    # the one D returns for this turn are both released.
    messages = [*copy.deepcopy(messages), assistant(turns[-1].reply), short_message(9)]
    last = send(sidecar, prefill, messages, session, truncate_prompt_tokens=4000)
    assert last.reply.outcome == "kv-mismatch", last.why()
    assert last.reply.token_ids == reference(prefill, messages, truncate_prompt_tokens=4000)
    started = time.monotonic()

    def none_pinned() -> bool:
        on_decode = pinned_on_decode(decode)
        assert on_decode == 0, (on_decode, residency(sidecar)["pinned"])
        return True

    wait_until(none_pinned, 5, "D to pin nothing after the last turn")
    zero_after = time.monotonic() - started
    rep = residency(sidecar)
    assert rep["pinned"]["handles"] == 0 and rep["pinned"]["blocks"] == 0, rep["pinned"]
    idle_cpu = cpu_share(decode)
    print(
        f"\nrelease: D pinned only the kept handle {kept_after:.2f}s after the last turn, "
        f"nothing {zero_after:.2f}s after the final one; D CPU share with one handle "
        f"pinned {pinned_cpu:.2f}, with none {idle_cpu:.2f}; releases {rep['releases']}"
    )
