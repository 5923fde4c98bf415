"""Engine tier: an option that changes the prompt unseen by /tokenize never gets a pull.

vLLM's chat endpoint renders the top-level ``documents`` and ``reasoning_effort``
(and with ``--exclude-tools-when-tool-choice-none`` drops the tools for
``tool_choice: "none"``); its ``/tokenize``, whose ids the sidecar aligns with the
handle, reads none of the three. The tiny model's template renders them as real
templates do (a system block first: hack/tinymodel/build.py), so a turn carrying one
is computed over other tokens than its ids say, and a handle pulled for it puts D's KV
under the wrong tokens. The allowlist (sidecar/allowlist.py) turns reuse off for such a
turn: ``unsafe-field``, nothing pulled, the answer equals the reuse-off sidecar's and
one engine's alone. The same options given where /tokenize reads them too
(``chat_template_kwargs``, tools with tool_choice "auto") reuse as usual.

The engines run with tool calling on (conftest.ENGINE_ARGS).
"""

from __future__ import annotations

from typing import Any

import pytest

from kvferry_dev.client import filler_text
from kvferry_dev.engines import Engine
from kvferry_dev.sidecars import SidecarProcess
from tests.engine.helpers import (
    Turn,
    assert_pulled,
    assert_recomputed,
    assistant,
    reference,
    second_turn,
    send,
    user_message,
)

pytestmark = pytest.mark.engine

DOCUMENTS = [
    {"title": "Harbour timetable", "text": filler_text(901, 40)},
    {"title": "Fares", "text": filler_text(902, 25)},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "departures",
            "description": "Departures from a port on a day.",
            "parameters": {
                "type": "object",
                "properties": {"port": {"type": "string"}, "day": {"type": "string"}},
                "required": ["port"],
            },
        },
    }
]


def assert_unsafe(t2: Turn, off: Turn) -> None:
    """Turn 2 neither pulled nor kept a handle, and answered as reuse off did."""
    # The answer first: with the allowlist check removed this is what breaks.
    assert t2.reply.token_ids == off.reply.token_ids, t2.why()
    assert t2.reply.outcome == "unsafe-field", t2.why()
    assert t2.reply.headers.get("X-Kvferry-Handle") == "not-kept; reason=unsafe-field", t2.why()
    assert_recomputed(t2)


def renders_more(turn: Turn, decode: Engine) -> bool:
    """The engine computed a longer prompt than /tokenize gives for the messages alone:
    the option really is in the prompt."""
    return turn.prompt > len(decode.tokenize_chat(turn.messages))


@pytest.mark.parametrize(
    "option",
    [{"documents": DOCUMENTS}, {"reasoning_effort": "high"}],
    ids=["documents", "reasoning_effort"],
)
def test_an_option_tokenize_ignores_never_pulls(
    sidecar: SidecarProcess,
    sidecar_off: SidecarProcess,
    prefill: Engine,
    decode: Engine,
    option: dict[str, Any],
) -> None:
    """Turn 2 adds the option: /tokenize's ids extend the handle, the prompt does not."""
    name = next(iter(option))
    _, t2, off, messages = second_turn(
        sidecar, sidecar_off, prefill, f"options-{name}", 31 + len(name), {}, option
    )
    assert renders_more(t2, decode), t2.why()
    assert_unsafe(t2, off)
    assert t2.reply.token_ids == reference(prefill, messages, **option)


def test_tool_choice_none_that_drops_the_tools_never_pulls(
    sidecar: SidecarProcess, sidecar_off: SidecarProcess, prefill: Engine, decode: Engine
) -> None:
    """Turn 1 renders the tools (tool_choice "auto"); turn 2 sends the same tools with
    tool_choice "none", which the engine drops from the prompt and /tokenize keeps."""
    t1, t2, off, messages = second_turn(
        sidecar,
        sidecar_off,
        prefill,
        "options-tool-choice-none",
        41,
        {"tools": TOOLS},
        {"tools": TOOLS, "tool_choice": "none"},
    )
    assert renders_more(t1, decode), t1.why()
    # --exclude-tools-when-tool-choice-none: the messages alone.
    assert not renders_more(t2, decode), t2.why()
    assert_unsafe(t2, off)
    assert t2.reply.token_ids == reference(prefill, messages, tools=TOOLS, tool_choice="none")


def test_the_same_options_where_tokenize_reads_them_reuse(
    sidecar: SidecarProcess, prefill: Engine, decode: Engine, bytes_per_token: int
) -> None:
    """Documents and reasoning effort in chat_template_kwargs, tools with tool_choice
    "auto", on both turns: /tokenize renders what the engine renders, turn 2 pulls."""
    options: dict[str, Any] = {
        "chat_template_kwargs": {"documents": DOCUMENTS, "reasoning_effort": "high"},
        "tools": TOOLS,
    }
    messages = [user_message(51, 0)]
    t1 = send(sidecar, prefill, messages, "options-control", **options)
    assert renders_more(t1, decode), t1.why()
    messages += [assistant(t1.reply), user_message(51, 1)]
    t2 = send(sidecar, prefill, messages, "options-control", **options)
    assert_pulled(t2, bytes_per_token)
    assert t2.reply.token_ids == reference(prefill, messages, **options)
