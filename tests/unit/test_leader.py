"""Leader election's rules (operator/leader.py) on an in-memory Lease store that
behaves as the API server does: replace needs the current resourceVersion."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from kvferry_operator import leader


class Leases:
    """One Lease, optimistic concurrency as the API server applies it."""

    def __init__(self) -> None:
        self.obj: dict[str, Any] | None = None
        self.version = 0
        self.down = False

    def get_lease(self, namespace: str, name: str) -> dict[str, Any] | None:
        if self.down:
            raise OSError("connection refused")
        return None if self.obj is None else {**self.obj, "spec": dict(self.obj["spec"])}

    def _store(self, spec: dict[str, Any]) -> None:
        self.version += 1
        self.obj = {"metadata": {"resourceVersion": str(self.version)}, "spec": dict(spec)}

    def create_lease(self, namespace: str, name: str, spec: dict[str, Any]) -> bool:
        if self.down:
            raise OSError("connection refused")
        if self.obj is not None:
            return False  # 409
        self._store(spec)
        return True

    def replace_lease(self, namespace: str, name: str, spec: dict[str, Any], rv: str) -> bool:
        if self.down:
            raise OSError("connection refused")
        if self.obj is None or self.obj["metadata"]["resourceVersion"] != rv:
            return False  # 409
        self._store(spec)
        return True

    @property
    def holder(self) -> str:
        return (self.obj or {}).get("spec", {}).get("holderIdentity") or ""


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def elector(leases: Leases, me: str, clock: Clock) -> leader.Elector:
    return leader.Elector(leases, "ops", "kvferry", me, 15, 10, 2, clock=clock, wall=clock)


def test_decide():
    rec = leader.Record("a", 15, None, 0, "1")
    assert leader.decide(None, "b", False) == leader.TAKE
    assert leader.decide(leader.Record("", 15, None, 0, "1"), "b", False) == leader.TAKE
    assert leader.decide(rec, "b", False) == leader.WAIT
    assert leader.decide(rec, "b", True) == leader.TAKE
    assert leader.decide(rec, "a", False) == leader.RENEW


def test_first_candidate_creates_the_lease_and_the_second_waits():
    leases, clock = Leases(), Clock()
    a, b = elector(leases, "a", clock), elector(leases, "b", clock)
    assert a.try_once() and leases.holder == "a"
    assert not b.try_once()
    assert leases.obj["spec"]["leaseTransitions"] == 0
    assert leases.obj["spec"]["renewTime"].endswith("Z")


def test_a_live_holder_is_never_displaced_and_a_silent_one_is_after_the_lease():
    leases, clock = Leases(), Clock()
    a, b = elector(leases, "a", clock), elector(leases, "b", clock)
    assert a.try_once()
    for _ in range(20):  # a renews every 2 s: b sees the record change, never expiry
        clock.t += 2
        assert a.try_once()
        assert not b.try_once()
    assert leases.holder == "a"
    # a dies: b's own clock runs from the last change it saw.
    clock.t += 14
    assert not b.try_once()  # 14 s without a change: not yet expired
    clock.t += 2
    assert b.try_once()  # 16 s > 15 s
    assert leases.holder == "b" and leases.obj["spec"]["leaseTransitions"] == 1
    clock.t += 1
    assert not a.try_once()  # a, back, finds b's live Lease and waits


def test_expiry_is_judged_by_the_candidates_clock_not_the_records_time():
    """A record whose renewTime is long past (the writer's clock is behind) is not
    expired for a candidate that has just seen it change."""
    leases, clock = Leases(), Clock()
    a = elector(leases, "a", clock)
    leases._store(
        {
            "holderIdentity": "x",
            "leaseDurationSeconds": 15,
            "renewTime": "2001-01-01T00:00:00.000000Z",
        }
    )
    assert not a.try_once()
    clock.t += 15
    assert not a.try_once()
    clock.t += 0.5
    assert a.try_once()


def test_two_candidates_racing_for_an_expired_lease_one_wins():
    leases, clock = Leases(), Clock()
    a, b = elector(leases, "a", clock), elector(leases, "b", clock)
    leases._store({"holderIdentity": "x", "leaseDurationSeconds": 15})
    assert not a.try_once() and not b.try_once()
    clock.t += 16
    # b reads the same version as a, a writes first: b's replace is a conflict.
    stale = leases.get_lease("ops", "kvferry")
    assert a.try_once()
    rec = leader.Record.of(stale)
    spec = leader.spec_for(rec, "b", 15, clock.t, leader.TAKE)
    assert not leases.replace_lease("ops", "kvferry", spec, rec.resource_version)
    assert not b.try_once() and leases.holder == "a"


def test_release_lets_a_standby_take_over_at_its_next_try():
    leases, clock = Leases(), Clock()
    a, b = elector(leases, "a", clock), elector(leases, "b", clock)
    assert a.try_once() and not b.try_once()
    a.release()
    assert leases.holder == ""
    assert b.try_once() and leases.holder == "b"
    b.release()
    a.release()  # not the holder: nothing written
    assert leases.holder == ""


def test_api_trouble_is_no_leadership_and_raises_nothing():
    leases, clock = Leases(), Clock()
    a = elector(leases, "a", clock)
    leases.down = True
    assert not a.try_once()
    a.release()


@pytest.mark.parametrize("timings", [(2, 10, 10), (0, 1, 2), (5, 3, 15)])
def test_timings_must_let_the_holder_give_up_before_a_standby_takes_over(timings):
    with pytest.raises(ValueError, match="KVFERRY_LEADER_RENEW_SECONDS"):
        leader.check_timings(*timings)


async def test_the_holder_is_lost_when_renewals_fail_past_the_deadline_and_when_displaced():
    leases = Leases()
    a = leader.Elector(leases, "ops", "kvferry", "a", 3, 2, 0.05)
    await a.acquire()
    lost_a = threading.Event()
    a.keep(lost_a.set)
    leases.down = True
    assert await asyncio.to_thread(lost_a.wait, 10)  # not renewed for 2 s
    leases.down = False
    b = leader.Elector(leases, "ops", "kvferry", "b", 3, 2, 0.05)
    await asyncio.wait_for(b.acquire(), 10)  # a's record stopped changing: b takes it
    assert leases.holder == "b"
    lost_b = threading.Event()
    stop_b = b.keep(lost_b.set)
    assert not await asyncio.to_thread(lost_b.wait, 0.3)  # renewing
    # Someone else writes the Lease (b's clock was wrong, an admin): b stops at once.
    leases._store({"holderIdentity": "c", "leaseDurationSeconds": 15})
    assert await asyncio.to_thread(lost_b.wait, 5)
    stop_b.set()


class HungLeases(Leases):
    """A replace that hangs until ``answer`` is set, then lands (a slow API server)."""

    def __init__(self) -> None:
        super().__init__()
        self.hang = False
        self.hung = threading.Event()
        self.answer = threading.Event()

    def replace_lease(self, namespace: str, name: str, spec: dict[str, Any], rv: str) -> bool:
        if self.hang:
            self.hang = False
            self.hung.set()
            self.answer.wait(30)
        return super().replace_lease(namespace, name, spec, rv)


async def test_a_lease_called_lost_is_not_renewed_when_the_call_comes_back():
    """The watchdog calls the Lease lost while a renewal hangs; that renewal then
    lands. Lost is lost: the renewer stops (a standby may hold the Lease by now)."""
    leases = HungLeases()
    a = leader.Elector(leases, "ops", "kvferry", "a", 3, 1, 0.05)
    await a.acquire()
    leases.hang = True
    lost = threading.Event()
    stop = a.keep(lost.set)
    assert await asyncio.to_thread(leases.hung.wait, 10)
    renewer = next(t for t in threading.enumerate() if t.name == "kvferry-lease-renew")
    assert await asyncio.to_thread(lost.wait, 10)  # the watchdog, by the deadline
    leases.answer.set()
    await asyncio.to_thread(renewer.join, 10)
    assert not renewer.is_alive()
    stop.set()


async def test_renewals_do_not_wait_for_the_event_loop():
    """A busy operator starves its loop (at 1,000 servers a renewal on it waited 30 s):
    the Lease is renewed from a thread while the loop is blocked."""
    leases = Leases()
    a = leader.Elector(leases, "ops", "kvferry", "a", 3, 1, 0.05)
    await a.acquire()
    lost = threading.Event()
    stop = a.keep(lost.set)
    version = leases.version
    time.sleep(1.5)  # the loop blocked past the renew deadline
    assert leases.version > version and not lost.is_set()
    stop.set()


def test_identity_differs_per_process():
    assert leader.identity("op-0") != leader.identity("op-0")
    assert leader.identity("op-0").startswith("op-0_")


def test_micro_time_is_rfc3339_with_microseconds():
    assert leader.micro_time(0) == "1970-01-01T00:00:00.000000Z"


async def test_the_standby_is_alive_not_ready_refuses_reports_and_says_so_in_metrics(
    aiohttp_client: Any,
):
    from kvferry_operator import standby
    from kvferry_wire.protocol import HDR_OPERATOR_STANDBY, REPORT_PATH

    client = await aiohttp_client(standby.app_factory())
    assert (await client.get("/healthz")).status == 200
    assert (await client.get("/readyz")).status == 503
    resp = await client.post(REPORT_PATH, data=b"{}")
    assert resp.status == 503 and resp.headers[HDR_OPERATOR_STANDBY] == "1"
    assert resp.headers["Retry-After"] == "1"
    metrics = await aiohttp_client(standby.metrics_app_factory())
    text = await (await metrics.get("/metrics")).text()
    assert "kvferry_operator_leader 0.0" in text


def test_leader_elect_without_the_lease_namespace_is_refused_naming_it(monkeypatch, caplog):
    from kvferry_operator import main

    monkeypatch.delenv("KVFERRY_LEADER_ELECTION_NAMESPACE", raising=False)
    assert main.run([], standalone=True, leader_elect=True) == 2
    assert "KVFERRY_LEADER_ELECTION_NAMESPACE" in caplog.text


def test_leader_timings_that_overlap_are_refused_at_start(monkeypatch, caplog):
    from kvferry_operator import main

    monkeypatch.setenv("KVFERRY_LEADER_ELECTION_NAMESPACE", "ops")
    monkeypatch.setenv("KVFERRY_LEADER_RENEW_SECONDS", "20")
    assert main.run([], standalone=True, leader_elect=True) == 2
    assert "KVFERRY_LEADER_LEASE_SECONDS" in caplog.text


class Pods:
    """A pod's labels, merge-patched as the API server does; ``fail`` refusals first."""

    def __init__(self, fail: list[Exception] | None = None, log: list[str] | None = None) -> None:
        self.labels: dict[str, str] = {leader.LEADER_LABEL: "true"}  # a predecessor's
        self.fail = list(fail or [])
        self.log = log if log is not None else []
        self.gone = False

    def label_pod(self, namespace: str, name: str, labels: dict[str, str | None]) -> bool:
        if self.fail:
            raise self.fail.pop(0)
        if self.gone:
            return False
        for key, value in labels.items():
            if value is None:
                self.labels.pop(key, None)
            else:
                self.labels[key] = value
        self.log.append(f"label {labels[leader.LEADER_LABEL]}")
        return True


class Forbidden(Exception):
    status = 403


async def test_the_mark_is_patched_until_it_lands():
    pods = Pods(fail=[OSError("connection refused"), OSError("connection refused")])
    mark = leader.PodMark(pods, "ops", "op-0", max_pause=0.01)
    await asyncio.wait_for(mark.set(False), 10)
    assert leader.LEADER_LABEL not in pods.labels and not pods.fail
    await asyncio.wait_for(mark.set(True), 10)
    assert pods.labels[leader.LEADER_LABEL] == "true"
    pods.gone = True  # nothing left to mark: done, not retried for good
    await asyncio.wait_for(mark.set(False), 10)


async def test_without_the_right_to_patch_the_mark_is_not_taken_off_nor_given_up(caplog):
    """No right: the label was never set, so a standby goes on; a leader keeps trying
    (the Service routes nothing to it until the Role is fixed) and says which Role."""
    pods = Pods(fail=[Forbidden("forbidden")] * 3)
    mark = leader.PodMark(pods, "ops", "op-0", max_pause=0.01)
    assert mark.set_once(False) is True
    assert mark.set_once(True) is False
    assert "leader-election grants patch on pods" in caplog.text


async def test_a_replica_unmarks_before_it_serves_and_marks_only_while_leading(monkeypatch):
    """The order that keeps reports off a standby: its own pod unlabelled before any
    port answers, labelled after the Lease is held, unlabelled before it is released."""
    from kvferry_operator import main, report_endpoint
    from kvferry_operator.settings import Settings

    events: list[str] = []

    class Api(Leases, Pods):
        def __init__(self) -> None:
            Leases.__init__(self)
            Pods.__init__(self, log=events)

        def create_lease(self, namespace: str, name: str, spec: dict[str, Any]) -> bool:
            events.append(f"lease {spec['holderIdentity']!r:.6}")
            return super().create_lease(namespace, name, spec)

        def replace_lease(self, namespace: str, name: str, spec: dict[str, Any], rv: str) -> bool:
            events.append("lease released" if spec["holderIdentity"] is None else "lease renewed")
            return super().replace_lease(namespace, name, spec, rv)

    async def serve(*args: Any) -> Any:
        events.append("serve")

        class Runner:
            async def cleanup(self) -> None:
                events.append("standby ports closed")

        return Runner()

    labelled = asyncio.Event()

    async def operate(*args: Any) -> None:
        events.append("kopf")
        while "label true" not in events:
            await asyncio.sleep(0.01)
        labelled.set()

    monkeypatch.setattr(report_endpoint, "serve", serve)
    monkeypatch.setattr(main, "operate", operate)
    monkeypatch.setattr(report_endpoint, "tls_context", lambda *a: None)
    settings = Settings(
        sidecar_image="sidecar",
        resync_seconds=300,
        leader_namespace="ops",
        pod_name="op-0",
        pod_namespace="ops",
        tls_cert_file="c",
        tls_key_file="k",
        metrics_port=0,
    )
    api = Api()
    assert await asyncio.wait_for(main.elected(settings, [], True, None, kube=api), 20) == 0
    assert labelled.is_set()
    assert events[:2] == ["label None", "serve"]
    assert events.index("label true") > events.index("lease 'op-0_")
    assert events[-2:] == ["label None", "lease released"]
    assert leader.LEADER_LABEL not in api.labels


def test_a_renewal_that_hangs_past_the_deadline_is_a_lost_lease():
    """A call to a slow API server (timeouts, the client's retries) may outlast the
    lease; the holder must stop by its deadline, not when the call gives up."""
    leases = Leases()
    a = leader.Elector(leases, "ops", "kvferry", "a", 3, 1, 0.05)
    assert a.try_once()
    answer = threading.Event()
    real_get = leases.get_lease

    def hanging_get(namespace: str, name: str) -> dict[str, Any] | None:
        answer.wait(30)  # the API server answers only when the test says so
        return real_get(namespace, name)

    leases.get_lease = hanging_get  # type: ignore[method-assign]
    lost = threading.Event()
    started = time.monotonic()
    stop = a.keep(lost.set, period=0.01)
    try:
        assert lost.wait(10)
        assert time.monotonic() - started < 1 + 0.5  # the deadline, and slack
    finally:
        answer.set()
        stop.set()


def test_a_stopped_keeper_never_reports_a_loss():
    """A clean stop sets the event before the Lease is released: no exit after it."""
    clock = Clock()
    a = leader.Elector(Leases(), "ops", "kvferry", "a", 15, 10, 2, clock=clock, wall=clock)
    assert a.try_once()
    fired = threading.Event()
    a.keep(fired.set, period=0.01).set()
    clock.t += 60
    assert not fired.wait(0.3)
