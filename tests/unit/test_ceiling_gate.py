"""The ceiling gate at apply (``handlers.gate_ceiling``): a raise of maxRetentionSeconds
waits while decode pins handles no release can free. Against a kube that records what
it is sent; the API server and the real operator are in tests/cluster/test_live_policy.py."""

from __future__ import annotations

import json
import logging
from typing import Any

from kvferry_operator import api, handlers, ownership, publisher, render
from kvferry_operator.settings import Settings
from tests.manifests import server

LOG = logging.getLogger("test")
SETTINGS = Settings(sidecar_image="", resync_seconds=60)


def raised(to: int, ceiling: int | None = 600, held: int | None = None) -> dict[str, Any]:
    """The server with maxRetentionSeconds ``to``; decode runs ``ceiling`` (status)."""
    obj = server({"cacheTuning": {"maxRetentionSeconds": to}})
    obj["metadata"].update(name="tiny", namespace="ns", uid="uid-tiny", generation=2)
    retention: dict[str, Any] = {"applied": 480}
    if ceiling is not None:
        retention["ceiling"] = ceiling
    if held is not None:
        retention["ceilingHeld"] = held
    obj["status"] = {"retention": retention}
    return obj


class RecordingKube:
    def __init__(self, running: dict[str, Any] | None = None) -> None:
        self.running = running  # the decode StatefulSet a get finds
        self.applied: dict[tuple[str, str], dict[str, Any]] = {}
        self.status_patches: list[dict[str, Any]] = []
        self.events: list[tuple[str, str, str]] = []

    def get(self, api_version, kind, namespace, name):
        if kind == "StatefulSet":
            return self.running if name == "tiny-decode" else None
        return None

    def apply(self, child: dict[str, Any]) -> dict[str, Any]:
        self.applied[(child["kind"], child["metadata"]["name"])] = child
        return child

    def patch_status(self, api_version, kind, namespace, name, body) -> None:
        if kind == api.SERVER_KIND:  # (the new KVCacheStatus gets its first status too)
            self.status_patches.append(body)

    def create_event(self, body, type: str, reason: str, message: str) -> None:
        self.events.append((type, reason, message))

    def decode_ttl(self) -> int:
        args = self.applied[("StatefulSet", "tiny-decode")]["spec"]["template"]["spec"][
            "containers"
        ][0]["args"]
        config = json.loads(args[args.index("--kv-transfer-config") + 1])
        return config["kv_connector_extra_config"]["decoder_kv_blocks_ttl"]


def apply(
    body: dict[str, Any],
    unreleasable: int | handlers.Unreleasable | None,
    kube: RecordingKube | None = None,
    claims: ownership.Claims | None = None,
) -> tuple[RecordingKube, Any]:
    """A whole apply with the gate's count ``unreleasable`` (or the function asked)."""
    kube, claims = kube or RecordingKube(), claims or ownership.Claims()
    count = unreleasable if callable(unreleasable) else (lambda key: unreleasable)
    result = handlers.apply_children(
        body,
        kube,  # type: ignore[arg-type]
        SETTINGS,
        LOG,
        claims=claims,
        post=kube.create_event,
        unreleasable=count,
    )
    assert result is handlers.Applied.ALL
    return kube, claims.last_apply(("ns", "tiny"))


def test_a_raise_over_unreleasable_pins_is_held_and_says_why():
    kube, outcome = apply(raised(3600), unreleasable=2)
    assert kube.decode_ttl() == 600  # decode's pods are not rolled for the raise
    assert kube.status_patches == [{"retention": {"ceiling": 600, "ceilingHeld": 600}}]
    assert [(t, r) for t, r, _ in kube.events] == [("Warning", publisher.EVENT_CEILING_HELD)]
    message = kube.events[0][2]
    assert "3600s held at 600s" in message and "2 pinned handle(s)" in message
    assert outcome.ceiling == 600
    # The sidecars' settings carry the ceiling decode runs, not the one asked for.
    settings = json.loads(kube.applied[("ConfigMap", "tiny-sidecar")]["data"]["sidecar.json"])
    assert settings["retentionCeilingSeconds"] == 600


