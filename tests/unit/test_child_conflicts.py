"""A child name taken by an object the server does not control: nothing is applied to
that object, and the server says so (issue 20, item 11)."""

from __future__ import annotations

import copy
import logging
from typing import Any

import kopf
import pytest

from kvferry_operator import api, handlers, ownership, render, status
from kvferry_operator.settings import Settings
from tests.manifests import server
from tests.unit.observed import SETTLED

LOG = logging.getLogger("test")
SETTINGS = Settings(sidecar_image="", resync_seconds=60)
UID = "uid-postgres"


def postgres_server() -> dict[str, Any]:
    obj = server()
    obj["metadata"].update(name="postgres", namespace="db", uid=UID, generation=1)
    return obj


def service(name: str, owners: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": "db", "uid": f"uid-svc-{name}"}
    if owners is not None:
        meta["ownerReferences"] = owners
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta, "spec": {"port": 5432}}


def owner(name: str, uid: str, controller: bool = True, kind: str = api.SERVER_KIND) -> dict:
    return {
        "apiVersion": api.API_VERSION,
        "kind": kind,
        "name": name,
        "uid": uid,
        "controller": controller,
    }


class ClusterKube:
    """Objects by (kind, name) in one namespace; every read and apply recorded."""

    def __init__(self, *objects: dict[str, Any]) -> None:
        self.objects = {(o["kind"], o["metadata"]["name"]): o for o in objects}
        self.gets: list[tuple[str, str]] = []
        self.applied: list[tuple[str, str]] = []
        self.statuses: list[dict[str, Any]] = []

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None:
        self.gets.append((kind, name))
        found = self.objects.get((kind, name))
        return copy.deepcopy(found) if found is not None else None

    def apply(self, child: dict[str, Any]) -> dict[str, Any]:
        key = (child["kind"], child["metadata"]["name"])
        self.applied.append(key)
        self.objects[key] = copy.deepcopy(child)
        return {**child, "status": {"phase": "x"}}

    def patch_status(self, api_version, kind, namespace, name, body) -> None:
        if kind == api.SERVER_KIND:
            self.statuses.append(body)


@pytest.fixture(autouse=True)
def quiet_events(monkeypatch):
    monkeypatch.setattr(kopf, "warn", lambda *a, **kw: None)
    monkeypatch.setattr(kopf, "info", lambda *a, **kw: None)


def children_of(obj: dict[str, Any]) -> list[tuple[str, str]]:
    return [
        (c["kind"], c["metadata"]["name"])
        for c in render.render(api.parse_server(obj), SETTINGS.render_context())
    ]


@pytest.mark.parametrize(
    "existing",
    [
        service("postgres"),  # a user's own Service, no owner at all
        service("postgres", [owner("db", "uid-deploy", kind="Deployment")]),
        service("postgres", [owner("postgres", "uid-earlier")]),  # an earlier server's
        service("postgres", [owner("postgres", UID, controller=False)]),  # not the controller
    ],
    ids=["no-owner", "another-controller", "earlier-server", "not-controller"],
)
def test_an_object_we_do_not_control_is_never_applied_to(existing):
    kube = ClusterKube(existing)
    before = copy.deepcopy(existing)
    result = handlers.apply_children(postgres_server(), kube, SETTINGS, LOG)
    assert ("Service", "postgres") not in kube.applied
    assert kube.objects[("Service", "postgres")] == before
    # Every other child still lands: one taken name must not block the rest.
    others = [c for c in children_of(postgres_server()) if c != ("Service", "postgres")]
    assert kube.applied == others
    assert result is handlers.Applied.NEVER


@pytest.mark.parametrize(
    "existing",
    [
        {**service("postgres-sidecar"), "kind": "ConfigMap", "data": {"sidecar.json": "{}"}},
        service("postgres-decode"),  # the headless Service the pods find their peers by
        service("postgres-prefill"),
    ],
    ids=["configmap", "decode-peers", "prefill-peers"],
)
def test_pods_never_start_on_someone_elses_settings_or_peers(existing):
    kube = ClusterKube(existing)
    claims = ownership.Claims()
    handlers.apply_children(postgres_server(), kube, SETTINGS, LOG, claims=claims)
    applied_kinds = {kind for kind, _ in kube.applied}
    assert "StatefulSet" not in applied_kinds
    assert (existing["kind"], existing["metadata"]["name"]) not in kube.applied
    assert {"Service", "PodDisruptionBudget", api.STATUS_KIND} <= applied_kinds
    # A watch event of one StatefulSet does not bring it in behind the conflict's back.
    kube.applied.clear()
    handlers.apply_children(
        postgres_server(),
        kube,
        SETTINGS,
        LOG,
        claims=claims,
        only=("StatefulSet", "postgres-decode"),
    )
    assert "StatefulSet" not in {kind for kind, _ in kube.applied}
    # Once the name is free, the next pass applies everything.
    del kube.objects[(existing["kind"], existing["metadata"]["name"])]
    assert handlers.apply_children(postgres_server(), kube, SETTINGS, LOG, claims=claims)
    assert ("StatefulSet", "postgres-decode") in kube.applied


