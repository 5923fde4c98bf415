"""Never a hang, never work for nobody: request budgets, client disconnects, bad JSON."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp

from kvferry_sidecar.runtime import Sidecar
from kvferry_sidecar.types import TurnReport

from .conftest import Engines, MakeSidecar, sidecar_of
from .test_turns import CHAT, LONG_QUESTION, Conversation


def chat(**extra: object) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": LONG_QUESTION}], **extra}


def turns_recorded(sc: Sidecar) -> asyncio.Event:
    """Set once the sidecar has recorded a turn (for a client gone, the handler's last
    step, after the engine's request is aborted or not)."""
    done = asyncio.Event()
    record = sc.record_turn

    def recording(turn: TurnReport) -> None:
        record(turn)
        done.set()

    sc.record_turn = recording  # type: ignore[method-assign]
    return done


async def test_deeply_nested_json_is_a_400_not_a_500(make_sidecar: MakeSidecar) -> None:
    """Bug prevented: json.loads raised RecursionError and the client got a 500."""
    client = await make_sidecar()
    body = "[" * 100_000 + "]" * 100_000
    resp = await client.post(CHAT, data=body, headers={"Content-Type": "application/json"})
    assert resp.status == 400
    assert "JSON object" in (await resp.json())["error"]["message"]


async def test_wedged_decode_gets_a_504_within_the_budget(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """A D that never answers holds the client no longer than decodeTimeoutSeconds."""
    client = await make_sidecar(decode_timeout_seconds=0.3)
    engines.decode.delay = 5.0
    started = asyncio.get_running_loop().time()
    resp = await client.post(CHAT, json=chat())
    assert resp.status == 504
    assert (await resp.json())["error"]["type"] == "upstream_timeout"
    assert asyncio.get_running_loop().time() - started < 3.0


async def test_stream_falling_silent_ends_within_the_idle_budget(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """A stream that stops mid-answer is cut after streamIdleTimeoutSeconds; the client
    has what came before, and the turn is reported as broken, not kept."""
    client = await make_sidecar(stream_idle_timeout_seconds=0.3)
    engines.decode.stall = 5.0
    started = asyncio.get_running_loop().time()
    resp = await client.post(CHAT, json=chat(stream=True))
    text = await resp.text()
    assert resp.status == 200 and "data: " in text
    assert asyncio.get_running_loop().time() - started < 3.0
    # The stream ends with an error event (as vLLM's own failed streams do).
    assert '"type": "upstream_error"' in text.strip().splitlines()[-1]
    assert len(sidecar_of(client).store) == 0  # a broken answer leaves no handle


async def test_client_gone_mid_decode_aborts_the_decode(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """A non-streaming client that disconnects stops D too (vLLM aborts a request
    whose connection closed), instead of generating to max_tokens for nobody."""
    client = await make_sidecar()
    recorded = turns_recorded(sidecar_of(client))
    engines.decode.delay = 5.0
    asking = asyncio.ensure_future(client.post(CHAT, json=chat()))
    # Gone once D has the request (a timer could fire before it got there on a
    # loaded machine: then D has nothing to abort).
    async with asyncio.timeout(30):
        await engines.decode.wait_received()
    asking.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await asking
    async with asyncio.timeout(5):
        await engines.decode.wait_aborted()
        await recorded.wait()
    assert engines.decode.aborted == 1
    assert sidecar_of(client).metrics.turns.labels("no-handle", "remote")._value.get() == 1


async def test_client_gone_mid_prefill_aborts_it_and_keeps_the_handle_counted(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """Disconnected while P was pulling: P's request is aborted, and the handle it may
    or may not have read stays in the pinned figures until D's deadline."""
    client = await make_sidecar()
    conv = Conversation(client, session_id="s")
    await conv.ask(LONG_QUESTION)
    for p in engines.prefill:
        p.delay = 5.0
    conv.messages.append({"role": "user", "content": "and then"})
    body = {"model": "m", "session_id": "s", "messages": conv.messages}
    recorded = turns_recorded(sidecar_of(client))
    with contextlib.suppress(TimeoutError):
        await client.post(CHAT, json=body, timeout=aiohttp.ClientTimeout(total=0.3))
    async with asyncio.timeout(5), asyncio.TaskGroup() as waits:
        aborts = [waits.create_task(p.wait_aborted()) for p in engines.prefill]
        await asyncio.wait(aborts, return_when=asyncio.FIRST_COMPLETED)
        await recorded.wait()
        for task in aborts:
            task.cancel()
    assert sum(p.aborted for p in engines.prefill) == 1
    assert engines.decode.completions()[-1:] and len(engines.decode.completions()) == 1
    sc = sidecar_of(client)
    assert sc.releaser.figures().handles == 1
    assert sc.metrics.prefill_attempts.labels("abandoned")._value.get() == 1


async def test_forward_hop_waits_no_longer_than_both_budgets(
    make_sidecar: MakeSidecar, engines: Engines, aiohttp_server: object
) -> None:
    """An owner sidecar that never answers: the entry sidecar gives up with a 504
    instead of holding the client (and does not redo the turn itself)."""
    from aiohttp import web

    async def hang(request: web.Request) -> web.Response:
        await asyncio.sleep(30)
        return web.Response()

    owner_app = web.Application()
    owner_app.router.add_post(CHAT, hang)
    owner = await aiohttp_server(owner_app)  # type: ignore[operator]
    url = str(owner.make_url("")).rstrip("/")
    client = await make_sidecar(
        ordinal=0,
        decode_sidecars=(url, url),
        prefill_timeout_seconds=0.2,
        decode_timeout_seconds=0.2,
    )
    # A session the ring gives to ordinal 1 (the hanging owner).
    from kvferry_sidecar.session import owner as owner_of

    session = next(f"s{i}" for i in range(100) if owner_of(f"session_id=s{i}", 2) == 1)
    resp = await client.post(CHAT, json=chat(session_id=session))
    assert resp.status == 504
    assert (await resp.json())["error"]["type"] == "upstream_timeout"
    assert engines.decode.completions() == []  # not redone here
