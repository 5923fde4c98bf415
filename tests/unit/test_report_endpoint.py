"""The report endpoint: who may report what, what bad input gets, and its bounds
under load (TokenReviews, caches, per-pod rate), against fake API answers."""

from __future__ import annotations

import asyncio
import base64
import copy
import json
import random
import threading
import time

import msgspec
import pytest

from kvferry_operator import api
from kvferry_operator import report_endpoint as endpoint
from kvferry_operator.reports import Received, ReportStore
from kvferry_wire import report as wire
from tests.hostile_reports import JUNK, report_body, report_corpus

NS, SERVER, POD, UID = "serving", "tiny", "tiny-decode-0", "pod-uid-1"
STS_UID = "sts-uid-1"
NOW = 100.0


def jwt(pod: str = POD, aud: str = "kvferry", exp: float = NOW + 3600, salt: str = "") -> str:
    """A token shaped like a projected ServiceAccount token (unsigned: the fake
    TokenReview below is what decides, as the API server does for real)."""

    def part(obj: dict) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).rstrip(b"=").decode()

    claims = {"aud": [aud], "exp": exp, "kubernetes.io": {"namespace": NS, "pod": {"name": pod}}}
    sig = base64.urlsafe_b64encode(f"sig{salt}".encode()).rstrip(b"=").decode()
    return f"{part({'alg': 'RS256'})}.{part(claims)}.{sig}"


GOOD_TOKEN = jwt()
UNBOUND = jwt(salt="unbound")
OTHER_AUDIENCE_REVIEWED = jwt(salt="other-audience")


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
    if token == UNBOUND:
        return {
            "authenticated": True,
            "audiences": ["kvferry"],
            "user": {"username": f"system:serviceaccount:{NS}:default"},
        }
    if token == OTHER_AUDIENCE_REVIEWED:
        return {
            "authenticated": True,
            "audiences": ["https://kubernetes.default.svc"],
            "user": {"username": f"system:serviceaccount:{NS}:default"},
        }
    return {"authenticated": False, "error": "invalid bearer token"}


def make_pod(name: str = POD, uid: str = UID, role: str = "decode", owner: str | None = None):
    sts = owner if owner is not None else f"{SERVER}-{role}"
    refs = [{"kind": "StatefulSet", "name": sts, "uid": STS_UID, "controller": True}]
    return {
        "metadata": {
            "name": name,
            "uid": uid,
            "labels": {api.LABEL_SERVER: SERVER, api.LABEL_ROLE: role},
            "ownerReferences": refs if owner != "" else [],
        }
    }


def make_sts(role: str = "decode", uid: str = STS_UID, managed_by: str = api.FIELD_MANAGER):
    return {
        "metadata": {
            "name": f"{SERVER}-{role}",
            "uid": uid,
            "labels": {
                api.LABEL_MANAGED_BY: managed_by,
                api.LABEL_INSTANCE: SERVER,
                api.LABEL_ROLE: role,
            },
            "ownerReferences": [
                {"kind": api.SERVER_KIND, "name": SERVER, "uid": "srv", "controller": True}
            ],
        }
    }


class FakeApi:
    """What the endpoint asks the API server, with call counts."""

    def __init__(self) -> None:
        self.pods = {(NS, POD): make_pod()}
        self.sets = {(NS, f"{SERVER}-decode"): make_sts(), (NS, f"{SERVER}-prefill"): make_sts()}
        self.pod_gets = 0
        self.reviews = 0

    def review(self, token: str) -> dict:
        self.reviews += 1
        return review(token)

    def get_pod(self, namespace: str, name: str) -> dict | None:
        self.pod_gets += 1
        return self.pods.get((namespace, name))

    def get_statefulset(self, namespace: str, name: str) -> dict | None:
        return self.sets.get((namespace, name))


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


async def make_client(aiohttp_client, fake: FakeApi | None = None, clock=None, **limits):
    fake = fake or FakeApi()
    store = ReportStore()
    app = endpoint.app_factory(
        store,
        lambda token: fake.review(token),  # late-bound: a test may swap them
        lambda ns, name: fake.get_pod(ns, name),
        lambda ns, name: fake.get_statefulset(ns, name),
        clock=clock or (lambda: NOW),
        limits=endpoint.Limits(**limits),
    )
    c = await aiohttp_client(app)
    c.store, c.fake = store, fake
    return c


