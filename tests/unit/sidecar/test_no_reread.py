"""Never read a handle twice (vLLM #52234: a consumed or stale NIXL handle read again
answers 200 with garbage, or the previous prompt's answer).

The fake engines watch every handle they issue (``kvferry_dev.fakeengines.KVReads``):
P pulling D's blocks, P registering an empty pull for them (a release) and D reading
P's blocks are each a handle's one use; a second presentation, or one of a handle
that expired or whose engine restarted, is a re-read, counted and answered with
``GARBAGE``. Each test drives the real sidecar app through one path that could
present a used handle again and checks that none was (``rereads == 0``) and that
every answer is the one the prompt gets without reuse.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from kvferry_dev.fakeengines import (
    GARBAGE,
    USE_DECODE,
    USE_PULL,
    USE_RELEASE,
    FakeEngine,
    KVReads,
)
from kvferry_sidecar import anchor
from kvferry_sidecar.app import app_factory
from kvferry_sidecar.release import PINNED_NO_PREFILL, PINNED_RELEASE_FAILED, Releaser
from kvferry_sidecar.session import owner
from kvferry_sidecar.types import KVHandle, PrefillResult, token_array
from kvferry_wire.protocol import Outcome, Route

from .conftest import Engines, MakeSidecar, sidecar_of, sidecar_settings, start
from .test_turns import LONG_QUESTION, Conversation, outcome, releases_done

# The fake D answers every prompt so when it computes it (no reuse, or a clean read).
NO_REUSE_ANSWER = "fine thanks"
UNUSED = "http://127.0.0.1:9"  # a ring slot the test never calls


@pytest.fixture
def reads(engines: Engines) -> KVReads:
    """The fakes' handle uses, on the clock the sidecar's store reads (so an expiry
    the test steps to is one for both)."""
    return KVReads(clock=engines.clock).watch(*engines.prefill, engines.decode)


async def ask(conv: Conversation, text: str, **extra: Any) -> Any:
    """One turn; its answer must be the no-reuse answer."""
    resp, raw = await conv.ask(text, **extra)
    assert resp.status == 200, raw
    assert GARBAGE not in raw
    assert conv.messages[-1]["content"] == NO_REUSE_ANSWER, raw
    return resp


async def retry(conv: Conversation, **extra: Any) -> Any:
    """The client sends its last turn again (its answer never came, or it timed out)."""
    conv.messages.pop()  # the answer
    return await ask(conv, conv.messages.pop()["content"], **extra)


def no_rereads(reads: KVReads) -> None:
    assert reads.rereads == 0, reads.log


def key(params: dict[str, Any] | KVHandle) -> tuple[str, str, int]:
    p = params.params if isinstance(params, KVHandle) else params
    return (p["remote_engine_id"], p["remote_request_id"], p["remote_block_ids"][0][0])


# ------------------------------------------------------------------ a failed pull


async def test_a_pull_that_failed_is_never_sent_again(
    make_sidecar: MakeSidecar, engines: Engines, reads: KVReads
) -> None:
    """P fails the pull (500): the turn retries at once without the handle, and the
    client's own retry of the turn gets the turn's new handle, never the failed one;
    the failed one is not released either (P may have read it)."""
    client = await make_sidecar()
    conv = Conversation(client, session_id="s")
    await ask(conv, LONG_QUESTION)
    for p in engines.prefill:
        p.fail_with_handle = 500
    resp = await ask(conv, "and then")
    assert outcome(resp) == "pull-failed"
    (failed,) = [k for k, how in reads.uses.items() if how == USE_PULL]
    for p in engines.prefill:
        p.fail_with_handle = None
    resp = await retry(conv)
    assert outcome(resp) == "reused"
    resp = await ask(conv, "and more")
    assert outcome(resp) == "reused"
    await releases_done(client)
    no_rereads(reads)
    assert reads.uses[failed] == USE_PULL  # its one use
    assert reads.count(USE_PULL) == 3


async def test_a_pull_that_timed_out_is_never_sent_again(
    make_sidecar: MakeSidecar, engines: Engines, reads: KVReads
) -> None:
    """P does not answer the pull within the prefill budget: the next P gets the turn
    without the handle; the client's retry and the next turn use newer handles."""
    client = await make_sidecar(prefill_timeout_seconds=0.3)
    conv = Conversation(client, session_id="s")
    await ask(conv, LONG_QUESTION)  # prefill-0
    engines.p1.delay = 1.0  # turn 2 goes to prefill-1 first
    resp = await ask(conv, "and then")
    assert outcome(resp) == "pull-failed"
    engines.p1.delay = 0.0
    resp = await retry(conv)
    assert outcome(resp) == "reused"
    resp = await ask(conv, "and more")
    assert outcome(resp) == "reused"
    await asyncio.sleep(1.0)  # prefill-1 answers the abandoned request meanwhile
    await releases_done(client)
    no_rereads(reads)
    assert reads.count(USE_PULL) == 3


