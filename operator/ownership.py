"""Whether an object that holds a child's name is the server's own. Pure.

A child's name comes from the server's name alone (``render.name_for``), so it can be
taken: by a user's object (a server ``postgres`` and the Service ``postgres`` the
database already has), by another server's child (servers ``chat`` and
``chat-decode`` both render Service ``chat-decode``), or by the child of an earlier
server of the same name that the garbage collector has not removed yet. A forced
server-side apply would take such an object over, and the garbage collector would
delete it with the server. So an object is applied to only when it is absent (the
apply creates it) or its controller owner reference is this server's uid; anything
else is a :class:`Conflict`, which leaves the object as it is and makes the server
``Degraded`` (``status.REASON_CHILD_CONFLICT``). While the object is one the pods
would use (:func:`feeds_pods`), their StatefulSets wait too.

Reading each child before every apply would double the operator's requests, so
:class:`Claims` remembers the children known to be ours (learned from a read, from
our own apply, and from the child watch, which also forgets a deleted one): only a
child not known to be ours is read first, by name, or for a burst of new servers in
one namespace from one list of its kind there (:class:`NameLookup`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from . import api

ChildKey = tuple[str, str, str]  # kind, namespace, name
ServerKey = tuple[str, str]  # namespace, name


@dataclass(frozen=True)
class Conflict:
    """A child's name held by an object this server does not control."""

    kind: str
    name: str
    controller: str = ""  # "<kind> <name>" of what controls it; "" when nothing does

    def __str__(self) -> str:
        return f"{self.kind} {self.name} (controlled by {self.controller or 'nothing'})"


@dataclass(frozen=True)
class ApplyOutcome:
    """A whole apply of one generation of a server (not a one-child re-apply)."""

    generation: int
    applied: bool  # every child landed
    refusals: tuple[str, ...] = ()  # "<kind> <name>: <the API server's message>"
    # The operator's settings refused the server (a hostPath, a podTemplate field): why.
    # It held the StatefulSets and the ConfigMap; the same refusal holds them again.
    held: str | None = None
    # The render this apply sent (render.digest): status.renderHash once it landed.
    render: str | None = field(default=None, compare=False)
    # When the apply ended (the caller's monotonic clock): a list taken before that
    # may lack some of its children (handlers.needs_apply).
    finished: float = field(default=0.0, compare=False)
    # The decode ceiling it rendered (api.Server.retention_ceiling): a lifted hold of the
    # ceiling gate differs from it, and re-applies (handlers.server_changed).
    ceiling: int | None = field(default=None, compare=False)


def controller_of(obj: dict[str, Any]) -> dict[str, Any] | None:
    """The owner reference with ``controller: true``; an object has at most one."""
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return next((r for r in refs if isinstance(r, dict) and r.get("controller") is True), None)


def is_ours(obj: dict[str, Any], server_uid: str) -> bool:
    """The object's controller is the server with ``server_uid``."""
    ref = controller_of(obj)
    return (
        bool(server_uid)
        and ref is not None
        and ref.get("uid") == server_uid
        and ref.get("kind") == api.SERVER_KIND
        and str(ref.get("apiVersion", "")).split("/")[0] == api.GROUP
    )


def conflict(
    existing: dict[str, Any] | None, kind: str, name: str, server_uid: str
) -> Conflict | None:
    """None when the child may be applied: absent, or controlled by this server."""
    if existing is None or is_ours(existing, server_uid):
        return None
    ref = controller_of(existing)
    held_by = f"{ref.get('kind', '?')} {ref.get('name', '?')}" if ref else ""
    return Conflict(kind, name, held_by)


def feeds_pods(found: Conflict, server_name: str) -> bool:
    """The pods would use the object: they mount ConfigMap ``<name>-sidecar``, find
    their peers through the headless Services ``<name>-<role>``, by name, and are
    isolated by NetworkPolicy ``<name>``. Pods must not start on someone else's
    settings or peers, or without their isolation, so their StatefulSets wait."""
    # A RoleScaler sets a role's count (scaler.py): none from an object not ours.
    return found.kind in ("ConfigMap", "NetworkPolicy", "RoleScaler") or (
        found.kind == "Service" and found.name != server_name
    )


