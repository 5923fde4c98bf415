"""The KV identity: what a handle's KV depends on besides its token ids."""

from __future__ import annotations

import pytest

from kvferry_sidecar.identity import (
    MISMATCH_MEDIA,
    MISMATCH_MEDIA_OPTIONS,
    MISMATCH_MODEL,
    MISMATCH_SALT,
    MISMATCH_TRUNCATION,
    compatible,
    kv_identity,
    plain_text,
)

CAT = {"type": "image_url", "image_url": {"url": "data:image/png;base64,Y2F0"}}
DOG = {"type": "image_url", "image_url": {"url": "data:image/png;base64,ZG9n"}}


def chat(*contents: object, **fields: object) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": c} for c in contents], **fields}


def test_identity_records_model_salt_media_options_and_truncation() -> None:
    ident = kv_identity(
        chat(
            [{"type": "text", "text": "look"}, CAT],
            cache_salt="tenant-a",
            mm_processor_kwargs={"fps": 2},
            truncate_prompt_tokens=100,
        )
    )
    assert ident.model == "m" and ident.cache_salt == "tenant-a" and ident.truncates
    assert len(ident.media) == 1 and ident.media_options is not None


def test_text_parts_are_not_media() -> None:
    assert kv_identity(chat([{"type": "text", "text": "hi"}], "plain")).media == ()


@pytest.mark.parametrize(
    ("first", "second", "why"),
    [
        pytest.param(chat("a"), chat("a", "b"), None, id="same-identity"),
        pytest.param(chat("a"), {**chat("a"), "model": "adapter"}, MISMATCH_MODEL, id="model"),
        pytest.param(
            chat("a", cache_salt="x"), chat("a", cache_salt="y"), MISMATCH_SALT, id="salt"
        ),
        pytest.param(chat("a"), chat("a", cache_salt="y"), MISMATCH_SALT, id="salt-added"),
        pytest.param(chat([CAT]), chat([CAT], [DOG]), None, id="image-appended"),
        pytest.param(chat([CAT]), chat([DOG], [DOG]), MISMATCH_MEDIA, id="image-replaced"),
        pytest.param(chat([CAT], [DOG]), chat([CAT]), MISMATCH_MEDIA, id="image-dropped"),
        pytest.param(
            chat([CAT], mm_processor_kwargs={"a": 1}),
            chat([CAT], mm_processor_kwargs={"a": 2}),
            MISMATCH_MEDIA_OPTIONS,
            id="media-options",
        ),
        pytest.param(chat("a"), chat("a", truncate_prompt_tokens=10), MISMATCH_TRUNCATION),
        pytest.param(chat("a", truncate_prompt_tokens=-1), chat("a"), MISMATCH_TRUNCATION),
    ],
)
def test_compatible_only_when_the_kv_is_the_same(first: dict, second: dict, why: str) -> None:
    """A handle never serves a turn under another model, salt, media or truncation."""
    assert compatible(kv_identity(first), kv_identity(second)) == why


@pytest.mark.parametrize(
    ("body", "base", "plain"),
    [
        (chat("a"), "m", True),
        (chat("a"), None, True),
        ({**chat("a"), "model": "adapter"}, "m", False),
        (chat("a", cache_salt="s"), "m", False),
        (chat([CAT]), "m", False),
        (chat("a", truncate_prompt_tokens=5), "m", False),
    ],
)
def test_plain_text_prompts_hash_like_their_ids(body: dict, base: str | None, plain: bool) -> None:
    """Only plain-text prompts of the base model hash in vLLM's prefix cache exactly
    as their token ids do (salt, media and adapters add extra keys)."""
    assert plain_text(kv_identity(body), base) is plain
