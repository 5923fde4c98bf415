"""held.py: a child's status update is not checked against a render again, and
anything that could change the answer is."""

from __future__ import annotations

import copy
import logging
from typing import Any

import kopf
import pytest

from kvferry_operator import api, handlers, held, render
from kvferry_operator.held import Held
from tests.unit.test_takeover import SETTINGS, Kube, run_child, tiny

LOG = logging.getLogger("test")


@pytest.fixture(autouse=True)
def no_events(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("info", "warn"):
        monkeypatch.setattr(kopf, name, lambda body, reason, message: None)


def owner() -> dict[str, Any]:
    obj = tiny()
    obj["metadata"]["resourceVersion"] = "7"
    return obj


def sts(obj: dict[str, Any]) -> dict[str, Any]:
    child = next(
        c
        for c in render.render(api.parse_server(obj), SETTINGS.render_context())
        if c["kind"] == "StatefulSet"
    )
    child = copy.deepcopy(child)
    child["metadata"].update(uid="uid-sts", resourceVersion="10", generation=1)
    child["status"] = {"replicas": 0}
    return child


def test_a_status_update_keeps_the_fingerprint_and_our_fields_or_the_owner_do_not():
    o, child = owner(), sts(owner())
    base = held.fingerprint(child, o, {})
    updated = copy.deepcopy(child)
    updated["status"] = {"replicas": 1, "readyReplicas": 1}
    updated["metadata"].update(resourceVersion="11", managedFields=[{"manager": "kcm"}])
    assert held.fingerprint(updated, o, {}) == base
    edited = copy.deepcopy(child)
    edited["spec"]["replicas"] = 5
    relabelled = copy.deepcopy(child)
    relabelled["metadata"]["labels"] = {**relabelled["metadata"]["labels"], "x": "y"}
    recreated = copy.deepcopy(child)
    recreated["metadata"]["uid"] = "uid-other"
    respec = owner()
    respec["metadata"]["generation"] = 2
    respec["spec"] = {**respec["spec"], "changed": True}
    status_written = owner()
    status_written["metadata"]["resourceVersion"] = "8"
    status_written["status"] = {"observedGeneration": 1}
    assert held.fingerprint(child, status_written, {}) == base
    others = {
        held.fingerprint(edited, o, {}),
        held.fingerprint(relabelled, o, {}),
        held.fingerprint(recreated, o, {}),
        held.fingerprint(child, respec, {}),
        held.fingerprint(child, o, {"prefill": 3}),
        # The ceiling gate's hold reaches decode's command line: not a status update.
        held.fingerprint(child, {**o, "status": {"retention": {"ceilingHeld": 600}}}, {}),
    }
    assert base not in others and len(others) == 6


def run(kube: Kube, memo: kopf.Memo, o: dict[str, Any], body: dict[str, Any], type="MODIFIED"):
    run_child(
        handlers._on_child_event("StatefulSet"),
        type=type,
        name=body["metadata"]["name"],
        namespace="ns",
        labels=body["metadata"]["labels"],
        body=kopf.Body(body),
        memo=memo,
        logger=LOG,
        servers={("ns", "tiny"): [o]},
        statefulsets={},
        pods={},
        nodes={},
    )


def test_the_child_handler_renders_once_for_status_updates_and_again_for_an_edit(monkeypatch):
    renders = []  # the drift checks, each a render of the whole server
    real = handlers._holds_ours
    monkeypatch.setattr(handlers, "_holds_ours", lambda *a: renders.append(1) or real(*a))
    o = owner()
    child = sts(o)
    kube = Kube()
    memo = kopf.Memo(kube=kube, settings=SETTINGS, probe=None, indexes={}, held=Held())
    run(kube, memo, o, child, type=None)
    assert (len(renders), kube.applied) == (1, [])
    for n in range(1, 4):
        updated = copy.deepcopy(child)
        updated["status"] = {"replicas": n}
        updated["metadata"]["resourceVersion"] = str(10 + n)
        run(kube, memo, o, updated)
    # Three status updates: no render, nothing applied.
    assert (len(renders), kube.applied, memo.held.hits) == (1, [], 3)
    edited = copy.deepcopy(child)
    edited["spec"]["template"]["spec"]["containers"][0]["image"] = "someone/else"
    run(kube, memo, o, edited)
    assert kube.applied and kube.applied[-1][0] == "StatefulSet"
    # After the re-apply, the edited fingerprint is not taken as holding.
    applied = len(kube.applied)
    run(kube, memo, o, edited)
    assert len(kube.applied) > applied


def test_a_deleted_child_is_forgotten_and_restored():
    o = owner()
    child = sts(o)
    key = ("StatefulSet", "ns", child["metadata"]["name"])
    kube = Kube()
    memo = kopf.Memo(kube=kube, settings=SETTINGS, probe=None, indexes={}, held=Held())
    run(kube, memo, o, child, type=None)
    assert memo.held.still(key, held.fingerprint(child, o, {}))
    run(kube, memo, o, child, type="DELETED")
    assert kube.applied and kube.applied[-1] == ("StatefulSet", child["metadata"]["name"])
    # The object that was deleted (its uid) is no longer taken as holding.
    assert not memo.held.still(key, held.fingerprint(child, o, {}))


def test_an_apply_that_lands_records_its_answer_so_its_own_watch_event_needs_no_render(
    monkeypatch,
):
    renders = []
    real = handlers._holds_ours
    monkeypatch.setattr(handlers, "_holds_ours", lambda *a: renders.append(1) or real(*a))
    o = owner()
    kube = Kube()
    memo = kopf.Memo(kube=kube, settings=SETTINGS, probe=None, indexes={}, held=Held())
    assert handlers.apply_or_retry(o, memo, LOG)
    assert len(memo.held) == len(kube.applied) > 0
    # The watch event of what was applied (the fake answers with what it was sent),
    # after a status patch of the owner: no render.
    child = next(
        c for c in render.render(api.parse_server(o), SETTINGS.render_context())
        if c["kind"] == "StatefulSet"
    )  # fmt: skip
    o["metadata"]["resourceVersion"] = "8"
    o["status"] = {"observedGeneration": 1}
    applied = len(kube.applied)
    run(kube, memo, o, child, type="ADDED")
    assert (renders, len(kube.applied)) == ([], applied)
