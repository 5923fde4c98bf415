"""The residency reports the operator has received: the latest one per pod. Pure.

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


def is_stale(item: Received, now: float, stale_after: float) -> bool:
    return now - item.received_at > stale_after


class ReportStore:
    """Latest report per pod, keyed (namespace, server) -> pod -> Received."""

    def __init__(self) -> None:
        self._by_server: dict[tuple[str, str], dict[str, Received]] = {}

    def put(self, received: Received) -> None:
        rep = received.report
        self._by_server.setdefault((rep.namespace, rep.server), {})[rep.pod] = received

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
