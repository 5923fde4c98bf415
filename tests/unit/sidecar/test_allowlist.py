"""The allowlist rule: a turn reuses KV only when every request field is known not to
change the rendered prompt or its KV (or is part of the KV identity); any other field,
one vLLM adds next release included, turns reuse off for that turn, with its own
outcome. Against the fake engines (kvferry_dev/fakeengines.py), which record what P
was asked to pull."""

from __future__ import annotations

from typing import Any

import pytest

from kvferry_sidecar import allowlist, identity, rewrite
from kvferry_sidecar.types import Api
from kvferry_wire import report
from kvferry_wire.protocol import Outcome

from .conftest import Engines, MakeSidecar
from .test_turns import LONG_QUESTION, Conversation, kv, outcome, prefill_bodies

TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]


def pulls(body: dict[str, Any]) -> bool:
    """The prefill request asks P to read KV from D (a handle sent only to be
    released carries ``remote_num_tokens: 0``)."""
    params = kv(body) or {}
    return bool(params.get("remote_block_ids")) and params.get("remote_num_tokens") != 0


def pulled(engines: Engines) -> bool:
    """The last prefill request pulled."""
    return pulls(prefill_bodies(engines)[-1])


# Fields of vLLM 0.32's ChatCompletionRequest that change neither the rendered prompt
# nor its KV (sampling and output options), or that the sidecar sends to /tokenize too.
REUSABLE: list[dict[str, Any]] = [
    {"temperature": 0.2},
    {"top_p": 0.9},
    {"max_tokens": 16},
    {"max_completion_tokens": 16},
    {"stop": ["\n"]},
    {"logprobs": True, "top_logprobs": 2},
    {"seed": 7},
    {"stream": False},
    {"user": "u-1"},
    {"priority": 0},
    {"repetition_penalty": 1.1},
    {"structured_outputs": {"regex": "[a-z]+"}},
    {"tools": TOOLS},
    {"tools": TOOLS, "tool_choice": "auto"},
    {"tool_choice": "none"},  # without tools vLLM collapses it before rendering
    {"chat_template_kwargs": {"enable_thinking": False}},
    {"add_generation_prompt": True},
    {"kv_transfer_params": {"do_remote_prefill": True}},  # stripped: the sidecar's own
]

# Fields that change what the chat endpoint renders (or the media behind it) while
# vLLM's /tokenize ignores them, and a field no vLLM has yet.
UNSAFE: list[dict[str, Any]] = [
    {"future_field": 1},
    {"media_io_kwargs": {"video": {"num_frames": 8}}},
    {"documents": [{"title": "t", "text": "a document"}]},
    {"reasoning_effort": "low"},
    {"tools": TOOLS, "tool_choice": "none"},  # --exclude-tools-when-tool-choice-none
    {"tools": TOOLS, "tool_choice": "required"},
    {"response_format": {"type": "json_object"}},
    {"ec_transfer_params": {"x": 1}},
]


def _id(fields: dict[str, Any]) -> str:
    return ",".join(f"{k}={v!r}"[:40] for k, v in fields.items())


@pytest.mark.parametrize("extra", REUSABLE, ids=_id)
async def test_allowlisted_fields_reuse(
    make_sidecar: MakeSidecar, engines: Engines, extra: dict[str, Any]
) -> None:
    conv = Conversation(await make_sidecar(), session_id="s", **extra)
    await conv.ask(LONG_QUESTION)
    resp, _ = await conv.ask("and then")
    assert resp.status == 200
    assert outcome(resp) == "reused"
    assert pulled(engines)


