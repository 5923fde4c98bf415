"""The live policy on a real API server with the real operator: a change of the
retention, the recompute threshold, skip-prefill or the prefill placement (by the user,
or Auto's: the measured break-even too) reaches
the sidecars in the answer to their report push and touches neither StatefulSet; only
the ceiling (cacheTuning.maxRetentionSeconds) rolls decode. The fake sidecar is this
test: it pushes reports with the pod's bound token, as a sidecar does."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from kvferry_wire import costfit
from kvferry_wire import policy as wire_policy
from kvferry_wire import report as wire_report
from tests.cluster.conftest import Kubectl, Operator, wait_until
from tests.cluster.test_operator import make, wait_ready
from tests.cluster.test_reports import bound_token, decode_report, push
from tests.cluster.test_status_fields import (
    LONG_GAPS,
    SHORT_GAPS,
    expected_recommendation,
    gap_report,
)
from tests.kube import wait_for_event

ROLES = ("prefill", "decode")


def statefulsets(kubectl: Kubectl, ns: str) -> dict[str, tuple[int, str, str]]:
    """Each StatefulSet's (generation, resourceVersion, pod template as JSON)."""
    out = {}
    for role in ROLES:
        sts = kubectl.get("statefulset", f"tiny-{role}", ns)
        assert sts is not None
        meta = sts["metadata"]
        template = json.dumps(sts["spec"]["template"], sort_keys=True)
        out[role] = (meta["generation"], meta["resourceVersion"], template)
    return out


def settled(kubectl: Kubectl, ns: str) -> bool:
    for role in ROLES:
        sts = kubectl.get("statefulset", f"tiny-{role}", ns) or {}
        st = sts.get("status") or {}
        if not (
            st.get("observedGeneration") == sts["metadata"]["generation"]
            and st.get("updatedReplicas") == st.get("readyReplicas") == 1
            and st.get("currentRevision") == st.get("updateRevision")
        ):
            return False
    return True


def wait_landed(kubectl: Kubectl, ns: str, generation: int) -> None:
    """Until the operator has applied the server's ``generation`` (observedGeneration)."""
    wait_until(
        lambda: (
            (kubectl.get("dserver", "tiny", ns).get("status") or {}).get("observedGeneration")
            == generation
        ),
        30,
        f"generation {generation} landed",
    )


def retention(kubectl: Kubectl, ns: str) -> dict[str, Any]:
    return ((kubectl.get("dserver", "tiny", ns) or {}).get("status") or {}).get("retention") or {}


class Sidecar:
    """tiny-decode-0's sidecar as far as the operator sees it: its pushes."""

    def __init__(self, kubectl: Kubectl, operator: Operator, ns: str) -> None:
        self.kubectl, self.operator, self.ns = kubectl, operator, ns
        self.token = bound_token(kubectl, ns, "tiny-decode-0")
        self.answers: list[dict[str, Any]] = []

    def push(self, body: bytes | None = None) -> dict[str, Any] | None:
        """One push; the policy in its answer (None when the answer has none)."""
        status, answer = push(
            self.operator, body or decode_report(self.ns, "tiny", "tiny-decode-0"), self.token
        )
        assert status == 202, answer
        self.answers.append(answer)
        return answer.get(wire_policy.RESPONSE_KEY)

    def policy_where(self, what: str, check: Any, body: bytes | None = None) -> dict[str, Any]:
        """Push (at most a report a second: the endpoint's per-pod rate) until the
        answer's policy passes ``check``."""
        return wait_until(
            lambda: (p := self.push(body)) is not None and check(p) and p, 30, what, interval=1.0
        )