@pytest.fixture
async def client(aiohttp_client):
    return await make_client(aiohttp_client)


async def until(condition, timeout: float = 5.0) -> None:
    """Wait for a counter the endpoint keeps to reach a state (fails after ``timeout``)."""
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.005)


async def post(client, data, token: str | None = GOOD_TOKEN):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    resp = await client.post("/v1/reports", data=data, headers=headers)
    return resp.status, (await resp.json())


# ------------------------------------------------------------------ who may report


async def test_a_pods_own_report_is_accepted(client):
    status, out = await post(client, body())
    assert (status, out) == (202, {"accepted": True})
    (received,) = client.store.get(NS, SERVER)
    assert received.report.pod == POD and received.received_at == NOW
    assert received.pod_uid == UID


@pytest.mark.parametrize(
    ("token", "fragment"),
    [
        (None, "missing bearer token"),
        ("forged", "not a ServiceAccount token"),
        (jwt(salt="forged"), "invalid bearer token"),
        (UNBOUND, "not bound to a pod"),
        (jwt(aud="https://kubernetes.default.svc"), "audience"),
        (OTHER_AUDIENCE_REVIEWED, "audience"),
        (jwt(exp=NOW - 1), "expired"),
    ],
)
async def test_unauthenticated_reports_get_401_and_change_nothing(client, token, fragment):
    status, out = await post(client, body(), token=token)
    assert status == 401 and fragment in out["error"]
    assert client.store.servers() == []


async def test_strings_that_are_no_service_account_token_cost_no_token_review(client):
    """A flood of garbage bearer strings must not reach the API server."""
    for token in ("x" * 40, "a.b", "a.!!!.c", "e30.e30.e30", jwt(pod="")):
        status, _ = await post(client, body(), token=token)
        assert status == 401
    assert client.fake.reviews == 0


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"server": "other"}, "belongs to server 'tiny', not 'other'"),
        ({"pod": "tiny-decode-1"}, "cannot report for pod tiny-decode-1"),
        ({"namespace": "elsewhere"}, "cannot report for elsewhere"),
        ({"role": "prefill"}, "has role 'decode'; its report says 'prefill'"),
    ],
)
async def test_reports_for_another_server_pod_or_role_get_403(client, overrides, fragment):
    status, out = await post(client, body(**overrides))
    assert status == 403 and fragment in out["error"]
    assert client.store.servers() == []


@pytest.mark.parametrize(
    ("pod", "sts", "fragment"),
    [
        # kubectl debug --copy-to / a hand-made pod with our labels: no controller.
        (make_pod(owner=""), make_sts(), "is not a pod of StatefulSet tiny-decode"),
        (make_pod(owner="lookalike"), make_sts(), "is not a pod of StatefulSet tiny-decode"),
        (make_pod(), make_sts(uid="another"), "names another StatefulSet"),
        (make_pod(), make_sts(managed_by="someone"), "is not the operator's"),
        (make_pod(), None, "StatefulSet tiny-decode does not exist"),
    ],
    ids=["no-owner", "other-owner", "sts-uid", "sts-not-ours", "no-sts"],
)
async def test_only_members_of_the_operators_statefulset_may_report(
    aiohttp_client, pod, sts, fragment
):
    fake = FakeApi()
    fake.pods[(NS, POD)] = pod
    fake.sets[(NS, f"{SERVER}-decode")] = sts
    client = await make_client(aiohttp_client, fake)
    status, out = await post(client, body())
    assert status == 403 and fragment in out["error"], out
    assert client.store.servers() == []


def test_a_pod_named_outside_the_statefulset_is_refused():
    pod = make_pod(name="tiny-decode-debug")
    with pytest.raises(endpoint.Forbidden, match="not named as a member"):
        endpoint.check_membership(pod, make_sts(), SERVER, "decode")


