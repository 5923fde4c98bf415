"""Which node folders a server may mount: ``spec.model.source.hub.cache.hostPath``
against the folders the operator's installer allows. Pure: no API calls.

A hostPath volume is the node's file system, read-write, in a container that runs
as root: whoever may create a server with any path owns the node. So the operator
allows no hostPath unless it is told prefixes (``KVFERRY_HOST_PATH_PREFIXES``, the
chart's ``settings.hostPathPrefixes``), and a server whose path is not under one
gets no StatefulSets, only a condition that names the field and the fix.

Rules (each has a test in ``tests/unit/test_hostpaths.py``):

- A path is compared by its components after normalising: repeated and trailing
  slashes and ``.`` components are dropped (``/var/cache//kvferry/.`` is
  ``/var/cache/kvferry``), on the path and on every prefix alike.
- A prefix matches whole components: ``/var/cache/kv`` allows ``/var/cache/kv/hf``,
  never ``/var/cache/kvferry``; a prefix allows itself.
- A path with a ``..`` component is refused whatever the prefixes (``/ok/../etc``
  must not pass as under ``/ok``; the API server refuses ``..`` in a hostPath too,
  but only once the StatefulSet is written).
- A relative path is refused (the CRD refuses it first); a prefix that is relative
  or has ``..`` is a startup error naming the variable.

The operator cannot see the node's file system: a symlink under an allowed folder
that points elsewhere is the node's to prevent. Allow only folders that nobody but
root can write, on the node and in the pods (docs/security.md).
"""

from __future__ import annotations

from .api import Server

FIELD = "spec.model.source.hub.cache.hostPath.path"
ENV = "KVFERRY_HOST_PATH_PREFIXES"
CHART_VALUE = "settings.hostPathPrefixes"
# Condition reason (Ready and Degraded) for a refused path.
REASON = "HostPathNotAllowed"


def components(path: str) -> tuple[str, ...] | None:
    """The path's components, normalised; None when it is not absolute or has ``..``."""
    if not path.startswith("/"):
        return None
    parts = tuple(p for p in path.split("/") if p not in ("", "."))
    return None if ".." in parts else parts


def parse_prefixes(text: str) -> tuple[str, ...]:
    """``KVFERRY_HOST_PATH_PREFIXES``: absolute folders separated by ``:``, as in PATH;
    empty allows none. Each comes back normalised; a bad one raises ValueError."""
    out = []
    for entry in text.split(":"):
        if not entry.strip():
            continue
        parts = components(entry.strip())
        if parts is None:
            raise ValueError(
                f"{ENV}: {entry!r} is not an absolute folder without '..' "
                f"(list folders such as /var/cache/kvferry, separated by ':')"
            )
        out.append("/" + "/".join(parts))
    return tuple(out)


def allowed(path: str, prefixes: tuple[str, ...]) -> bool:
    parts = components(path)
    if parts is None:
        return False
    for prefix in prefixes:
        head = components(prefix)
        if head is not None and parts[: len(head)] == head:
            return True
    return False


def refusal(server: Server, prefixes: tuple[str, ...]) -> str | None:
    """Why the server's hostPath is refused (the condition's message), or None."""
    hub = server.spec.model.hub
    path = hub.cache.host_path if hub else None
    if path is None or allowed(path, prefixes):
        return None
    if components(path) is None:
        why = "has a '..' component (name the folder itself)"
    elif prefixes:
        why = f"is not under a folder the operator allows ({', '.join(prefixes)})"
    else:
        why = "is a node folder, and the operator allows none"
    return (
        f"{FIELD} {path!r} {why}: the StatefulSets are not applied. Keep the cache on a PVC "
        "(spec.model.source.hub.cache.pvc) or leave cache unset (an emptyDir per pod), or "
        f"have the operator's installer allow the folder ({CHART_VALUE} in the chart, "
        f"{ENV} for the operator)"
    )