def test_a_spec_change_of_the_policy_reaches_the_sidecars_and_rolls_nothing(
    kubectl: Kubectl, operator: Operator, ns: str
):
    kubectl.apply(make(ns), "--server-side")
    wait_ready(kubectl, ns)
    wait_until(lambda: settled(kubectl, ns), 60, "both roles settled")
    sidecar = Sidecar(kubectl, operator, ns)
    first = sidecar.policy_where(
        "the spec's policy in a report answer", lambda p: p[wire_policy.K_RETENTION] == 480
    )
    assert (first[wire_policy.K_THRESHOLD], first[wire_policy.K_SKIP]) == (64, 256)
    before = statefulsets(kubectl, ns)
    generation = kubectl.get("dserver", "tiny", ns)["metadata"]["generation"]

    assert first[wire_policy.K_PLACEMENT] == wire_policy.PLACEMENT_MEASURED
    patch = {
        "spec": {
            "kvTransfer": {"decodeRetentionSeconds": 120, "recomputeThreshold": 32},
            "routing": {"skipPrefillBelowTokens": 100, "prefillPlacement": "Threshold"},
        }
    }
    kubectl.run("patch", "dserver", "tiny", "-n", ns, "--type", "merge", "-p", json.dumps(patch))
    told = sidecar.policy_where(
        "the new policy in a report answer", lambda p: p[wire_policy.K_RETENTION] == 120
    )
    assert (told[wire_policy.K_THRESHOLD], told[wire_policy.K_SKIP]) == (32, 100)
    assert told[wire_policy.K_PLACEMENT] == wire_policy.PLACEMENT_THRESHOLD
    # The operator handled the new generation (its children applied) ...
    wait_landed(kubectl, ns, generation + 1)
    # ... and neither StatefulSet changed: no generation, no write, the same template.
    assert statefulsets(kubectl, ns) == before
    # The ConfigMap carries the new values as the start value of a pod started later.
    settings = json.loads(kubectl.get("configmap", "tiny-sidecar", ns)["data"]["sidecar.json"])
    assert (settings["decodeRetentionSeconds"], settings["retentionCeilingSeconds"]) == (120, 1800)
    # Status says what is in force, with the revision the sidecars were told; the new
    # fields survived the API server (the CRD declares them).
    shown = wait_until(
        lambda: (r := retention(kubectl, ns)).get("applied") == 120 and r, 30, "status shows 120s"
    )
    assert shown["ceiling"] == 1800
    assert shown["policyRevision"] == told[wire_policy.K_REVISION]
    assert "restarts" not in shown
    # KVCacheStatus shows the whole policy in force (its fields declared: read back).
    kvcs = wait_until(
        lambda: (
            ((kubectl.get("kvcachestatus", "tiny", ns) or {}).get("status") or {})
            .get("policy", {})
            .get("revision")
            == told[wire_policy.K_REVISION]
            and kubectl.get("kvcachestatus", "tiny", ns)["status"]["policy"]
        ),
        30,
        "KVCacheStatus shows the new policy",
    )
    assert kvcs == {
        "revision": told[wire_policy.K_REVISION],
        "retentionSeconds": 120,
        "recomputeThreshold": 32,
        "skipPrefillBelowTokens": 100,
        "prefillPlacement": "Threshold",
        "ceilingSeconds": 1800,
        "reason": "retention 120s: spec.kvTransfer.decodeRetentionSeconds; ceiling 1800s: "
        "spec.cacheTuning.maxRetentionSeconds; recomputeThreshold 32: "
        "spec.kvTransfer.recomputeThreshold; prefill placement: spec.routing.prefillPlacement "
        "Threshold",
    }


def decode_ttl(kubectl: Kubectl, ns: str) -> int:
    sts = kubectl.get("statefulset", "tiny-decode", ns)
    args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
    config = json.loads(args[args.index("--kv-transfer-config") + 1])
    return config["kv_connector_extra_config"]["decoder_kv_blocks_ttl"]


def test_only_the_ceiling_rolls_decode(kubectl: Kubectl, operator: Operator, ns: str):
    kubectl.apply(make(ns), "--server-side")
    wait_ready(kubectl, ns)
    wait_until(lambda: settled(kubectl, ns), 60, "both roles settled")
    before = statefulsets(kubectl, ns)
    patch = {"spec": {"cacheTuning": {"maxRetentionSeconds": 600}}}
    kubectl.run("patch", "dserver", "tiny", "-n", ns, "--type", "merge", "-p", json.dumps(patch))

    wait_until(
        lambda: decode_ttl(kubectl, ns) == 600, 30, "decode's decoder_kv_blocks_ttl is the ceiling"
    )
    after = statefulsets(kubectl, ns)
    assert after["prefill"] == before["prefill"]
    assert after["decode"][0] == before["decode"][0] + 1


