"""Engine tier: streamed turns through the official OpenAI SDK keep their handles on
vLLM 0.32, and pin nothing nobody tracks.

vLLM 0.32 returns ``kv_transfer_params`` only in non-streamed answers. The sidecar
reads P's KV into D in a one-token request that returns a handle, streams the answer
without kv_transfer_params, and re-anchors the turn (prompt + answer ids) on D in a
one-token prefill-side request before the stream's ``[DONE]``
(``kvferry_sidecar.anchor``). Every turn here is streamed through ``openai`` with
``stream_options.include_usage`` and ``session_id`` in ``extra_body``.

Reuse is proven from P's own /metrics (``helpers.assert_pulled``); answers are
compared token by token with the P engine alone computing everything (reuse off).
What D pins is D's own KV usage while nothing runs, and D's expired-handle count
(``vllm:nixl_num_kv_expired_reqs``) over one ``decoder_kv_blocks_ttl`` after the run:
a streamed turn that pinned KV nobody knows of would expire there.
"""

from __future__ import annotations

import copy
import re
import time
from pathlib import Path
from typing import Any

import pytest

from kvferry_dev.client import filler_text
from kvferry_dev.configs import DECODE_RETENTION_SECONDS, tiny_server
from kvferry_dev.engines import Engine, EnginePair
from kvferry_dev.sidecars import SidecarProcess, start_sidecar
from tests.engine import sdk
from tests.engine.helpers import (
    Turn,
    assert_pulled,
    assistant,
    cpu_share,
    pinned_on_decode,
    round_down,
)
from tests.kube import wait_until
from tests.progress import say

pytestmark = pytest.mark.engine

TURNS = 6
WORDS = 180  # ~200 tokens a user message (the trial)
TOOL_WORDS = 900  # a long tool result: ~1k tokens
SHORT_WORDS = 40  # below skipPrefillBelowTokens (256): D prefills it alone


def words(seed: str, n: int) -> str:
    return filler_text(seed, n)


def expired_on(engine: Engine) -> float:
    return engine.metrics().total("vllm:nixl_num_kv_expired_reqs")


def start(pair: EnginePair, log_dir: Path, name: str, **overrides: Any) -> SidecarProcess:
    server = tiny_server(prefill_placement="Threshold")  # routes by the rule (conftest.server)
    return start_sidecar(pair, server, log_dir, name=name, overrides=overrides)


def reanchor_seconds(sc: SidecarProcess) -> list[float]:
    """The re-anchor request's time of every turn, from the sidecar's turn log lines."""
    text = sc.log_path.read_text()
    return [float(s) for s in re.findall(r" reanchor_s=([0-9.]+) ", text)]


def kept_only_the_handle(sc: SidecarProcess, decode: Engine) -> dict[str, Any]:
    """D pins exactly the one handle the sidecar keeps, no unused one (the anchors were
    released through P)."""
    rep = sc.residency()
    pinned = rep["pinned"]
    on_decode = pinned_on_decode(decode)
    ok = pinned["handles"] == 1 and pinned["unusedHandles"] == 0
    assert ok and on_decode == pinned["blocks"], f"D {on_decode} {pinned} {rep['releases']}"
    return rep


def nothing_left(sc: SidecarProcess, decode: Engine, expired_before: float) -> str:
    """Stop the sidecar (it releases what it holds), then D pins nothing, and nothing
    expires on D over one decoder_kv_blocks_ttl: no pin was left that nobody tracks."""
    sc.stop()
    wait_until(lambda: pinned_on_decode(decode) == 0, 5, "D to pin nothing once stopped")
    time.sleep(DECODE_RETENTION_SECONDS + 2)  # one TTL: what D pinned untracked expires
    assert pinned_on_decode(decode) == 0
    expired = expired_on(decode) - expired_before
    assert expired == 0, f"{expired} handles expired on D: pinned, never read or released"
    idle = cpu_share(decode)
    return f"D expired +{expired:.0f} over one TTL, D CPU share idle {idle:.2f}"


