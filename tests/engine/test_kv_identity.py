"""Engine tier: a handle is reused only when its KV is provably the turn's KV.

Token ids alone do not fix the KV: the model (or adapter) name, ``cache_salt`` and
engine-side truncation change it too (``kvferry_sidecar.identity``). Each test runs a
session whose second turn changes one of them: the old handle must not be pulled (P's
/metrics show no p2p tokens), the outcome says ``kv-mismatch``, and the greedy answer
equals the reuse-off sidecar's and one engine computing alone. The engines serve the
same weights under two names (``SERVED_MODEL_NAME`` and ``SERVED_MODEL_ALIAS``): to the
client and to the sidecar they are two models.
"""

from __future__ import annotations

import pytest

from kvferry_dev.configs import SERVED_MODEL_ALIAS, SERVED_MODEL_NAME
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


def assert_not_reused(t2: Turn, off: Turn) -> None:
    assert t2.reply.outcome == "kv-mismatch", t2.why()
    assert_recomputed(t2)
    assert t2.reply.token_ids == off.reply.token_ids, t2.why()


def test_switching_model_never_pulls_the_old_handle(
    sidecar: SidecarProcess, sidecar_off: SidecarProcess, prefill: Engine
) -> None:
    """Turn 2 names another model (an adapter, to the client): same ids, other KV."""
    _, t2, off, messages = second_turn(
        sidecar,
        sidecar_off,
        prefill,
        "identity-model",
        21,
        {"model": SERVED_MODEL_NAME},
        {"model": SERVED_MODEL_ALIAS},
    )
    assert_not_reused(t2, off)
    assert t2.reply.token_ids == reference(prefill, messages, model=SERVED_MODEL_ALIAS)


def test_another_cache_salt_never_pulls_the_handle_the_same_salt_does(
    sidecar: SidecarProcess, sidecar_off: SidecarProcess, prefill: Engine, bytes_per_token: int
) -> None:
    """A handle never crosses cache salts (vLLM's per-tenant isolation); within one
    salt it is reused as usual."""
    session, seed = "identity-salt", 22
    messages = [user_message(seed, 0)]
    t1 = send(sidecar, prefill, messages, session, cache_salt="tenant-a")
    messages += [assistant(t1.reply), user_message(seed, 1)]
    t2 = send(sidecar, prefill, messages, session, cache_salt="tenant-b")
    # Turn 3 stays with tenant-b, at once (the handle lives 30 s here): turn 2's
    # handle (salt b) is pulled.
    third = [*messages, assistant(t2.reply), user_message(seed, 2)]
    t3 = send(sidecar, prefill, third, session, cache_salt="tenant-b")
    off = send(sidecar_off, prefill, messages, f"{session}-off", cache_salt="tenant-b")
    assert_not_reused(t2, off)
    assert t2.reply.token_ids == reference(prefill, messages, cache_salt="tenant-b")
    assert_pulled(t3, bytes_per_token)
    assert t3.reply.token_ids == reference(prefill, third, cache_salt="tenant-b")


def test_truncating_turn_neither_pulls_nor_keeps_a_handle(
    sidecar: SidecarProcess, sidecar_off: SidecarProcess, prefill: Engine
) -> None:
    """``truncate_prompt_tokens`` lets the engine cut the prompt's head, so positions
    are not the ids': the handle is not pulled, and the turn keeps none."""
    _, t2, off, messages = second_turn(
        sidecar,
        sidecar_off,
        prefill,
        "identity-truncate",
        23,
        {},
        {"truncate_prompt_tokens": 4000},
    )
    assert_not_reused(t2, off)
    assert "reason=truncation" in t2.reply.headers.get("X-Kvferry-Handle", ""), t2.why()
    assert t2.reply.token_ids == reference(prefill, messages, truncate_prompt_tokens=4000)
    # The next (untruncated) turn finds no handle to pull.
    messages += [assistant(t2.reply), user_message(23, 2)]
    t3 = send(sidecar, prefill, messages, "identity-truncate")
    assert t3.reply.outcome == "no-handle", t3.why()
    assert_recomputed(t3)
