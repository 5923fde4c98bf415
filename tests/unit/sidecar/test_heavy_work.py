"""Heavy work off the event loop: a big turn's JSON (the client's body, each engine
leg's body, the /tokenize answer, D's answer) is parsed and written in the sidecar's
heavy-work thread, one piece at a time, never on the loop that serves /healthz and
every other stream.

Bug prevented: 24 concurrent 2.9 MiB bodies stalled /healthz 7.96 s and a steady
stream 17.3 s (``python -m bench.hostile --loads memory``): the engine legs' JSON
ran on the loop, and six parse threads held the GIL against it in turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import types
from typing import Any

import pytest
from aiohttp import web

from kvferry_sidecar import limits, relay, rewrite, upstream

from .conftest import Engines, MakeSidecar, sidecar_of
from .test_budgets import turns_recorded
from .test_turns import releases_done

CHAT = "/v1/chat/completions"
BIG = limits.PARSE_IN_THREAD_BYTES


def big_body(words: int = 60_000, sid: str = "big") -> bytes:
    """About 420 KiB of text: past the heavy threshold, within the fakes' caps."""
    text = " ".join(f"w{i % 5000}" for i in range(words))
    body = {"model": "m", "messages": [{"role": "user", "content": text}], "session_id": sid}
    return json.dumps(body).encode()


class Calls:
    """JSON work the sidecar did, by size and whether it ran on the loop's thread."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int, bool]] = []
        self._lock = threading.Lock()

    def note(self, what: str, size: int) -> None:
        on_loop = threading.current_thread() is threading.main_thread()
        with self._lock:
            self.seen.append((what, size, on_loop))

    def big(self, *, on_loop: bool) -> list[tuple[str, int, bool]]:
        return [c for c in self.seen if c[1] > BIG and c[2] is on_loop]

    def wrap_json(self) -> types.SimpleNamespace:
        def loads(raw: Any, *a: Any, **kw: Any) -> Any:
            self.note("loads", len(raw))
            return json.loads(raw, *a, **kw)

        def dumps(obj: Any, *a: Any, **kw: Any) -> str:
            out = json.dumps(obj, *a, **kw)
            self.note("dumps", len(out))
            return out

        return types.SimpleNamespace(**{**vars(json), "loads": loads, "dumps": dumps})


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Calls:
    calls = Calls()
    spy = calls.wrap_json()
    for module in (relay, upstream, rewrite, limits):
        monkeypatch.setattr(module, "json", spy)
    real = web.json_response

    def json_response(data: Any = None, **kw: Any) -> web.Response:
        response = real(data, **kw)
        calls.note("json_response", len(response.body or b""))
        return response

    # The relay's alone: the fake engines in this process answer with it too.
    monkeypatch.setattr(
        relay, "web", types.SimpleNamespace(**{**vars(web), "json_response": json_response})
    )
    return calls


async def test_a_big_turns_json_is_read_and_written_off_the_event_loop(
    make_sidecar: MakeSidecar, engines: Engines, calls: Calls
) -> None:
    client = await make_sidecar()
    sc = sidecar_of(client)
    serialize = sc.http._json_serialize

    def engine_body(obj: Any) -> str:  # what aiohttp's client encodes for json=
        out = serialize(obj)
        calls.note("client json=", len(out))
        return out

    sc.http._json_serialize = engine_body  # type: ignore[misc]
    resp = await client.post(CHAT, data=big_body(), headers={"Content-Type": "application/json"})
    assert resp.status == 200, await resp.text()
    # Every engine leg ran: /tokenize, P, D (the turn is long enough for P).
    assert engines.prefill_calls() == 1
    assert calls.big(on_loop=True) == []
    kinds = {what for what, _, _ in calls.big(on_loop=False)}
    assert {"loads", "dumps"} <= kinds, calls.seen


async def test_heavy_work_runs_one_piece_at_a_time(
    make_sidecar: MakeSidecar, engines: Engines, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two threads of heavy work hold the GIL against the loop in turn (a C call such
    as json.loads gives it back only when done): one piece at a time keeps the
    loop's wait to one piece."""
    client = await make_sidecar()
    real = limits.parse_body
    lock = threading.Lock()
    both = threading.Event()
    state = {"active": 0, "most": 0}

    def parse_body(raw: bytes, caps: limits.BodyCaps) -> Any:
        with lock:
            state["active"] += 1
            state["most"] = max(state["most"], state["active"])
            if state["active"] >= 2:
                both.set()
        both.wait(1.0)  # room for a second parse to start beside this one
        try:
            return real(raw, caps)
        finally:
            with lock:
                state["active"] -= 1

    monkeypatch.setattr(limits, "parse_body", parse_body)
    headers = {"Content-Type": "application/json"}
    answers = await asyncio.gather(
        *(client.post(CHAT, data=big_body(sid=f"s{i}"), headers=headers) for i in range(2))
    )
    assert [a.status for a in answers] == [200, 200]
    assert state["most"] == 1


async def test_a_client_gone_while_ds_answer_is_read_leaves_no_handle_untracked(
    make_sidecar: MakeSidecar, engines: Engines, monkeypatch: pytest.MonkeyPatch
) -> None:
    """D has answered, so it holds the turn's KV whatever the client does; a client
    that leaves while the sidecar reads that answer must not make the sidecar drop
    the handle (D would pin it, untracked, until its TTL). Found by bench/hostile.py:
    D held 151 handles, the sidecar tracked 40."""
    client = await make_sidecar()
    sc = sidecar_of(client)
    recorded = turns_recorded(sc)
    reading, go = threading.Event(), threading.Event()
    handler: list[asyncio.Task[Any]] = []
    real_read, real_decode = relay._read_answer, relay.run_decode

    def read_answer(raw: bytes, wants_token_ids: bool) -> Any:
        reading.set()
        go.wait(5)
        return real_read(raw, wants_token_ids)

    async def run_decode(*args: Any) -> Any:
        handler.append(asyncio.current_task())  # type: ignore[arg-type]
        return await real_decode(*args)

    monkeypatch.setattr(relay, "_read_answer", read_answer)
    monkeypatch.setattr(relay, "run_decode", run_decode)
    post = asyncio.create_task(
        client.post(CHAT, data=big_body(), headers={"Content-Type": "application/json"})
    )
    async with asyncio.timeout(10):
        await asyncio.to_thread(reading.wait, 5)
        # The client leaves: aiohttp cancels the turn's handler, as it does here.
        handler[0].cancel()
        go.set()
        await recorded.wait()
    post.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await post
    (returned,) = [h for h in engines.decode.handles if h is not None]
    await releases_done(client)
    # Released through P (or, failing that, in the ledger): never forgotten.
    carried = [
        s.body.get("kv_transfer_params") or {} for p in engines.prefill for s in p.completions()
    ]
    released = any(c.get("remote_request_id") == returned["remote_request_id"] for c in carried)
    assert released or sc.releaser.figures().handles + len(sc.store) == 1
