"""A quiet operator (issue 23, items 1 and 2), counted by the API server's audit log.

The operator runs under a client certificate of its own (tests.kube.AUDITED_USER, the
one user the tier's audit policy records), with the safety pass's interval set by
the test: every request it makes is in the log, by verb, resource and namespace.

- at rest, a safety pass lists and compares, and writes nothing;
- to Ready, status is written a few times and two Events are posted; a condition
  change posts its Event once;
- drift is restored from the watch and a failed apply retries on its own with
  backoff, with a safety pass an hour away;
- a restart re-applies nothing that has landed: a child deleted while no operator
  ran is put back by the first safety pass, soon after start (issue 23, item 3).
"""

from __future__ import annotations

import itertools
import json
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvferry_operator import api, handlers, render
from kvferry_wire import protocol
from tests.cluster.conftest import Kubectl, Operator, wait_until
from tests.cluster.test_operator import make, uid, wait_ready
from tests.kube import (
    audited_kubeconfig,
    audited_requests,
    condition_of,
    wait_condition,
    watch_server,
)


@pytest.fixture
def audited(
    kubectl: Kubectl, operator: Operator, kubeconfig: Path, tmp_path: Path
) -> Iterator[Callable[[float], Operator]]:
    """Start the audited operator with a given safety-pass interval (the tier's
    operator is stopped meanwhile: two operators would both reconcile)."""
    started: list[Operator] = []

    def start(resync_seconds: float) -> Operator:
        operator.stop()
        op = Operator(audited_kubeconfig(kubeconfig, tmp_path), tmp_path / "operator.log")
        op.extra_env = {"KVFERRY_RESYNC_SECONDS": str(resync_seconds)}
        op.started_at = time.time()  # type: ignore[attr-defined]
        op.start()
        started.append(op)
        return op

    try:
        yield start
    finally:
        for op in started:
            op.stop()
        operator.start()


def passes(op: Operator) -> int:
    """Safety passes finished: each starts with a list of the servers, one after the
    other, so the lists after kopf's own first one, less the one running."""
    lists = [
        r
        for r in audited_requests(op.started_at)  # type: ignore[attr-defined]
        if r.verb == "list" and r.resource == "disaggregatedservers"
    ]
    return max(0, len(lists) - 2)


def wait_passes(op: Operator, at_least: int) -> None:
    wait_until(lambda: passes(op) >= at_least, 60, f"{at_least} safety passes")


def server_events(kubectl: Kubectl, ns: str, name: str) -> Counter[str]:
    items = kubectl.json(
        "get", "events", "-n", ns, "--field-selector", f"involvedObject.name={name}"
    )["items"]
    return Counter(
        e["reason"]
        for e in items
        if (e.get("involvedObject") or {}).get("kind") == "DisaggregatedServer"
        for _ in range(int(e.get("count") or 1))
    )


def test_a_server_at_rest_costs_no_write_and_its_way_to_ready_few(
    kubectl: Kubectl, audited: Callable[[float], Operator], ns: str
):
    op = audited(2)  # a safety pass every 2 s +-20 %
    t0 = time.time()
    kubectl.apply(make(ns), "--server-side")
    wait_ready(kubectl, ns)
    # Both roles Ready, and nothing left to write: a pass after Ready has the last word.
    wait_passes(op, passes(op) + 2)

    to_ready = [r for r in audited_requests(t0) if r.namespace == ns]
    status_patches = [r for r in to_ready if r.resource == "disaggregatedservers/status"]
    assert len(status_patches) <= 3, status_patches
    events = server_events(kubectl, ns, "tiny")
    # A new server's way to Ready is news twice: Ready=True and Progressing Complete.
    assert events == Counter({"AllReplicasReady": 1, "Complete": 1}), events
    # Every request for it to Ready (issue 23, item 2): each child read once (a lone
    # server's children are read by name before their first apply: ownership.py) and
    # applied once, the KVCacheStatus's first status, the status patches, two Events.
    # An apply that did not land (a loaded API server's timeout; the log says so) is
    # retried whole (retries.py): once more each time, of children known to be ours.
    log = op.log()
    whole = 1 + log.count("apply deferred") + log.count("apply failed")
    children = render.render(api.parse_server(make(ns)))
    by = Counter(f"{r.verb} {r.resource}" for r in to_ready)
    for kind in {c["kind"] for c in children}:
        resource = next(p for _g, _v, p, _a, k in handlers.CHILD_KINDS if k == kind)
        count = sum(c["kind"] == kind for c in children)
        assert count <= by[f"patch {resource}"] <= count * whole, (kind, whole, by)
        assert by[f"get {resource}"] <= count, (kind, by)
    assert by["patch kvcachestatuses/status"] == 1, by
    assert by["create events"] == 2, by
    assert len(to_ready) <= len(children) * (1 + whole) + 1 + 3 + 2, (whole, by)

    # At rest: passes list servers and children cluster-wide, and write nothing.
    start = passes(op)
    wait_passes(op, start + 1)
    since = time.time()
    wait_passes(op, start + 4)
    until = time.time()
    window = audited_requests(since, until)
    assert [r for r in window if r.namespace == ns] == []
    # Cluster-wide: the passes' lists. (Servers that earlier tests left in namespaces
    # being deleted are not at rest: their applies are refused, and they are theirs.)
    cluster_wide = [r for r in window if not r.namespace]
    assert [r for r in cluster_wide if r.write] == []
    lists_per_pass = 1 + len(handlers.CHILD_KINDS)
    assert len(cluster_wide) <= 3 * lists_per_pass + 2, Counter(
        f"{r.verb} {r.resource}" for r in cluster_wide
    )

    # A condition change posts its Event once, however many refreshes follow.
    kubectl.run("patch", "dserver", "tiny", "-n", ns, "--type=merge", "-p",
                '{"spec":{"decode":{"replicas":0}}}')  # fmt: skip
    wait_condition(kubectl, ns, "tiny", "Ready", "NoDecodeReplicas")
    wait_passes(op, passes(op) + 3)
    assert server_events(kubectl, ns, "tiny")["NoDecodeReplicas"] == 1