def test_a_server_named_like_another_servers_child_takes_nothing_from_it():
    # Servers chat and chat-decode both render Service chat-decode.
    chat = server()
    chat["metadata"].update(name="chat", namespace="db", uid="uid-chat")
    kube = ClusterKube()
    assert handlers.apply_children(chat, kube, SETTINGS, LOG)
    held = copy.deepcopy(kube.objects[("Service", "chat-decode")])
    other = server()
    other["metadata"].update(name="chat-decode", namespace="db", uid="uid-chat-decode")
    kube.applied.clear()
    claims = ownership.Claims()
    assert not handlers.apply_children(other, kube, SETTINGS, LOG, claims=claims)
    assert ("Service", "chat-decode") not in kube.applied
    assert kube.objects[("Service", "chat-decode")] == held
    (conflict,) = claims.conflicts(("db", "chat-decode"))
    assert conflict == ownership.Conflict("Service", "chat-decode", "DisaggregatedServer chat")


def test_each_child_is_read_once_then_applied_without_a_read():
    kube = ClusterKube()
    claims = ownership.Claims()
    obj = postgres_server()
    assert handlers.apply_children(obj, kube, SETTINGS, LOG, claims=claims)
    assert kube.gets == children_of(obj)  # none existed: each read once, then created
    kube.gets.clear()
    assert handlers.apply_children(obj, kube, SETTINGS, LOG, claims=claims)
    assert kube.gets == []  # known to be ours: applied straight away
    assert kube.applied == children_of(obj) * 2


def test_a_child_of_ours_found_by_a_read_is_applied_and_remembered():
    ours = service("postgres", [owner("postgres", UID)])
    kube = ClusterKube(ours)
    claims = ownership.Claims()
    assert handlers.apply_children(postgres_server(), kube, SETTINGS, LOG, claims=claims)
    assert ("Service", "postgres") in kube.applied
    assert claims.owner(("Service", "db", "postgres")) == UID


def test_the_conflict_makes_the_server_degraded_and_clears_once_the_object_goes():
    kube = ClusterKube(service("postgres"))
    claims = ownership.Claims()
    obj = postgres_server()
    handlers.apply_children(obj, kube, SETTINGS, LOG, claims=claims)
    settled = {("db", "postgres", role): [SETTLED] for role in api.ROLES}
    handlers.refresh_status(obj, kube, settled, {}, claims=claims)
    conditions = {c["type"]: c for c in kube.statuses[-1]["conditions"]}
    degraded = conditions[api.COND_DEGRADED]
    assert (degraded["status"], degraded["reason"]) == ("True", status.REASON_CHILD_CONFLICT)
    assert "Service postgres" in degraded["message"]
    assert conditions[api.COND_READY]["reason"] == status.REASON_CHILD_CONFLICT

    del kube.objects[("Service", "postgres")]  # the user removes (or renames) theirs
    assert handlers.apply_children(obj, kube, SETTINGS, LOG, claims=claims)
    assert ("Service", "postgres") in kube.applied
    obj["status"] = kube.statuses[-1]
    handlers.refresh_status(obj, kube, settled, {}, claims=claims)
    conditions = {c["type"]: c for c in kube.statuses[-1]["conditions"]}
    assert conditions[api.COND_DEGRADED]["status"] == "False"
    assert conditions[api.COND_READY]["status"] == "True"


def test_a_deleted_child_is_read_again_before_it_is_recreated():
    # Between our child's deletion and our re-apply, anyone may create that name.
    kube = ClusterKube()
    claims = ownership.Claims()
    obj = postgres_server()
    handlers.apply_children(obj, kube, SETTINGS, LOG, claims=claims)
    kube.objects[("Service", "postgres")] = service("postgres")  # deleted, then someone's
    claims.forget(("Service", "db", "postgres"))  # what the DELETED watch event does
    kube.applied.clear()
    handlers.apply_children(obj, kube, SETTINGS, LOG, claims=claims, only=("Service", "postgres"))
    assert kube.applied == [] and kube.gets[-1] == ("Service", "postgres")
    assert claims.conflicts(("db", "postgres"))


# ------------------------------------------------------------------ the pure parts


@pytest.mark.parametrize(
    ("existing", "expected"),
    [
        (None, None),  # absent: ours to create
        (service("postgres", [owner("postgres", UID)]), None),
        (service("postgres"), ownership.Conflict("Service", "postgres", "")),
        (
            service("postgres", [owner("db", "uid-deploy", kind="Deployment")]),
            ownership.Conflict("Service", "postgres", "Deployment db"),
        ),
        (
            service("postgres", [owner("postgres", UID, controller=False)]),
            ownership.Conflict("Service", "postgres", ""),
        ),
        (
            service("postgres", [owner("postgres", "uid-earlier")]),
            ownership.Conflict("Service", "postgres", "DisaggregatedServer postgres"),
        ),
    ],
    ids=["absent", "ours", "no-owner", "deployment", "not-controller", "earlier-server"],
)
def test_whether_an_existing_object_is_ours(existing, expected):
    assert ownership.conflict(existing, "Service", "postgres", UID) == expected


