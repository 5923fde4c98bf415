"""drift.covers: an observed child holds every field the operator renders, or not."""

from __future__ import annotations

import copy

import pytest

from kvferry_operator import api, drift, render
from tests.manifests import MINIMAL

CHILDREN = render.render(api.parse_server(copy.deepcopy(MINIMAL)))
STATEFULSET = next(c for c in CHILDREN if c["kind"] == "StatefulSet")
SERVICE = next(c for c in CHILDREN if c["kind"] == "Service")


def as_stored(obj: dict) -> dict:
    """What the API server hands back: our fields plus its own (uid, defaults, status)."""
    out = copy.deepcopy(obj)
    out["metadata"].update(uid="u-1", resourceVersion="42", managedFields=[{"manager": "x"}])
    out["status"] = {"replicas": 1, "readyReplicas": 0}
    if out["kind"] == "Service":
        for port in out["spec"]["ports"]:
            port.setdefault("protocol", "TCP")
    return out


@pytest.mark.parametrize("child", CHILDREN, ids=lambda c: f"{c['kind']}/{c['metadata']['name']}")
def test_every_rendered_child_covers_itself_as_stored(child: dict) -> None:
    assert drift.covers(as_stored(child), child)


def test_a_changed_field_of_ours_is_drift() -> None:
    observed = as_stored(STATEFULSET)
    observed["spec"]["replicas"] = 5
    assert not drift.covers(observed, STATEFULSET)


def test_a_removed_label_of_ours_is_drift() -> None:
    observed = as_stored(SERVICE)
    key = next(iter(SERVICE["metadata"]["labels"]))
    del observed["metadata"]["labels"][key]
    assert not drift.covers(observed, SERVICE)


def test_a_removed_list_item_is_drift() -> None:
    observed = as_stored(STATEFULSET)
    observed["spec"]["template"]["spec"]["containers"].pop()
    assert not drift.covers(observed, STATEFULSET)


def test_foreign_fields_are_not_drift() -> None:
    observed = as_stored(STATEFULSET)
    observed["metadata"].setdefault("annotations", {})["argocd.argoproj.io/sync"] = "x"
    observed["spec"]["template"]["metadata"].setdefault("labels", {})["team"] = "a"
    assert drift.covers(observed, STATEFULSET)


@pytest.mark.parametrize(
    ("observed", "desired", "holds"),
    [
        ("1", 1, True),  # a quantity rendered as a number, stored as a string
        ("2", 1, False),
        (True, 1, False),  # bools are not numbers here
        (None, None, True),
        ({}, {"a": None}, True),  # a field we render as null must be absent
        ({"a": 1}, {"a": None}, False),
        ([1, 2], [1], False),
    ],
)
def test_scalars(observed: object, desired: object, holds: bool) -> None:
    assert drift.covers(observed, desired) is holds
