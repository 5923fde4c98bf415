"""Reuse only when the KV is provably the same, and no handle left pinned for nothing:
the turn protocol against fake engines (kvferry_dev/fakeengines.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

from aiohttp.test_utils import TestClient

from kvferry_dev.fakeengines import chat_ids
from kvferry_sidecar.blockhash import prefix_block_hashes
from kvferry_sidecar.kvevents import Batch, Stored
from kvferry_wire import report

from .conftest import Engines, MakeSidecar, sidecar_of
from .test_turns import (
    IMAGE_MESSAGE,
    LONG_QUESTION,
    Conversation,
    kv,
    outcome,
    prefill_bodies,
    releases_done,
    rider,
)


async def residency(client: TestClient) -> report.Report:
    resp = await client.get("/v1/residency")
    return report.decode(await resp.read())


def releases(engines: Engines) -> list[dict[str, Any]]:
    """Release requests P received: one token, nothing to pull."""
    return [b for b in prefill_bodies(engines) if (kv(b) or {}).get("remote_num_tokens") == 0]


# ------------------------------------------------------------------ KV identity


async def test_switching_model_does_not_pull_the_handle(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """Same ids under another model (an adapter): the handle only rides along to be
    released, P pulls nothing."""
    conv = Conversation(await make_sidecar(), session_id="s")
    await conv.ask(LONG_QUESTION)
    conv.fields["model"] = "adapter-b"
    resp, _ = await conv.ask("and then")
    assert outcome(resp) == "kv-mismatch"
    assert kv(prefill_bodies(engines)[-1]) == rider(engines.decode.handles[0])


async def test_other_cache_salt_does_not_pull_the_same_salt_does(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    conv = Conversation(await make_sidecar(), session_id="s", cache_salt="a")
    await conv.ask(LONG_QUESTION)
    conv.fields["cache_salt"] = "b"
    resp, _ = await conv.ask("and then")
    assert outcome(resp) == "kv-mismatch"
    resp, _ = await conv.ask("and more")  # salt b's own handle
    assert outcome(resp) == "reused"


async def test_changed_image_in_history_does_not_pull(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """Image placeholders tokenize alike whatever the image: the identity tells."""
    client = await make_sidecar()
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,Y2F0"}}
    first = {"role": "user", "content": [{"type": "text", "text": LONG_QUESTION}, image]}
    body = {"model": "m", "session_id": "s", "messages": [first]}
    assert (await client.post("/v1/chat/completions", json=body)).status == 200
    other = {**image, "image_url": {"url": "data:image/png;base64,ZG9n"}}
    edited = {"role": "user", "content": [{"type": "text", "text": LONG_QUESTION}, other]}
    answer = {"role": "assistant", "content": "fine thanks"}
    again = {**body, "messages": [edited, answer, {"role": "user", "content": "and then"}]}
    resp = await client.post("/v1/chat/completions", json=again)
    assert outcome(resp) == "kv-mismatch"


async def test_truncating_turn_keeps_no_handle_and_releases_ds(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """With truncate_prompt_tokens the engine may cut the prompt's head: the turn uses
    no handle, keeps none, and D's (pinned all the same) is released."""
    client = await make_sidecar()
    conv = Conversation(client, session_id="s", truncate_prompt_tokens=100)
    resp, _ = await conv.ask(LONG_QUESTION)
    assert resp.headers["X-Kvferry-Handle"] == "not-kept; reason=truncation"
    await releases_done(client)
    (released,) = releases(engines)
    assert kv(released) == rider(engines.decode.handles[0])
    assert len(sidecar_of(client).store) == 0


# ------------------------------------------------------------------ handle slots


async def test_parallel_conversations_of_one_user_each_reuse_their_handle(
    make_sidecar: MakeSidecar,
) -> None:
    """Under the user key, interleaved conversations no longer take (and misalign)
    each other's handle."""
    client = await make_sidecar()
    a = Conversation(client, user="u")
    b = Conversation(client, user="u")
    await a.ask(LONG_QUESTION)
    await b.ask("a different opening question of this other conversation")
    resp_a, _ = await a.ask("and then")
    resp_b, _ = await b.ask("and then")
    assert (outcome(resp_a), outcome(resp_b)) == ("reused", "reused")


