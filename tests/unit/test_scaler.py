"""RoleScalers (scaler.py): one scale subresource per role, and the rules of its count."""

from __future__ import annotations

import asyncio
import json
import logging

import kopf
import pytest

from kvferry_operator import api, handlers, ownership, render, scaler, status
from kvferry_operator.settings import Settings
from tests.manifests import server

UID = "0b8d1c4e-0000-4000-8000-000000000001"
EXTERNAL = {"scaling": {"mode": "External"}}


def make(spec: dict | None = None, scaled: dict[str, int] | None = None) -> api.Server:
    body = server(spec, name="tiny", namespace="ns", uid=UID, generation=1)
    return api.parse_server(body, scaled)


def statefulset(replicas: int) -> dict:
    return {
        "metadata": {"name": "x", "ownerReferences": [render.owner_reference(make())]},
        "spec": {"replicas": replicas},
    }


def topology(objs: list[dict]) -> dict:
    cm = next(o for o in objs if o["kind"] == "ConfigMap")
    return json.loads(cm["data"][render.CONFIG_KEY_TOPOLOGY])


def replicas(objs: list[dict], role: str) -> int:
    return next(
        o["spec"]["replicas"]
        for o in objs
        if o["kind"] == "StatefulSet" and o["metadata"]["name"] == f"tiny-{role}"
    )


# ------------------------------------------------------------ the count


class TestReplicas:
    def test_static_is_the_spec_whatever_a_scaler_says(self):
        s = make({"prefill": {"replicas": 2}}, scaled={"prefill": 7})
        assert s.replicas("prefill") == 2

    def test_external_is_the_scalers(self):
        s = make({"prefill": {"replicas": 2, **EXTERNAL}}, scaled={"prefill": 7})
        assert s.replicas("prefill") == 7
        assert s.replicas("decode") == 1

    def test_external_unread_falls_back_to_the_spec(self):
        # Offline rendering (kvferry-operator render) has no RoleScaler to read.
        assert make({"decode": {"replicas": 3, **EXTERNAL}}).replicas("decode") == 3

    def test_mode_defaults_to_static(self):
        assert make().spec.prefill.scaling_mode == api.SCALING_STATIC


class TestRender:
    """The StatefulSet and the sidecars' topology follow the RoleScaler, together."""

    @pytest.mark.parametrize("role", ["prefill", "decode"])
    def test_statefulset_and_topology_come_from_the_scaler(self, role):
        objs = render.render(make({role: EXTERNAL}, scaled={role: 3}))
        assert replicas(objs, role) == 3
        key = "prefillEngines" if role == "prefill" else "decodeSidecars"
        assert len(topology(objs)[key]) == 3
        assert topology(objs)[key][2].startswith(f"http://tiny-{role}-2.tiny-{role}.ns.svc:")

    def test_a_static_role_ignores_a_leftover_count(self):
        objs = render.render(make(scaled={"prefill": 5, "decode": 5}))
        assert replicas(objs, "prefill") == 1 and replicas(objs, "decode") == 1
        assert len(topology(objs)["decodeSidecars"]) == 1

    def test_the_count_does_not_restart_pods(self):
        # The pod template (its config hash) is the same at any count: sidecars re-read
        # the topology live, so a scale-up starts new pods and restarts none.
        one = render.render(make({"decode": EXTERNAL}, scaled={"decode": 1}))
        four = render.render(make({"decode": EXTERNAL}, scaled={"decode": 4}))
        sts = [o for o in one if o["kind"] == "StatefulSet"]
        sts4 = [o for o in four if o["kind"] == "StatefulSet"]
        assert [o["spec"]["template"] for o in sts] == [o["spec"]["template"] for o in sts4]


# ------------------------------------------------------------ the object


