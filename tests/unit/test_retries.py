"""A failed apply is retried with backoff: the schedule (pure), the retry task, and
the handler path that starts it."""

from __future__ import annotations

import asyncio
import json
import logging

import kopf
import pytest
import urllib3

from kvferry_operator import api, backoff, handlers
from kvferry_operator.retries import ApplyRetries
from kvferry_operator.settings import RESYNC_SECONDS, Settings
from tests.manifests import server

LOG = logging.getLogger("test")


def test_the_schedule_doubles_from_one_second_up_to_the_cap():
    assert backoff.schedule()[:7] == (1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0)
    assert backoff.delay(10) == backoff.CAP_SECONDS
    assert backoff.schedule(3, base=0.5, factor=3.0, cap=4.0) == (0.5, 1.5, 4.0)


def test_the_schedule_ends_about_when_the_default_safety_pass_would_run():
    assert 0.8 * RESYNC_SECONDS <= sum(backoff.schedule()) <= 1.2 * RESYNC_SECONDS


@pytest.mark.parametrize("rand", [0.0, 0.25, 0.5, 0.999])
def test_a_jittered_interval_stays_within_a_fifth_of_itself(rand):
    got = backoff.jittered(300.0, rand)
    assert 240.0 <= got <= 360.0
    assert backoff.jittered(300.0, 0.5) == 300.0


def test_a_negative_attempt_is_refused():
    with pytest.raises(ValueError, match="0 or more"):
        backoff.delay(-1)


class Sleeps:
    """asyncio.sleep stand-in: records each wait and returns at once."""

    def __init__(self) -> None:
        self.waits: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.waits.append(seconds)


async def finished(retries: ApplyRetries) -> None:
    await asyncio.sleep(0)  # the call_soon_threadsafe callback starts the task
    await asyncio.gather(*retries.tasks.values())


async def test_retries_wait_out_the_schedule_until_an_apply_lands():
    outcomes = iter([False, False, True])
    calls: list[tuple[str, str]] = []

    def retry(namespace: str, name: str) -> bool:
        calls.append((namespace, name))
        return next(outcomes)

    sleeps = Sleeps()
    retries = ApplyRetries(asyncio.get_running_loop(), retry, backoff.schedule(), sleeps)
    retries.failed("ns", "tiny")
    await finished(retries)
    assert sleeps.waits == [1.0, 2.0, 4.0]
    assert calls == [("ns", "tiny")] * 3 and retries.tasks == {}


async def test_retries_stop_after_the_last_delay_and_survive_errors(caplog):
    def retry(namespace: str, name: str) -> bool:
        raise ConnectionRefusedError("connection refused")

    sleeps = Sleeps()
    retries = ApplyRetries(asyncio.get_running_loop(), retry, (1.0, 2.0), sleeps)
    retries.failed("ns", "tiny")
    await finished(retries)
    assert sleeps.waits == [1.0, 2.0] and retries.tries == 2
    assert "still failing after 2 retries" in caplog.text


async def test_a_server_has_one_retry_task_at_a_time():
    gate = asyncio.Event()

    async def held(seconds: float) -> None:
        await gate.wait()

    retries = ApplyRetries(asyncio.get_running_loop(), lambda ns, n: True, (1.0,), held)
    retries.failed("ns", "tiny")
    retries.failed("ns", "tiny")
    retries.failed("ns", "other")
    await asyncio.sleep(0)
    assert sorted(retries.tasks) == [("ns", "other"), ("ns", "tiny")]
    gate.set()
    await finished(retries)
    assert retries.tries == 2


class FlakyKube:
    """The API server is unreachable for the first ``down`` applies, then answers."""

    def __init__(self, obj: dict, down: int) -> None:
        self.obj, self.down = obj, down
        self.applies = 0
        self.landed: list[str] = []
        self.events: list[tuple[str, str]] = []

    def apply(self, child: dict) -> dict:
        self.applies += 1
        if self.applies <= self.down:
            raise urllib3.exceptions.MaxRetryError(None, "/apis", "connection refused")
        self.landed.append(child["kind"])
        return {**child, "status": {"phase": "x"}}

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None:
        return self.obj if kind == api.SERVER_KIND else None

    def create_event(self, body: dict, type: str, reason: str, message: str) -> None:
        self.events.append((type, reason))


