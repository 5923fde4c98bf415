"""One status write per burst of changes: the memory of our own last write, the
per-server coalescing, and a refresh from a body that predates our write."""

from __future__ import annotations

import asyncio
import threading

from kvferry_operator import api, handlers, ownership
from kvferry_operator.statuswriter import Coalescer, StatusMemory
from tests.unit.test_faults_operator import SERVER_OBJ


def test_our_last_write_is_laid_over_an_older_body():
    memory = StatusMemory()
    key = ("ns", "tiny")
    memory.wrote(key, "uid-1", {"conditions": ["new"]})
    stale = {"conditions": ["old"], "retention": {"applied": 1}}
    assert memory.base(key, "uid-1", stale) == {"conditions": ["new"], "retention": {"applied": 1}}
    # A server of the same name made again (another uid) starts from its own status.
    assert memory.base(key, "uid-2", stale) == stale
    memory.forget(key)
    assert memory.base(key, "uid-1", stale) == stale


class CountingKube:
    def __init__(self) -> None:
        self.patches: list[dict] = []

    def patch_status(self, api_version, kind, namespace, name, body):
        self.patches.append(body)


def test_a_refresh_from_a_body_older_than_our_write_writes_and_posts_nothing_again():
    # A pod event carries the server as the watch last showed it: before our own
    # status patch came back. It used to see the same change, write it and post its
    # Event again (docs/performance.md: 17.6 Events per server to Ready).
    kube = CountingKube()
    memory = StatusMemory()
    posted: list[str] = []
    obj = {**SERVER_OBJ, "status": {}}
    obj["metadata"] = {**obj["metadata"], "uid": "u1"}
    for _ in range(3):
        handlers.refresh_status(
            obj,  # the same stale body each time
            kube,  # type: ignore[arg-type]
            {},
            {},
            post=lambda body, kind, reason, message: posted.append(reason),
            claims=ownership.Claims(),  # fresh each time: the memory alone must hold
            memory=memory,
        )
    assert len(kube.patches) == 1
    assert "conditions" in kube.patches[0]


def test_a_fresh_body_is_trusted_over_the_memory():
    # The safety pass lists servers: a status someone else cleared is written again.
    kube = CountingKube()
    memory = StatusMemory()
    obj = {**SERVER_OBJ, "status": {}}
    obj["metadata"] = {**obj["metadata"], "uid": "u1"}
    handlers.refresh_status(obj, kube, {}, {}, post=lambda *a: None, memory=memory)  # type: ignore[arg-type]
    handlers.refresh_status(obj, kube, {}, {}, post=lambda *a: None, memory=memory)  # type: ignore[arg-type]
    assert len(kube.patches) == 1
    handlers.refresh_status(
        obj,
        kube,  # type: ignore[arg-type]
        {},
        {},
        post=lambda *a: None,
        memory=memory,
        fresh=True,
    )
    assert len(kube.patches) == 2
    assert {c["type"] for c in kube.patches[1]["conditions"]} >= {api.COND_READY}


async def test_a_burst_of_requests_is_one_run_and_a_late_one_another():
    loop = asyncio.get_running_loop()
    runs: list[tuple[str, str]] = []
    ran = threading.Event()

    def run(key):
        runs.append(key)
        ran.set()
        return True

    queue = Coalescer(loop, run, quiet=0.05, most=1.0)
    for _ in range(20):
        queue.request(("ns", "a"))
    queue.request(("ns", "b"))
    await asyncio.to_thread(ran.wait, 10)
    while len(runs) < 2:  # a and b, once each
        await asyncio.sleep(0.01)
    await queue.close()
    assert sorted(runs) == [("ns", "a"), ("ns", "b")]


async def test_a_run_that_did_not_land_is_tried_again_on_its_own():
    loop = asyncio.get_running_loop()
    results = iter([False, True])
    done = asyncio.Event()
    tries: list[int] = []

    def run(key):
        tries.append(1)
        landed = next(results)
        if landed:
            loop.call_soon_threadsafe(done.set)
        return landed

    queue = Coalescer(loop, run, quiet=0.01, most=0.1)
    queue.request(("ns", "a"))
    await asyncio.wait_for(done.wait(), 10)  # the first retry waits backoff.delay(0): 1 s
    await queue.close()
    assert len(tries) == 2


def test_once_the_watch_shows_our_write_the_body_is_the_truth_again():
    memory = StatusMemory()
    key = ("ns", "tiny")
    memory.wrote(key, "u1", {"conditions": ["ours"]})
    memory.confirm(key, "u1", {"conditions": ["older"]})  # not yet: still laid over
    assert memory.base(key, "u1", {"conditions": ["older"]}) == {"conditions": ["ours"]}
    memory.confirm(key, "u1", {"conditions": ["ours"], "retention": {}})
    # Someone clears status afterwards: the refresh sees it and writes it back.
    assert memory.base(key, "u1", {}) == {}


def test_an_event_that_cannot_be_posted_does_not_undo_the_status_write(caplog):
    # A namespace being deleted refuses new Events (403): the status has landed, the
    # refresh is done, and the log says so in one line.
    kube = CountingKube()
    obj = {**SERVER_OBJ, "status": {}}

    def refuse(*args):
        raise RuntimeError("events is forbidden: namespace is being terminated")

    unknown = {"type": api.COND_READY, "status": "True", "reason": "AllReplicasReady"}
    obj["status"] = {"conditions": [unknown]}  # Ready flips to False: an Event is due
    assert handlers.refresh_status(obj, kube, {}, {}, post=refuse)  # type: ignore[arg-type]
    assert len(kube.patches) == 1
    assert "not posted" in caplog.text