async def test_sessions_sharing_a_preamble_each_reuse_their_handle(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """Without any key, conversations with the same opening share a routing key (and
    D's prefix cache) but not a handle: their histories part at the first answer."""
    client = await make_sidecar()
    a, b = Conversation(client), Conversation(client)
    engines.decode.reply = "answer for a"
    await a.ask(LONG_QUESTION)
    engines.decode.reply = "another answer for b"
    await b.ask(LONG_QUESTION)
    resp_a, _ = await a.ask("first follow up")
    resp_b, _ = await b.ask("second follow up")
    assert (outcome(resp_a), outcome(resp_b)) == ("reused", "reused")


# ------------------------------------------------------------------ release


async def test_misaligned_handle_rides_on_the_prefill_and_counts_as_released(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    client = await make_sidecar()
    conv = Conversation(client, session_id="s")
    await conv.ask(LONG_QUESTION)
    conv.messages[0]["content"] = "completely different words here"
    resp, _ = await conv.ask("and then")
    assert outcome(resp) == "misaligned"
    assert releases(engines) == [prefill_bodies(engines)[-1]]  # no request of its own
    rep = await residency(client)
    assert rep.releases.rider == 1 and rep.releases.request == 0
    assert rep.handles["misaligned"] == 1
    assert rep.pinned.handles == 1 and rep.pinned.unused_handles == 0  # the new one


async def test_superseded_handle_is_released(make_sidecar: MakeSidecar, engines: Engines) -> None:
    """Two answers for one slot (turns of a session that raced): the older handle is
    let go, not left pinned on D."""
    client = await make_sidecar()
    await Conversation(client, session_id="s").ask(LONG_QUESTION)
    sc = sidecar_of(client)
    (older,) = sc.store.values()
    newer = dataclasses.replace(older, params={**older.params, "remote_request_id": "newer"})
    sc.store.put(newer)
    await releases_done(client)
    (released,) = releases(engines)
    assert kv(released)["remote_request_id"] == older.params["remote_request_id"]


async def test_release_without_prefill_engine_stays_pinned_until_expiry(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """No P to release through: the handle is reported pinned (unused) until D's
    deadline, then gone from the figures."""
    client = await make_sidecar(skip_prefill_below_tokens=10)
    conv = Conversation(client, session_id="s")
    await conv.ask(LONG_QUESTION)
    sidecar_of(client).pool.update([])  # every prefill engine gone
    resp, _ = await conv.ask("and you")
    assert outcome(resp) == "skipped-prefill"
    await releases_done(client)
    rep = await residency(client)
    assert rep.pinned.unused_handles == 1 and rep.pinned.unused_blocks > 0
    assert rep.releases.unreleasable == 1
    engines.clock.advance(engines.decode.ttl + 1)
    rep = await residency(client)
    assert rep.pinned.unused_handles == 0


async def test_failed_release_is_counted_and_stays_pinned(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    client = await make_sidecar(skip_prefill_below_tokens=10)
    conv = Conversation(client, session_id="s")
    await conv.ask(LONG_QUESTION)
    for p in engines.prefill:
        p.fail_statuses = [500]
    await conv.ask("and you")
    await releases_done(client)
    rep = await residency(client)
    assert rep.releases.failed == 1 and rep.pinned.unused_handles == 1


async def test_streaming_remote_turn_on_032_pins_only_the_handle_it_keeps(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """vLLM 0.32 returns no handle on a stream: the turn's KV is read in a request that
    returns one (released once the turn is re-anchored) and the stream itself carries
    no kv_transfer_params, so D pins only the kept re-anchored handle."""
    engines.decode.version = "0.32.0"
    client = await make_sidecar()
    resp, _ = await Conversation(client, session_id="s", stream=True).ask(LONG_QUESTION)
    assert outcome(resp) == "no-handle"
    await releases_done(client)
    rep = await residency(client)
    assert rep.pinned.handles == 1 and rep.pinned.unused_handles == 0
    assert rep.releases.request == 1 and rep.releases.unreleasable == 0


async def test_streaming_media_turn_on_032_pins_nothing(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """A streamed turn with media cannot be re-anchored from its ids and keeps no
    handle: D read P's KV in a request whose handle is released, and the stream itself
    carried no kv_transfer_params, so D pins nothing for it."""
    engines.decode.version = "0.32.0"
    client = await make_sidecar()
    conv = Conversation(client, session_id="s", stream=True)
    conv.messages.append(IMAGE_MESSAGE)
    resp, _ = await conv.ask(LONG_QUESTION)
    assert outcome(resp) == "no-handle"
    assert [kv(s.body) is None for s in engines.decode.completions()] == [False, True]
    await releases_done(client)
    rep = await residency(client)
    assert rep.pinned.handles == 0 and rep.releases.request == 1
    assert rep.releases.unreleasable == 0


async def test_stopping_sidecar_releases_the_handles_it_held(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    client = await make_sidecar()
    await Conversation(client, session_id="s").ask(LONG_QUESTION)
    await client.close()
    (released,) = releases(engines)
    assert kv(released) == rider(engines.decode.handles[0])


# ------------------------------------------------------------------ what D holds


async def test_expired_handle_short_tail_is_served_from_decodes_prefix_cache(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """After the handle expired, D's KV events still show the prefix in its prefix
    cache: a short tail is prefilled by D alone (new outcome), P is not asked."""
    client = await make_sidecar(skip_prefill_below_tokens=10, kv_events="tcp://127.0.0.1:9")
    conv = Conversation(client, session_id="s")
    await conv.ask(LONG_QUESTION)
    engines.clock.advance(engines.decode.ttl)  # past expiry - margin
    sidecar_of(client).store.purge_expired()
    conv.messages.append({"role": "user", "content": "and you"})
    held = chat_ids(conv.messages)[:16]  # D's cache: the first 4 blocks of 4 tokens
    index = sidecar_of(client).kv_index
    index.accept(0, Batch(0.0, (Stored(tuple(prefix_block_hashes(held, 4)), 16, 4, "GPU"),)))
    conv.messages.pop()
    calls = engines.prefill_calls()
    resp, _ = await conv.ask("and you")
    assert outcome(resp) == "cached-on-decode"
    assert resp.headers["X-Kvferry-Route"] == "skip"
    assert resp.headers["X-Kvferry-Reused-Tokens"] == "16"
    assert engines.prefill_calls() == calls


async def test_decode_cache_is_not_consulted_for_salted_prompts(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """A salted prompt's blocks hash with the salt: the plain hashes prove nothing."""
    client = await make_sidecar(skip_prefill_below_tokens=10)
    conv = Conversation(client, session_id="s", cache_salt="t")
    held = chat_ids([{"role": "user", "content": LONG_QUESTION}])[:12]
    index = sidecar_of(client).kv_index
    index.accept(0, Batch(0.0, (Stored(tuple(prefix_block_hashes(held, 4)), 12, 4, "GPU"),)))
    resp, _ = await conv.ask(LONG_QUESTION)
    assert outcome(resp) == "no-handle"


async def test_decode_cache_is_not_consulted_when_hashes_are_not_reproducible(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """An engine hashing blocks with another algorithm: its KV events' hashes cannot be
    matched, so a short tail after an expired handle goes to P as before."""
    engines.decode.hash_algo = "sha256"
    client = await make_sidecar(skip_prefill_below_tokens=10)
    conv = Conversation(client, session_id="s")
    await conv.ask(LONG_QUESTION)
    engines.clock.advance(engines.decode.ttl)
    sidecar_of(client).store.purge_expired()
    conv.messages.append({"role": "user", "content": "and you"})
    held = chat_ids(conv.messages)[:16]
    index = sidecar_of(client).kv_index
    index.accept(0, Batch(0.0, (Stored(tuple(prefix_block_hashes(held, 4)), 16, 4, "GPU"),)))
    conv.messages.pop()
    resp, _ = await conv.ask("and you")
    assert outcome(resp) == "expired"


async def test_waiting_release_rides_on_the_next_prefill_of_any_session(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """A handle dropped unread waits for a prefill this sidecar sends anyway and rides
    on it: no release request of its own (which would cost P a block for its lease)."""
    client = await make_sidecar(skip_prefill_below_tokens=10, release_after_seconds=30.0)
    conv = Conversation(client, session_id="s")
    await conv.ask(LONG_QUESTION)
    resp, _ = await conv.ask("and you")  # skip-prefill: turn 1's handle goes unread
    assert outcome(resp) == "skipped-prefill"
    calls = engines.prefill_calls()
    resp, _ = await Conversation(client, session_id="other").ask(LONG_QUESTION)
    assert engines.prefill_calls() == calls + 1  # the other session's prefill only
    assert kv(prefill_bodies(engines)[-1]) == rider(engines.decode.handles[0])
    rep = await residency(client)
    assert rep.releases.rider == 1 and rep.releases.request == 0
    assert rep.pinned.unused_handles == 0