@pytest.fixture
def no_safety_pass(operator: Operator) -> Iterator[Operator]:
    """The tier's operator with its safety pass 10 minutes apart after the first (the
    tier runs one every 5 s), so what re-applies decode is the event the test is about."""
    operator.stop()
    operator.extra_env = {**operator.extra_env, "KVFERRY_RESYNC_SECONDS": "600"}
    # The log is the tier's, appended to: this process's lines start here.
    operator.log_from = len(operator.log())  # type: ignore[attr-defined]
    operator.start()
    try:
        yield operator
    finally:
        operator.stop()
        operator.extra_env.pop("KVFERRY_RESYNC_SECONDS")
        operator.start()


def test_a_ceiling_raise_waits_while_decode_pins_what_no_release_can_free(
    kubectl: Kubectl, no_safety_pass: Operator, ns: str
):
    operator = no_safety_pass
    kubectl.apply(make(ns, spec={"cacheTuning": {"maxRetentionSeconds": 600}}), "--server-side")
    wait_ready(kubectl, ns)
    wait_until(lambda: settled(kubectl, ns), 60, "both roles settled")
    sidecar = Sidecar(kubectl, operator, ns)
    stuck = decode_report(ns, "tiny", "tiny-decode-0", unreleasable=2)
    sidecar.push(stuck)
    # The publisher records the ceiling decode runs (what a raise is measured from).
    wait_until(lambda: retention(kubectl, ns).get("ceiling") == 600, 30, "ceiling 600s shown")
    before = statefulsets(kubectl, ns)
    generation = kubectl.get("dserver", "tiny", ns)["metadata"]["generation"]

    patch = {"spec": {"cacheTuning": {"maxRetentionSeconds": 3600}}}
    kubectl.run("patch", "dserver", "tiny", "-n", ns, "--type", "merge", "-p", json.dumps(patch))
    held = wait_for_event(kubectl, ns, "tiny", "CeilingHeld")
    assert "3600s held at 600s" in held[0]["message"], held[0]["message"]
    wait_landed(kubectl, ns, generation + 1)
    # Held: the field survived the API server, and decode was not rolled.
    shown = retention(kubectl, ns)
    assert (shown["ceiling"], shown["ceilingHeld"]) == (600, 600)
    assert decode_ttl(kubectl, ns) == 600
    assert statefulsets(kubectl, ns) == before
    # KVCacheStatus shows the ceiling in force and what holds it.
    wait_until(
        lambda: (
            ((kubectl.get("kvcachestatus", "tiny", ns) or {}).get("status") or {})
            .get("retention", {})
            .get("unreleasablePinnedHandles")
            == 2
        ),
        30,
        "KVCacheStatus shows the unreleasable pins",
    )

    # The operator's first safety pass (15 s after its start, whatever the interval)
    # is over: from here only the hold's lift can re-apply decode.
    since = operator.log_from  # type: ignore[attr-defined]
    wait_until(
        lambda: "safety pass done" in operator.log()[since:],
        60,
        "this operator's first safety pass",
    )
    # The pins are gone from the next report: the raise goes in (the publisher lifts the
    # hold, whose status event re-applies decode), and rolls decode only.
    sidecar.push(decode_report(ns, "tiny", "tiny-decode-0", unreleasable=0))
    wait_until(lambda: decode_ttl(kubectl, ns) == 3600, 60, "decode runs the raised ceiling")
    raised = wait_for_event(kubectl, ns, "tiny", "CeilingRaised")
    assert "3600s in force" in raised[0]["message"], raised[0]["message"]
    shown = retention(kubectl, ns)
    assert shown["ceiling"] == 3600 and "ceilingHeld" not in shown
    after = statefulsets(kubectl, ns)
    assert after["prefill"] == before["prefill"]
    assert after["decode"][0] == before["decode"][0] + 1