async def test_a_pull_broken_off_by_a_dying_prefill_engine_is_never_sent_again(
    make_sidecar: MakeSidecar, engines: Engines, reads: KVReads
) -> None:
    """P closes the connection with the handle on it (it may have read it): the other
    P gets the turn without it."""
    client = await make_sidecar()
    conv = Conversation(client, session_id="s")
    await ask(conv, LONG_QUESTION)
    engines.p1.drop_connections = 1
    resp = await ask(conv, "and then")
    assert outcome(resp) == "pull-failed"
    resp = await ask(conv, "and more")
    assert outcome(resp) == "reused"
    await releases_done(client)
    no_rereads(reads)


async def test_a_client_that_leaves_mid_pull_leaves_the_handle_unsent(
    make_sidecar: MakeSidecar, engines: Engines, reads: KVReads, tmp_path: Path
) -> None:
    """The client goes away while P holds the pull: the handle is not released (P may
    have read it), not even by the sidecar's next process, and the session's next
    turn recomputes."""
    path = tmp_path / "pins.jsonl"
    client = await make_sidecar(pin_journal_path=str(path))
    conv = Conversation(client, session_id="s")
    await ask(conv, LONG_QUESTION)
    engines.p1.delay = 0.5
    body = {"model": "m", "session_id": "s", "messages": [*conv.messages]}
    body["messages"].append({"role": "user", "content": "and then"})
    request = asyncio.ensure_future(client.post("/v1/chat/completions", json=body))
    await engines.p1.wait_received()
    request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await request
    engines.p1.delay = 0.0
    await asyncio.sleep(0.6)
    resp = await ask(conv, "and then")
    assert outcome(resp) == "no-handle"
    await releases_done(client)
    # Nor does the sidecar's next process release it (its pin journal forgot it).
    await crash(client, path)
    again = await make_sidecar(pin_journal_path=str(path))
    assert sidecar_of(again).residency.orphans.found == 1  # the last turn's handle
    await releases_done(again)
    no_rereads(reads)


# ------------------------------------------------------------------ one session, twice


async def test_two_turns_of_one_session_at_once_read_the_handle_once(
    make_sidecar: MakeSidecar, engines: Engines, reads: KVReads
) -> None:
    """The same turn sent three times at once (a client retrying too early): one of
    them pulls, the others recompute; the handles they leave supersede each other and
    are released, never pulled; the session's next turn pulls the last kept."""
    client = await make_sidecar()
    conv = Conversation(client, session_id="s")
    await ask(conv, LONG_QUESTION)
    for p in engines.prefill:
        p.delay = 0.5  # the turns overlap at P
    body = {"model": "m", "session_id": "s", "messages": [*conv.messages]}
    body["messages"].append({"role": "user", "content": "and then"})
    answers = await asyncio.gather(
        *(client.post("/v1/chat/completions", json=body) for _ in range(3))
    )
    outcomes = sorted(outcome(r) for r in answers)
    assert outcomes == ["no-handle", "no-handle", "reused"]
    for r in answers:
        assert (await r.json())["choices"][0]["message"]["content"] == NO_REUSE_ANSWER
    for p in engines.prefill:
        p.delay = 0.0
    conv.messages += [body["messages"][-1], {"role": "assistant", "content": NO_REUSE_ANSWER}]
    resp = await ask(conv, "and more")
    assert outcome(resp) == "reused"
    await releases_done(client)
    no_rereads(reads)
    assert reads.count(USE_PULL) == 2
    assert reads.count(USE_RELEASE) == 2  # the two superseded ones


