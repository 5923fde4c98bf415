"""Helpers of the engine tier's turn tests: conversations through the real sidecar,
references computed by one engine alone, and what P's /metrics must show."""

from __future__ import annotations

import copy
import json
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvferry_dev.client import Reply, filler_text
from kvferry_dev.configs import BLOCK_SIZE
from kvferry_dev.engines import Engine
from kvferry_dev.figures import PrefillFigures
from kvferry_dev.sidecars import SidecarProcess
from tests.kube import wait_until

TURNS = 5
USER_WORDS = 330  # ~365 tokens a user message: above skipPrefillBelowTokens (256)
ANSWER_TOKENS = 32
# Long enough for a handle to outlive a restart of D (40-60 s here).
LONG_RETENTION_S = 300


def user_message(seed: int, turn: int) -> dict[str, str]:
    return {"role": "user", "content": filler_text(seed * 1000 + turn, USER_WORDS)}


def assistant(reply: Reply) -> dict[str, str]:
    return {"role": "assistant", "content": reply.text}


def rid(tag: str) -> str:
    return f"kvferry-{tag}-{uuid.uuid4().hex[:8]}"


def kv_bytes_per_token(model: Path) -> int:
    """K and V of every layer, float32: what NIXL moves per token."""
    cfg = json.loads((model / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 4


def round_down(n: int) -> int:
    return n // BLOCK_SIZE * BLOCK_SIZE


@dataclass
class Turn:
    messages: list[dict[str, Any]]
    reply: Reply
    p: PrefillFigures  # what P's /metrics saw during the turn

    @property
    def prompt(self) -> int:
        return self.reply.prompt_tokens

    def why(self) -> str:
        r = self.reply
        return (
            f"status={r.status} outcome={r.outcome} route={r.route} "
            f"reused={r.reused_tokens} prompt={self.prompt if r.status == 200 else '?'} "
            f"handle={r.headers.get('X-Kvferry-Handle')} P={self.p}"
        )


def send(
    sc: SidecarProcess,
    prefill: Engine,
    messages: list[dict[str, Any]],
    session: str | None,
    *,
    reset: bool = True,
    **extra: Any,
) -> Turn:
    """One turn through the sidecar, P's metrics read around it. ``reset``: empty P's
    prefix cache first (a no-op for the tier's P, which has none). ``extra``: more
    request fields (model, salt)."""
    if reset:
        prefill.reset_prefix_cache()
    before = prefill.metrics()
    reply = sc.chat(
        messages,
        max_tokens=ANSWER_TOKENS,
        session_id=session,
        request_id=rid(session or "nosession"),
        check=False,
        **extra,
    )
    turn = Turn(copy.deepcopy(messages), reply, PrefillFigures.between(before, prefill.metrics()))
    assert reply.status == 200, f"the client saw an error: {reply.body} ({turn.why()})"
    assert reply.token_ids and len(reply.token_ids) == ANSWER_TOKENS, turn.why()
    return turn


def reference(prefill: Engine, messages: list[dict[str, Any]], **extra: Any) -> list[int]:
    """The answer of one engine computing everything itself."""
    prefill.reset_prefix_cache()
    r = prefill.chat(messages, max_tokens=ANSWER_TOKENS, request_id=rid("reference"), **extra)
    assert r.token_ids and len(r.token_ids) == ANSWER_TOKENS, r.body
    return r.token_ids


def assert_pulled(turn: Turn, bytes_per_token: int) -> None:
    """P read exactly the reused tokens from D over NIXL and computed only the rest."""
    reused = turn.reply.reused_tokens
    assert turn.reply.outcome == "reused" and turn.reply.route == "remote", turn.why()
    assert reused >= 64, turn.why()  # the recompute threshold
    assert turn.p.pulled_tokens == reused, turn.why()
    blocks = -(-reused // BLOCK_SIZE)
    assert turn.p.pull_bytes == blocks * BLOCK_SIZE * bytes_per_token, turn.why()
    assert turn.p.computed_tokens == turn.prompt - reused, turn.why()
    # Not expired_reads: P counts there the lease of every release request it served
    # (the one block it held for D's pull that never comes), whichever turn sent it.
    assert turn.p.failed_transfers == 0, turn.why()


def assert_recomputed(turn: Turn) -> None:
    """Nothing came from D: P computed the whole prompt."""
    assert turn.reply.reused_tokens == 0, turn.why()
    assert turn.p.pulled_tokens == 0 and turn.p.pull_bytes == 0, turn.why()
    assert turn.p.computed_tokens == turn.prompt, turn.why()


def second_turn(
    sidecar: SidecarProcess,
    sidecar_off: SidecarProcess,
    prefill: Engine,
    session: str,
    seed: int,
    first: dict[str, Any],
    second: dict[str, Any],
) -> tuple[Turn, Turn, Turn, list[dict[str, Any]]]:
    """Turn 1 with request fields ``first``, turn 2 with ``second``; turn 2 also through
    the reuse-off sidecar. Returns (turn 1, turn 2, turn 2 with reuse off, its messages)."""
    messages = [user_message(seed, 0)]
    t1 = send(sidecar, prefill, messages, session, **first)
    assert t1.reply.outcome == "no-handle", t1.why()
    messages += [assistant(t1.reply), user_message(seed, 1)]
    t2 = send(sidecar, prefill, messages, session, **second)
    off = send(sidecar_off, prefill, messages, f"{session}-off", **second)
    releases_settled(sidecar, sidecar_off)
    return t1, t2, off, messages


def releases_settled(*sidecars: SidecarProcess, timeout: float = 60.0) -> None:
    """Wait until no sidecar has a handle dropped unread that D still pins. Each such
    handle is released ``releaseAfterSeconds`` later by a one-token request through P,
    which P counts as a computed token: a turn measured while one is in flight would
    see P compute one token more than its prompt."""

    def settled() -> bool:
        for sc in sidecars:
            unused = sc.residency()["pinned"]["unusedHandles"]
            assert unused == 0, f"{sc.name} still pins {unused} unused handle(s)"
        return True

    wait_until(settled, timeout, "the sidecars' unread handles to be released")


def pinned_on_decode(decode: Engine) -> int:
    """Blocks D holds while no request runs: the pinned handles' (D's own view)."""
    scrape = decode.metrics()
    assert scrape.total("vllm:num_requests_running") == 0, "D is still running a request"
    info = next(s for s in scrape.samples if s.name == "vllm:cache_config_info")
    total = int(info.labels["num_gpu_blocks"])
    return round(scrape.total("vllm:kv_cache_usage_perc") * total)


def group_cpu_seconds(engine: Engine) -> float:
    """CPU seconds used so far by the engine's process group (API server + core)."""
    assert engine.proc is not None
    ticks = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == engine.proc.pid:  # process group
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def cpu_share(engine: Engine, seconds: float = 3.0) -> float:
    before = group_cpu_seconds(engine)
    time.sleep(seconds)
    return (group_cpu_seconds(engine) - before) / seconds
