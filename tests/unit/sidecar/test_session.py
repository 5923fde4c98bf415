"""Session keys (configured order) and owner hashing (rendezvous over ordinals)."""

from __future__ import annotations

from collections import Counter

import pytest

from kvferry_sidecar.config import DEFAULT_SESSION_KEYS
from kvferry_sidecar.session import (
    handle_slot,
    invalid_text_field,
    next_handle_slot,
    owner,
    refines_slot,
    session_key,
    session_tag,
)

SYSTEM = {"role": "system", "content": "be brief"}
Q1 = {"role": "user", "content": "hello"}
A1 = {"role": "assistant", "content": "hi"}
Q2 = {"role": "user", "content": "more"}


@pytest.mark.parametrize(
    ("body", "headers", "expected"),
    [
        pytest.param(
            {"session_id": "s", "conversation_id": "c", "user": "u"},
            {},
            "session_id=s",
            id="session_id-first",
        ),
        pytest.param(
            {"conversation_id": "c", "user": "u"},
            {},
            "conversation_id=c",
            id="conversation_id-second",
        ),
        pytest.param({"user": "u"}, {"X-Session-Id": "h"}, "header:X-Session-Id=h", id="header"),
        pytest.param({"user": "u"}, {}, "user=u", id="user-last"),
        pytest.param({"session_id": "", "user": "u"}, {}, "user=u", id="empty-is-absent"),
        pytest.param({"session_id": {"x": 1}, "user": "u"}, {}, "user=u", id="object-is-absent"),
    ],
)
def test_session_key_order(body: dict, headers: dict, expected: str) -> None:
    """The first present source in the configured order names the session."""
    assert session_key(body, headers, DEFAULT_SESSION_KEYS) == expected


@pytest.mark.parametrize("body_key", ["session_id", "conversation_id", "user"])
def test_a_session_header_wins_over_every_body_key(body_key: str) -> None:
    """Issue 38 (7): a gateway that sets X-Session-Id decides the session, not the
    client's body. Before, ``session_id`` (first in the default order) won, so a client
    behind such a gateway picked any session it liked by sending one; the body's key
    is ignored, not merged (the key names the header's session alone)."""
    body = {body_key: "someone-else", "model": "m"}
    headers = {"X-Session-Id": "gw-set"}
    assert session_key(body, headers, DEFAULT_SESSION_KEYS) == "header:X-Session-Id=gw-set"
    assert (
        session_key(
            {**body, "session_id": "x", "conversation_id": "y"}, headers, DEFAULT_SESSION_KEYS
        )
        == "header:X-Session-Id=gw-set"
    )


def test_a_header_key_wins_wherever_it_stands_in_the_order() -> None:
    """A header key configured last still wins when the header is there (a body key
    can never outrank what the gateway set); without the header the body keys decide
    in their configured order, and the first header present wins among headers."""
    order = ["user", "session_id", "header:X-Tenant-Session", "header:X-Session-Id"]
    body = {"user": "u", "session_id": "s"}
    assert session_key(body, {"X-Session-Id": "h"}, order) == "header:X-Session-Id=h"
    both = {"X-Session-Id": "h", "X-Tenant-Session": "t"}
    assert session_key(body, both, order) == "header:X-Tenant-Session=t"
    assert session_key(body, {}, order) == "user=u"
    assert session_key(body, {"X-Session-Id": "  "}, order) == "user=u"


def test_session_key_order_is_configurable() -> None:
    """A custom order is honoured (user before session_id here)."""
    body = {"session_id": "s", "user": "u"}
    assert session_key(body, {}, ["user", "session_id"]) == "user=u"


def test_session_key_fallback_stable_as_conversation_grows() -> None:
    """Without a key, turn 1 and turn 2 of one conversation get the same key."""
    # Bug prevented: keying on "the first two messages" changes the key at turn 2
    # (assistant reply joins the head), so the handle is never found.
    turn1 = {"model": "m", "messages": [SYSTEM, Q1]}
    turn2 = {"model": "m", "messages": [SYSTEM, Q1, A1, Q2]}
    assert session_key(turn1, {}, DEFAULT_SESSION_KEYS) == session_key(
        turn2, {}, DEFAULT_SESSION_KEYS
    )


def test_session_key_fallback_differs_by_model_and_opening() -> None:
    """The fallback key separates models and different opening questions."""
    a = session_key({"model": "m", "messages": [Q1]}, {}, ())
    b = session_key({"model": "n", "messages": [Q1]}, {}, ())
    c = session_key({"model": "m", "messages": [Q2]}, {}, ())
    assert len({a, b, c}) == 3


def test_session_key_fallback_for_completions_prompt() -> None:
    """A completions prompt is keyed by its start, so a growing prompt keeps its key."""
    head = "x " * 400
    a = session_key({"model": "m", "prompt": head + "one"}, {}, ())
    b = session_key({"model": "m", "prompt": head + "one two three"}, {}, ())
    assert a == b


def test_session_tag_hides_key() -> None:
    """The tag used in logs and engine session_id does not contain the raw key."""
    tag = session_tag("user=alice@example.com")
    assert "alice" not in tag
    assert tag == session_tag("user=alice@example.com")


# ------------------------------------------------------------------ owner

# Pinned values: a change of hash function or ring rule would move every live
# session to another pod (all handles lost at once). Change them only on purpose.
PINNED_OWNERS = {
    ("session_id=a", 4): 3,
    ("session_id=b", 4): 0,
    ("session_id=c", 4): 0,
    ("user=alice", 3): 0,
    ("user=bob", 8): 5,
}