@pytest.mark.parametrize(
    ("keys", "extra"),
    [
        (None, {"conversation_id": "c"}),  # a default session key
        (("thread", "session_id"), {"thread": "t"}),
    ],
)
async def test_the_sidecars_own_session_key_fields_reuse(
    make_sidecar: MakeSidecar, engines: Engines, keys: Any, extra: dict[str, Any]
) -> None:
    """A body field the sidecar reads its session key from is the sidecar's: vLLM
    ignores it, it renders nothing."""
    settings = {} if keys is None else {"session_keys": keys}
    conv = Conversation(await make_sidecar(**settings), **extra)
    await conv.ask(LONG_QUESTION)
    resp, _ = await conv.ask("and then")
    assert outcome(resp) == "reused"
    assert pulled(engines)


@pytest.mark.parametrize("extra", UNSAFE, ids=_id)
async def test_fields_off_the_allowlist_turn_reuse_off(
    make_sidecar: MakeSidecar, engines: Engines, extra: dict[str, Any]
) -> None:
    """Turn 2 carries the field: no pull. It keeps no handle either (its KV may not be
    what its ids say), so turn 3 without the field finds none."""
    conv = Conversation(await make_sidecar(), session_id="s")
    await conv.ask(LONG_QUESTION)
    resp, _ = await conv.ask("and then", **extra)
    assert resp.status == 200
    assert outcome(resp) == "unsafe-field"
    assert not pulled(engines)
    assert "X-Kvferry-Handle" in resp.headers
    resp, _ = await conv.ask("and more")
    assert outcome(resp) == "no-handle"


