"""The ceiling gate at apply (``handlers.gate_ceiling``): a raise of maxRetentionSeconds
waits while decode pins handles no release can free. Against a kube that records what
it is sent; the API server and the real operator are in tests/cluster/test_live_policy.py."""

from __future__ import annotations

import json
import logging
from typing import Any

from kvferry_operator import api, handlers, ownership, publisher
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
    def __init__(self) -> None:
        self.applied: dict[tuple[str, str], dict[str, Any]] = {}
        self.status_patches: list[dict[str, Any]] = []
        self.events: list[tuple[str, str, str]] = []

    def get(self, api_version, kind, namespace, name):
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


def apply(body: dict[str, Any], unreleasable: int | None) -> tuple[RecordingKube, Any]:
    kube, claims = RecordingKube(), ownership.Claims()
    result = handlers.apply_children(
        body,
        kube,  # type: ignore[arg-type]
        SETTINGS,
        LOG,
        claims=claims,
        post=kube.create_event,
        unreleasable=lambda key: unreleasable,
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
        kube, claims = RecordingKube(), ownership.Claims()
        handlers.apply_children(
            body,
            kube,  # type: ignore[arg-type]
            SETTINGS,
            LOG,
            claims=claims,
            post=kube.create_event,
            unreleasable=never,
        )
        assert claims.last_apply(("ns", "tiny")).applied


def test_a_hold_outlasts_a_stale_ceiling_written_over_it():
    # A publisher pass that read the server before the hold landed wrote the spec's
    # 3600 s as the ceiling; the hold (600 s) is still what decode runs.
    kube, _ = apply(raised(3600, ceiling=3600, held=600), unreleasable=1)
    assert kube.decode_ttl() == 600
    assert kube.status_patches == [{"retention": {"ceiling": 600, "ceilingHeld": 600}}]
    assert kube.events == []  # the same hold: nothing new to say