def webhook(ns: str) -> dict[str, Any]:
    """Admission of our ConfigMaps in ``ns`` fails: the webhook is not listening (the
    API server answers 500, as for an admission service that is down)."""
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": f"down-{ns}"},
        "webhooks": [
            {
                "name": "down.kvferry.test",
                "clientConfig": {"url": "https://127.0.0.1:1/validate"},
                "rules": [
                    {
                        "operations": ["CREATE", "UPDATE"],
                        "apiGroups": [""],
                        "apiVersions": ["v1"],
                        "resources": ["configmaps"],
                    }
                ],
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}},
                "objectSelector": {
                    "matchLabels": {"app.kubernetes.io/managed-by": "kvferry-operator"}
                },
                "failurePolicy": "Fail",
                "sideEffects": "None",
                "admissionReviewVersions": ["v1"],
                "timeoutSeconds": 1,
            }
        ],
    }


def first_pass_done(op: Operator) -> None:
    """Wait for the safety pass that follows start (handlers.first_pass_delay, 10-20 s
    under a long interval); with an interval of an hour, no other comes."""
    wait_until(lambda: "safety pass done" in op.log(), 60, "the first safety pass")


def test_drift_is_restored_and_a_failed_apply_retried_without_a_safety_pass(
    kubectl: Kubectl, audited: Callable[[float], Operator], ns: str
):
    op = audited(3600)
    first_pass_done(op)  # before the server: it must not be the one that lands it
    hook = webhook(ns)
    kubectl.apply(hook)
    try:
        t0 = time.time()
        kubectl.apply(make(ns), "--server-side")
        wait_condition(kubectl, ns, "tiny", "Degraded", "ApplyFailed")
        # Retried on its own, waiting longer each time.
        wait_until(
            lambda: len(failed_configmap_applies(ns, t0)) >= 4, 60, "4 refused ConfigMap applies"
        )
    finally:
        kubectl.run("delete", "validatingwebhookconfiguration", hook["metadata"]["name"])
    tries = [r.at for r in failed_configmap_applies(ns, t0)]
    gaps = [b - a for a, b in itertools.pairwise(tries)]
    # backoff.schedule(): 1, 2, 4 s between the first four (and the apply's own time,
    # which a loaded machine stretches unevenly): never back to back, 7 s at least.
    assert min(gaps) >= 0.9 and tries[3] - tries[0] >= 6.9, gaps
    # The next retry lands it, and status says so, without a watch event to prompt it.
    wait_until(lambda: kubectl.get("configmap", "tiny-sidecar", ns), 60, "the ConfigMap applied")
    watch_server(
        kubectl,
        ns,
        "tiny",
        lambda obj: (
            condition_of(obj, "Degraded").get("reason") == "Healthy"
            and condition_of(obj, "Progressing").get("reason") == "Complete"
        ),
        60,
        "Degraded=False Healthy and Progressing Complete after the retry",
    )
    wait_ready(kubectl, ns)

    # Drift, restored from the watch: a deleted child, an edited one.
    before = uid(kubectl, "service", "tiny", ns)
    kubectl.run("delete", "service", "tiny", "-n", ns, "--wait=true")
    wait_until(lambda: uid(kubectl, "service", "tiny", ns) not in (None, before), 30, "restored")
    kubectl.run("patch", "statefulset", "tiny-decode", "-n", ns, "--type=merge", "-p",
                json.dumps({"spec": {"replicas": 3}}))  # fmt: skip
    wait_until(
        lambda: kubectl.get("statefulset", "tiny-decode", ns)["spec"]["replicas"] == 1,
        30,
        "decode replicas back to 1",
    )
    # The first pass was done before the server came: passes() counts none but later ones.
    assert passes(op) == 0, "a safety pass ran: the test proves nothing"