async def test_a_replaced_pods_token_is_refused(client):
    client.fake.pods[(NS, POD)] = make_pod(uid="new-uid")
    status, out = await post(client, body())
    assert status == 403 and "replaced" in out["error"]


# ------------------------------------------------------------------ what a report may say


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        (b"{not json", "not JSON"),
        (body(version=3), "report version 3; this operator reads 1 and 2"),
        (body(transport="Infiniband"), "transport 'Infiniband' is not one of"),
        (body(role="router"), "neither prefill nor decode"),
        (body(gaps={"bounds": [1, 2], "counts": [0, 0, 0]}), "gaps.bounds differ"),
        (body(startedAt="yesterday"), "malformed report"),
        # One bad byTurn key used to stop every later publish of the server.
        (body(byTurn={"x": {}}), "byTurn key 'x' is not one of 1, 2, 3"),
        (body(byTurn={"9": {}}), "byTurn key '9'"),
        (body(byTurn={"1": {"turns": -1}}), "byTurn['1'].turns is -1"),
        (body(outcomes={"reused": -5}), "outcomes['reused'] is -5"),
        (body(outcomes={"x" * 200: 1}), "outcomes key"),
        (body(handles={"stolen": 1}), "handles key 'stolen' is not one of consumed"),
        (body(pinned={"bytes": 2**60}), "pinned.bytes is"),
        (body(startedAt=1e400), "malformed report"),  # JSON has no infinity: it overflows
        (body(transfer={"seconds": -1.0}), "transfer.seconds is -1.0"),
        (body(engine={"kvUsage": 7.0}), "engine.kvUsage is 7.0: it is a fraction"),
        (body(engineBuild="b" * 5000), "engineBuild is 5000 characters long"),
        (body(pod="Tiny_Decode"), "pod 'Tiny_Decode' is not a Kubernetes name"),
        (body(namespace="a" * 64), "is not a Kubernetes name"),
        (body(server=""), "server '' is not a Kubernetes name"),
        (body(gaps={"bounds": list(wire.GAP_BOUNDS), "counts": [0] * 26, "sum": -3}), "gaps.sum"),
    ],
)
async def test_malformed_reports_get_400_naming_the_field(client, data, fragment):
    status, out = await post(client, data)
    assert status == 400 and fragment in out["error"], out
    assert client.store.servers() == []


async def test_a_version_1_report_is_still_read(client):
    """Sidecars of the previous release keep reporting during an operator upgrade."""
    raw = msgspec.json.decode(body(version=1))
    del raw["transportReason"], raw["transfer"]["transfers"]
    status, _ = await post(client, msgspec.json.encode(raw))
    assert status == 202
    (received,) = client.store.get(NS, SERVER)
    assert (received.report.transport_reason, received.report.transfer.transfers) == ("", 0)


def deep_in(field: str, depth: int) -> bytes:
    """A good report with ``field`` set to a list nested ``depth`` deep (as bytes:
    json.dumps cannot write it)."""
    raw = msgspec.json.decode(body())
    raw.pop(field, None)
    head = msgspec.json.encode(raw)[:-1]
    return head + b',"%s":' % field.encode() + b"[" * depth + b"1" + b"]" * depth + b"}"


@pytest.mark.parametrize("depth", [1_000, 100_000])
@pytest.mark.parametrize("field", ["version", "outcomes", "x-unknown"])
def test_decode_refuses_nesting_past_its_stack_with_a_report_error(field, depth):
    """Bug prevented: msgspec raised RecursionError out of decode (the endpoint's 500)."""
    with pytest.raises(wire.ReportError, match="nested too deeply"):
        wire.decode(deep_in(field, depth))


def test_the_depth_bound_counts_arrays_and_objects_not_brackets_in_strings():
    """The bound is explicit, the same whatever the caller's stack. Bug prevented:
    with only the decoder's RecursionError, whether 1,000 deep was refused depended
    on the interpreter's recursion limit and the stack (in the whole unit tier it
    decoded, and the version check printed all of it)."""
    wire.decode(deep_in("x-unknown", wire.MAX_DEPTH - 1))  # the report object is one
    with pytest.raises(wire.ReportError, match="over 32 levels"):
        wire.decode(deep_in("x-unknown", wire.MAX_DEPTH))
    wire.decode(body(engineBuild='[{"[' * 200, transportReason="\\" + "[" * 300))