def test_auto_applies_each_recommendation_live_without_a_restart(
    kubectl: Kubectl, operator: Operator, ns: str
):
    kubectl.apply(make(ns, spec={"cacheTuning": {"mode": "Auto"}}), "--server-side")
    wait_ready(kubectl, ns)
    wait_until(lambda: settled(kubectl, ns), 60, "both roles settled")
    before = statefulsets(kubectl, ns)
    sidecar = Sidecar(kubectl, operator, ns)
    # Flapping traffic: each recommendation far from the one before. Before, Auto
    # rolled decode for each, at most maxRestartsPerDay (2) a day.
    patterns = [SHORT_GAPS, LONG_GAPS, SHORT_GAPS]
    for i, gaps in enumerate(patterns):
        want = expected_recommendation(gaps)
        body = gap_report(ns, "tiny-decode-0", gaps)
        told = sidecar.policy_where(
            f"flip {i + 1}: {want}s in a report answer",
            lambda p, w=want: p[wire_policy.K_RETENTION] == w,
            body,
        )
        shown = retention(kubectl, ns)
        assert shown["applied"] == want and shown["policyRevision"] == told[wire_policy.K_REVISION]
    assert "restarts" not in retention(kubectl, ns)
    assert statefulsets(kubectl, ns) == before
    events = wait_for_event(kubectl, ns, "tiny", "RetentionApplied")
    assert events and all("live" in e["message"] for e in events), [e["message"] for e in events]


def measured_report(ns: str, per_pulled: float) -> bytes:
    """tiny-decode-0's report with prefill legs timed at 17 ms a pull, ``per_pulled`` s a
    pulled token and 1.3 ms a computed one."""
    rep = wire_report.decode(gap_report(ns, "tiny-decode-0", []))
    for n in (8, 16, 32, 64, 128, 256, 512, 1024, 2048) * 3:
        for pulled in (0, n):
            x = {costfit.PULL: 1.0 if pulled else 0.0, costfit.PULLED_TOKENS: pulled}
            x[costfit.COMPUTED_TOKENS] = n + 16 - pulled
            seconds = 0.05 + (0.017 if pulled else 0.0) + per_pulled * pulled
            seconds += 0.0013 * (n + 16 - pulled)
            costfit.observe(rep.costs.prefill_leg, costfit.PREFILL_LEG, x, seconds, n + 16)
    return wire_report.encode(rep)


def threshold_status(kubectl: Kubectl, ns: str) -> dict[str, Any]:
    status = (kubectl.get("dserver", "tiny", ns) or {}).get("status") or {}
    return status.get("recomputeThreshold") or {}


def test_auto_applies_the_measured_break_even_live_without_a_restart(
    kubectl: Kubectl, operator: Operator, ns: str
):
    """The decode sidecars' prefill legs say a pull of more than 22 tokens pays (then,
    on a slower link, that no pull does): Auto tells the sidecars each threshold in
    its report answer, status shows it and why, and neither StatefulSet changes."""
    spec = {"cacheTuning": {"mode": "Auto"}, "model": {"maxModelLen": 4096}}
    kubectl.apply(make(ns, spec=spec), "--server-side")
    wait_ready(kubectl, ns)
    wait_until(lambda: settled(kubectl, ns), 60, "both roles settled")
    before = statefulsets(kubectl, ns)
    sidecar = Sidecar(kubectl, operator, ns)
    for per_pulled, want in ((0.0005, 22), (0.002, 4096)):  # 4096: maxModelLen, never pull
        told = sidecar.policy_where(
            f"recomputeThreshold {want} in a report answer",
            lambda p, w=want: p[wire_policy.K_THRESHOLD] == w,
            measured_report(ns, per_pulled),
        )
        shown = wait_until(
            lambda w=want: (t := threshold_status(kubectl, ns)).get("applied") == w and t,
            30,
            f"status.recomputeThreshold.applied {want}",
        )
        assert shown["recommended"] == want and shown["reason"]
        assert retention(kubectl, ns)["policyRevision"] == told[wire_policy.K_REVISION]
    assert statefulsets(kubectl, ns) == before
    events = wait_for_event(kubectl, ns, "tiny", "RecomputeThresholdApplied")
    assert events and all("no restart" in e["message"] for e in events)
    costs = kubectl.get("kvcachestatus", "tiny", ns)["status"]["costs"]
    assert costs["pullLegs"] == 27 and costs["pullSecondsPerToken"] == 0.002
