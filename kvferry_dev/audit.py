"""The API server's audit log, read as one request per audit ID: how the cluster tier
(tests/cluster/test_quiet.py) and the operator bench (bench/operator_scale.py) count
what the operator asked the API server."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

WRITE_VERBS = frozenset({"create", "update", "patch", "delete", "deletecollection"})


@dataclass(frozen=True)
class AuditedRequest:
    audit_id: str
    at: float  # unix seconds the API server received it
    verb: str
    resource: str  # with "/<subresource>"; the request path when there is no object
    namespace: str
    name: str
    code: int

    @property
    def write(self) -> bool:
        return self.verb in WRITE_VERBS


def read_audit(path: Path, user: str) -> list[AuditedRequest]:
    """``user``'s requests in the audit log at ``path``, one per audit ID (a watch logs
    two stages), in the order received; [] while there is no log."""
    seen: dict[str, AuditedRequest] = {}
    if not path.exists():
        return []
    for line in path.read_text().splitlines():
        try:
            ev = json.loads(line)
        except ValueError:
            continue  # a line the API server is still writing
        aid = ev.get("auditID")
        if (ev.get("user") or {}).get("username") != user or not aid or aid in seen:
            continue
        ref = ev.get("objectRef") or {}
        resource = ref.get("resource") or ev.get("requestURI", "?").split("?")[0]
        if ref.get("subresource"):
            resource += "/" + ref["subresource"]
        # RFC 3339 with microseconds, always UTC ("...Z").
        at = datetime.fromisoformat(ev["requestReceivedTimestamp"].replace("Z", "+00:00"))
        seen[aid] = AuditedRequest(
            aid,
            at.timestamp(),
            ev.get("verb", "?"),
            resource,
            ref.get("namespace", ""),
            ref.get("name", ""),
            int((ev.get("responseStatus") or {}).get("code") or 0),
        )
    return list(seen.values())