async def test_a_report_nested_1000_deep_gets_400_not_500(client):
    status, out = await post(client, deep_in("x-unknown", 1_000))
    assert status == 400 and "nested too deeply" in out["error"], out
    assert client.store.servers() == []


BASE_REPORT = msgspec.json.decode(body(outcomes={"reused": 3}, handles={"consumed": 2}))


def test_a_thousand_generated_reports_decode_or_get_a_report_error():
    """The generator the cluster tier pushes to the real operator, against decode
    alone: every body is a Report or a ReportError, nothing else escapes. A fixed
    corpus of exactly 1,000 (hypothesis could end a run early, and its count varied)."""
    verdicts = {"decoded": 0, "refused": 0}
    for raw in report_corpus(BASE_REPORT, 1000):
        try:
            wire.decode(raw)
        except wire.ReportError:
            verdicts["refused"] += 1
        else:
            verdicts["decoded"] += 1
    assert sum(verdicts.values()) == 1000, verdicts
    assert verdicts["refused"] >= 500 and verdicts["decoded"] >= 50, verdicts


@pytest.mark.parametrize("where", ["start", "inside-a-string"])
def test_a_report_that_is_no_utf8_is_a_report_error(where: str):
    """Bug prevented (found by the generator): msgspec raised UnicodeDecodeError,
    which escaped decode, and the endpoint answered 500."""
    good = body()
    raw = b"\xff\xfe" + good if where == "start" else good.replace(b'"tiny"', b'"ti\xffny"')
    with pytest.raises(wire.ReportError):
        wire.decode(raw)


def test_no_generated_report_changes_the_junk_the_next_one_draws():
    """Bug prevented (the flaky thousand-reports test): junk lists and dicts were
    shared between bodies, a later mutation of the same body wrote into them (a field
    replaced by a dict, then a field under it), they grew into each other and the
    generator failed with "Circular reference detected". A two-level base hits that
    path often; the corpus is then the same bodies for the same seed."""
    before = copy.deepcopy(JUNK)
    rng = random.Random(3)
    for _ in range(3000):
        report_body(rng, {"a": {"b": 1, "c": {"d": 2}}, "e": 3})
    assert before == JUNK
    assert report_corpus(BASE_REPORT, 200, seed=1) == report_corpus(BASE_REPORT, 200, seed=1)


async def test_a_thousand_generated_reports_get_202_400_or_413_from_the_endpoint(client):
    """The same corpus through the endpoint in process: never a 5xx."""
    statuses: dict[int, int] = {}
    for raw in report_corpus(BASE_REPORT, 1000, seed=21):
        status, _ = await post(client, raw)
        statuses[status] = statuses.get(status, 0) + 1
    # 403: a mutated pod or namespace is not the token's; 429: one pod, 1,000 reports.
    assert set(statuses) <= {202, 400, 403, 413, 429}, statuses
    assert sum(statuses.values()) == 1000


async def test_oversized_reports_get_413(client):
    status, out = await post(client, b"x" * (wire.MAX_REPORT_BYTES + 10))
    assert status == 413 and "larger than" in out["error"]
    assert client.store.servers() == []


async def test_a_report_sent_in_pieces_is_read_whole(client):
    """A body that arrives in several chunks is one report, not a truncated one
    (a single read() may return part of it: that was a bogus 400)."""
    raw = body(outcomes={"reused": 3}, engineBuild="b" * 1000)

    async def chunks():
        for i in range(0, len(raw), 500):
            yield raw[i : i + 500]
            await asyncio.sleep(0.01)

    status, out = await post(client, chunks())
    assert (status, out) == (202, {"accepted": True})