# ------------------------------------------------------------------ superseded, evicted


@pytest.mark.parametrize("release_after", [0.0, 3600.0])
async def test_an_evicted_or_superseded_handle_is_released_once_and_never_pulled(
    make_sidecar: MakeSidecar, engines: Engines, reads: KVReads, release_after: float
) -> None:
    """A store of one handle: each session's turn evicts the other's handle (released
    through P: at once, or riding on a later prefill); a turn D prefills alone (a
    short tail) releases the handle it took and keeps its own; the handles held when
    the sidecar stops are released. None of them is offered to a turn afterwards, and
    none is released twice."""
    client = await make_sidecar(
        handle_store_cap=1, release_after_seconds=release_after, skip_prefill_below_tokens=10
    )
    sc = sidecar_of(client)
    a = Conversation(client, session_id="a")
    b = Conversation(client, session_id="b")
    await ask(a, LONG_QUESTION)
    await ask(b, LONG_QUESTION)  # evicts a's
    resp = await ask(a, f"and then {LONG_QUESTION}")  # evicts b's
    assert outcome(resp) == "no-handle"
    resp = await ask(a, "and you")  # D alone: a's handle taken, released, its own kept
    assert outcome(resp) == "skipped-prefill"
    resp = await ask(a, LONG_QUESTION)  # pulls D's own
    assert outcome(resp) == "reused"
    resp = await ask(b, f"and then {LONG_QUESTION}")  # b's was evicted: evicts a's
    assert outcome(resp) == "no-handle"
    await sc.releaser.release_all(sc.store.values(), 5)  # the sidecar stops
    sc.store.clear()
    for conv in (a, b):
        resp = await ask(conv, f"and last {LONG_QUESTION}")
        assert outcome(resp) == "no-handle"
    await sc.releaser.release_all(sc.store.values(), 5)
    no_rereads(reads)
    assert reads.count(USE_PULL) == 1
    assert reads.count(USE_RELEASE) == 7


async def test_a_handle_past_its_end_is_never_offered(
    make_sidecar: MakeSidecar, engines: Engines, reads: KVReads
) -> None:
    """A handle is offered until the ceiling (D's deadline) less the margin: past it the
    session's next turn recomputes and nothing is sent for it (D frees it; P would read
    freed blocks), and again past D's own deadline for the newer one."""
    client = await make_sidecar(retention_seconds=60, retention_ceiling_seconds=60)
    sc = sidecar_of(client)
    conv = Conversation(client, session_id="s")
    await ask(conv, LONG_QUESTION)
    engines.clock.advance(50)
    sc.store.purge_expired()
    await releases_done(client)
    resp = await ask(conv, "and then")
    assert outcome(resp) == "expired"
    assert reads.count(USE_RELEASE) == 0
    engines.clock.advance(engines.decode.ttl)  # past D's deadline for the newer one
    resp = await ask(conv, "and more")
    assert outcome(resp) == "expired"
    await releases_done(client)
    no_rereads(reads)
    assert reads.count(USE_PULL) == 0


# ------------------------------------------------------------------ forwarded turns


def session_owned_by(ordinal: int, ring: int) -> str:
    for i in range(1000):
        if owner(f"session_id=s{i}", ring) == ordinal:
            return f"s{i}"
    raise AssertionError("no such session")