def message(conflicts: Iterable[Conflict], server_name: str) -> str:
    """The condition's message: each object, and what the user can do."""
    found = sorted(conflicts, key=lambda c: (c.kind, c.name))
    what = "; ".join(str(c) for c in found)
    held = (
        " The StatefulSets are not applied either: the pods would read that ConfigMap, "
        "find that Service's pods as peers, run without their NetworkPolicy, or at the "
        "count that RoleScaler sets."
        if any(feeds_pods(c, server_name) for c in found)
        else ""
    )
    return (
        f"{len(found)} child name(s) taken by objects this server does not control, so "
        f"nothing is applied to them: {what}.{held} Child names come from the server's "
        "name: rename this server, or delete or rename those objects if they are not "
        "needed (an earlier server's child goes once the garbage collector removes it)"
    )


class Claims:
    """Children known to be ours (key -> the owning server's uid) and each server's
    current conflicts. Shared by the operator's threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owners: dict[ChildKey, str] = {}
        self._conflicts: dict[ServerKey, dict[ChildKey, Conflict]] = {}
        self._applies: dict[ServerKey, ApplyOutcome] = {}
        # Whole applies under way, per server (a handler's and a retry's may overlap).
        self._applying: dict[ServerKey, int] = {}
        # Condition type -> (status, reason) last posted as an Event, per server.
        self._posted: dict[ServerKey, dict[str, tuple[str, str]]] = {}

    def owner(self, key: ChildKey) -> str | None:
        with self._lock:
            return self._owners.get(key)

    def remember(self, key: ChildKey, server_uid: str) -> None:
        with self._lock:
            self._owners[key] = server_uid

    def forget(self, key: ChildKey) -> None:
        with self._lock:
            self._owners.pop(key, None)

    def record(self, server: ServerKey, key: ChildKey, found: Conflict | None) -> None:
        """The outcome of one child's claim: a conflict, or None when it was ours."""
        with self._lock:
            held = self._conflicts.setdefault(server, {})
            if found is None:
                held.pop(key, None)
            else:
                held[key] = found
            if not held:
                del self._conflicts[server]

    def conflicts(self, server: ServerKey) -> tuple[Conflict, ...]:
        with self._lock:
            return tuple(self._conflicts.get(server, {}).values())

    def applied(self, server: ServerKey, outcome: ApplyOutcome) -> None:
        with self._lock:
            self._applies[server] = outcome

    def last_apply(self, server: ServerKey) -> ApplyOutcome | None:
        with self._lock:
            return self._applies.get(server)

    @contextmanager
    def applying(self, server: ServerKey) -> Iterator[None]:
        """A whole apply of ``server`` under way, for the safety pass to leave alone:
        its list may predate the apply's children, and the apply has its own retries."""
        with self._lock:
            self._applying[server] = self._applying.get(server, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                left = self._applying[server] - 1
                if left:
                    self._applying[server] = left
                else:
                    del self._applying[server]

    def apply_state(self, server: ServerKey) -> tuple[bool, ApplyOutcome | None]:
        """Whether a whole apply is under way, and the last one's outcome, read together:
        an apply records its outcome before it leaves ``applying``, so two reads could
        see neither (no outcome yet, then no longer running)."""
        with self._lock:
            return server in self._applying, self._applies.get(server)

    def first_post(self, server: ServerKey, ctype: str, status: str, reason: str) -> bool:
        """True once per change of a condition: two status refreshes that both start
        from the status before their writes (a server event and a child event at once)
        both see the change, and only one may post its Event."""
        with self._lock:
            posted = self._posted.setdefault(server, {})
            if posted.get(ctype) == (status, reason):
                return False
            posted[ctype] = (status, reason)
            return True

    def drop_server(self, server: ServerKey) -> None:
        with self._lock:
            self._conflicts.pop(server, None)
            self._applies.pop(server, None)
            self._posted.pop(server, None)


Getter = Callable[[str, str, str, str], "dict[str, Any] | None"]  # apiVersion, kind, ns, name
Lister = Callable[[str, str, str], "list[dict[str, Any]]"]  # apiVersion, kind, ns


@dataclass(frozen=True)
class _Listed:
    at: float  # when the list was asked for (before its answer: the older bound)
    holders: dict[str, dict[str, Any]]  # name -> the object's metadata


class NameLookup:
    """What holds a child's name, for a child not known to be ours (the read before its
    first apply). A lone new server's children are read by name, one request each. A
    burst of new servers in one namespace (a first-sight read of a kind there for a
    second server within ``window`` seconds) lists that kind in the namespace once
    instead, and the list answers every such lookup there for ``window`` seconds: 100
    servers applied at once cost a few lists per kind, not a read per child (docs/performance.md).

    The list may be up to ``window`` seconds old: an object someone else creates under
    a child's name in that time is not seen (a read has the same gap, of one request's
    time, not up to ``window``): the forced apply then takes it over. The object of
    ours the list predates is absent from it, which is right: an apply to an absent
    name creates it. Only names and owner references are kept (what conflict reads),
    and a list older than ``window`` is dropped at the next lookup (at most one per
    kind and namespace stays until then)."""

    def __init__(
        self,
        get: Getter,
        list_all: Lister,
        window: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._get = get
        self._list = list_all
        self._window = window
        self._clock = clock
        self._lock = threading.Lock()
        # (kind, ns) -> when a server's child was last read by name there, and which server
        self._read_at: dict[tuple[str, str], tuple[float, str]] = {}
        self._listed: dict[tuple[str, str], _Listed] = {}
        self._listing: dict[tuple[str, str], threading.Lock] = {}

    def holder(
        self, api_version: str, kind: str, namespace: str, name: str, server_uid: str = ""
    ) -> dict[str, Any] | None:
        """The object that holds ``name`` (its metadata at least), or None when none
        does; ``server_uid``: whose child it is (one server's children alone are no burst)."""
        key = (kind, namespace)
        with self._lock:
            now = self._clock()
            self._expire(now)
            listed = self._listed.get(key)
            if listed is not None:
                return listed.holders.get(name)
            last = self._read_at.get(key)
            burst = last is not None and now - last[0] <= self._window and last[1] != server_uid
            self._read_at[key] = (now, server_uid)
            one_at_a_time = self._listing.setdefault(key, threading.Lock())
        if not burst:
            return self._get(api_version, kind, namespace, name)
        with one_at_a_time:  # a burst's threads wait for one list, not a list each
            with self._lock:
                listed = self._listed.get(key)
            if listed is None:
                # Only what conflict() reads: a metadata list still carries every
                # annotation (last-applied-configuration holds a whole object).
                holders = {
                    (o.get("metadata") or {}).get("name", ""): _slim(o)
                    for o in self._list(api_version, kind, namespace)
                }
                # Fresh from its arrival: a list that took longer than the window (a
                # few thousand objects) would otherwise be stale on arrival, and every
                # thread of the burst would list again behind it.
                listed = _Listed(self._clock(), holders)
                with self._lock:
                    self._listed[key] = listed
        return listed.holders.get(name)

    def _expire(self, now: float) -> None:
        # Runs at each lookup: after a burst the last lists stay until the next lookup,
        # at most one per kind and namespace, names and owner references only.
        for key in [k for k, v in self._listed.items() if now - v.at > self._window]:
            del self._listed[key]
        for key in [k for k, (at, _) in self._read_at.items() if now - at > self._window]:
            del self._read_at[key]


def _slim(obj: dict[str, Any]) -> dict[str, Any]:
    meta = obj.get("metadata") or {}
    return {
        "metadata": {
            "name": meta.get("name", ""),
            "ownerReferences": meta.get("ownerReferences") or [],
        }
    }