async def test_a_body_that_never_finishes_gets_408_in_time(aiohttp_client):
    client = await make_client(aiohttp_client, read_timeout=0.3)

    async def trickle():
        yield body()[:10]
        await asyncio.sleep(5)
        yield b"}"

    started = time.monotonic()
    status, out = await post(client, trickle())
    assert "did not arrive in time" in out["error"]
    assert status == 408 and time.monotonic() - started < 3


# ------------------------------------------------------------------ bounds under load


async def test_token_reviews_run_a_few_at_a_time_and_excess_waits_get_503(aiohttp_client):
    fake = FakeApi()
    release = threading.Event()
    running, peak = 0, 0
    lock = threading.Lock()

    def slow_review(token: str) -> dict:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        release.wait(5)
        with lock:
            running -= 1
        return review(token)

    fake.review = slow_review
    client = await make_client(aiohttp_client, fake, review_concurrency=2, review_queue=3)
    tasks = [asyncio.ensure_future(post(client, body(), token=jwt(salt=str(i)))) for i in range(8)]
    # The three beyond 2 running + 3 waiting are answered at once, while the others wait.
    pending, answered = set(tasks), 0
    while answered < 3:
        done, pending = await asyncio.wait(pending, timeout=5, return_when=asyncio.FIRST_COMPLETED)
        assert done, "no request was answered while the reviews were held"
        answered += len(done)
    assert answered == 3
    release.set()
    results = await asyncio.gather(*tasks)
    statuses = sorted(s for s, _ in results)
    assert peak == 2
    # 2 running + 3 waiting get an answer (refused: forged); the other 3 are told to retry.
    assert statuses == [401] * 5 + [503] * 3
    assert all("retry" in out["error"] for s, out in results if s == 503)


async def test_a_token_review_that_hangs_times_out_with_503(aiohttp_client):
    fake = FakeApi()
    stuck = threading.Event()
    fake.review = lambda token: (stuck.wait(5), review(token))[1]
    client = await make_client(aiohttp_client, fake, review_timeout=0.2)
    started = time.monotonic()
    status, out = await post(client, body())
    stuck.set()
    assert status == 503 and "TokenReview took longer" in out["error"]
    assert time.monotonic() - started < 2


async def test_api_server_errors_are_503_not_500(aiohttp_client):
    fake = FakeApi()

    def down(*_):
        raise ConnectionRefusedError("connection refused")

    fake.review = down
    client = await make_client(aiohttp_client, fake)
    status, out = await post(client, body())
    assert status == 503 and "retry" in out["error"]
    fake.review, fake.get_pod = FakeApi().review, down
    status, out = await post(client, body())
    assert status == 503


async def test_identical_tokens_in_flight_share_one_review(aiohttp_client):
    fake = FakeApi()
    gate = threading.Event()
    calls = []
    fake.review = lambda token: calls.append(token) or (gate.wait(5), review(token))[1]
    client = await make_client(aiohttp_client, fake)
    tasks = [asyncio.ensure_future(post(client, body())) for _ in range(5)]
    reviewer = client.app[endpoint.REVIEWER_KEY]
    await until(lambda: reviewer.shared == 4)
    gate.set()
    assert [s for s, _ in await asyncio.gather(*tasks)] == [202] * 5
    assert len(calls) == 1 and reviewer.reviews == 1


async def test_refused_tokens_are_cached_apart_and_cannot_evict_good_ones(aiohttp_client):
    client = await make_client(aiohttp_client, refused_cache_size=4, review_cache_size=4)
    assert (await post(client, body()))[0] == 202
    for i in range(20):
        assert (await post(client, body(), token=jwt(salt=f"forged{i}")))[0] == 401
    reviewer = client.app[endpoint.REVIEWER_KEY]
    assert len(reviewer.refused) == 4 and len(reviewer.accepted) == 1
    before = client.fake.reviews
    assert (await post(client, body()))[0] == 202
    assert client.fake.reviews == before  # the good token is still cached