async def test_turns_relayed_between_decode_sidecars_read_each_handle_once(
    aiohttp_server: Any, aiohttp_client: Any, engines: Engines, reads: KVReads
) -> None:
    """Two decode pods, one P pool. A session served by pod 0 alone, then (the ring
    grown) relayed to its owner pod 1, whose D fails a turn after its P pulled (pod 0
    serves that turn itself), then back on pod 0 (the ring shrunk): each pod's handle
    is read at most once, whichever pod the turn lands on."""
    d1 = await start(aiohttp_server, FakeEngine("decode", "decode-1"))
    reads.watch(d1)
    session = session_owned_by(1, 2)
    s1 = await aiohttp_server(
        app_factory(
            sidecar_settings(
                engines, engine_url=d1.url, ordinal=1, decode_sidecars=(UNUSED, UNUSED)
            ),
            clock=engines.clock,
        )
    )
    url1 = str(s1.make_url("")).rstrip("/")
    s0 = await aiohttp_client(
        app_factory(sidecar_settings(engines, ordinal=0), clock=engines.clock)
    )
    conv = Conversation(s0, session_id=session)
    await ask(conv, LONG_QUESTION)  # pod 0 alone in the ring: its own handle
    assert len(engines.decode.handles) == 1
    sidecar_of(s0).decode_sidecars = (UNUSED, url1)  # the ring grows: pod 1 owns it
    resp = await ask(conv, "and then")
    assert resp.headers["X-Kvferry-Owner"] == "1" and outcome(resp) == "no-handle"
    resp = await ask(conv, "and more")
    assert outcome(resp) == "reused"
    # Pod 1's D fails both the decode leg and its local retry after P pulled: pod 0
    # serves the turn (owner-error) without any handle of its own for it.
    d1.fail_statuses = [500, 500]
    resp = await ask(conv, "and again")
    assert resp.headers["X-Kvferry-Owner"] == "0"
    async with TestClient(s1) as direct:  # the turn after, straight to the owner pod
        relayed = Conversation(direct, session_id=session)
        relayed.messages = list(conv.messages)
        resp = await ask(relayed, "and so", headers={"X-Kvferry-Forwarded-By": "0"})
        assert outcome(resp) in {"no-handle", "misaligned", "below-threshold"}
        conv.messages = list(relayed.messages)
        sidecar_of(s0).decode_sidecars = ()  # the ring shrinks: pod 0 serves again
        resp = await ask(conv, "and last")
        # Pod 0's only handle of the session is turn 1's own (read at most once).
        assert outcome(resp) in {"reused", "misaligned", "below-threshold", "no-handle"}
        await releases_done(s0)
        await releases_done(direct)
    no_rereads(reads)


async def test_a_relayed_turn_whose_owner_breaks_off_is_not_served_with_its_handle(
    aiohttp_server: Any, aiohttp_client: Any, engines: Engines, reads: KVReads
) -> None:
    """The owner pod answers 5xx after its P pulled the session's handle: the pod
    that relayed the turn serves it itself, without any handle, and the owner's next
    turn of the session does not offer the used one again."""
    d1 = await start(aiohttp_server, FakeEngine("decode", "decode-1"))
    reads.watch(d1)
    session = session_owned_by(1, 2)
    s1 = await aiohttp_server(
        app_factory(
            sidecar_settings(
                engines, engine_url=d1.url, ordinal=1, decode_sidecars=(UNUSED, UNUSED)
            ),
            clock=engines.clock,
        )
    )
    url1 = str(s1.make_url("")).rstrip("/")
    s0 = await aiohttp_client(
        app_factory(
            sidecar_settings(engines, ordinal=0, decode_sidecars=(UNUSED, url1)),
            clock=engines.clock,
        )
    )
    conv = Conversation(s0, session_id=session)
    await ask(conv, LONG_QUESTION)
    d1.fail_statuses = [500, 500]
    resp = await ask(conv, "and then")
    assert resp.headers["X-Kvferry-Owner"] == "0"  # served by the relaying pod
    pulled = [k for k, how in reads.uses.items() if how == USE_PULL]
    assert len(pulled) == 1  # the owner's P did read it before its D failed
    resp = await retry(conv)  # the owner again: its handle is gone
    assert resp.headers["X-Kvferry-Owner"] == "1"
    assert outcome(resp) == "no-handle"
    resp = await ask(conv, "and more")
    assert outcome(resp) == "reused"
    await releases_done(s0)
    no_rereads(reads)


# ------------------------------------------------------------------ a restart


async def crash(client: TestClient, path: Path) -> None:
    """The sidecar process dies (a kill, an OOM): it releases nothing on its way out,
    and its journal is left as it was."""
    sidecar_of(client)._released_on_drain = True  # what a clean stop would release
    left = path.read_bytes()
    await client.close()
    path.write_bytes(left)


