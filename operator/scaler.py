"""RoleScalers: a scale subresource per role, for an HPA or KEDA. Pure: no API calls.

A CRD has one scale subresource, and the DisaggregatedServer's is decode's
spec.decode.replicas. An HPA on a role's StatefulSet cannot work either: the operator
renders the StatefulSet's replicas and the sidecars' topology (the decode session
ring, the prefill engines) from one count, and would set the StatefulSet back.

So a role whose ``spec.<role>.scaling.mode`` is External gets a RoleScaler
``<server>-<role>`` (kvferry.io/v1alpha1; LeaderWorkerSet's
DisaggregatedSetRoleScaler, lws#922, is the same shape), and its spec.replicas is the
role's count. The rules, each with a test in tests/unit/test_scaler.py:

- **Seeded at the current count.** The operator creates the RoleScaler with
  spec.replicas = the role's StatefulSet's spec.replicas when it exists (what runs
  now, so a switch from Static never scales the role down), else spec.<role>.replicas
  (a new server).
- **Never written again.** After the create, spec.replicas is the autoscaler's: the
  operator never applies the RoleScaler (an apply would take the field back from the
  HPA's field manager, or drop it), and reads spec.replicas only.
- **Only ours.** A RoleScaler of that name whose controller is not the server is
  someone else's: it is left alone, reported as a ChildConflict, and the role keeps
  running at its StatefulSet's count (no StatefulSet is applied from a count the
  server does not own).
- **Switching back to Static** deletes the RoleScaler (``stale``): a later switch to
  External seeds a new one at the count then running, never at a stale value, and an
  HPA still aimed at it says FailedGetScale instead of scaling nothing.
- **Status** is the role's StatefulSet: status.replicas (pods that exist: the scale
  subresource's current count), status.readyReplicas, status.selector (the role's
  pods: what an HPA averages per-pod metrics over).
"""

from __future__ import annotations

from typing import Any

from . import api
from .api import Server
from .render import common_labels, name_for, owner_reference, selector_labels

Obj = dict[str, Any]


def scaler_name(server: Server, role: str) -> str:
    """``<server>-<role>``, like the role's StatefulSet (another kind, so no clash)."""
    return name_for(server.name, role)


def external_roles(server: Server) -> list[str]:
    return [r for r in api.ROLES if server.spec.role(r).scaled_externally]


def stale(server: Server, found: dict[str, Obj]) -> list[str]:
    """Roles in scaling mode Static whose RoleScaler (ours, in ``found``) is left over."""
    return [r for r in api.ROLES if r in found and not server.spec.role(r).scaled_externally]


def seed_replicas(server: Server, role: str, statefulset: Obj | None) -> int:
    """spec.replicas of a new RoleScaler: what the role runs at now, else the spec's."""
    if statefulset is not None:
        replicas = (statefulset.get("spec") or {}).get("replicas")
        if isinstance(replicas, int) and 0 <= replicas <= api.MAX_REPLICAS:
            return replicas
    return server.spec.role(role).replicas


def replicas_of(obj: Obj | None) -> int | None:
    """A RoleScaler's spec.replicas, or None when it has none the operator may use (the
    CRD bounds it; an object stored before the bound, or by hand with none, is not
    trusted to size a StatefulSet)."""
    replicas = ((obj or {}).get("spec") or {}).get("replicas")
    if isinstance(replicas, bool) or not isinstance(replicas, int):
        return None
    return replicas if 0 <= replicas <= api.MAX_REPLICAS else None


def build_role_scaler(server: Server, role: str, seed: int) -> Obj:
    """The RoleScaler the operator creates (once: see the module's rules)."""
    meta: Obj = {
        "name": scaler_name(server, role),
        "namespace": server.namespace,
        "labels": common_labels(server, "scaler", role),
    }
    if server.uid:
        meta["ownerReferences"] = [owner_reference(server)]
    return {
        "apiVersion": api.API_VERSION,
        "kind": api.SCALER_KIND,
        "metadata": meta,
        "spec": {"serverName": server.name, "role": role, "replicas": seed},
    }


def selector(server: Server, role: str) -> str:
    return ",".join(f"{k}={v}" for k, v in selector_labels(server, role).items())


def build_scaler_status(server: Server, role: str, replicas: int, ready: int) -> Obj:
    """status of the role's RoleScaler from its StatefulSet as observed."""
    return {"replicas": replicas, "readyReplicas": ready, "selector": selector(server, role)}


def status_patch(old: Obj | None, new: Obj) -> Obj:
    """The fields of ``new`` that differ from the RoleScaler's status ``old``."""
    old = old or {}
    return {k: v for k, v in new.items() if old.get(k) != v}
