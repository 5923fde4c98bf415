"""A standby taking over (or any restart) re-applies nothing that has landed: kopf's
initial listing (type None) applies a server only when its status does not show its
generation landed, the child watches' own listing restores edited children, and the
first safety pass comes soon after start for children deleted while no operator ran
(tests/unit/test_safety_pass.py, tests/cluster/test_failover.py)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import kopf
import pytest

from kvferry_operator import api, handlers, ownership, render, status
from kvferry_operator.settings import Settings
from tests.manifests import server

SETTINGS = Settings(sidecar_image="", resync_seconds=300)
LOG = logging.getLogger("test")
COMPLETE = {"type": "Progressing", "status": "False", "reason": "Complete"}


@pytest.fixture(autouse=True)
def events(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """kopf's Events need a running operator: the reasons, recorded."""
    posted: list[str] = []
    for name in ("info", "warn"):
        monkeypatch.setattr(kopf, name, lambda body, reason, message: posted.append(reason))
    return posted


def tiny(generation: int = 1, **status: Any) -> dict[str, Any]:
    obj = server()
    obj["metadata"].update(name="tiny", namespace="ns", uid="uid-tiny", generation=generation)
    obj["status"] = status
    return obj


class Kube:
    """What the handlers ask of the API server: every child's name free, applies and
    status patches recorded."""

    def __init__(self) -> None:
        self.applied: list[tuple[str, str]] = []
        self.statuses: list[tuple[str, dict]] = []

    def get(self, api_version, kind, namespace, name):
        return None

    def apply(self, child: dict[str, Any]) -> dict[str, Any]:
        self.applied.append((child["kind"], child["metadata"]["name"]))
        return child

    def patch_status(self, api_version, kind, namespace, name, body):
        self.statuses.append((kind, body))


def listed(
    obj: dict[str, Any],
    type: str | None = None,
    claims: Any = None,
    settings: Settings = SETTINGS,
) -> Kube:
    """The server's event through server_changed (type None: the initial listing)."""
    kube = Kube()
    memo = kopf.Memo(
        kube=kube,
        settings=settings,
        probe=None,
        indexes={},
        claims=claims if claims is not None else ownership.Claims(),
    )
    handlers.server_changed(
        type=type,
        body=kopf.Body(obj),
        memo=memo,
        logger=LOG,
        statefulsets={},
        pods={},
        nodes={},
    )
    return kube


def rendered(obj: dict[str, Any], settings: Settings = SETTINGS) -> str:
    """The render.digest this operator's settings give the server."""
    return render.digest(render.render(api.parse_server(obj), settings.render_context()))


def landed(generation: int = 1) -> dict[str, Any]:
    obj = tiny(generation=generation, observedGeneration=generation, conditions=[COMPLETE])
    obj["status"]["renderHash"] = rendered(obj)
    return obj


def test_the_initial_listing_applies_no_server_whose_generation_landed():
    # A standby taking over applied every server: an ownership read and an apply of
    # each of ~10 children, thousands of requests for servers that had not changed.
    kube = listed(landed())
    assert kube.applied == []


def test_the_hash_an_apply_lands_in_status_is_the_one_a_later_listing_matches():
    first = listed(tiny())
    assert first.applied
    written = [body for kind, body in first.statuses if kind == api.SERVER_KIND]
    assert written and written[-1]["renderHash"] == rendered(tiny())
    # The next process (a standby, a restart) reads that status back: nothing to do.
    again = tiny(**written[-1])
    assert again["status"]["observedGeneration"] == 1
    assert listed(again).applied == []


@pytest.mark.parametrize(
    "obj",
    [
        tiny(),  # never landed
        tiny(generation=2, observedGeneration=1),  # a new generation while none ran
        # Landed, then an apply of it refused or held (observedGeneration stays).
        tiny(
            observedGeneration=1,
            conditions=[{"type": "Progressing", "status": "False", "reason": "ApplyFailed"}],
        ),
        tiny(
            observedGeneration=1,
            conditions=[
                {"type": "Progressing", "status": "False", "reason": "PodTemplateNotAllowed"}
            ],
        ),
        # Landed, by an operator that rendered it otherwise (another version, another
        # sidecar image): applied once, so that what this one renders (and no longer
        # renders) lands; and by one that wrote no hash yet (an upgrade to this one).
        tiny(observedGeneration=1, conditions=[COMPLETE], renderHash="0123456789abcdef"),
        tiny(observedGeneration=1, conditions=[COMPLETE]),
    ],
    ids=[
        "no-observed-generation",
        "older",
        "apply-failed",
        "settings-held",
        "other-render",
        "no-render-hash",
    ],
)
def test_the_initial_listing_applies_a_server_whose_status_does_not_show_it_landed(obj):
    kube = listed(obj)
    wanted = render.render(api.parse_server(obj), SETTINGS.render_context())
    assert len(kube.applied) == len(wanted)