@pytest.mark.parametrize("retried", [True, False], ids=["unreachable", "invalid-spec"])
async def test_an_apply_that_may_land_later_is_retried_and_lands(monkeypatch, retried):
    monkeypatch.setattr(kopf, "warn", lambda *a, **kw: None)
    obj = server()
    obj["metadata"].update(name="tiny", namespace="ns")
    if not retried:
        del obj["spec"]["model"]  # a SpecError: no retry can fix it
    kube = FlakyKube(obj, down=1)
    settings = Settings(sidecar_image="", resync_seconds=60)
    sleeps = Sleeps()
    loop = asyncio.get_running_loop()
    memo = kopf.Memo(kube=kube, settings=settings)
    memo.retries = ApplyRetries(
        loop, lambda ns, n: handlers.retry_apply(ns, n, kube, settings, LOG), (1.0, 2.0), sleeps
    )
    result = await asyncio.to_thread(handlers.apply_or_retry, obj, memo, LOG)
    await finished(memo.retries)
    if retried:
        assert result is handlers.Applied.RETRY
        assert sleeps.waits == [1.0]  # the first retry landed everything
        assert "StatefulSet" in kube.landed and api.STATUS_KIND in kube.landed
    else:
        assert result is handlers.Applied.NEVER and not result
        assert sleeps.waits == [] and kube.applies == 0


def test_a_retry_of_a_server_that_is_gone_is_done():
    kube = FlakyKube({}, down=0)
    kube.get = lambda *a: None  # type: ignore[method-assign]
    assert handlers.retry_apply("ns", "tiny", kube, Settings("", 60), LOG)  # type: ignore[arg-type]
    assert kube.applies == 0


class RefusingKube(FlakyKube):
    """Every apply answered by the API server with ``status``."""

    def __init__(self, obj: dict, status: int) -> None:
        super().__init__(obj, down=0)
        self.status = status

    def apply(self, child: dict) -> dict:
        self.applies += 1
        raise handlers.ApiException(status=self.status, reason="refused")


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (422, handlers.Applied.NEVER),  # invalid: the same object fails the same way
        (403, handlers.Applied.NEVER),  # forbidden: RBAC is fixed by a chart upgrade
        (409, handlers.Applied.RETRY),  # a conflict passes
        (429, handlers.Applied.RETRY),  # overload passes
        (503, handlers.Applied.RETRY),
    ],
)
def test_only_a_refusal_that_may_pass_is_retried(monkeypatch, status, expected):
    # A refusal retried six times would post six identical ApplyFailed Warnings.
    warnings: list[str] = []
    monkeypatch.setattr(kopf, "warn", lambda *a, **kw: warnings.append(kw["reason"]))
    obj = server()
    obj["metadata"].update(name="tiny", namespace="ns")
    kube = RefusingKube(obj, status)
    result = handlers.apply_children(obj, kube, Settings("", 60), LOG)  # type: ignore[arg-type]
    assert result is expected
    assert kube.applies > 1  # one bad child never blocks the rest
    assert set(warnings) == {handlers.EVENT_APPLY_FAILED}


async def test_close_cancels_the_retries_and_waits_for_them():
    started = asyncio.Event()

    async def sleep_forever(seconds: float) -> None:
        started.set()
        await asyncio.Event().wait()

    retries = ApplyRetries(asyncio.get_running_loop(), lambda ns, n: True, (1.0,), sleep_forever)
    retries.failed("ns", "tiny")
    await asyncio.wait_for(started.wait(), 5)
    task = next(iter(retries.tasks.values()))
    await retries.close()
    assert task.cancelled() and retries.tasks == {}


def test_a_failure_after_the_loop_closed_starts_nothing():
    loop = asyncio.new_event_loop()
    retries = ApplyRetries(loop, lambda ns, n: True, (1.0,))
    loop.close()
    retries.failed("ns", "tiny")  # no RuntimeError from a closed loop
    assert retries.tasks == {}


def _refusal(status: int, message: str) -> Exception:
    from kubernetes.client.exceptions import ApiException

    exc = ApiException(status=status, reason="x")
    exc.body = json.dumps({"kind": "Status", "message": message})
    return exc


def test_a_field_the_api_server_does_not_know_is_a_refusal_not_an_outage():
    # Server-side apply answers a misspelt field (a pod template's nodeSelecter) with a
    # 500; retrying it every 30 s would repeat the same ApplyFailed Warning forever.
    from kvferry_operator.kube import is_transient

    typo = _refusal(
        500,
        "failed to create typed patch object (ns/x-decode; apps/v1, Kind=StatefulSet): "
        ".spec.template.spec.nodeSelecter: field not declared in schema",
    )
    assert not is_transient(typo)
    assert is_transient(_refusal(500, "etcdserver: request timed out"))
    assert is_transient(_refusal(503, "the server is currently unable to handle the request"))