def test_a_server_without_a_uid_owns_nothing():
    assert ownership.conflict(service("x", [owner("x", "")]), "Service", "x", "") is not None


def test_the_message_names_each_object_and_the_fix():
    text = ownership.message(
        [
            ownership.Conflict("Service", "postgres", ""),
            ownership.Conflict("PodDisruptionBudget", "postgres-decode", "Deployment db"),
        ],
        "postgres",
    )
    assert "Service postgres (controlled by nothing)" in text
    assert "PodDisruptionBudget postgres-decode (controlled by Deployment db)" in text
    assert "nothing is applied to them" in text and "rename this server" in text
    assert "StatefulSets" not in text  # the pods use neither
    peers = ownership.message([ownership.Conflict("Service", "postgres-decode", "")], "postgres")
    assert "The StatefulSets are not applied either" in peers


def test_claims_forget_a_server_and_a_child():
    claims = ownership.Claims()
    claims.remember(("Service", "db", "x"), "u")
    claims.record(("db", "x"), ("Service", "db", "y"), ownership.Conflict("Service", "y", ""))
    claims.forget(("Service", "db", "x"))
    assert claims.owner(("Service", "db", "x")) is None
    claims.record(("db", "x"), ("Service", "db", "y"), None)
    assert claims.conflicts(("db", "x")) == ()
    claims.record(("db", "x"), ("Service", "db", "y"), ownership.Conflict("Service", "y", ""))
    claims.drop_server(("db", "x"))
    assert claims.conflicts(("db", "x")) == ()


# ------------------------------------------------------------------ a burst of servers


class ListingKube(ClusterKube):
    """ClusterKube that also answers lists of a kind in the namespace."""

    def __init__(self, *objects: dict[str, Any]) -> None:
        super().__init__(*objects)
        self.lists: list[str] = []

    def list_metadata(self, api_version, kind, namespace, page=500):
        assert namespace == "db"
        self.lists.append(kind)
        return [{"metadata": o["metadata"]} for (k, _), o in self.objects.items() if k == kind]


def new_server(name: str) -> dict[str, Any]:
    obj = server()
    obj["metadata"].update(name=name, namespace="db", uid=f"uid-{name}", generation=1)
    return obj


def test_a_burst_of_new_servers_lists_each_kind_once_instead_of_a_read_per_child():
    # 100 servers applied at once read each of their 10 children first: 1,000 reads.
    now = [0.0]
    kube = ListingKube(service("c"))  # a user's Service under server c's name
    names = ownership.NameLookup(kube.get, kube.list_metadata, clock=lambda: now[0])
    claims = ownership.Claims()
    burst = ["a", "b", "c", "d", "e"]
    for name in burst:
        handlers.apply_children(new_server(name), kube, SETTINGS, LOG, claims=claims, names=names)
        now[0] += 0.1
    kinds = {kind for kind, _ in children_of(new_server("a"))}
    # The first server's children are read by name (one server's children are no burst);
    # the second's start one list per kind, which answers every lookup of the burst after it.
    assert len(kube.gets) == len(children_of(new_server("a")))
    assert sorted(kube.lists) == sorted(kinds)
    # The list still shows what holds a name: server c's Service is the user's.
    assert ("Service", "c") not in kube.applied
    assert [c.kind for c in claims.conflicts(("db", "c"))] == ["Service"]
    for name in ("a", "b", "d", "e"):
        assert claims.conflicts(("db", name)) == ()
    # Later, a lone new server is read by name again (the list is too old to trust).
    now[0] += 10
    reads, lists = len(kube.gets), len(kube.lists)
    handlers.apply_children(new_server("f"), kube, SETTINGS, LOG, claims=claims, names=names)
    assert len(kube.gets) - reads == len(children_of(new_server("f")))
    assert len(kube.lists) == lists


def test_a_listing_is_one_request_however_many_threads_wait_for_it():
    import threading

    gate = threading.Event()
    calls: list[str] = []

    def slow_list(api_version, kind, namespace):
        calls.append(kind)
        gate.wait(5)
        return []

    names = ownership.NameLookup(lambda *a: None, slow_list, clock=lambda: 0.0)
    # A read by name for server a; the next servers' lookups list.
    assert names.holder("v1", "Service", "db", "x", "a") is None
    done: list[Any] = []
    entered = [threading.Event() for _ in range(3)]

    def look(n: str, i: int) -> None:
        entered[i].set()
        done.append(names.holder("v1", "Service", "db", n, f"uid-{n}"))

    threads = [threading.Thread(target=look, args=(n, i)) for i, n in enumerate("yzw")]
    for t in threads:
        t.start()
    for e in entered:  # every thread is on its way to the lookup before the list returns
        assert e.wait(5)
    while len(calls) < 1:  # one of them is listing (holds the per-kind lock)
        threading.Event().wait(0.01)
    gate.set()
    for t in threads:
        t.join(5)
    assert calls == ["Service"] and done == [None, None, None]