def test_a_raise_with_no_unreleasable_pin_goes_in_and_is_recorded():
    kube, outcome = apply(raised(3600), unreleasable=0)
    assert kube.decode_ttl() == 3600
    # Recorded as the ceiling in force at once: a second apply before the publisher's
    # next pass must not take 600 s for decode's ceiling and hold at it.
    assert kube.status_patches == [{"retention": {"ceiling": 3600, "ceilingHeld": None}}]
    assert kube.events == [] and outcome.ceiling == 3600


def test_an_unknown_count_does_not_hold_the_users_raise():
    kube, _ = apply(raised(3600), unreleasable=None)
    assert kube.decode_ttl() == 3600 and kube.events == []


def test_a_lowering_is_never_held_and_clears_a_hold():
    kube, outcome = apply(raised(300, ceiling=600, held=600), unreleasable=9)
    assert kube.decode_ttl() == 300
    assert kube.status_patches == [{"retention": {"ceiling": 300, "ceilingHeld": None}}]
    assert kube.events == [] and outcome.ceiling == 300


def test_a_standing_hold_renders_the_same_and_writes_nothing():
    kube, _ = apply(raised(3600, ceiling=600, held=600), unreleasable=1)
    assert kube.decode_ttl() == 600
    assert kube.status_patches == [] and kube.events == []


def test_a_server_nobody_reported_for_is_rendered_as_its_spec():
    kube, _ = apply(raised(3600, ceiling=None), unreleasable=4)
    assert kube.decode_ttl() == 3600 and kube.status_patches == []


def test_the_count_is_asked_for_a_raise_only():
    def never(key: tuple[str, str]) -> int | None:
        raise AssertionError("counted for an apply that raises nothing")

    for body in (raised(300, ceiling=600), raised(600, ceiling=600)):
        _, outcome = apply(body, never)
        assert outcome.applied


def running(ceiling: int) -> dict[str, Any]:
    """The decode StatefulSet as an apply at maxRetentionSeconds ``ceiling`` left it."""
    children = render.render(api.parse_server(raised(ceiling)), SETTINGS.render_context())
    return next(
        c for c in children if c["kind"] == "StatefulSet" and "decode" in c["metadata"]["name"]
    )


def test_a_raise_the_publisher_wrote_as_the_ceiling_first_is_still_held():
    # A publisher pass that read the raised spec before this apply wrote 3600 s as the
    # ceiling; decode still runs 600 s (its StatefulSet says so), and pins are stuck.
    kube = RecordingKube(running=running(600))
    kube, outcome = apply(raised(3600, ceiling=3600), unreleasable=2, kube=kube)
    assert kube.decode_ttl() == 600 and outcome.ceiling == 600
    assert kube.status_patches == [{"retention": {"ceiling": 600, "ceilingHeld": 600}}]
    assert [r for _, r, _ in kube.events] == [publisher.EVENT_CEILING_HELD]


def test_a_process_goes_by_what_its_own_last_apply_rendered():
    kube, claims = RecordingKube(), ownership.Claims()
    apply(raised(600), unreleasable=0, kube=kube, claims=claims)
    # Status now says 3600 s (a stale publisher write), no StatefulSet is read.
    kube.status_patches.clear()
    apply(raised(3600, ceiling=3600), unreleasable=1, kube=kube, claims=claims)
    assert kube.decode_ttl() == 600
    assert kube.status_patches == [{"retention": {"ceiling": 600, "ceilingHeld": 600}}]


def test_a_drift_re_apply_keeps_the_ceiling_of_the_last_whole_apply():
    kube, claims = RecordingKube(), ownership.Claims()
    apply(raised(3600), unreleasable=3, kube=kube, claims=claims)  # held at 600
    # The owner the drift check saw predates the gate's status write: no hold in it.
    result = handlers.apply_children(
        raised(3600),
        kube,  # type: ignore[arg-type]
        SETTINGS,
        LOG,
        only=("StatefulSet", "tiny-decode"),
        claims=claims,
        post=kube.create_event,
    )
    assert result is handlers.Applied.ALL
    assert kube.decode_ttl() == 600
