"""The CRD schema and its CEL rules, evaluated locally (the cluster tier re-runs
the same table through a real API server)."""

from __future__ import annotations

import re
from typing import Any

import pytest

from kvferry_operator import api, render, validation
from tests.manifests import EXAMPLES, INVALID, Invalid, load_example, server


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_is_valid(path):
    assert validation.validate(load_example(path)) == []


@pytest.mark.parametrize("case", INVALID, ids=lambda c: c.id)
def test_invalid_spec_is_rejected_with_its_message(case: Invalid):
    errors = validation.validate(case.manifest)
    matching = [e for e in errors if e.path == case.path and case.message in e.message]
    assert matching, f"expected {case.path}: ...{case.message}...; got {[str(e) for e in errors]}"


def _walk_rules(schema: dict[str, Any], path: str) -> list[tuple[str, str]]:
    """(field path, message) of every CEL rule, with [] for list items."""
    found = [
        (path + rule.get("fieldPath", ""), " ".join(rule["message"].split()))
        for rule in schema.get("x-kubernetes-validations", [])
    ]
    for name, sub in schema.get("properties", {}).items():
        found += _walk_rules(sub, f"{path}.{name}" if path else name)
    if isinstance(schema.get("items"), dict):
        found += _walk_rules(schema["items"], path + "[]")
    return found


def _walk_required(schema: dict[str, Any], path: str) -> list[str]:
    found = [f"{path}.{name}" if path else name for name in schema.get("required", [])]
    for name, sub in schema.get("properties", {}).items():
        found += _walk_required(sub, f"{path}.{name}" if path else name)
    if isinstance(schema.get("items"), dict):
        found += _walk_required(schema["items"], path + "[]")
    return found


def _covered_paths() -> set[str]:
    return {re.sub(r"\[\d+\]", "[]", c.path) for c in INVALID}


SPEC_SCHEMA = api.openapi_schema(api.SERVER_KIND)


def test_table_covers_every_cel_rule():
    # A rule added to the CRD without a case here would ship untested.
    missing = [
        (path, msg)
        for path, msg in _walk_rules(SPEC_SCHEMA, "")
        if not any(re.sub(r"\[\d+\]", "[]", c.path) == path and c.message in msg for c in INVALID)
    ]
    assert missing == []


def test_table_covers_every_required_field():
    required = [p for p in _walk_required(SPEC_SCHEMA, "") if not p.startswith("status")]
    assert sorted(set(required) - _covered_paths()) == []


def test_table_has_at_least_fifteen_cases():
    assert len(INVALID) >= 15
    assert len({c.id for c in INVALID}) == len(INVALID)


def test_unquoted_off_gets_a_yaml_hint():
    # `mode: Off` in YAML 1.1 arrives as false; the user must learn to quote it.
    case = next(c for c in INVALID if c.id == "tuning-mode-yaml-bool")
    (err,) = validation.validate(case.manifest)
    assert "quote it" in err.message


@pytest.mark.parametrize("value", [0, 1, 7, "0%", "25%", "100%"])
def test_max_unavailable_takes_pods_or_a_percentage_as_a_pdb_does(value: int | str):
    assert validation.validate(server({"decode": {"maxUnavailable": value}})) == []


def test_a_server_that_already_has_a_status_keeps_its_name():
    # Created before the suffix rule: the API server must still take its spec edits
    # and the operator's status writes (create drops status, so new ones are checked).
    existing = {**server(name="chat-decode"), "status": {"observedGeneration": 1}}
    assert validation.validate(existing) == []


def _children(name: str) -> set[tuple[str, str]]:
    obj = api.parse_server({**server(name=name), "metadata": {"name": name, "namespace": "ns"}})
    return {(c["kind"], c["metadata"]["name"]) for c in render.render(obj)}


def test_the_names_the_crd_accepts_never_render_the_same_child():
    # Every child name of server "chat" is itself a server name someone might pick.
    names = {"chat"} | {name for _, name in _children("chat")}
    names |= {f"{n}-x" for n in set(names)}
    accepted = sorted(n for n in names if validation.validate(server(name=n)) == [])
    assert "chat" in accepted and "chat-sidecar" in accepted
    for i, a in enumerate(accepted):
        for b in accepted[i + 1 :]:
            assert not _children(a) & _children(b), (a, b)
    rejected = set(names) - set(accepted)
    assert rejected >= {"chat-decode", "chat-prefill"}