def test_a_child_deleted_while_no_operator_ran_is_put_back_by_the_first_pass(
    kubectl: Kubectl, audited: Callable[[float], Operator], ns: str
):
    op = audited(3600)  # no safety pass but the one soon after each start
    kubectl.apply(make(ns), "--server-side")
    wait_ready(kubectl, ns)
    op.stop()
    before = uid(kubectl, "configmap", "tiny-sidecar", ns)
    kubectl.run("delete", "configmap", "tiny-sidecar", "-n", ns, "--wait=true")
    restarted, offset = time.time(), len(op.log())
    op.start()  # the same certificate and report URL: it renders the same children
    wait_until(
        lambda: uid(kubectl, "configmap", "tiny-sidecar", ns) not in (None, before),
        90,
        "the deleted ConfigMap put back",
    )
    # By the first pass: kopf's initial listing applied nothing (the generation had
    # landed), and no event comes for a child deleted while no operator ran.
    log = op.log()[offset:]
    assert f"safety pass: re-applying {ns}/tiny" in log, log[-3000:]
    # That one whole apply (and its retries, if one did not land) is all it wrote.
    after = [r for r in audited_requests(restarted) if r.namespace == ns and r.write]
    children = render.render(api.parse_server(make(ns)))
    by = Counter(f"{r.verb} {r.resource}" for r in after)
    whole = 1 + log.count("apply deferred") + log.count("apply failed")
    for kind in {c["kind"] for c in children}:
        resource = next(p for _g, _v, p, _a, k in handlers.CHILD_KINDS if k == kind)
        assert by[f"patch {resource}"] <= sum(c["kind"] == kind for c in children) * whole, by
    wait_ready(kubectl, ns)


def failed_configmap_applies(ns: str, since: float) -> list[Any]:
    return [
        r
        for r in audited_requests(since)
        if r.namespace == ns and r.resource == "configmaps" and r.verb == "patch" and r.code >= 500
    ]


SCRAPER_NS = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
SCRAPER_POD = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}


def metrics_peers(kubectl: Kubectl, ns: str) -> list[dict[str, Any]]:
    policy = kubectl.json("get", "networkpolicy", "tiny", "-n", ns)
    return [
        peer
        for rule in policy["spec"]["ingress"]
        if any(p.get("port") == protocol.SIDECAR_METRICS_PORT for p in rule.get("ports") or [])
        for peer in rule["from"]
    ]


def render_hash(kubectl: Kubectl, ns: str) -> str | None:
    return kubectl.json("get", "dserver", "tiny", "-n", ns).get("status", {}).get("renderHash")


def test_a_restart_drops_a_field_no_longer_rendered_and_one_rendering_alike_writes_nothing(
    kubectl: Kubectl, audited: Callable[[float], Operator], ns: str
):
    # An operator whose settings (or version) stop rendering a field: the scrapers'
    # podSelector. Nothing else changes, so no child differs in a field the new render
    # sets (drift sees none), and the generation has landed: only the render hash in
    # the server's status tells the new process that what landed is not its render.
    op = audited(3600)
    op.stop()
    op.extra_env["KVFERRY_METRICS_CLIENTS"] = json.dumps([{**SCRAPER_NS, **SCRAPER_POD}])
    op.start()
    kubectl.apply(make(ns), "--server-side")
    wait_ready(kubectl, ns)
    assert metrics_peers(kubectl, ns) == [{**SCRAPER_NS, **SCRAPER_POD}]
    first = render_hash(kubectl, ns)
    assert first
    op.stop()
    op.extra_env["KVFERRY_METRICS_CLIENTS"] = json.dumps([SCRAPER_NS])
    op.start()
    wait_until(lambda: metrics_peers(kubectl, ns) == [SCRAPER_NS], 90, "the podSelector dropped")
    # Its status records the new render (a stop before that write would leave the old
    # hash, and the next start would apply once more).
    wait_until(lambda: render_hash(kubectl, ns) not in (None, first), 60, "the new render hash")
    wait_ready(kubectl, ns)
    # The same settings again: nothing to apply, by the listing or the first pass.
    op.stop()
    restarted, offset = time.time(), len(op.log())
    op.start()
    wait_until(lambda: "safety pass done" in op.log()[offset:], 60, "the first safety pass")
    log = op.log()[offset:]
    assert "applied children" not in log and "re-applying" not in log, log[-3000:]
    writes = [r for r in audited_requests(restarted) if r.namespace == ns and r.write]
    assert writes == [], Counter(f"{r.verb} {r.resource}" for r in writes)
