"""The prerequisite probe's own logic: what it asks, how long it reuses an answer, and
that a read it cannot make is unknown, never missing (the cluster tier runs it against
the real API server)."""

from __future__ import annotations

from typing import Any

from kubernetes.client.exceptions import ApiException

from kvferry_operator import api
from kvferry_operator.prerequisites import NAD_CRD, NodeFacts
from kvferry_operator.probe import PrerequisiteProbe
from tests.manifests import server

NODE = {"metadata": {"name": "n"}, "status": {"allocatable": {"nvidia.com/gpu": "8"}}}
RDMA = {"network": {"rdma": {"enabled": True, "resourceName": "r/x", "networks": ["a", "o/b"]}}}


class FakeKube:
    def __init__(self, forbid: set[str] = frozenset()) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.forbid = forbid

    def _call(self, *what: Any) -> None:
        self.calls.append(what)
        if what[0] in self.forbid:
            raise ApiException(status=403, reason="Forbidden")

    def list_nodes(self) -> list[dict]:
        self._call("nodes")
        return [NODE]

    def get_namespace(self, name: str) -> dict | None:
        self._call("namespace", name)
        return {"metadata": {"labels": {"pod-security.kubernetes.io/enforce": "baseline"}}}

    def crd_exists(self, name: str) -> bool:
        self._call("crd", name)
        return True

    def get_network_attachment_definition(self, namespace: str, name: str) -> dict | None:
        self._call("nad", namespace, name)
        return {} if name == "a" else None


def srv(spec: dict | None = None) -> api.Server:
    return api.parse_server(server(spec, namespace="serving"))


def test_facts_from_each_read():
    kube = FakeKube()
    facts = PrerequisiteProbe(kube).facts(srv(RDMA))
    assert facts.nodes == [NodeFacts("n", {"nvidia.com/gpu": 8})]
    assert facts.namespace_labels == {"pod-security.kubernetes.io/enforce": "baseline"}
    assert facts.nad_crd_installed is True
    assert facts.nads == {"serving/a": True, "o/b": False}
    assert ("crd", NAD_CRD) in kube.calls


def test_no_multus_reads_without_networks():
    kube = FakeKube()
    facts = PrerequisiteProbe(kube).facts(srv())
    assert (facts.nad_crd_installed, facts.nads) == (None, None)
    assert {c[0] for c in kube.calls} == {"nodes", "namespace"}


def test_answers_are_reused_until_the_ttl_passes():
    kube, now = FakeKube(), [0.0]
    probe = PrerequisiteProbe(kube, ttl=30, clock=lambda: now[0])
    probe.facts(srv())
    probe.facts(srv())
    assert len(kube.calls) == 2  # nodes and the namespace, once each
    now[0] = 31.0
    probe.facts(srv())
    assert len(kube.calls) == 4


def test_a_forbidden_read_is_unknown_not_missing(caplog):
    kube = FakeKube(forbid={"nodes"})
    probe = PrerequisiteProbe(kube, ttl=0)
    assert probe.facts(srv()).nodes is None
    probe.facts(srv())
    warnings = [r for r in caplog.records if "prerequisite check nodes skipped" in r.message]
    assert len(warnings) == 1  # said once, not at every status refresh
    assert "403" in warnings[0].message