async def test_a_restarted_sidecar_releases_its_orphans_once_and_never_offers_them(
    make_sidecar: MakeSidecar, engines: Engines, reads: KVReads, tmp_path: Path
) -> None:
    """Before the crash: a handle kept (s), a handle pulled (t's first), a pull that
    timed out (t's second: P may have read it), an evicted handle released. After
    it, the journal's live pins are released through P once each; none is a handle
    already read or released, and no turn is offered one of them."""
    path = tmp_path / "pins.jsonl"
    first = await make_sidecar(pin_journal_path=str(path), prefill_timeout_seconds=0.3)
    s = Conversation(first, session_id="s")
    t = Conversation(first, session_id="t")
    await ask(s, LONG_QUESTION)  # prefill-0
    await ask(t, LONG_QUESTION)  # prefill-1
    resp = await ask(t, "and then")  # prefill-0: pulls t's first
    assert outcome(resp) == "reused"
    engines.p1.delay = 1.0
    resp = await ask(t, "and more")  # prefill-1 first: times out with t's second
    assert outcome(resp) == "pull-failed"
    engines.p1.delay = 0.0
    await releases_done(first)
    await asyncio.sleep(1.0)  # prefill-1 answers the abandoned request meanwhile
    before = reads.count(USE_RELEASE)
    await crash(first, path)

    second = await make_sidecar(pin_journal_path=str(path))
    s.client = t.client = second
    await releases_done(second)
    orphans = sidecar_of(second).residency.orphans
    assert orphans.found == 2  # s's handle and t's third turn's
    assert reads.count(USE_RELEASE) == before + 2
    assert len(sidecar_of(second).store) == 0
    resp = await ask(s, "and then")
    assert outcome(resp) == "no-handle"
    resp = await ask(t, "and last")
    assert outcome(resp) == "no-handle"
    await releases_done(second)
    no_rereads(reads)


async def test_an_orphan_whose_release_broke_off_is_not_released_again_after_a_restart(
    make_sidecar: MakeSidecar, engines: Engines, reads: KVReads, tmp_path: Path
) -> None:
    """An orphan waits for a ride; the prefill it rides on times out (P may have
    released it). The sidecar crashes again: the next one must not send it again."""
    path = tmp_path / "pins.jsonl"
    first = await make_sidecar(pin_journal_path=str(path))
    await ask(Conversation(first, session_id="s"), LONG_QUESTION)
    await crash(first, path)

    second = await make_sidecar(
        pin_journal_path=str(path), release_after_seconds=3600.0, prefill_timeout_seconds=0.3
    )
    assert sidecar_of(second).residency.orphans.found == 1
    for p in engines.prefill:
        p.delay = 1.0  # the first prefill, with the orphan riding on it, times out
    resp = await ask(Conversation(second, session_id="u"), LONG_QUESTION)
    assert resp.headers["X-Kvferry-Route"] == "fallback"
    assert reads.count(USE_RELEASE) == 1  # it reached P
    for p in engines.prefill:
        p.delay = 0.0
    await asyncio.sleep(1.0)
    await crash(second, path)

    third = await make_sidecar(pin_journal_path=str(path))
    await releases_done(third)
    await sidecar_of(third).releaser.release_all([], 5)
    no_rereads(reads)


async def test_a_release_that_timed_out_is_not_sent_again_after_a_restart(
    make_sidecar: MakeSidecar, engines: Engines, reads: KVReads, tmp_path: Path
) -> None:
    """An evicted handle's release request reaches P, which answers too late: pinned
    ``release-failed`` (P may have released it). The sidecar's next process releases
    the handle it kept, not that one."""
    path = tmp_path / "pins.jsonl"
    # A release request waits 10 x connect_timeout_seconds for P's answer.
    first = await make_sidecar(
        pin_journal_path=str(path), handle_store_cap=1, connect_timeout_seconds=0.05
    )
    await ask(Conversation(first, session_id="a"), LONG_QUESTION)
    for p in engines.prefill:
        p.delay = 1.0  # the turn's own prefill waits; the release request gives up
    await ask(Conversation(first, session_id="b"), LONG_QUESTION)  # evicts a's
    await releases_done(first)
    assert sidecar_of(first).releaser.ledger.by_reason(engines.clock()) == {"release-failed": 1}
    assert reads.count(USE_RELEASE) == 1  # it reached P
    for p in engines.prefill:
        p.delay = 0.0
    await asyncio.sleep(1.0)
    await crash(first, path)

    second = await make_sidecar(pin_journal_path=str(path))
    assert sidecar_of(second).residency.orphans.found == 1  # b's handle
    await releases_done(second)
    assert reads.count(USE_RELEASE) == 2
    no_rereads(reads)