def test_new_settings_that_render_the_children_otherwise_apply_a_landed_server():
    obj = landed()
    other = Settings(sidecar_image="registry.invalid/sidecar:next", resync_seconds=300)
    assert rendered(obj, other) != obj["status"]["renderHash"]
    assert len(listed(obj, settings=other).applied) == len(
        render.render(api.parse_server(obj), other.render_context())
    )


def test_a_new_server_and_one_this_process_applied_are_applied_as_before():
    landed_ = landed()
    assert listed(landed_, type="ADDED").applied
    # A re-listing (a watch restarted) of a server this process applied: as before.
    claims = ownership.Claims()
    claims.applied(("ns", "tiny"), ownership.ApplyOutcome(1, True))
    assert listed(landed_, claims=claims).applied
    # Our own status write coming back: no apply.
    assert listed(landed_, type="MODIFIED").applied == []


def test_generation_landed_reads_observed_generation_and_progressing():
    assert status.generation_landed({"observedGeneration": 3}, 3)
    assert status.generation_landed({"observedGeneration": 3, "conditions": [COMPLETE]}, 3)
    rolling = {"type": "Progressing", "status": "True", "reason": "RollingUpdate"}
    assert status.generation_landed({"observedGeneration": 3, "conditions": [rolling]}, 3)
    assert not status.generation_landed({"observedGeneration": 2}, 3)
    assert not status.generation_landed({}, 3)
    assert not status.generation_landed(None, 3)
    assert not status.generation_landed({"observedGeneration": "3"}, 3)
    # With this process's render: only the one that landed.
    assert status.generation_landed({"observedGeneration": 3, "renderHash": "ab"}, 3, "ab")
    assert not status.generation_landed({"observedGeneration": 3, "renderHash": "ab"}, 3, "cd")
    assert not status.generation_landed({"observedGeneration": 3}, 3, "ab")
    for reason in ("ApplyFailed", "ChildConflict", "HostPathNotAllowed"):
        held = {"type": "Progressing", "status": "False", "reason": reason}
        assert not status.generation_landed({"observedGeneration": 3, "conditions": [held]}, 3)


@pytest.mark.parametrize("rand", [0.0, 0.5, 0.999])
def test_the_first_safety_pass_comes_soon_after_start(rand):
    # One interval after start (300 s by default) left a child deleted while no
    # operator ran missing for minutes: nothing else restores it.
    assert 10.0 <= handlers.first_pass_delay(300, rand) <= 20.0
    assert 10.0 <= handlers.first_pass_delay(3600, rand) <= 20.0
    # A shorter interval is not made longer.
    assert 1.6 <= handlers.first_pass_delay(2, rand) <= 2.4


def test_the_child_watches_listing_restores_an_edited_child_and_leaves_the_rest():
    # What the takeover relies on (not new): a child's initial listing event (type None)
    # re-applies a child that lost our fields, and nothing for one that holds them.
    owner = tiny(observedGeneration=1, conditions=[COMPLETE])
    rendered = next(
        c
        for c in render.render(api.parse_server(owner), SETTINGS.render_context())
        if c["kind"] == "ConfigMap"
    )
    name = rendered["metadata"]["name"]
    edited = {**rendered, "data": {k: "edited" for k in rendered["data"]}}
    for body, want in ((rendered, []), (edited, [("ConfigMap", name)])):
        kube = Kube()
        memo = kopf.Memo(kube=kube, settings=SETTINGS, probe=None, indexes={})
        run_child(
            handlers._on_child_event("ConfigMap"),
            type=None,
            name=name,
            namespace="ns",
            labels={api.LABEL_INSTANCE: "tiny"},
            body=kopf.Body(body),
            memo=memo,
            logger=LOG,
            servers={("ns", "tiny"): [owner]},
            statefulsets={},
            pods={},
            nodes={},
        )
        assert kube.applied == want


def run_child(handler, **kwargs):
    """A child handler (a coroutine function) run to its end."""
    return asyncio.run(handler(**kwargs))