async def test_refused_reviews_expire_sooner_than_accepted_ones(aiohttp_client):
    now = [NOW]
    client = await make_client(aiohttp_client, clock=lambda: now[0])
    forged = jwt(salt="forged")
    assert (await post(client, body()))[0] == 202
    assert (await post(client, body(), token=forged))[0] == 401
    assert client.fake.reviews == 2
    now[0] = NOW + 4.9
    assert (await post(client, body(), token=forged))[0] == 401
    assert client.fake.reviews == 2  # still the cached refusal
    now[0] = NOW + endpoint.Limits().refused_ttl
    assert (await post(client, body(), token=forged))[0] == 401
    assert client.fake.reviews == 3  # the refusal expired: reviewed again
    assert (await post(client, body()))[0] == 202
    assert client.fake.reviews == 3  # the accepted review is still cached
    assert endpoint.Limits().refused_ttl < endpoint.Limits().review_ttl


async def test_caches_are_size_bound_lru(aiohttp_client):
    client = await make_client(aiohttp_client, review_cache_size=3)
    cache = client.app[endpoint.REVIEWER_KEY].accepted
    for k in "abc":
        cache[k] = {"k": k}
    cache.get("a")  # recently used: survives
    cache["d"] = {"k": "d"}
    assert [k for k in "abcd" if cache.get(k)] == ["a", "c", "d"]


async def test_a_pod_that_reports_too_often_gets_429(aiohttp_client):
    client = await make_client(aiohttp_client, pod_report_burst=3, pod_reports_per_second=0.001)
    statuses = [(await post(client, body()))[0] for _ in range(5)]
    assert statuses == [202, 202, 202, 429, 429]


async def test_pod_lookups_are_cached_and_refreshed_when_the_uid_changes(client):
    for _ in range(5):
        assert (await post(client, body()))[0] == 202
    assert client.fake.pod_gets == 1
    # The cached pod has another uid than the token's: look again (a replaced pod).
    client.app[endpoint.LOOKUPS_KEY].pods[(NS, POD)] = make_pod(uid="old-uid")
    assert (await post(client, body()))[0] == 202
    assert client.fake.pod_gets == 2


async def test_requests_beyond_the_in_flight_bound_get_503(aiohttp_client):
    fake = FakeApi()
    gate = threading.Event()
    fake.review = lambda token: (gate.wait(5), review(token))[1]
    client = await make_client(aiohttp_client, fake, max_in_flight=2)
    tasks = [asyncio.ensure_future(post(client, body())) for _ in range(2)]
    reviewer = client.app[endpoint.REVIEWER_KEY]
    await until(lambda: reviewer.reviews == 1 and reviewer.shared == 1)  # both held
    status, out = await post(client, body())
    gate.set()
    await asyncio.gather(*tasks)
    assert status == 503 and "too many reports at once" in out["error"]


# ------------------------------------------------------------------ the store


def test_the_store_prunes_rows_and_forgets_an_empty_server():

    store = ReportStore()
    rep = msgspec.json.decode(body(), type=wire.Report)
    store.put(Received(rep, NOW))
    store.prune(NS, SERVER, [POD])
    assert store.servers() == [] and store.get(NS, SERVER) == []


def _rep(started: float, generated: float) -> wire.Report:
    return msgspec.json.decode(body(startedAt=started, generatedAt=generated), type=wire.Report)


def _kept(store: ReportStore) -> tuple[float, float]:
    (row,) = store.get(NS, SERVER)
    return row.report.started_at, row.report.generated_at


def test_an_older_report_never_replaces_a_newer_one():
    """Two pushes of one pod in flight (a slow TokenReview, a retry) land out of
    order: the earlier generatedAt once replaced the later, and KVCacheStatus went
    back in time. Kept: the newest per pod; a restarted sidecar's first report (a
    later startedAt: its counters start again) wins whatever its generatedAt."""
    store = ReportStore()
    assert store.put(Received(_rep(100.0, 500.0), NOW, UID))
    assert not store.put(Received(_rep(100.0, 485.0), NOW + 1, UID))  # late: older
    assert _kept(store) == (100.0, 500.0)
    assert store.put(Received(_rep(100.0, 515.0), NOW + 2, UID))
    assert store.put(Received(_rep(100.0, 515.0), NOW + 3, UID))  # the same again: arrived
    assert _kept(store) == (100.0, 515.0)
    assert store.get(NS, SERVER)[0].received_at == NOW + 3
    # The sidecar restarted: its first report, with a clock a little behind.
    assert store.put(Received(_rep(510.0, 512.0), NOW + 4, UID))
    assert _kept(store) == (510.0, 512.0)
    # The old process's last push, landing after it: refused.
    assert not store.put(Received(_rep(100.0, 530.0), NOW + 5, UID))
    assert _kept(store) == (510.0, 512.0)
    # A replaced pod (another uid; another node's clock, maybe behind): the new pod wins.
    assert store.put(Received(_rep(50.0, 60.0), NOW + 6, "pod-uid-2"))
    assert _kept(store) == (50.0, 60.0)


