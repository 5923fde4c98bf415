"""The residency reports the operator has received: the newest one per pod. Pure.

The report endpoint (``report_endpoint.py``) puts what it authenticated and
decoded here; the publisher (``publisher.py``) reads, prunes and forgets it on its
timer; ``aggregate.py`` folds a server's rows into figures. Everything runs on
the operator's one event loop or hands over whole rows, so no lock is needed.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvferry_wire.report import Report


@dataclass(frozen=True)
class Received:
    report: Report
    received_at: float  # unix seconds, operator clock
    pod_uid: str = ""  # the reporting pod's uid, as the endpoint checked it


def newer(received: Received, held: Received) -> bool:
    """Whether ``received`` replaces ``held``, the row of the same pod name.

    Two pushes of one pod in flight (a slow TokenReview, a retry) may land out of
    order: the later report wins, by the sidecar's own clock (the same one again is
    kept, its arrival new). A sidecar that restarted
    starts its counters again, and its first report wins over every report of the
    process before (a later ``startedAt``), even when its ``generatedAt`` is earlier (a
    clock stepped back). A pod replaced under the same name (another uid, both known:
    the endpoint checked each against the live pod) wins by arrival: its node's clock
    need not agree with the old pod's. A clock stepped back within one process holds
    its rows until the publisher prunes the row as stale; the next report is kept."""
    if received.pod_uid and held.pod_uid and received.pod_uid != held.pod_uid:
        return True
    new, old = received.report, held.report
    # The same report again (a fake sidecar's, a replay) refreshes the row's arrival.
    return (new.started_at, new.generated_at) >= (old.started_at, old.generated_at)


def is_stale(item: Received, now: float, stale_after: float) -> bool:
    return now - item.received_at > stale_after


class ReportStore:
    """Latest report per pod, keyed (namespace, server) -> pod -> Received."""

    def __init__(self) -> None:
        self._by_server: dict[tuple[str, str], dict[str, Received]] = {}

    def put(self, received: Received) -> bool:
        """Keep ``received`` unless this pod's row holds a newer report; whether it was
        kept. See :func:`newer`."""
        rep = received.report
        rows = self._by_server.setdefault((rep.namespace, rep.server), {})
        held = rows.get(rep.pod)
        if held is not None and not newer(received, held):
            return False
        rows[rep.pod] = received
        return True

    def servers(self) -> list[tuple[str, str]]:
        return list(self._by_server)

    def get(self, namespace: str, server: str) -> list[Received]:
        return list(self._by_server.get((namespace, server), {}).values())

    def forget(self, namespace: str, server: str) -> None:
        self._by_server.pop((namespace, server), None)

    def prune(self, namespace: str, server: str, pods: list[str]) -> None:
        """Drop these pods' rows (gone, or silent too long)."""
        rows = self._by_server.get((namespace, server), {})
        for pod in pods:
            rows.pop(pod, None)
        if not rows:
            self._by_server.pop((namespace, server), None)
