"""The KV-event sockets the operator renders listen on 127.0.0.1 alone, checked on
vLLM's own publisher (issue 20, item 2).

The events carry every prompt's block hashes and token ids, and their one reader is the
sidecar in the same pod. vLLM 0.32 binds the PUB endpoint only when it has "*" or "::"
and connects to any other, so a plain tcp://127.0.0.1:PORT would make engine and
sidecar both connect and nothing would arrive; the rendered endpoint must be bound, on
loopback, and reach a subscriber there. The check builds the publisher the way vLLM
does from ``--kv-events-config`` (``EventPublisherFactory.create``) in the engine venv,
on free ports, without starting an engine.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from kvferry_dev.procs import free_port
from kvferry_operator.engine_config import build_kv_events_config
from kvferry_wire import protocol

pytestmark = pytest.mark.engine

# Runs in the engine venv: publish one batch through the rendered config, print which
# addresses the two ports listen on (/proc/net/tcp, state 0A = LISTEN) and whether a
# SUB on 127.0.0.1 got the batch.
SCRIPT = r"""
import json, sys, time
import zmq
from vllm.config.kv_events import KVEventsConfig
from vllm.distributed.kv_events import EventPublisherFactory, KVEventBatch

cfg = json.loads(sys.argv[1])
ports = [int(cfg[k].rsplit(":", 1)[1]) for k in ("endpoint", "replay_endpoint")]
pub = EventPublisherFactory.create(KVEventsConfig(**cfg), 0)

def listening(port):
    out = []
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        addr, hexport = local.split(":")
        if int(hexport, 16) == port and state == "0A":
            out.append(".".join(str(int(addr[i : i + 2], 16)) for i in (6, 4, 2, 0)))
    return out

sub = zmq.Context.instance().socket(zmq.SUB)
sub.setsockopt(zmq.SUBSCRIBE, b"")
sub.connect(f"tcp://127.0.0.1:{ports[0]}")
got = None
# A SUB joins asynchronously: publish until one batch arrives (bounded: 10 s).
deadline = time.monotonic() + 10
while got is None and time.monotonic() < deadline:
    pub.publish(KVEventBatch(ts=time.time(), events=[]))
    if sub.poll(200):
        got = sub.recv_multipart()
print(json.dumps({
    "pub": listening(ports[0]),
    "replay": listening(ports[1]),
    "received": got is not None and got[0] == cfg["topic"].encode(),
}))
pub.shutdown()
"""


def on_free_ports(cfg: dict) -> dict:
    """The rendered config with the two ports replaced (other engines may hold them)."""
    out = dict(cfg)
    for key, default in (
        ("endpoint", protocol.KV_EVENTS_PORT),
        ("replay_endpoint", protocol.KV_EVENTS_REPLAY_PORT),
    ):
        assert out[key].endswith(f":{default}"), out
        out[key] = out[key][: -len(str(default))] + str(free_port())
    return out


def test_rendered_kv_event_sockets_are_bound_on_loopback_and_reach_the_sidecar(
    engine_python: Path,
):
    cfg = on_free_ports(build_kv_events_config())
    proc = subprocess.run(
        [str(engine_python), "-c", SCRIPT, json.dumps(cfg)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen == {"pub": ["127.0.0.1"], "replay": ["127.0.0.1"], "received": True}