async def test_what_a_restarted_decode_engine_freed_is_never_sent(
    make_sidecar: MakeSidecar, engines: Engines, reads: KVReads, tmp_path: Path
) -> None:
    """D restarted while the sidecar was down: its handles went with it. Nothing of
    the journal is released (P would notify a D that never issued it) or offered."""
    path = tmp_path / "pins.jsonl"
    first = await make_sidecar(pin_journal_path=str(path))
    s = Conversation(first, session_id="s")
    await ask(s, LONG_QUESTION)
    await crash(first, path)
    engines.decode.restart()
    second = await make_sidecar(pin_journal_path=str(path))
    s.client = second
    await releases_done(second)
    assert sidecar_of(second).residency.orphans.void == 1
    resp = await ask(s, "and then")
    assert outcome(resp) == "no-handle"
    await releases_done(second)
    no_rereads(reads)
    assert reads.count(USE_RELEASE) == 0


async def test_a_decode_engine_restart_mid_session_drops_its_handles_unsent(
    make_sidecar: MakeSidecar, engines: Engines, reads: KVReads
) -> None:
    """D restarts under a running sidecar (its probe sees the new process): the
    handles it held are forgotten, neither pulled nor released."""
    client = await make_sidecar()
    conv = Conversation(client, session_id="s")
    await ask(conv, LONG_QUESTION)
    engines.decode.restart()
    await sidecar_of(client).scrape_engine()
    resp = await ask(conv, "and then")
    assert outcome(resp) == "no-handle"
    await releases_done(client)
    no_rereads(reads)


# ------------------------------------------------------------------ vLLM 0.32 streams


async def test_streamed_turns_on_032_read_anchor_and_reanchor_once(
    make_sidecar: MakeSidecar, engines: Engines, reads: KVReads
) -> None:
    """vLLM 0.32: D reads P's KV in the anchor, streams, re-anchors; the anchor is
    released and the next turn pulls the re-anchored handle, each once; streamed and
    non-streamed turns mixed."""
    engines.decode.version = "0.32.0"
    client = await make_sidecar()
    conv = Conversation(client, session_id="s", stream=True)
    await ask(conv, LONG_QUESTION)
    resp = await ask(conv, "and then")
    assert outcome(resp) == "reused"
    resp = await ask(conv, "and more", stream=False)
    assert outcome(resp) == "reused"
    resp = await ask(conv, "and again")
    assert outcome(resp) == "reused"
    await releases_done(client)
    no_rereads(reads)
    assert reads.count(USE_PULL) == 3
    assert reads.count(USE_DECODE) == 4  # P's KV: three anchors, one decode leg
    assert reads.count(USE_RELEASE) == 3  # the streamed turns' anchors
    await sidecar_of(client).releaser.release_all(sidecar_of(client).store.values(), 5)
    no_rereads(reads)


async def test_a_reanchor_that_times_out_keeps_the_anchor_read_once(
    make_sidecar: MakeSidecar, engines: Engines, reads: KVReads, monkeypatch: Any
) -> None:
    """The re-anchor does not answer in time: the anchor's handle is kept instead
    (never released as well), and the next turn pulls it once; the late re-anchor's
    own handle is never offered."""
    engines.decode.version = "0.32.0"
    monkeypatch.setattr(anchor, "REANCHOR_TIMEOUT_S", 0.3)
    hold = asyncio.Event()
    engines.decode.hold_reanchor = hold
    client = await make_sidecar()
    conv = Conversation(client, session_id="s", stream=True)
    await ask(conv, LONG_QUESTION)
    hold.set()
    await asyncio.sleep(0.1)  # the late re-anchor is answered (nobody listens)
    engines.decode.hold_reanchor = None
    resp = await ask(conv, "and then")
    assert outcome(resp) == "reused"
    (pulled,) = [k for k, how in reads.uses.items() if how == USE_PULL]
    assert pulled == key(engines.decode.handles[0])  # the anchor's
    resp = await ask(conv, "and more")
    assert outcome(resp) == "reused"
    await releases_done(client)
    no_rereads(reads)


