"""Handles bound to their owner, the client the gateway authenticated (issue 20, items
7 and 8): the real sidecar against the fake engines (kvferry_dev/fakeengines.py).

With ``owner_header`` set, a handle is filed and found under (owner, key): another
owner's ``session_id`` finds nothing and spoils nothing, a turn without a valid owner
neither uses nor keeps a handle, and each owner has its own caps, past which it loses
its own oldest handle (released through P), never another owner's."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from multidict import CIMultiDict

from kvferry_sidecar import config, owners
from kvferry_wire import report
from kvferry_wire import settings as wire_settings

from .conftest import Engines, MakeSidecar, post_raw, sidecar_of
from .test_turns import (
    LONG_QUESTION,
    Conversation,
    kv,
    outcome,
    prefill_bodies,
    releases_done,
    rider,
)

HEADER = "X-Authenticated-User"
ALICE = {HEADER: "alice@example.com"}
BOB = {HEADER: "bob@example.com"}


async def owners_sidecar(make_sidecar: MakeSidecar, **overrides: Any) -> TestClient:
    return await make_sidecar(owner_header=HEADER, **overrides)


class Owned(Conversation):
    """A conversation whose every turn carries the owner header the gateway set."""

    def __init__(self, client: TestClient, owner: dict[str, str], **fields: Any) -> None:
        super().__init__(client, **fields)
        self.owner = owner

    async def ask(self, text: str, *, headers: dict[str, str] | None = None, **extra: Any):
        return await super().ask(text, headers={**self.owner, **(headers or {})}, **extra)


def pulls(body: dict[str, Any]) -> bool:
    params = kv(body) or {}
    return bool(params.get("remote_block_ids")) and params.get("remote_num_tokens") != 0


async def residency(client: TestClient) -> report.Report:
    resp = await client.get("/v1/residency")
    return report.decode(await resp.read())


# ------------------------------------------------------------------ item 8: bound handles


async def test_another_owner_with_the_same_session_id_finds_nothing_and_spoils_nothing(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """B sends A's session_id: P's request carries none of A's handle, and A's next
    turn still pulls it. (Without owners, B took A's handle: A lost reuse.)"""
    client = await owners_sidecar(make_sidecar)
    alice = Owned(client, ALICE, session_id="s")
    await alice.ask(LONG_QUESTION)
    (alices_handle,) = [h for h in engines.decode.handles if h]
    bob = Owned(client, BOB, session_id="s")
    resp, _ = await bob.ask(LONG_QUESTION + " and then")
    assert resp.status == 200
    assert outcome(resp) == "no-handle"
    bobs_prefill = prefill_bodies(engines)[-1]
    assert kv(bobs_prefill) != alices_handle
    assert (kv(bobs_prefill) or {}).get("remote_request_id") != alices_handle["remote_request_id"]
    resp, _ = await alice.ask("and then")
    assert outcome(resp) == "reused"
    assert (
        kv(prefill_bodies(engines)[-1])["remote_request_id"] == (alices_handle["remote_request_id"])
    )


async def test_the_same_owner_on_another_turn_finds_its_own_handle(
    make_sidecar: MakeSidecar,
) -> None:
    client = await owners_sidecar(make_sidecar)
    alice = Owned(client, ALICE, session_id="s")
    await alice.ask(LONG_QUESTION)
    resp, _ = await alice.ask("and then")
    assert outcome(resp) == "reused"


@pytest.mark.parametrize(
    "headers",
    [{}, {HEADER: ""}, {HEADER: "   "}, {HEADER: "a" * 257}, {HEADER: "ali\u00e7e"}],
    ids=["missing", "empty", "blank", "oversize", "non-ascii"],
)
async def test_a_turn_without_a_valid_owner_neither_uses_nor_keeps_a_handle(
    make_sidecar: MakeSidecar, engines: Engines, headers: dict[str, str]
) -> None:
    """Outcome no-owner, counted as such; P gets no handle to pull, the turn keeps
    none, and the owner's own handle under the same session_id is untouched."""
    client = await owners_sidecar(make_sidecar)
    alice = Owned(client, ALICE, session_id="s")
    await alice.ask(LONG_QUESTION)
    anonymous = Owned(client, headers, session_id="s")
    resp, _ = await anonymous.ask(LONG_QUESTION + " and then")
    assert resp.status == 200
    assert outcome(resp) == "no-owner"
    assert resp.headers["X-Kvferry-Handle"] == "not-kept; reason=no-owner"
    assert not pulls(prefill_bodies(engines)[-1])
    await releases_done(client)
    rep = await residency(client)
    assert rep.outcomes.get("no-owner") == 1
    resp, _ = await alice.ask("and then")
    assert outcome(resp) == "reused"


async def test_the_owner_header_never_reaches_the_engines(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    client = await owners_sidecar(make_sidecar)
    alice = Owned(client, ALICE, session_id="s")
    await alice.ask(LONG_QUESTION)
    await alice.ask("and then")
    seen = [s for e in (*engines.prefill, engines.decode) for s in e.seen]
    assert seen
    assert all(HEADER not in s.headers for s in seen)
    assert all(ALICE[HEADER] not in str(s.body) for s in seen)


async def test_the_raw_owner_is_never_logged(
    make_sidecar: MakeSidecar, caplog: pytest.LogCaptureFixture
) -> None:
    """The turn log names the owner by a keyed digest only."""
    caplog.set_level(logging.DEBUG)
    client = await owners_sidecar(make_sidecar)
    alice = Owned(client, ALICE, session_id="s")
    await alice.ask(LONG_QUESTION)
    await alice.ask("and then")
    turns = [r.getMessage() for r in caplog.records if r.getMessage().startswith("turn ")]
    assert len(turns) == 2
    assert all(" owner=own-" in line for line in turns)
    assert not any(ALICE[HEADER] in r.getMessage() for r in caplog.records)


async def test_without_an_owner_header_setting_sessions_are_shared_as_before(
    make_sidecar: MakeSidecar,
) -> None:
    """Owners off (the default): the header means nothing, one store for everyone."""
    client = await make_sidecar()
    await Owned(client, ALICE, session_id="s").ask(LONG_QUESTION)
    resp, _ = await Owned(client, BOB, session_id="s").ask(LONG_QUESTION + " and then")
    assert outcome(resp) == "reused"


# ------------------------------------------------------------------ item 7: per-owner caps


async def test_an_owner_over_its_handle_cap_loses_one_of_its_own_handles_released_on_p(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """Alice's third handle puts her over her cap of two: one of her earlier ones goes
    (the lowest value, retention.py), never bob's and never the one just stored."""
    client = await owners_sidecar(make_sidecar, owner_max_handles=2)
    bobs = Owned(client, BOB, session_id="b1")
    await bobs.ask(LONG_QUESTION)
    alices = [Owned(client, ALICE, session_id=f"a{i}") for i in range(3)]
    for conv in alices:
        await conv.ask(LONG_QUESTION)
    # Decode handles by turn: bob's, then alice's a0, a1, a2.
    _, a0_handle, a1_handle, _ = [h for h in engines.decode.handles if h]
    await releases_done(client)
    released = [
        kv(b) for b in prefill_bodies(engines) if (kv(b) or {}).get("remote_num_tokens") == 0
    ]
    assert released in ([rider(a0_handle)], [rider(a1_handle)])
    victim = 0 if released == [rider(a0_handle)] else 1
    rep = await residency(client)
    assert rep.evictions == report.Evictions(owner_handles=1)
    assert rep.handles.get("evicted") == 1
    for conv in (bobs, alices[1 - victim], alices[2]):
        resp, _ = await conv.ask("and then")
        assert outcome(resp) == "reused"
    resp, _ = await alices[victim].ask("and then")
    assert outcome(resp) == "no-handle"


async def test_an_owner_over_its_token_cap_loses_one_of_its_own_earlier_handles(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """Each first turn pins 14 tokens (a 13-token prompt and a 2-token answer, less the
    last token, which has no KV): a cap of 30 holds two of alice's handles, not three;
    the one that goes is an earlier one of hers (the lowest value), never bob's."""
    client = await owners_sidecar(make_sidecar, owner_max_pinned_tokens=30)
    bobs = Owned(client, BOB, session_id="b1")
    await bobs.ask(LONG_QUESTION)
    alices = [Owned(client, ALICE, session_id=f"a{i}") for i in range(3)]
    for conv in alices:
        await conv.ask(LONG_QUESTION)
    await releases_done(client)
    rep = await residency(client)
    assert rep.evictions == report.Evictions(owner_tokens=1)
    store = sidecar_of(client).store
    assert len(store) == 3  # bob's and two of alice's
    resp, _ = await bobs.ask("and then")
    assert outcome(resp) == "reused"
    resp, _ = await alices[2].ask("and then")
    assert outcome(resp) == "reused"


async def test_a_handle_alone_over_its_owners_token_cap_is_not_kept(
    make_sidecar: MakeSidecar,
) -> None:
    """Released at once, and the turn says it kept nothing (not-kept owner-tokens)."""
    client = await owners_sidecar(make_sidecar, owner_max_pinned_tokens=10)
    await Owned(client, ALICE, session_id="a0").ask(LONG_QUESTION)
    await releases_done(client)
    assert len(sidecar_of(client).store) == 0
    text = await (await client.get("/metrics")).text()
    assert 'kvferry_handles_not_kept_total{reason="owner-tokens"} 1.0' in text
    assert (await residency(client)).releases.request == 1


async def test_evictions_are_exported_by_reason(make_sidecar: MakeSidecar) -> None:
    client = await owners_sidecar(make_sidecar, owner_max_handles=1, handle_store_cap=2)
    await Owned(client, ALICE, session_id="a0").ask(LONG_QUESTION)
    await Owned(client, ALICE, session_id="a1").ask(LONG_QUESTION)  # owner cap
    await Owned(client, BOB, session_id="b0").ask(LONG_QUESTION)
    await Owned(client, {HEADER: "carol"}, session_id="c0").ask(LONG_QUESTION)  # store cap
    await releases_done(client)
    text = await (await client.get("/metrics")).text()
    assert 'kvferry_handle_evictions_total{reason="owner-handles"} 1.0' in text
    assert 'kvferry_handle_evictions_total{reason="store-cap"} 1.0' in text
    assert 'kvferry_handle_evictions_total{reason="owner-tokens"} 0.0' in text
    assert len(sidecar_of(client).store) == 2


async def test_the_store_cap_alone_still_evicts_without_owners(make_sidecar: MakeSidecar) -> None:
    client = await make_sidecar(handle_store_cap=1)
    await Conversation(client, session_id="s0").ask(LONG_QUESTION)
    await Conversation(client, session_id="s1").ask(LONG_QUESTION)
    await releases_done(client)
    rep = await residency(client)
    assert rep.evictions == report.Evictions(store_cap=1)


# ------------------------------------------------------------------ the rules, pure

RULE = owners.Rule(HEADER, b"k" * 16)


def test_the_owner_tag_is_keyed_so_a_guess_cannot_be_confirmed_by_hashing() -> None:
    other = owners.Rule(HEADER, b"j" * 16)
    assert owners.read_owner(ALICE, RULE) == owners.read_owner(ALICE, RULE)
    assert owners.read_owner(ALICE, RULE) != owners.read_owner(ALICE, other)
    assert owners.read_owner(ALICE, RULE) != owners.read_owner(BOB, RULE)
    tag = owners.read_owner(ALICE, RULE)
    assert tag is not None and tag.startswith("own-") and "alice" not in tag


def test_an_owner_is_read_stripped_and_up_to_its_length_limit() -> None:
    assert owners.read_owner({HEADER: "  alice  "}, RULE) == owners.read_owner(
        {HEADER: "alice"}, RULE
    )
    assert owners.read_owner({HEADER: "a" * owners.MAX_OWNER_CHARS}, RULE) is not None
    assert owners.read_owner({HEADER: "a\x00b"}, RULE) is None


def test_an_owner_header_sent_twice_is_no_owner() -> None:
    """A gateway that appends its value leaves the client's first: neither counts."""
    twice = CIMultiDict([(HEADER, "mallory"), (HEADER.lower(), "alice")])
    assert owners.read_owner(twice, RULE) is None
    assert owners.read_owner(CIMultiDict([(HEADER, "alice")]), RULE) is not None


async def test_a_turn_with_the_owner_header_twice_gets_no_owner(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    client = await owners_sidecar(make_sidecar)
    alice = Owned(client, ALICE, session_id="s")
    await alice.ask(LONG_QUESTION)
    head = {HEADER: b"mallory", HEADER.lower(): b"alice@example.com"}
    messages = [{"role": "user", "content": LONG_QUESTION + " and then"}]
    body = json.dumps({"model": "m", "session_id": "s", "messages": messages}).encode()
    status, rest = await post_raw(client, "/v1/chat/completions", head, body)
    assert status == 200
    assert b"X-Kvferry-Outcome: no-owner" in rest
    assert not pulls(prefill_bodies(engines)[-1])


def test_unset_caps_are_an_eighth_of_the_store_and_of_ds_kv() -> None:
    assert owners.caps(1024, None, None, 80_000) == owners.Caps(128, 10_000)
    assert owners.caps(1024, None, None, None) == owners.Caps(128, None)
    assert owners.caps(4, None, None, 3) == owners.Caps(1, 1)
    assert owners.caps(1024, 5, 6, 80_000) == owners.Caps(5, 6)
    # Never below one full-length conversation (a small KV: 4,500 tokens, 4,096 long).
    assert owners.caps(1024, None, None, 4_500, 4_096) == owners.Caps(128, 4_096)
    assert owners.caps(1024, None, None, 80_000, 4_096) == owners.Caps(128, 10_000)
    assert owners.caps(1024, None, 6, 4_500, 4_096) == owners.Caps(128, 6)  # as set


async def test_the_token_cap_follows_ds_kv_size_from_its_metrics(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    client = await owners_sidecar(make_sidecar)
    blocks, size = engines.decode.num_gpu_blocks, engines.decode.block_size
    context = sidecar_of(client).local.info.max_model_len or 0
    expected = max(blocks * size // 8, context)
    assert sidecar_of(client).owner_caps() == owners.Caps(128, expected)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"owner_header": "X Bad"}, "owner_header must be a header name"),
        ({"owner_header": "X-Kvferry-Owner"}, "one of the sidecar's own headers"),
        ({"owner_header": HEADER, "owner_max_handles": 0}, "owner_max_handles must be >= 1"),
        (
            {"owner_header": HEADER, "owner_max_pinned_tokens": 0},
            "owner_max_pinned_tokens must be >= 1",
        ),
    ],
)
def test_bad_owner_settings_are_refused_naming_the_setting(
    overrides: dict[str, Any], message: str
) -> None:
    with pytest.raises(config.ConfigError, match=message):
        config.validate(config.Settings(**overrides))


def test_owner_settings_come_from_the_file_the_environment_and_flags() -> None:
    env = {"KVFERRY_OWNER_HEADER": HEADER, "KVFERRY_OWNER_MAX_HANDLES": "3"}
    built = config.build({"owner_max_pinned_tokens": "900"}, env=env)
    assert (built.owner_header, built.owner_max_handles, built.owner_max_pinned_tokens) == (
        HEADER,
        3,
        900,
    )
    decoded = wire_settings.decode_file({"ownerHeader": HEADER, "ownerMaxHandles": 4}, "f")
    assert wire_settings.given(decoded) == {"owner_header": HEADER, "owner_max_handles": 4}
