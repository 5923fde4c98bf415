"""Which request fields a turn may carry and still reuse KV: the allowlist rule.

The sidecar proves a handle fits a turn by comparing token ids from ``/tokenize``
(``align.py``) and the KV identity (``identity.py``). Both see only part of the
request: the chat endpoint renders with fields ``/tokenize`` never receives
(``documents``, ``reasoning_effort``, ``tool_choice``, ``response_format``: vLLM
0.32's ``ChatCompletionRequest.build_chat_params``), and media options such as
``media_io_kwargs`` change the KV behind the same placeholder ids. So a turn may
reuse only when **every** field of its body is

- sampling or output only (it cannot touch the prompt or its KV),
- sent to ``/tokenize`` as well (``rewrite.TEMPLATE_FIELDS``: the alignment check
  then compares the real prompt's ids), or
- part of the KV identity (``identity.kv_identity``), or
- the sidecar's own: a body field it reads the session key from (``sessionKeys``;
  vLLM ignores fields it does not know, it renders nothing from them).

Anything else, a field a later vLLM adds included, turns reuse off for that turn
(``Outcome.UNSAFE_FIELD``): unknown is unsafe. The lists follow vLLM 0.32's
``ChatCompletionRequest`` and ``CompletionRequest`` (vllm/entrypoints/openai/
chat_completion/protocol.py, completion/protocol.py).

Pure: no I/O, no settings.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Final

from .rewrite import TEMPLATE_FIELDS, TOKENIZE_IGNORES
from .types import Api

# Sampling, stopping, output shape and scheduling: read after the prompt is rendered.
_OUTPUT_ONLY: Final = frozenset(
    {
        "allowed_token_ids",
        "bad_words",
        "best_of",
        "echo",  # echoes the last message in the answer, renders nothing
        "frequency_penalty",
        "ignore_eos",
        "include_reasoning",
        "include_stop_str_in_output",
        "length_penalty",
        "logit_bias",
        "logprob_token_ids",
        "logprobs",
        "max_completion_tokens",
        "max_tokens",
        "min_p",
        "min_tokens",
        "mm_payload",
        "n",
        "parallel_tool_calls",
        "presence_penalty",
        "priority",
        "prompt_logprobs",
        "repetition_detection",
        "repetition_penalty",
        "request_id",
        "return_mm_kwargs",
        "return_prompt_text",
        "return_token_ids",
        "return_token_offsets",
        "return_tokens_as_token_ids",
        "routed_experts_prompt_start",
        "seed",
        "session_id",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "stop",
        "stop_token_ids",
        "stream",
        "stream_interval",
        "stream_options",
        "structured_outputs",  # a grammar on the output; the prompt is not touched
        "temperature",
        "thinking_token_budget",
        "top_k",
        "top_logprobs",
        "top_p",
        "use_beam_search",
        "user",
        "vllm_xargs",  # sampling extra_args; its kv_transfer_params is stripped
        "watermarking",
    }
)

# Part of the KV identity (identity.py), or of what the alignment check compares.
_IDENTITY: Final = frozenset(
    {
        "model",
        "cache_salt",
        "mm_processor_kwargs",
        "truncate_prompt_tokens",  # such a turn neither uses nor keeps a handle
        "truncation_side",  # read only when truncate_prompt_tokens is set
        # The client's own is stripped (rewrite.client_body): engines see the sidecar's.
        "kv_transfer_params",
    }
)

# Sent to /tokenize as the engine gets them, and read there (rewrite.tokenize_body).
CHAT_TOKENIZED: Final = frozenset(TEMPLATE_FIELDS) - TOKENIZE_IGNORES
COMPLETION_TOKENIZED: Final = frozenset({"prompt", "add_special_tokens"})

ALLOWED: Final[Mapping[Api, frozenset[str]]] = {
    Api.CHAT: _OUTPUT_ONLY | _IDENTITY | CHAT_TOKENIZED,
    Api.COMPLETIONS: _OUTPUT_ONLY | _IDENTITY | COMPLETION_TOKENIZED,
}

# tool_choice reaches the renderer only with tools (vLLM collapses it to None
# otherwise); "auto" is what vLLM assumes when tools come without one, so it renders
# as /tokenize's request does. "none" drops the tools under
# --exclude-tools-when-tool-choice-none, "required" and a named tool may add an
# instruction: neither reaches /tokenize.
_HEADER_KEY: Final = "header:"  # a session key read from a header (session.py)
_TOOL_CHOICE: Final = "tool_choice"
_TOOL_CHOICE_AS_TOKENIZED: Final = frozenset({"auto"})


def _tool_choice_safe(body: Mapping[str, Any]) -> bool:
    if not body.get("tools"):
        return True
    choice = body.get(_TOOL_CHOICE)
    return choice is None or (isinstance(choice, str) and choice in _TOOL_CHOICE_AS_TOKENIZED)


def unsafe_field(api: Api, body: Mapping[str, Any], session_keys: Iterable[str] = ()) -> str | None:
    """The first field (in name order, so the answer is stable) that may change the
    prompt or its KV unseen by the alignment check; None when the turn may reuse.

    ``session_keys`` is the sidecar's key order (``header:<Name>`` entries name
    headers, the others body fields the sidecar owns)."""
    allowed = ALLOWED[api]
    own = {k for k in session_keys if not k.startswith(_HEADER_KEY)}
    for name in sorted(str(k) for k in body):
        if name in allowed or name in own:
            continue
        if api is Api.CHAT and name == _TOOL_CHOICE and _tool_choice_safe(body):
            continue
        return name
    return None
