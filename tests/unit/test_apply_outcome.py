"""What the API server refuses is recorded for status, and applying goes on, also
outside a kopf handler (the resync loop and the retries run in threads of their own)."""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

from kvferry_operator import handlers, ownership
from kvferry_operator.kube import ApiException
from kvferry_operator.settings import Settings
from tests.manifests import server

LOG = logging.getLogger("test")
SETTINGS = Settings(sidecar_image="", resync_seconds=60)
REFUSAL = "admission webhook denied the request: at most 2 replicas"


def tiny(generation: int) -> dict[str, Any]:
    obj = server()
    obj["metadata"].update(name="tiny", namespace="ns", uid="uid-tiny", generation=generation)
    return obj


class RefusingKube:
    """Applies every child but ``refused`` (admission refuses it, 422)."""

    def __init__(self, refused: tuple[str, str] | None = ("StatefulSet", "tiny-decode")) -> None:
        self.refused = refused
        self.applied: list[tuple[str, str]] = []
        self.events: list[tuple[str, str, str]] = []

    def get(self, api_version, kind, namespace, name):
        return None

    def apply(self, child: dict[str, Any]) -> dict[str, Any]:
        key = (child["kind"], child["metadata"]["name"])
        if key == self.refused:
            exc = ApiException(status=422, reason="Invalid")
            exc.body = json.dumps({"message": REFUSAL})
            raise exc
        self.applied.append(key)
        return {**child, "status": {"x": 1}}

    def patch_status(self, *args: Any) -> None:
        pass

    def create_event(self, body, type: str, reason: str, message: str) -> None:
        self.events.append((type, reason, message))


def test_a_refusal_off_the_handler_is_posted_recorded_and_the_rest_still_lands():
    kube = RefusingKube()
    claims = ownership.Claims()
    result: list[handlers.Applied] = []
    # As the resync loop runs it: a worker thread, no kopf handler context (kopf.warn
    # raised LookupError there, and the rest of the children were never applied).
    worker = threading.Thread(
        target=lambda: result.append(
            handlers.apply_children(tiny(4), kube, SETTINGS, LOG, None, claims, kube.create_event)
        )
    )
    worker.start()
    worker.join(30)
    assert result == [handlers.Applied.NEVER]
    assert ("StatefulSet", "tiny-prefill") in kube.applied
    assert ("Service", "tiny") in kube.applied
    message = f"StatefulSet tiny-decode: 422 {REFUSAL}"
    assert kube.events == [("Warning", handlers.EVENT_APPLY_FAILED, message)]
    assert claims.last_apply(("ns", "tiny")) == ownership.ApplyOutcome(4, False, (message,))


def test_a_whole_apply_that_lands_is_recorded_a_one_child_apply_is_not():
    kube = RefusingKube(refused=None)
    claims = ownership.Claims()
    assert handlers.apply_children(tiny(2), kube, SETTINGS, LOG, None, claims, kube.create_event)
    assert claims.last_apply(("ns", "tiny")) == ownership.ApplyOutcome(2, True, ())
    only = ("StatefulSet", "tiny-decode")
    handlers.apply_children(tiny(3), kube, SETTINGS, LOG, only, claims, kube.create_event)
    assert claims.last_apply(("ns", "tiny")) == ownership.ApplyOutcome(2, True, ())
    claims.drop_server(("ns", "tiny"))
    assert claims.last_apply(("ns", "tiny")) is None


def test_an_event_that_cannot_be_posted_does_not_stop_the_apply():
    kube = RefusingKube()

    def broken(*args: Any) -> None:
        raise OSError("API server gone")

    claims = ownership.Claims()
    handlers.apply_children(tiny(1), kube, SETTINGS, LOG, None, claims, broken)
    assert ("StatefulSet", "tiny-prefill") in kube.applied
    assert claims.last_apply(("ns", "tiny")) is not None