def test_every_streamed_turn_pulls_its_history(
    engine_pair: EnginePair,
    prefill: Engine,
    decode: Engine,
    engine_log_dir: Path,
    bytes_per_token: int,
) -> None:
    """Six turns, every one streamed through the SDK, P path forced
    (skipPrefillBelowTokens 0): every later turn pulls its history (P's metrics: the
    reused tokens over NIXL, at least the previous prompt), every answer equals one
    engine computing it all, and no turn leaves a pin nobody tracks."""
    wait_until(lambda: pinned_on_decode(decode) == 0, 60, "D to pin nothing before the test")
    expired_before = expired_on(decode)
    sc = start(engine_pair, engine_log_dir, "sidecar-stream-p", skipPrefillBelowTokens=0)
    bpt = bytes_per_token
    messages: list[dict[str, Any]] = [{"role": "user", "content": words("s0", WORDS)}]
    turns: list[Turn] = []
    for n in range(TURNS):
        t = sdk.turn(sc, prefill, messages, "stream-p")
        assert t.reply.route == "remote", t.why()
        if n == 0:
            assert t.reply.outcome == "no-handle", t.why()
        else:
            assert_pulled(t, bpt)
            assert t.reply.reused_tokens >= round_down(turns[-1].prompt), t.why()
        assert t.reply.token_ids == sdk.reference(prefill, messages), t.why()
        wait_until(lambda: kept_only_the_handle(sc, decode), 10, f"turn {n + 1}'s pins")
        turns.append(t)
        messages = [*copy.deepcopy(messages), assistant(t.reply)]
        messages.append({"role": "user", "content": words(f"s{n + 1}", WORDS)})
    costs = reanchor_seconds(sc)
    assert len(costs) == TURNS, costs
    tail = nothing_left(sc, decode, expired_before)
    say(
        "streamed, P path: reused "
        + ", ".join(f"{t.reply.reused_tokens}/{t.prompt}" for t in turns)
        + f"; re-anchor s per turn {', '.join(f'{c:.3f}' for c in costs)}; {tail}"
    )


def test_streamed_turns_with_defaults_and_a_long_tool_result(
    engine_pair: EnginePair,
    prefill: Engine,
    decode: Engine,
    engine_log_dir: Path,
    bytes_per_token: int,
) -> None:
    """Default settings (skipPrefillBelowTokens 256): a short follow-up is prefilled by
    D alone and still leaves a handle, and the long tool result after it pulls the
    whole history from D; every answer equals one engine computing it all."""
    wait_until(lambda: pinned_on_decode(decode) == 0, 60, "D to pin nothing before the test")
    expired_before = expired_on(decode)
    sc = start(engine_pair, engine_log_dir, "sidecar-stream-defaults")
    bpt = bytes_per_token
    messages: list[dict[str, Any]] = [{"role": "user", "content": words("d0", 330)}]
    first = sdk.turn(sc, prefill, messages, "stream-d")
    assert first.reply.outcome == "no-handle" and first.reply.route == "remote", first.why()
    wait_until(lambda: kept_only_the_handle(sc, decode), 10, "turn 1's pins")

    messages = [*copy.deepcopy(messages), assistant(first.reply)]
    messages.append({"role": "user", "content": words("d1", SHORT_WORDS)})
    short = sdk.turn(sc, prefill, messages, "stream-d")
    assert short.reply.outcome == "skipped-prefill", short.why()
    # P prefilled nothing: it saw only the one-token release of turn 1's handle.
    assert short.p.pulled_tokens == 0 and short.p.computed_tokens <= 1, short.why()
    wait_until(lambda: kept_only_the_handle(sc, decode), 10, "the short turn's pins")

    call = {"id": "call-1", "type": "function", "function": {"name": "read", "arguments": "{}"}}
    messages = [*copy.deepcopy(messages), {**assistant(short.reply), "tool_calls": [call]}]
    messages.append({"role": "tool", "tool_call_id": "call-1", "content": words("d2", TOOL_WORDS)})
    tool = sdk.turn(sc, prefill, messages, "stream-d")
    assert_pulled(tool, bpt)
    assert tool.reply.reused_tokens >= round_down(short.prompt), tool.why()
    wait_until(lambda: kept_only_the_handle(sc, decode), 10, "the tool turn's pins")
    # The references after the turns: P has no prefix cache, and the gaps stay short.
    for t in (first, short, tool):
        assert t.reply.token_ids == sdk.reference(prefill, t.messages), t.why()
    costs = reanchor_seconds(sc)
    tail = nothing_left(sc, decode, expired_before)
    say(
        f"streamed, defaults: {short.reply.outcome} {short.prompt} tokens, then the tool "
        f"result reused {tool.reply.reused_tokens}/{tool.prompt}; re-anchor s "
        f"{', '.join(f'{c:.3f}' for c in costs)}; {tail}"
    )
