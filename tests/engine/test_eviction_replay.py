"""Engine tier: the eviction simulator predicts what the real decode sidecar did.

A short seeded trace (``bench.eviction_replay``, smaller: 4 sessions of 4 turns, a few
seconds apart) goes as real chat turns through the decode sidecar in front of a P/D
pair whose D has a small KV (``--num-gpu-blocks-override``, so the module starts its
own pair: ~1-2 min on 2 cores), small enough that the handles do not all fit and the
policy must let some go for room. The same turns (times, prompt, reused and answer
tokens as measured) replayed through ``kvferry_wire.replay.Replay`` with
``retention.Wiring.of`` the sidecar's own settings and D's real size must predict the
tokens P pulled within 20 %, and release handles of the same kinds as the sidecar did
(its /v1/residency ``evictions``: for room, at their end), at least one for room.
Measured here (2 cores): 16 turns in ~66 s, the module ~2 min with the engines' start.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench import eviction_replay as er
from kvferry_dev.engines import EnginePair
from kvferry_dev.sidecars import SidecarProcess
from tests.progress import say

pytestmark = pytest.mark.engine

SEED = 7
SESSIONS = 4
TURNS = 4
D_BLOCKS = 130  # vLLM's floor here: one request of the max length (4,096 tokens)
# The report's reasons by the fate they give (kvferry_sidecar.handles.POLICY_REASONS):
# let go for room (evicted) or at its end (expired). Which of the room reasons answers
# depends on when the sidecar last scraped D (admission at the turn's end, pressure at
# the next look): the kinds compared are the fates.
ROOM = {"pressure", "preemption", "admission", "storeCap"}
END = {"usefulness", "retention", "lease"}


def fates(reasons: set[str]) -> set[str]:
    return {"evicted" for r in reasons if r in ROOM} | {"expired" for r in reasons if r in END}


@pytest.fixture(scope="module")
def small_d(
    engine_python: Path, tiny_model: Path, engine_log_dir: Path
) -> Iterator[tuple[EnginePair, SidecarProcess]]:
    t0 = time.monotonic()
    pair, sc = er.start_small_pair(
        engine_python, tiny_model, engine_log_dir / "eviction-replay", D_BLOCKS
    )
    say(f"eviction replay: small-KV pair and sidecar up in {time.monotonic() - t0:.0f} s")
    try:
        yield pair, sc
    finally:
        sc.stop()
        pair.stop()


def test_the_simulator_predicts_the_real_sidecar(
    small_d: tuple[EnginePair, SidecarProcess],
) -> None:
    pair, sc = small_d
    blocks, block_size = er.d_cache(pair.decode)
    assert blocks == D_BLOCKS, f"D has {blocks} blocks (vllm:cache_config_info)"
    plan = er.plan_trace(SEED, SESSIONS, TURNS, stagger_s=1.0, short_s=(2.0, 6.0), long_share=0.0)
    before = sc.residency()
    t0 = time.monotonic()
    measured = er.run_real(sc, pair.prefill, plan, seed=SEED)
    took = time.monotonic() - t0
    after = sc.residency()
    figures, sim = er.simulate(
        measured, er.sidecar_settings(sc), blocks, block_size, er.decode_s_per_token(measured)
    )
    c = er.compare(measured, before, after, figures)
    say(f"eviction replay: {len(measured)} turns in {took:.0f} s\n{er.side_by_side(c)}")
    real, predicted = c.kinds
    assert real & ROOM, f"the trace forced no release for room: {c}"
    assert c.pulled_tokens > 0, c
    assert c.off_by <= er.TOLERANCE, f"ratio {c.ratio:.3f}: {c} ({sim})"
    assert fates(real) == fates(predicted), (
        f"measured {sorted(real)}, simulated {sorted(predicted)}: {c}"
    )
