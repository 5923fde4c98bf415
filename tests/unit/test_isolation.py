"""Pods start only isolated and only with a node folder the operator allows (issue 20,
items 2 and 10): what apply_children holds back, and what status says."""

from __future__ import annotations

import logging
from typing import Any

import kopf
import pytest

from kvferry_operator import api, handlers, hostpaths, ownership
from kvferry_operator.kube import ApiException
from kvferry_operator.settings import Settings
from tests.manifests import DELETE, server
from tests.unit.test_child_conflicts import ClusterKube

LOG = logging.getLogger("test")
NONE_ALLOWED = Settings(sidecar_image="", resync_seconds=60)
CACHE_ALLOWED = Settings(
    sidecar_image="", resync_seconds=60, host_path_prefixes=("/var/cache/kvferry",)
)
UID = "uid-chat"


@pytest.fixture(autouse=True)
def quiet_events(monkeypatch):
    monkeypatch.setattr(kopf, "warn", lambda *a, **kw: None)
    monkeypatch.setattr(kopf, "info", lambda *a, **kw: None)


def chat(spec: dict[str, Any] | None = None) -> dict[str, Any]:
    obj = server(spec or {})
    obj["metadata"].update(name="chat", namespace="db", uid=UID, generation=1)
    return obj


def host_path_chat(path: str = "/var/cache/kvferry/hf") -> dict[str, Any]:
    cache = {"hostPath": {"path": path}}
    return chat({"model": {"source": {"pvc": DELETE, "hub": {"id": "org/m", "cache": cache}}}})


def kinds(applied: list[tuple[str, str]]) -> set[str]:
    return {kind for kind, _ in applied}


def conditions(kube: ClusterKube) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in kube.statuses[-1]["conditions"]}


def test_a_host_path_outside_the_allowed_folders_gets_no_statefulset_and_says_why():
    kube = ClusterKube()
    obj = host_path_chat()
    assert handlers.apply_children(obj, kube, NONE_ALLOWED, LOG) is handlers.Applied.NEVER
    # Nor their ConfigMap (the running pods keep the topology they run with);
    # everything else lands (the entry Service, the policy, the status object).
    assert not {"StatefulSet", "ConfigMap"} & kinds(kube.applied)
    assert {"NetworkPolicy", "Service", api.STATUS_KIND} <= kinds(kube.applied)
    handlers.refresh_status(obj, kube, {}, {}, settings=NONE_ALLOWED)
    got = conditions(kube)
    for ctype, value in ((api.COND_READY, "False"), (api.COND_DEGRADED, "True")):
        assert (got[ctype]["status"], got[ctype]["reason"]) == (value, hostpaths.REASON)
        assert got[ctype]["message"].startswith(
            "spec.model.source.hub.cache.hostPath.path '/var/cache/kvferry/hf'"
        )
        assert "settings.hostPathPrefixes" in got[ctype]["message"]


def test_an_allowed_host_path_is_applied():
    kube = ClusterKube()
    assert handlers.apply_children(host_path_chat(), kube, CACHE_ALLOWED, LOG)
    assert ("StatefulSet", "chat-decode") in kube.applied
    obj = host_path_chat()
    handlers.refresh_status(obj, kube, {}, {}, settings=CACHE_ALLOWED)
    assert conditions(kube)[api.COND_READY]["reason"] != hostpaths.REASON


class RefusingPolicies(ClusterKube):
    """An API server that refuses NetworkPolicies (an RBAC rule missing after an upgrade)."""

    def apply(self, child: dict[str, Any]) -> dict[str, Any]:
        if child["kind"] == "NetworkPolicy":
            raise ApiException(status=403, reason="Forbidden")
        return super().apply(child)


def test_pods_never_start_without_their_network_policy():
    kube = RefusingPolicies()
    assert not handlers.apply_children(chat(), kube, NONE_ALLOWED, LOG)
    assert not {"StatefulSet", "ConfigMap"} & kinds(kube.applied)
    assert {"Service", "PodDisruptionBudget"} <= kinds(kube.applied)


def test_one_statefulset_reapplied_never_comes_back_without_its_network_policy():
    # The drift path re-applies one child; the policy may have gone with it.
    kube = RefusingPolicies()
    handlers.apply_children(chat(), kube, NONE_ALLOWED, LOG, ("StatefulSet", "chat-decode"))
    assert "StatefulSet" not in kinds(kube.applied)


def test_a_users_policy_holding_the_name_holds_the_statefulsets():
    theirs = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "chat", "namespace": "db", "uid": "uid-theirs"},
        "spec": {"podSelector": {}, "ingress": [{}]},  # allow-all: the pods would be open
    }
    kube = ClusterKube(theirs)
    claims = ownership.Claims()
    handlers.apply_children(chat(), kube, NONE_ALLOWED, LOG, claims=claims)
    assert ("NetworkPolicy", "chat") not in kube.applied
    assert "StatefulSet" not in kinds(kube.applied)
    (conflict,) = claims.conflicts(("db", "chat"))
    assert "run without their NetworkPolicy" in ownership.message([conflict], "chat")