class TestBuild:
    def test_role_scaler_names_labels_owner_and_seed(self):
        obj = scaler.build_role_scaler(make({"prefill": EXTERNAL}), "prefill", 4)
        assert obj["apiVersion"] == "kvferry.io/v1alpha1" and obj["kind"] == "RoleScaler"
        assert obj["metadata"]["name"] == "tiny-prefill"
        assert obj["metadata"]["namespace"] == "ns"
        assert obj["metadata"]["labels"][api.LABEL_MANAGED_BY] == api.FIELD_MANAGER
        assert obj["metadata"]["labels"][api.LABEL_INSTANCE] == "tiny"
        assert obj["metadata"]["labels"][api.LABEL_ROLE] == "prefill"
        assert obj["metadata"]["ownerReferences"][0]["uid"] == UID
        assert obj["metadata"]["ownerReferences"][0]["controller"] is True
        assert obj["spec"] == {"serverName": "tiny", "role": "prefill", "replicas": 4}

    def test_status_is_the_statefulsets_with_the_pods_selector(self):
        st = scaler.build_scaler_status(make(), "decode", replicas=3, ready=2)
        assert st == {
            "replicas": 3,
            "readyReplicas": 2,
            "selector": "app.kubernetes.io/name=kvferry,app.kubernetes.io/instance=tiny,"
            "kvferry.io/role=decode",
        }

    def test_status_patch_is_only_what_changed(self):
        new = {"replicas": 3, "readyReplicas": 2, "selector": "a=b"}
        assert scaler.status_patch(new, new) == {}
        assert scaler.status_patch({**new, "replicas": 2}, new) == {"replicas": 3}


class TestSeed:
    def test_seeded_at_the_statefulsets_count(self):
        # A switch from Static never scales the role down: the count running now.
        s = make({"prefill": {"replicas": 1, **EXTERNAL}})
        assert scaler.seed_replicas(s, "prefill", statefulset(5)) == 5

    def test_seeded_at_the_spec_without_a_statefulset(self):
        s = make({"prefill": {"replicas": 2, **EXTERNAL}})
        assert scaler.seed_replicas(s, "prefill", None) == 2

    @pytest.mark.parametrize("bad", [None, -1, 1001, "3"])
    def test_a_statefulset_count_out_of_bounds_is_not_a_seed(self, bad):
        s = make({"prefill": {"replicas": 2, **EXTERNAL}})
        assert scaler.seed_replicas(s, "prefill", {"spec": {"replicas": bad}}) == 2


@pytest.mark.parametrize("value", [None, -1, 1001, True, "2"])
def test_a_scaler_count_out_of_bounds_is_not_used(value):
    assert scaler.replicas_of({"spec": {"replicas": value}}) is None


def test_stale_are_static_roles_with_a_scaler():
    s = make({"decode": EXTERNAL})
    assert scaler.stale(s, {"prefill": {}, "decode": {}}) == ["prefill"]


# ------------------------------------------------------------ status


class TestServerStatus:
    def test_desired_and_scaled_by_name_the_scaler(self):
        s = make({"decode": EXTERNAL}, scaled={"decode": 4})
        obs = status.Observed(roles={r: status.RoleObserved() for r in api.ROLES})
        st, _ = status.compute_status(s, obs, None, "2026-01-01T00:00:00Z")
        assert st["decode"]["desiredReplicas"] == 4
        assert st["decode"]["display"] == "0/4"
        assert st["decode"]["scaledBy"] == "RoleScaler tiny-decode"
        assert st["prefill"]["scaledBy"] == "spec.prefill.replicas"

    def test_decode_scaled_to_zero_names_the_scaler(self):
        s = make({"decode": EXTERNAL}, scaled={"decode": 0})
        obs = status.Observed(roles={r: status.RoleObserved() for r in api.ROLES})
        st, _ = status.compute_status(s, obs, None, "2026-01-01T00:00:00Z")
        ready = next(c for c in st["conditions"] if c["type"] == "Ready")
        assert ready["reason"] == status.REASON_NO_DECODE
        assert "RoleScaler tiny-decode has spec.replicas 0" in ready["message"]


# ------------------------------------------------------------ the operator's I/O