async def test_unsafe_field_on_every_turn_never_pulls(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    conv = Conversation(await make_sidecar(), session_id="s", reasoning_effort="high")
    for text in (LONG_QUESTION, "and then", "and more"):
        resp, _ = await conv.ask(text)
        assert outcome(resp) == "unsafe-field"
    bodies = prefill_bodies(engines)
    assert len(bodies) >= 3
    assert not any(pulls(b) for b in bodies)


async def test_short_unsafe_turn_is_ds_alone_with_no_transfer(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """Below skipPrefillBelowTokens D prefills an unsafe turn alone, as any short
    turn, but as a plain request (kv params an explicit null): no handle to keep."""
    conv = Conversation(await make_sidecar(skip_prefill_below_tokens=256), session_id="s")
    resp, _ = await conv.ask("hi", documents=[{"text": "d"}])
    assert outcome(resp) == "unsafe-field"
    assert resp.headers["X-Kvferry-Handle"] == "not-kept; reason=unsafe-field"
    assert engines.prefill_calls() == 0
    d_body = engines.decode.last().body
    assert "kv_transfer_params" in d_body and d_body["kv_transfer_params"] is None


async def test_unknown_completions_field_turns_reuse_off(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    client = await make_sidecar()
    body = {"model": "m", "session_id": "s", "prompt": LONG_QUESTION}
    first = await client.post("/v1/completions", json=body)
    answer = (await first.json())["choices"][0]["text"]
    again = {**body, "prompt": LONG_QUESTION + answer + " and then", "future_field": True}
    resp = await client.post("/v1/completions", json=again)
    assert outcome(resp) == "unsafe-field"
    assert not pulled(engines)


async def test_unsafe_turns_are_counted_in_the_report(make_sidecar: MakeSidecar) -> None:
    """The outcome is part of the report's vocabulary: the operator decodes it."""
    client = await make_sidecar()
    conv = Conversation(client, session_id="s")
    await conv.ask(LONG_QUESTION)
    await conv.ask("and then", documents=[{"text": "d"}])
    rep = report.decode(await (await client.get("/v1/residency")).read())
    assert rep.outcomes.get("unsafe-field") == 1
    metrics = await (await client.get("/metrics")).text()
    assert 'kvferry_turns_total{outcome="unsafe-field"' in metrics


# ------------------------------------------------------------------ media


def _image_turns(url: str, other_url: str | None = None) -> list[dict[str, Any]]:
    def user(u: str) -> dict[str, Any]:
        image = {"type": "image_url", "image_url": {"url": u}}
        return {"role": "user", "content": [{"type": "text", "text": LONG_QUESTION}, image]}

    first = {"model": "m", "session_id": "s", "messages": [user(url)]}
    history = [user(other_url or url), {"role": "assistant", "content": "fine thanks"}]
    second = {**first, "messages": [*history, {"role": "user", "content": "and then"}]}
    return [first, second]


async def _two_image_turns(client: Any, turns: list[dict[str, Any]]) -> Any:
    assert (await client.post("/v1/chat/completions", json=turns[0])).status == 200
    return await client.post("/v1/chat/completions", json=turns[1])


async def test_remote_image_url_is_uncacheable(make_sidecar: MakeSidecar, engines: Engines) -> None:
    """The bytes behind a URL may change between turns: the sidecar cannot tell."""
    client = await make_sidecar()
    resp = await _two_image_turns(client, _image_turns("https://example.test/cat.png"))
    assert outcome(resp) == "uncacheable-media"
    assert not pulled(engines)


async def test_remote_image_url_reuses_when_urls_are_immutable(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    client = await make_sidecar(media_urls_immutable=True)
    resp = await _two_image_turns(client, _image_turns("https://example.test/cat.png"))
    assert outcome(resp) == "reused"
    assert pulled(engines)


async def test_data_url_with_other_bytes_does_not_pull(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """A data: URL carries its bytes: the identity covers them (no setting needed)."""
    client = await make_sidecar()
    turns = _image_turns("data:image/png;base64,Y2F0", "data:image/png;base64,ZG9n")
    resp = await _two_image_turns(client, turns)
    assert outcome(resp) == "kv-mismatch"
    assert not pulled(engines)
    same = await _two_image_turns(client, _image_turns("data:image/png;base64,Y2F0"))
    assert outcome(same) == "reused"


# ------------------------------------------------------------------ the pure rule


def test_rule_names_the_first_field_off_the_allowlist() -> None:
    body = {"model": "m", "messages": [], "temperature": 1, "zeta": 1, "alpha": 2}
    assert allowlist.unsafe_field(Api.CHAT, body) == "alpha"
    assert allowlist.unsafe_field(Api.CHAT, {"model": "m", "messages": []}) is None
    # Chat-only fields are not the completions endpoint's.
    assert allowlist.unsafe_field(Api.COMPLETIONS, {"prompt": "x", "tools": TOOLS}) == "tools"
    assert allowlist.unsafe_field(Api.COMPLETIONS, {"prompt": "x", "prompt_embeds": "e"})


def test_fields_said_to_reach_tokenize_do() -> None:
    """The allowlist trusts the alignment check for these: /tokenize must get them."""
    chat = {name: 1 for name in allowlist.ALLOWED[Api.CHAT]}
    sent = rewrite.tokenize_body({**chat, "messages": []}) or {}
    assert sent.keys() >= allowlist.CHAT_TOKENIZED
    assert "mm_processor_kwargs" in sent  # in the identity too
    completion = rewrite.tokenize_body({n: "x" for n in allowlist.ALLOWED[Api.COMPLETIONS]})
    assert (completion or {}).keys() >= allowlist.COMPLETION_TOKENIZED


@pytest.mark.parametrize(
    ("part", "remote"),
    [
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,Y2F0"}}, False),
        ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, False),
        ({"type": "image_url", "image_url": {"url": "https://example.test/a.png"}}, True),
        ({"type": "video_url", "video_url": {"url": " http://example.test/v.mp4"}}, True),
        ({"type": "image_url", "image_url": {"url": "file:///media/a.png"}}, True),
        ({"image_url": "https://example.test/a.png"}, True),  # a part without a type
    ],
)
def test_media_named_by_url_is_remote(part: dict[str, Any], remote: bool) -> None:
    body = {"messages": [{"role": "user", "content": [part]}]}
    assert identity.kv_identity(body).remote_media is remote


def test_new_outcomes_are_in_the_wire_vocabulary() -> None:
    assert Outcome("unsafe-field") in report.MAP_KEYS["outcomes"]
    assert Outcome("uncacheable-media") in report.MAP_KEYS["outcomes"]
