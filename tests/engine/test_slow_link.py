"""Engine tier, one fault of its own: the P<->D link slowed past the prefill budget.

P runs in a network namespace joined to D by a veth pair shaped with ``tc``
(``kvferry_dev.netns``), so every KV byte between them crosses a link of a chosen
rate. A later turn whose history P must pull over a link too slow for
``prefillTimeoutSeconds`` must not hang and must not be wrong: the sidecar gives up
on P at the budget, D computes the prompt itself, the answer equals the no-reuse
answer, and the outcome says ``pull-failed``.

Needs root (``ip netns``, ``tc``) and starts a pair of its own; it runs before the
tier's pair starts (tests/engine/order.py), so the two pairs never share the cores.
Without root the module is skipped, saying why.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvferry_dev.client import filler_text
from kvferry_dev.engines import EnginePair
from kvferry_dev.netns import ThrottledLink, start_linked_pair
from kvferry_dev.sidecars import SidecarProcess, start_sidecar
from kvferry_operator.api import Server
from tests.engine.helpers import ANSWER_TOKENS, assistant, reference, send, user_message
from tests.kube import wait_until
from tests.progress import step

pytestmark = pytest.mark.engine

# Long enough for P to prefill turn 1 (~650 tokens) on a loaded core, far shorter than
# pulling that KV back over the shaped link (sized to take 4x this).
PREFILL_BUDGET_S = 10.0
HISTORY_WORDS = 600


def _netns_missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root for ip netns and tc (the P<->D link is shaped with tc)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"needs {' and '.join(missing)} (iproute2) to shape the P<->D link"
    return None


@pytest.fixture(scope="module")
def link() -> Iterator[ThrottledLink]:
    why = _netns_missing()
    if why:
        pytest.skip(f"slow-link fault not run: {why}")
    with ThrottledLink("kvf-slow") as shaped:
        yield shaped


@pytest.fixture(scope="module")
def linked_pair(
    link: ThrottledLink, engine_python: Path, tiny_model: Path, engine_log_dir: Path, server: Server
) -> Iterator[EnginePair]:
    logs = engine_log_dir / "slow-link"
    with step("starting a second P (in a network namespace) and D for the slow-link fault"):
        pair = start_linked_pair(engine_python, tiny_model, logs, link=link, server=server)
    with pair:
        yield pair


@pytest.fixture(scope="module")
def slow_sidecar(
    linked_pair: EnginePair, server: Server, engine_log_dir: Path
) -> Iterator[SidecarProcess]:
    sc = start_sidecar(
        linked_pair,
        server,
        engine_log_dir / "slow-link",
        name="sidecar-slow-link",
        overrides={"prefillTimeoutSeconds": PREFILL_BUDGET_S},
    )
    yield sc
    sc.stop()


def test_slow_link_past_the_prefill_budget_recomputes_right(
    link: ThrottledLink, linked_pair: EnginePair, slow_sidecar: SidecarProcess, bytes_per_token: int
) -> None:
    p = linked_pair.prefill
    history = [{"role": "user", "content": filler_text("slow-link", HISTORY_WORDS)}]
    # Turn 1 on the unshaped link: P prefills, D pulls P's KV and keeps a handle.
    t1 = send(slow_sidecar, p, history, "slow-link")
    assert t1.reply.outcome is not None and t1.reply.route == "remote", t1.why()
    held = t1.reply.prompt_tokens + ANSWER_TOKENS

    # A rate at which pulling turn 1's KV takes ~4x the budget.
    kv_bytes = held * bytes_per_token
    mbit = max(0.5, kv_bytes * 8 / 1e6 / (4 * PREFILL_BUDGET_S))
    link.set_rate(mbit=mbit)
    attempts = "kvferry_prefill_attempts_total"
    timeouts_before = slow_sidecar.metrics().total(attempts, result="timeout")
    messages = [*history, assistant(t1.reply), user_message(7, 2)]
    try:
        started = time.monotonic()
        t2 = send(slow_sidecar, p, messages, "slow-link", reset=False)
        took = time.monotonic() - started
    finally:
        link.set_rate(None)
    # The budget held: P was given up at PREFILL_BUDGET_S, D prefilled the prompt
    # itself (a few seconds here), no hang.
    assert took < PREFILL_BUDGET_S + 60, f"turn 2 took {took:.1f} s; {t2.why()}"
    assert t2.reply.outcome == "pull-failed", t2.why()
    assert t2.reply.route == "fallback", t2.why()
    assert slow_sidecar.metrics().total(attempts, result="timeout") == timeouts_before + 1
    # The aborted pull finishes or is dropped on the unshaped link; P is idle again.
    wait_until(
        lambda: p.metrics().total("vllm:num_requests_running") == 0,
        timeout=120,
        what="P idle after the aborted pull",
    )
    assert t2.reply.token_ids == reference(p, messages), (
        f"turn 2 over the slow link answered differently from no reuse; {t2.why()}"
    )

    # And the session goes on: a next turn on the healed link answers right.
    messages3 = [*messages, assistant(t2.reply), user_message(7, 3)]
    t3 = send(slow_sidecar, p, messages3, "slow-link")
    assert t3.reply.token_ids == reference(p, messages3), t3.why()