class FakeKube:
    """RoleScalers and StatefulSets by name; every write recorded."""

    def __init__(self, objects: dict[tuple[str, str], dict] | None = None) -> None:
        self.objects = dict(objects or {})
        self.created: list[dict] = []
        self.deleted: list[tuple[str, str]] = []
        self.writes: list[tuple[str, str]] = []
        self.applied: dict[tuple[str, str], dict] = {}

    def get(self, api_version, kind, namespace, name):
        return self.objects.get((kind, name))

    def create(self, obj):
        self.created.append(obj)
        self.objects[(obj["kind"], obj["metadata"]["name"])] = obj
        return obj

    def delete(self, api_version, kind, namespace, name, uid):
        self.deleted.append((kind, name))

    def apply(self, obj):
        self.writes.append((obj["kind"], obj["metadata"]["name"]))
        self.applied[(obj["kind"], obj["metadata"]["name"])] = obj
        return obj

    def patch_status(self, api_version, kind, namespace, name, body):
        self.writes.append((f"{kind}/status", name))


def ours(replicas: int, role: str = "prefill") -> dict:
    obj = scaler.build_role_scaler(make({role: EXTERNAL}), role, replicas)
    obj["metadata"]["uid"] = f"scaler-{role}"  # as the API server stores it
    return obj


def resolve(s: api.Server, kube: FakeKube, seen: dict | None = None):
    claims = ownership.Claims()
    lookup = (lambda key: seen) if seen is not None else None
    out = handlers.resolve_scalers(s, kube, claims, lookup, logging.getLogger("t"))
    return (*out, claims)


class TestResolve:
    def test_a_missing_scaler_is_created_at_the_running_count(self):
        kube = FakeKube({("StatefulSet", "tiny-prefill"): statefulset(3)})
        s, counted, why, _ = resolve(make({"prefill": EXTERNAL}), kube)
        assert counted and why == ""
        assert [o["spec"]["replicas"] for o in kube.created] == [3]
        assert s.replicas("prefill") == 3

    def test_an_existing_scaler_is_read_never_written(self):
        # The HPA owns spec.replicas: no create, no apply, no patch of it.
        kube = FakeKube()
        s, counted, _, _ = resolve(make({"prefill": EXTERNAL}), kube, {"prefill": ours(6)})
        assert counted and s.replicas("prefill") == 6
        assert kube.created == [] and kube.writes == []

    def test_someone_elses_scaler_is_a_conflict_and_holds_the_count(self):
        theirs = {**ours(9), "metadata": {"name": "tiny-prefill", "ownerReferences": []}}
        kube = FakeKube({("RoleScaler", "tiny-prefill"): theirs})
        s, counted, _, claims = resolve(make({"prefill": EXTERNAL}), kube)
        assert not counted and kube.created == []
        assert s.replicas("prefill") == 1  # the spec's, which apply_children does not apply
        assert [c.kind for c in claims.conflicts(("ns", "tiny"))] == ["RoleScaler"]

    def test_a_scaler_without_a_count_is_refused_by_name(self):
        broken = ours(1)
        del broken["spec"]["replicas"]
        _, counted, why, _ = resolve(make({"prefill": EXTERNAL}), FakeKube(), {"prefill": broken})
        assert not counted
        assert "RoleScaler tiny-prefill: spec.replicas is missing" in why

    def test_back_to_static_deletes_our_scaler(self):
        kube = FakeKube()
        resolve(make(), kube, {"prefill": ours(4)})
        assert kube.deleted == [("RoleScaler", "tiny-prefill")]

    def test_only_ours_are_deleted(self):
        theirs = {**ours(9), "metadata": {"name": "tiny-prefill", "uid": "u"}}
        kube = FakeKube()
        resolve(make(), kube, {"prefill": theirs})
        assert kube.deleted == []