@pytest.mark.parametrize(("key", "ring"), list(PINNED_OWNERS))
def test_owner_hashing_stable(key: str, ring: int) -> None:
    """Owners are fixed values, independent of process and PYTHONHASHSEED."""
    assert owner(key, ring) == PINNED_OWNERS[(key, ring)]


def test_owner_single_pod_owns_everything() -> None:
    assert owner("session_id=x", 1) == 0


def test_owner_scale_up_moves_only_sessions_to_new_pod() -> None:
    """Growing the ring from 4 to 5 moves sessions only to ordinal 4, about a fifth."""
    keys = [f"session_id={i}" for i in range(2000)]
    moved = [k for k in keys if owner(k, 4) != owner(k, 5)]
    assert all(owner(k, 5) == 4 for k in moved)
    assert 300 < len(moved) < 500


def test_owner_spreads_sessions_evenly() -> None:
    """Each of 4 owners gets a fair share of 4000 sessions (within 20%)."""
    counts = Counter(owner(f"user={i}", 4) for i in range(4000))
    assert set(counts) == {0, 1, 2, 3}
    assert all(800 < c < 1200 for c in counts.values())


# ------------------------------------------------------------------ handle slots


def test_conversation_keys_are_their_own_slot() -> None:
    """A session_id names one conversation: its handle is kept under the key."""
    key = "session_id=s"
    assert not refines_slot(key)
    body = {"messages": [SYSTEM, Q1, A1, Q2]}
    assert handle_slot(key, body) == session_tag(key) == next_handle_slot(key, body, "x")


@pytest.mark.parametrize("key", ["user=u", "auto:abc"])
def test_next_turn_finds_the_slot_its_predecessor_filled(key: str) -> None:
    """Under user and fallback keys the slot follows the conversation: turn N files its
    handle where turn N+1 (its messages + the echoed answer + a new message) looks."""
    turn1 = {"messages": [SYSTEM, Q1]}
    filed = next_handle_slot(key, turn1, "hi there ")
    turn2 = {"messages": [SYSTEM, Q1, {"role": "assistant", "content": "hi there"}, Q2]}
    assert handle_slot(key, turn2) == filed
    # An agent loop: the next request ends with a tool result, not a user message.
    call = {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}
    result = {"role": "tool", "content": "42", "tool_call_id": "1"}
    filed = next_handle_slot(key, turn2, "")
    assert handle_slot(key, {"messages": [*turn2["messages"], call, result]}) == filed


@pytest.mark.parametrize("key", ["session_id=s", "user=u", "auto:abc"])
def test_slots_are_bound_to_their_owner(key: str) -> None:
    """With owners, one key under two owners names two slots, and each owner's next
    turn finds the slot its own predecessor filled; no owner keeps the slot as before."""
    turn1 = {"messages": [SYSTEM, Q1]}
    turn2 = {"messages": [SYSTEM, Q1, {"role": "assistant", "content": "hi there"}, Q2]}
    filed = {o: next_handle_slot(key, turn1, "hi there", o) for o in ("own-a", "own-b")}
    assert filed["own-a"] != filed["own-b"]
    assert {o: handle_slot(key, turn2, o) for o in filed} == filed
    assert handle_slot(key, turn2) == next_handle_slot(key, turn1, "hi there")
    assert handle_slot(key, turn2) not in filed.values()


def test_parallel_conversations_of_one_user_have_their_own_slots() -> None:
    """Two conversations of one user (one routing key) keep separate handles."""
    a = next_handle_slot("user=u", {"messages": [Q1]}, "answer a")
    b = next_handle_slot("user=u", {"messages": [Q2]}, "answer b")
    assert a != b
    assert session_key({"user": "u", "messages": [Q1]}, {}, DEFAULT_SESSION_KEYS) == "user=u"


# ------------------------------------------------------------------ client text

LONE = "a\ud800b"  # a lone surrogate: JSON's "\ud800", or a header's non-UTF-8 bytes


@pytest.mark.parametrize(
    ("body", "headers", "field"),
    [
        ({"session_id": LONE}, {}, "session_id"),
        ({"conversation_id": LONE}, {}, "conversation_id"),
        ({"user": LONE}, {}, "user"),
        ({}, {"X-Session-Id": "\udcff"}, "X-Session-Id"),
        ({"model": LONE}, {}, "model"),
        ({"session_id": "s", "model": LONE}, {}, "model"),  # the model names the KV too
        ({"session_id": "s", "cache_salt": LONE}, {}, "cache_salt"),
        ({"session_id": "s", "model": "m", "user": "u"}, {"X-Session-Id": "h"}, None),
        ({"session_id": 5, "model": ["m"]}, {}, None),  # not text: the engine's to judge
        ({"messages": [{"role": "user", "content": LONE}], "prompt": LONE}, {}, None),
    ],
)
def test_invalid_text_field_names_the_key_or_model_that_is_no_unicode(
    body: dict, headers: dict, field: str | None
) -> None:
    assert invalid_text_field(body, headers, DEFAULT_SESSION_KEYS) == field


def test_digests_are_total_over_client_text() -> None:
    """Prompt and message text are the engine's to judge: the fallback key and the
    slot digests take any str. Bug prevented: a lone surrogate in a prompt was a 500."""
    chat = {"model": "m", "messages": [SYSTEM, {"role": "user", "content": LONE}]}
    key = session_key(chat, {}, DEFAULT_SESSION_KEYS)
    assert key != session_key({**chat, "messages": [SYSTEM, Q1]}, {}, DEFAULT_SESSION_KEYS)
    assert handle_slot(key, chat) != next_handle_slot(key, chat, LONE)
    prompt = session_key({"model": "m", "prompt": LONE}, {}, DEFAULT_SESSION_KEYS)
    assert prompt.startswith("auto:") and owner(prompt, 3) in range(3)