async def test_an_anchor_that_fails_is_never_read_again(
    make_sidecar: MakeSidecar, engines: Engines, reads: KVReads
) -> None:
    """D fails the anchor (it could not read P's KV): the stream prefills on D, P's
    params are not offered to D again, the re-anchor's handle serves the next turn."""
    engines.decode.version = "0.32.0"
    engines.decode.fail_with_prefill_params = 500
    client = await make_sidecar()
    conv = Conversation(client, session_id="s", stream=True)
    resp = await ask(conv, LONG_QUESTION)
    assert resp.headers["X-Kvferry-Route"] == "fallback"
    engines.decode.fail_with_prefill_params = None
    resp = await ask(conv, "and then")
    assert outcome(resp) == "reused"
    await releases_done(client)
    no_rereads(reads)
    assert reads.count(USE_DECODE) == 2


# ------------------------------------------------------------------ the fakes


async def test_the_fakes_count_a_reread_and_answer_it_with_garbage(
    make_sidecar: MakeSidecar, engines: Engines, reads: KVReads
) -> None:
    """The check itself: a handle put back after its pull is pulled again; P counts
    the re-read and D's answer is garbage, with a 200."""
    client = await make_sidecar()
    sc = sidecar_of(client)
    conv = Conversation(client, session_id="s")
    await ask(conv, LONG_QUESTION)
    (held,) = sc.store.values()
    resp = await ask(conv, "and then")
    assert outcome(resp) == "reused"
    sc.store.put(held)  # what no path may do: offer a used handle again
    conv.messages = conv.messages[:2]
    resp, raw = await conv.ask("and then")
    assert resp.status == 200 and outcome(resp) == "reused"
    assert GARBAGE in raw
    assert reads.rereads == 1
    (reread,) = reads.log
    assert (reread.key, reread.first, reread.then) == (key(held), USE_PULL, USE_PULL)


# ------------------------------------------------------------------ the releaser's rule


async def test_nothing_sent_twice_after_a_restart() -> None:
    """release.py's rule: a handle that may have reached P (a rider on an attempt
    that broke off, a release request that failed, the turn's own handle whose pull
    broke off) is gone from the pin journal (``on_freed``); one that never left
    (no P to send it to) stays there for the next process to release."""
    gone: list[str] = []
    answers: list[str | None] = [PINNED_RELEASE_FAILED, PINNED_NO_PREFILL]

    async def send(handle: KVHandle) -> str | None:
        return answers.pop(0)

    releaser = Releaser(
        send=send,
        clock=lambda: 200.0,
        expired=lambda handle, now: False,
        count=lambda method: None,
        retention_s=480.0,
        after_s=1000.0,
        on_freed=lambda handle: gone.append(handle.params["remote_request_id"]),
    )

    def made(rid: str) -> KVHandle:
        params = {"remote_request_id": rid, "remote_block_ids": [[1]], "remote_num_tokens": 4}
        return KVHandle(
            session=rid,
            params=params,
            token_ids=token_array([5]),
            num_tokens=4,
            engine_build=None,
            created_at=100.0,
            expires_at=500.0,
        )

    releaser.release(made("rider"))
    with releaser.ride(None, None) as ride:
        ride.broke_off()
    await releaser.release_all([made("failed"), made("no-prefill")], timeout_s=5)
    broken = PrefillResult(Route.FALLBACK, Outcome.PULL_FAILED, None, handle_unknown=True)
    releaser.settle_taken(made("taken"), broken)
    assert gone == ["rider", "failed", "taken"]