class TestApplyChildren:
    def test_no_statefulset_or_topology_from_an_unknown_count(self):
        theirs = {**ours(9), "metadata": {"name": "tiny-prefill", "ownerReferences": []}}
        kube = FakeKube({("RoleScaler", "tiny-prefill"): theirs})
        body = server(EXTERNAL_PREFILL, name="tiny", namespace="ns", uid=UID, generation=1)
        handlers.apply_children(
            body,
            kube,
            Settings(sidecar_image="", resync_seconds=60),
            logging.getLogger("t"),
            post=lambda *a: None,
        )
        kinds = {k for k, _ in kube.writes}
        assert "StatefulSet" not in kinds and "ConfigMap" not in kinds
        assert "Service" in kinds  # the rest still lands

    def test_statefulset_follows_the_scaler(self):
        kube = FakeKube()
        body = server(EXTERNAL_PREFILL, name="tiny", namespace="ns", uid=UID, generation=1)
        seen = {"prefill": ours(5)}
        handlers.apply_children(
            body,
            kube,
            Settings(sidecar_image="", resync_seconds=60),
            logging.getLogger("t"),
            seen=lambda key: seen,
        )
        assert kube.applied[("StatefulSet", "tiny-prefill")]["spec"]["replicas"] == 5
        assert len(topology(list(kube.applied.values()))["prefillEngines"]) == 5
        assert kube.created == []


EXTERNAL_PREFILL = {"prefill": EXTERNAL}


def test_a_missing_rolescaler_crd_is_named_and_holds_the_statefulsets():
    """An operator upgraded without the new CRD: the Event names it and the fix, and
    no StatefulSet is applied from the spec's count meanwhile."""
    from kubernetes.dynamic.exceptions import ResourceNotFoundError

    class NoCRD(FakeKube):
        def get(self, api_version, kind, namespace, name):
            if kind == api.SCALER_KIND:
                raise ResourceNotFoundError(f"No matches found for {kind}")
            return super().get(api_version, kind, namespace, name)

    posted: list[tuple[str, str]] = []
    kube = NoCRD()
    body = server(EXTERNAL_PREFILL, name="tiny", namespace="ns", uid=UID, generation=1)
    applied = handlers.apply_children(
        body,
        kube,
        Settings(sidecar_image="", resync_seconds=60),
        logging.getLogger("t"),
        post=lambda _body, _type, reason, message: posted.append((reason, message)),
    )
    assert applied is handlers.Applied.NEVER
    ((reason, message),) = posted
    assert reason == "ApplyFailed"
    assert "rolescalers.kvferry.io is not installed" in message
    assert "crds/kvferry.io_rolescalers.yaml" in message
    assert "StatefulSet" not in {k for k, _ in kube.writes}


# ------------------------------------------------------------ RoleScaler events


def scaler_event(replicas: int, running: int, kind_type: str = "MODIFIED") -> FakeKube:
    """A RoleScaler event through the child-event handler, the StatefulSet running
    ``running``; what the handler wrote."""
    kube = FakeKube()
    owner = server(EXTERNAL_PREFILL, name="tiny", namespace="ns", uid=UID, generation=1)
    body = ours(replicas)
    memo = kopf.Memo(
        kube=kube,
        settings=Settings(sidecar_image="", resync_seconds=60),
        probe=None,
        indexes={},
    )
    sts = status.RoleObserved(exists=True, spec_replicas=running, replicas=running)
    run_child(
        handlers._on_child_event(api.SCALER_KIND),
        type=kind_type,
        name="tiny-prefill",
        namespace="ns",
        labels=body["metadata"]["labels"],
        body=body,
        memo=memo,
        logger=logging.getLogger("t"),
        servers={("ns", "tiny"): [owner]},
        statefulsets={("ns", "tiny", "prefill"): [sts]},
        pods={},
        nodes={},
        rolescalers={("ns", "tiny", "prefill"): [body]},
    )
    assert memo.indexes["rolescalers"] == {("ns", "tiny", "prefill"): [body]}
    return kube


