"""The report endpoint: who may report what, and what bad input gets."""

from __future__ import annotations

import msgspec
import pytest

from kvferry_operator import api
from kvferry_operator import report_endpoint as endpoint
from kvferry_wire import report as wire

NS, SERVER, POD, UID = "serving", "tiny", "tiny-decode-0", "pod-uid-1"
GOOD_TOKEN = "good-token"


def review(token: str) -> dict:
    if token == GOOD_TOKEN:
        return {
            "authenticated": True,
            "audiences": ["kvferry"],
            "user": {
                "username": f"system:serviceaccount:{NS}:default",
                "extra": {endpoint.POD_NAME_EXTRA: [POD], endpoint.POD_UID_EXTRA: [UID]},
            },
        }
    if token == "unbound":
        return {
            "authenticated": True,
            "audiences": ["kvferry"],
            "user": {"username": f"system:serviceaccount:{NS}:default"},
        }
    if token == "other-audience":
        return {
            "authenticated": True,
            "audiences": ["https://kubernetes.default.svc"],
            "user": {"username": f"system:serviceaccount:{NS}:default"},
        }
    return {"authenticated": False, "error": "invalid bearer token"}


PODS = {
    (NS, POD): {"metadata": {"name": POD, "uid": UID, "labels": {api.LABEL_SERVER: SERVER}}},
}


def get_pod(namespace: str, name: str) -> dict | None:
    return PODS.get((namespace, name))


def body(**overrides) -> bytes:
    rep = wire.Report(
        version=wire.REPORT_VERSION,
        server=SERVER,
        namespace=NS,
        pod=POD,
        role="decode",
        started_at=1.0,
        generated_at=2.0,
    )
    raw = msgspec.json.decode(wire.encode(rep))
    raw.update(overrides)
    return msgspec.json.encode(raw)


@pytest.fixture
async def client(aiohttp_client):
    store = endpoint.ReportStore()
    app = endpoint.app_factory(store, review, get_pod, clock=lambda: 100.0)
    c = await aiohttp_client(app)
    c.store = store
    return c


async def post(client, data: bytes, token: str | None = GOOD_TOKEN):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    resp = await client.post("/v1/reports", data=data, headers=headers)
    return resp.status, (await resp.json())


async def test_a_pods_own_report_is_accepted(client):
    status, out = await post(client, body())
    assert (status, out) == (202, {"accepted": True})
    (received,) = client.store.get(NS, SERVER)
    assert received.report.pod == POD and received.received_at == 100.0


@pytest.mark.parametrize(
    ("token", "fragment"),
    [
        (None, "missing bearer token"),
        ("forged", "invalid bearer token"),
        ("unbound", "not bound to a pod"),
        ("other-audience", "audience"),
    ],
)
async def test_unauthenticated_reports_get_401_and_change_nothing(client, token, fragment):
    status, out = await post(client, body(), token=token)
    assert status == 401 and fragment in out["error"]
    assert client.store.servers() == []


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"server": "other"}, "belongs to server 'tiny', not 'other'"),
        ({"pod": "tiny-decode-1"}, "cannot report for pod tiny-decode-1"),
        ({"namespace": "elsewhere"}, "cannot report for elsewhere"),
    ],
)
async def test_reports_for_another_server_or_pod_get_403(client, overrides, fragment):
    status, out = await post(client, body(**overrides))
    assert status == 403 and fragment in out["error"]
    assert client.store.servers() == []


async def test_a_replaced_pods_token_is_refused(client):
    PODS[(NS, POD)]["metadata"]["uid"] = "new-uid"
    try:
        status, out = await post(client, body())
    finally:
        PODS[(NS, POD)]["metadata"]["uid"] = UID
    assert status == 403 and "replaced" in out["error"]


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        (b"{not json", "not JSON"),
        (body(version=3), "report version 3; this operator reads 1 and 2"),
        (body(transport="Infiniband"), "transport 'Infiniband' is not one of"),
        (body(role="router"), "neither prefill nor decode"),
        (body(gaps={"bounds": [1, 2], "counts": [0, 0, 0]}), "gaps.bounds differ"),
        (body(startedAt="yesterday"), "malformed report"),
    ],
)
async def test_malformed_reports_get_400(client, data, fragment):
    status, out = await post(client, data)
    assert status == 400 and fragment in out["error"]
    assert client.store.servers() == []


async def test_a_version_1_report_is_still_read(client):
    """Sidecars of the previous release keep reporting during an operator upgrade."""
    raw = msgspec.json.decode(body(version=1))
    del raw["transportReason"], raw["transfer"]["transfers"]
    status, _ = await post(client, msgspec.json.encode(raw))
    assert status == 202
    (received,) = client.store.get(NS, SERVER)
    assert (received.report.transport_reason, received.report.transfer.transfers) == ("", 0)


async def test_oversized_reports_get_413(client):
    status, out = await post(client, b"x" * (wire.MAX_REPORT_BYTES + 10))
    assert status == 413 and "larger than" in out["error"]
    assert client.store.servers() == []


def test_token_reviews_are_cached_by_hash():
    calls = []
    cache = endpoint._TokenCache(lambda t: calls.append(t) or {"ok": 1}, clock=lambda: 0.0)
    cache("t")
    cache("t")
    assert calls == ["t"]
    assert "t" not in str(cache._cache)