async def test_the_endpoint_keeps_the_newest_report_of_a_pod(client):
    for generated in (20.0, 10.0):
        status, out = await post(client, body(startedAt=5.0, generatedAt=generated))
        assert (status, out) == (202, {"accepted": True})  # authenticated: no retry needed
    (received,) = client.store.get(NS, SERVER)
    assert received.report.generated_at == 20.0


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


@pytest.mark.parametrize(
    ("token", "fragment"),
    [
        ("forged", "use the pod's projected kvferry token"),
        ("a.b", "use the pod's projected kvferry token"),
        (jwt().rsplit(".", 1)[0] + ".", "use the pod's projected kvferry token"),
        (f"{_b64(b'not json')}.{_b64(b'{}')}.{_b64(b'sig')}", "projected kvferry token"),
        (f"{_b64(b'{}')}.{_b64(b'[1]')}.{_b64(b'sig')}", "unreadable claims"),
        (f"{_b64(b'{}')}.{_b64(b'not json')}.{_b64(b'sig')}", "unreadable claims"),
        (jwt() + "x" * endpoint.MAX_TOKEN_CHARS, "use the pod's projected kvferry token"),
        (jwt(aud="other"), "audience"),
        (jwt(exp=NOW - 1), "expired"),
    ],
)
def test_token_claims_refuses_what_is_no_projected_token(token: str, fragment: str):
    with pytest.raises(endpoint.Unauthorized) as refused:
        endpoint.token_claims(token, NOW)
    assert fragment in str(refused.value)


def test_token_claims_reads_a_projected_token_without_its_signature():
    claims = endpoint.token_claims(jwt(), NOW)
    assert claims["kubernetes.io"]["pod"]["name"] == POD and claims["aud"] == ["kvferry"]


# ------------------------------------------------------------------ the live policy in the answer

POLICIES = {
    (NS, SERVER): {"version": 1, "revision": "tiny-rev", "retentionSeconds": 120},
    (NS, "other"): {"version": 1, "revision": "other-rev", "retentionSeconds": 999},
}


async def policy_client(aiohttp_client, asked: list):
    fake = FakeApi()

    def policy_for(namespace: str, server: str) -> dict | None:
        asked.append((namespace, server))
        return POLICIES.get((namespace, server))

    app = endpoint.app_factory(
        ReportStore(),
        fake.review,
        fake.get_pod,
        fake.get_statefulset,
        clock=lambda: NOW,
        policy_for=policy_for,
    )
    return await aiohttp_client(app)


async def test_the_answer_carries_the_pods_own_servers_policy(aiohttp_client):
    asked: list = []
    c = await policy_client(aiohttp_client, asked)
    assert await post(c, body()) == (202, {"accepted": True, "policy": POLICIES[(NS, SERVER)]})
    assert asked == [(NS, SERVER)]


async def test_a_report_naming_another_server_learns_no_policy(aiohttp_client):
    # The pod is tiny's: a report that says "other" is refused before any policy is
    # looked up, so no sidecar can read another server's policy by naming it.
    asked: list = []
    c = await policy_client(aiohttp_client, asked)
    status, out = await post(c, body(server="other"))
    assert status == 403 and "policy" not in out
    assert asked == []


async def test_no_policy_yet_answers_accepted_alone(client):
    # The default policy_for knows none (before the publisher's first pass).
    assert await post(client, body()) == (202, {"accepted": True})