class TestScalerEvents:
    def test_the_rolescaler_watch_is_the_one_child_handler(self):
        # One registration and one code path for every child kind, RoleScalers too.
        registry = kopf.get_default_registry()
        ids = [
            h.id
            for h in registry._watching.get_all_handlers()
            if (h.selector.plural or h.selector.any_name) == api.SCALER_PLURAL
        ]
        assert ids == [f"child-{api.SCALER_PLURAL}"]

    def test_a_new_count_applies_the_server_at_that_count(self):
        kube = scaler_event(replicas=5, running=3)
        assert kube.applied[("StatefulSet", "tiny-prefill")]["spec"]["replicas"] == 5
        assert ("DisaggregatedServer/status", "tiny") in kube.writes

    def test_the_running_count_applies_nothing_and_refreshes_status(self):
        kube = scaler_event(replicas=3, running=3)
        assert kube.applied == {}
        assert {k for k, _ in kube.writes} == {"RoleScaler/status", "DisaggregatedServer/status"}


def run_child(handler, **kwargs):
    """A child handler (a coroutine function) run to its end."""
    return asyncio.run(handler(**kwargs))


EXT_DECODE = {"decode": EXTERNAL}


class TestScalerLookup:
    """A server's RoleScaler is the one of its name (``<server>-<role>``) that it
    controls; the labels only narrow the watch. A look-alike of
    another name carrying the server's labels, with or without a controller reference
    to it, is never the server's."""

    def lookalike(self, *, controlled: bool, replicas: int = 7) -> dict:
        body = scaler.build_role_scaler(make(EXT_DECODE), "decode", replicas)
        body["metadata"]["name"] = "evil-decode"
        if not controlled:
            body["metadata"].pop("ownerReferences")
        return body

    def seen(self, *bodies: dict) -> handlers.Seen:
        memo = kopf.Memo(indexes={"rolescalers": {("ns", "tiny", "decode"): list(bodies)}})
        lookup = handlers._seen(memo)
        assert lookup is not None
        return lookup

    @pytest.mark.parametrize("controlled", [True, False], ids=["controller-ref", "no-ref"])
    def test_a_lookalike_first_in_the_index_is_passed_over(self, controlled: bool):
        ours = scaler.build_role_scaler(make(EXT_DECODE), "decode", 2)
        seen = self.seen(self.lookalike(controlled=controlled), ours)
        assert seen(("ns", "tiny")) == {"decode": ours}
        body = server(EXT_DECODE, name="tiny", namespace="ns", uid=UID, generation=1)
        assert handlers._scaled(body, seen) == {"decode": 2}

    @pytest.mark.parametrize("controlled", [True, False], ids=["controller-ref", "no-ref"])
    def test_a_lookalike_alone_is_not_the_servers(self, controlled: bool):
        seen = self.seen(self.lookalike(controlled=controlled))
        assert seen(("ns", "tiny")) == {}
        body = server(EXT_DECODE, name="tiny", namespace="ns", uid=UID, generation=1)
        assert handlers._scaled(body, seen) == {}

    def test_a_lookalikes_count_never_resolves_the_role(self):
        # resolve_scalers reads the server's own RoleScaler by name past the look-alike,
        # reports no conflict, and never deletes the look-alike.
        srv = make(EXT_DECODE)
        ours = scaler.build_role_scaler(srv, "decode", 2)
        ours["metadata"]["uid"] = "ours"

        class FakeKube:
            def __init__(self) -> None:
                self.deleted: list = []

            def get(self, api_version, kind, ns, name):
                return ours if (kind, name) == (api.SCALER_KIND, "tiny-decode") else None

            def create(self, obj):
                raise AssertionError(f"created {obj['metadata']['name']}")

            def delete(self, *args):
                self.deleted.append(args)

        kube = FakeKube()
        claims = ownership.Claims()
        got, counted, why = handlers.resolve_scalers(
            srv, kube, claims, self.seen(self.lookalike(controlled=True)), logging.getLogger("t")
        )
        assert (got.scaled, counted, why) == ({"decode": 2}, True, "")
        assert claims.conflicts(("ns", "tiny")) == ()
        assert kube.deleted == []
