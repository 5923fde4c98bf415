"""A rollout the API server refuses, as GitOps tools read it: status must not call
the refused generation observed (Argo CD and Flux take observedGeneration ==
generation with Progressing Complete for "rolled out, healthy"), and a finished
rollout is not a Warning Event."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator

import pytest

from tests.cluster.conftest import Kubectl, Operator, wait_until
from tests.cluster.test_operator import make, wait_ready
from tests.kube import condition, wait_condition, wait_for_event

POLICY_MESSAGE = "this namespace allows at most 2 replicas per StatefulSet"


def policy(ns: str) -> list[dict]:
    """An organisation's admission rule the operator cannot know about (cluster-scoped,
    bound to the test's namespace only)."""
    name = f"max-replicas-{ns}"
    return [
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicy",
            "metadata": {"name": name},
            "spec": {
                "failurePolicy": "Fail",
                "matchConstraints": {
                    "resourceRules": [
                        {
                            "apiGroups": ["apps"],
                            "apiVersions": ["v1"],
                            "operations": ["CREATE", "UPDATE"],
                            "resources": ["statefulsets"],
                        }
                    ]
                },
                "validations": [
                    {"expression": "object.spec.replicas <= 2", "message": POLICY_MESSAGE}
                ],
            },
        },
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicyBinding",
            "metadata": {"name": name},
            "spec": {
                "policyName": name,
                "validationActions": ["Deny"],
                "matchResources": {
                    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}}
                },
            },
        },
    ]


@pytest.fixture
def replica_policy(kubectl: Kubectl, ns: str) -> Iterator[None]:
    objs = policy(ns)
    kubectl.apply(objs, "--server-side")
    probe = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": "policy-probe", "namespace": ns},
        "spec": {
            "replicas": 3,
            "selector": {"matchLabels": {"a": "b"}},
            "template": {
                "metadata": {"labels": {"a": "b"}},
                "spec": {"containers": [{"name": "c", "image": "x"}]},
            },
        },
    }

    def enforced() -> bool:
        # The API server compiles a new policy asynchronously: wait until it refuses.
        proc = kubectl.run(
            "create", "--dry-run=server", "-f", "-", input=json.dumps(probe), check=False
        )
        return proc.returncode != 0 and POLICY_MESSAGE in proc.stderr

    wait_until(enforced, 60, "the admission policy enforced")
    try:
        yield
    finally:
        for obj in reversed(objs):
            kubectl.run("delete", obj["kind"], obj["metadata"]["name"], check=False)


def status_of(kubectl: Kubectl, ns: str) -> tuple[int, dict]:
    obj = kubectl.get("dserver", "tiny", ns) or {}
    return obj["metadata"]["generation"], obj.get("status") or {}


def test_a_refused_rollout_keeps_the_observed_generation_and_says_why(
    kubectl: Kubectl, operator: Operator, ns: str, replica_policy: None
):
    kubectl.apply(make(ns), "--server-side")
    wait_ready(kubectl, ns)
    first, st = status_of(kubectl, ns)
    assert st["observedGeneration"] == first

    kubectl.apply(make(ns, spec={"decode": {"replicas": 3}}), "--server-side")
    refused = wait_condition(kubectl, ns, "tiny", "Progressing", "ApplyFailed")
    generation, st = status_of(kubectl, ns)
    assert generation == first + 1
    assert st["observedGeneration"] == first, st  # the refused generation is not observed
    assert refused["status"] == "False" and POLICY_MESSAGE in refused["message"]
    degraded = condition(kubectl, ns, "tiny", "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "ApplyFailed")
    assert POLICY_MESSAGE in degraded["message"] and "tiny-decode" in degraded["message"]
    events = wait_for_event(kubectl, ns, "tiny", "ApplyFailed")
    assert {e["type"] for e in events} == {"Warning"}

    # Fixed in git: the next generation lands and is observed; the finished rollout
    # is a Normal Event (alerting pipelines page on Warnings).
    kubectl.apply(make(ns, spec={"decode": {"replicas": 2}}), "--server-side")

    def rolled_out() -> bool:
        generation, st = status_of(kubectl, ns)
        return (
            st.get("observedGeneration") == generation == first + 2
            and condition(kubectl, ns, "tiny", "Progressing").get("reason") == "Complete"
            and condition(kubectl, ns, "tiny", "Degraded").get("status") == "False"
        )

    wait_until(rolled_out, 120, "generation 3 observed, Progressing Complete")
    complete = wait_for_event(kubectl, ns, "tiny", "Complete")
    assert {e["type"] for e in complete} == {"Normal"}, complete
    assert "Traceback" not in operator.log()


def test_admission_policies_are_available(kubectl: Kubectl):
    # The test above needs them; say so plainly if a control plane lacks the API.
    out = subprocess.run(
        ["kubectl", "api-resources", "--api-group=admissionregistration.k8s.io", "-o", "name"],
        capture_output=True,
        text=True,
        env=kubectl.env,
        timeout=30,
    ).stdout
    assert "validatingadmissionpolicies" in out


def test_a_value_outside_the_basic_plane_is_applied(kubectl: Kubectl, operator: Operator, ns: str):
    # An emoji in an env value or annotation: the apply patch (YAML to the API server)
    # once carried it as a JSON surrogate pair, which YAML refuses, so the server's
    # StatefulSet could never be applied (found by the generated specs of test_bad_input).
    value = "caf\u00e9 \U0001f600"
    spec = {
        "decode": {"env": [{"name": "GREETING", "value": value}]},
        "prefill": {"podAnnotations": {"team": value}},
    }
    kubectl.apply(make(ns, spec=spec), "--server-side")
    wait_ready(kubectl, ns)
    generation, st = status_of(kubectl, ns)
    assert st["observedGeneration"] == generation
    decode = kubectl.get("statefulset", "tiny-decode", ns)
    env = {
        e["name"]: e.get("value")
        for e in decode["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["GREETING"] == value
    prefill = kubectl.get("statefulset", "tiny-prefill", ns)
    assert prefill["spec"]["template"]["metadata"]["annotations"]["team"] == value
