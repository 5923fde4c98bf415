"""``spec.<role>.podTemplate``: a strategic-merge patch of the role's pod template,
applied last to what render.py built, and the checks on it. Pure: no API calls.

The overlay is the escape hatch for what kvferry does not type (a service account
for IRSA / Workload Identity, runtimeClassName, schedulerName, volumes, probes,
topologySpreadConstraints, ...), as LeaderWorkerSet and LLMInferenceService take a
pod template and Dynamo an ``extraPodSpec``.

**The merge.** The kubernetes Python client has no strategic merge (it lives in Go's
apimachinery), so :func:`merge` implements its rules for the fields a
PodTemplateSpec has, as core/v1's ``patchStrategy`` / ``patchMergeKey`` tags declare
them (each rule has a test in ``tests/unit/test_podtemplate.py``):

- Maps merge key by key, recursively; a ``null`` value removes the key.
- The lists in :data:`POD_LISTS` and :data:`CONTAINER_LISTS` merge item by item on
  their key: containers, initContainers, ephemeralContainers, volumes,
  imagePullSecrets, resourceClaims and schedulingGates by ``name``, hostAliases by
  ``ip``, topologySpreadConstraints by ``topologyKey``; a container's env by
  ``name``, ports by ``containerPort``, volumeMounts by ``mountPath``, volumeDevices
  by ``devicePath``. An item whose key matches one of ours merges into it (a volume
  replaces its namesake: core/v1 volumes are ``retainKeys``, one source each); others
  are appended in the overlay's order; an item with ``$patch: delete`` removes ours of
  that key (the one directive taken: e.g. the default decode spread).
- Every other list (tolerations, command, args, readinessGates, a node affinity's
  terms, capabilities ...) replaces ours whole, as in Kubernetes, whose types
  declare no merge key for them.

:func:`check` refuses, naming the field, what cannot be merged (an item of a keyed
list without its key; the CRD refuses it first), and :func:`forbidden` any other
directive (``$patch: replace`` on a map or list, ``$setElementOrder``,
``$retainKeys``, ``$deleteFromPrimitiveList``: write the value whole instead).

**What the overlay may not change.** The CRD's rules refuse, naming the field: the
engine's ports, command, args, env, image and resources (the typed fields set them),
the ``kvferry-sidecar`` container, kvferry's volumes, the ``app.kubernetes.io/*`` and
``kvferry.io/*`` labels and annotations (and ``k8s.v1.cni.cncf.io/networks``: the one
rule :func:`check_annotations` keeps for ``spec.<role>.podAnnotations`` too, the same
pods' annotations). CEL cannot see ``$patch`` nor a null, so
:func:`forbidden` refuses deleting or nulling what is kvferry's (its containers, its
volumes, the containers / initContainers / volumes lists, anything inside its
containers); render re-applies kvferry's labels after the merge, for objects stored
before the rules. The lifecycle hooks of the engine and the sidecar (the engine's
preStop is the drain) are kvferry's as its ports and command are: the CRD refuses
them on the engine, and :func:`forbidden` on either (objects stored before the rule).

**What it may set only when the operator's installer allows it** (:func:`forbidden`;
the CRD cannot see the operator's settings): a hostPath volume outside
``KVFERRY_HOST_PATH_PREFIXES``, ``privileged`` or ``allowPrivilegeEscalation``, a host
namespace or host port (hostNetwork, hostPID, hostIPC, ``hostPort``) and capabilities
beyond ``IPC_LOCK`` (what RDMA needs). A server author may be hostile: each of these
hands the pod the node. Refused, the server's StatefulSets are not applied and status
says why (reason ``PodTemplateNotAllowed``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

# Nothing of this package: api.parse_spec calls check(), and api is imported by all.
Obj = dict[str, Any]

PATCH = "$patch"
# List fields of a PodSpec with a merge key: (key, the item's own list fields).
CONTAINER_LISTS = {
    "env": "name",
    "ports": "containerPort",
    "volumeMounts": "mountPath",
    "volumeDevices": "devicePath",
}
POD_LISTS: dict[str, tuple[str, dict[str, str]]] = {
    "containers": ("name", CONTAINER_LISTS),
    "initContainers": ("name", CONTAINER_LISTS),
    "ephemeralContainers": ("name", CONTAINER_LISTS),
    "volumes": ("name", {}),
    "imagePullSecrets": ("name", {}),
    "hostAliases": ("ip", {}),
    "topologySpreadConstraints": ("topologyKey", {}),
    "resourceClaims": ("name", {}),
    "schedulingGates": ("name", {}),
}
# core/v1 volumes are "merge,retainKeys": an overlay volume of one of our names would
# replace ours whole (the CRD refuses our names anyway).
RETAIN_KEYS = {"volumes"}

# kvferry's containers and volumes (render.py names them; a test checks these match):
# the CRD refuses an overlay entry for the sidecar or a volume of these names, and
# forbidden() deleting or nulling the engine.
ENGINE_CONTAINER = "engine"
SIDECAR_CONTAINER = "kvferry-sidecar"
KVFERRY_VOLUMES = (
    "dshm",
    "sidecar-config",
    "kvferry-token",
    "kvferry-journal",
    "models",
    "hf-cache",
    "hf-token",
)
# Pod annotations a server may not write, in podTemplate.metadata.annotations or
# spec.<role>.podAnnotations (one rule, the CRD's and check_annotations'): the rollout
# hashes are kvferry's, and a Multus network is spec.network.rdma.networks' (a pod
# must not join another tenant's network).
OPERATOR_ANNOTATIONS = "kvferry.io/"
NETWORKS_ANNOTATION = "k8s.v1.cni.cncf.io/networks"
ANNOTATIONS_RULE = (
    f"self.all(k, !k.startsWith('{OPERATOR_ANNOTATIONS}') && k != '{NETWORKS_ANNOTATION}')"
)
ANNOTATIONS_MESSAGE = (
    f"pod annotations may not be {OPERATOR_ANNOTATIONS}* (the rollout hashes) or "
    f"{NETWORKS_ANNOTATION} (set spec.network.rdma.networks)."
)
# Why an entry of forbidden() is refused whatever the settings: it removes what is
# kvferry's, or is a strategic-merge directive the merge does not take.
KVFERRY_OWN = "kvferry"
DIRECTIVE = "directive"
# A lifecycle hook on kvferry's containers: the engine's preStop is the drain.
HOOK = "hook"

# The operator's installer allows these (KVFERRY_POD_TEMPLATE_ALLOW, the chart's
# settings.podTemplateAllow); none by default.
ALLOW_PRIVILEGED = "privileged"
ALLOW_HOST_NAMESPACES = "hostNamespaces"
ALLOW_CAPABILITIES = "capabilities"
ALLOWS = (ALLOW_PRIVILEGED, ALLOW_HOST_NAMESPACES, ALLOW_CAPABILITIES)
ENV = "KVFERRY_POD_TEMPLATE_ALLOW"
CHART_VALUE = "settings.podTemplateAllow"
# Condition reason (Ready, Progressing and Degraded) for a refused overlay.
REASON = "PodTemplateNotAllowed"
# What RDMA needs (memory registration pins pages); any other added capability is
# the installer's to allow.
RDMA_CAPABILITIES = frozenset({"IPC_LOCK"})


def field(role: str) -> str:
    return f"spec.{role}.podTemplate"


# ------------------------------------------------------------------ the merge


def merge(base: Obj, overlay: Obj | None) -> Obj:
    """``base`` with the overlay (a PodTemplateSpec patch) merged in; neither changes."""
    if not overlay:
        return copy.deepcopy(base)
    out = copy.deepcopy(base)
    for key, value in overlay.items():
        if key == "spec":
            out["spec"] = _merge_map(out.get("spec") or {}, value, POD_LISTS)
        else:  # metadata: plain maps
            out[key] = _merge_map(out.get(key) or {}, value, {})
    return out


def _merge_map(base: Obj, patch: Obj, lists: dict[str, Any]) -> Obj:
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge_map(out[key], value, {})
        elif isinstance(value, list) and key in lists:
            merge_key, inner = _list_rule(lists[key])
            out[key] = _merge_list(out.get(key) or [], value, merge_key, inner, key in RETAIN_KEYS)
        else:
            out[key] = _strip(value)
    return out


def _list_rule(rule: str | tuple[str, dict[str, str]]) -> tuple[str, dict[str, str]]:
    return rule if isinstance(rule, tuple) else (rule, {})


def _merge_list(
    base: list[Any], patch: list[Any], key: str, inner: dict[str, str], retain: bool
) -> list[Any]:
    out = copy.deepcopy(base)
    for item in patch:
        if not isinstance(item, dict) or key not in item:
            out.append(_strip(item))  # check() refuses it; an unchecked render keeps it
            continue
        at = next(
            (
                n
                for n, mine in enumerate(out)
                if isinstance(mine, dict) and mine.get(key) == item[key]
            ),
            None,
        )
        if item.get(PATCH) == "delete":
            if at is not None:
                del out[at]
        elif at is None:
            out.append(_strip(item))
        elif retain:
            out[at] = _strip(item)
        else:
            out[at] = _merge_map(out[at], item, inner)
    return out


def _strip(value: Any) -> Any:
    """A value as it lands in the object: without directives, nulls dropped."""
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if k != PATCH and v is not None}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return copy.deepcopy(value)


# ------------------------------------------------------------------ shape


def check(role: str, overlay: Any) -> None:
    """Raise ValueError naming the field (api.parse_spec makes it a SpecError) when the
    overlay cannot be merged: not a map, a list item that is no map or lacks its merge
    key. The CRD refuses each of these first (every keyed list is typed, its key
    required); this holds for objects stored before it did. A directive the merge does
    not take is forbidden()'s: CEL cannot see ``$`` keys, so the API server stores them
    and the operator refuses them in status rather than in a parse error."""
    where = field(role)
    if not isinstance(overlay, dict):
        raise ValueError(f"{where} must be a pod template (metadata, spec), not {overlay!r}")
    extra = set(overlay) - {"metadata", "spec"}
    if extra:
        raise ValueError(f"{where} takes metadata and spec only; remove {', '.join(sorted(extra))}")
    for part in ("metadata", "spec"):
        if part in overlay and not isinstance(overlay[part], dict):
            raise ValueError(f"{where}.{part} must be a map")
    _check_map(overlay.get("metadata") or {}, f"{where}.metadata", {})
    _check_map(overlay.get("spec") or {}, f"{where}.spec", POD_LISTS)
    annotations = (overlay.get("metadata") or {}).get("annotations")
    if isinstance(annotations, dict):
        check_annotations(f"{where}.metadata.annotations", annotations)


def check_annotations(where: str, annotations: Mapping[str, Any]) -> None:
    """Raise ValueError naming the field and the keys when ``annotations`` (a pod
    template's or ``spec.<role>.podAnnotations``) hold one that is not the author's:
    the CRD's rule (ANNOTATIONS_RULE), for objects stored before it."""
    reserved = sorted(
        k for k in annotations if k.startswith(OPERATOR_ANNOTATIONS) or k == NETWORKS_ANNOTATION
    )
    if reserved:
        raise ValueError(f"{where}: {', '.join(reserved)}: {ANNOTATIONS_MESSAGE}")


def _check_map(value: Obj, where: str, lists: dict[str, Any]) -> None:
    for key, sub in value.items():
        path = f"{where}.{key}"
        if isinstance(sub, dict):
            _check_map(sub, path, {})
        elif isinstance(sub, list) and key in lists:
            merge_key, inner = _list_rule(lists[key])
            for n, item in enumerate(sub):
                item_path = f"{path}[{n}]"
                if not isinstance(item, dict) or merge_key not in item:
                    raise ValueError(
                        f"{item_path} has no {merge_key}: {key} merge by {merge_key} (an item "
                        f"of the same {merge_key} merges into kvferry's, others are added)"
                    )
                _check_map(item, item_path, inner)


def _directives(value: Obj, where: str, lists: dict[str, Any], in_item: bool = False) -> list[str]:
    """Where the overlay holds a directive the merge does not take: any ``$`` key but
    ``$patch: delete`` in an item of a keyed list."""
    out = []
    for key, sub in value.items():
        path = f"{where}.{key}"
        if key.startswith("$") and not (key == PATCH and in_item and sub == "delete"):
            out.append(path)
        elif isinstance(sub, dict):
            out += _directives(sub, path, {})
        elif isinstance(sub, list) and key in lists:
            inner = _list_rule(lists[key])[1]
            for n, item in enumerate(sub):
                if isinstance(item, dict):
                    out += _directives(item, f"{path}[{n}]", inner, True)
    return out


# ------------------------------------------------------------------ refusals


def parse_allow(text: str) -> frozenset[str]:
    """``KVFERRY_POD_TEMPLATE_ALLOW``: names from :data:`ALLOWS`, comma-separated; empty
    allows none. An unknown name raises ValueError naming the variable."""
    names = frozenset(n.strip() for n in text.split(",") if n.strip())
    unknown = sorted(names - set(ALLOWS))
    if unknown:
        raise ValueError(
            f"{ENV}: {', '.join(unknown)} is not one of {', '.join(ALLOWS)} "
            "(comma-separated; empty allows none)"
        )
    return names


def _containers(spec: Obj) -> list[tuple[str, Obj]]:
    out = []
    for kind in ("initContainers", "containers", "ephemeralContainers"):
        for item in spec.get(kind) or []:
            if isinstance(item, dict):
                out.append((f"{kind}[name={item.get('name')}]", item))
    return out


def forbidden(
    role: str, overlay: Obj, allow: frozenset[str], path_allowed: Callable[[str], bool]
) -> list[tuple[str, str]]:
    """What the overlay sets that the operator's settings do not allow: (field, which
    setting would allow it). The operator's own objects never set any of these (the
    engine's IPC_LOCK under RDMA is in RDMA_CAPABILITIES; the hub cache's hostPath is
    hostpaths.py's), so every one the pods would get is written in the overlay."""
    spec = overlay.get("spec") or {}
    where = f"{field(role)}.spec"
    out: list[tuple[str, str]] = [
        (path, DIRECTIVE)
        for path in _directives(overlay.get("metadata") or {}, f"{field(role)}.metadata", {})
        + _directives(spec, where, POD_LISTS)
    ]
    for name in ("containers", "initContainers", "volumes"):
        if name in spec and spec[name] is None:
            out.append((f"{where}.{name}", KVFERRY_OWN))
    for n, item in enumerate(spec.get("containers") or []):
        if isinstance(item, dict) and item.get("name") == ENGINE_CONTAINER:
            out += [(f"{where}.containers[{n}]{p}", KVFERRY_OWN) for p in _removals(item)]
    for at, container in _containers(spec):
        if (
            container.get("name") in (ENGINE_CONTAINER, SIDECAR_CONTAINER)
            and container.get("lifecycle") is not None
        ):
            out.append((f"{where}.{at}.lifecycle", HOOK))
    if ALLOW_HOST_NAMESPACES not in allow:
        for name in ("hostNetwork", "hostPID", "hostIPC"):
            if spec.get(name) is True:
                out.append((f"{where}.{name}", ALLOW_HOST_NAMESPACES))
    for volume in spec.get("volumes") or []:
        path = ((volume or {}).get("hostPath") or {}).get("path")
        if path is not None and not path_allowed(str(path)):
            out.append((f"{where}.volumes[name={volume.get('name')}].hostPath.path", "prefixes"))
    for at, container in _containers(spec):
        sc = container.get("securityContext") or {}
        base = f"{where}.{at}"
        if ALLOW_PRIVILEGED not in allow:
            for name in ("privileged", "allowPrivilegeEscalation"):
                if sc.get(name) is True:
                    out.append((f"{base}.securityContext.{name}", ALLOW_PRIVILEGED))
        added = set((sc.get("capabilities") or {}).get("add") or []) - RDMA_CAPABILITIES
        if added and ALLOW_CAPABILITIES not in allow:
            out.append((f"{base}.securityContext.capabilities.add", ALLOW_CAPABILITIES))
        if ALLOW_HOST_NAMESPACES not in allow:
            for n, port in enumerate(container.get("ports") or []):
                if isinstance(port, dict) and port.get("hostPort"):
                    out.append((f"{base}.ports[{n}].hostPort", ALLOW_HOST_NAMESPACES))
    return out


# hostpaths.py's names for the node folders a hostPath may be under (hostpaths imports
# api, which imports this module: the names are passed in, not imported).
HOST_PATH_SETTING = "settings.hostPathPrefixes (KVFERRY_HOST_PATH_PREFIXES)"


def _removals(value: Any, path: str = "") -> list[str]:
    """Where a value deletes (``$patch: delete``) or nulls something."""
    out = []
    if isinstance(value, dict):
        for key, sub in value.items():
            if key == PATCH or sub is None:
                out.append(f"{path}.{key}")
            else:
                out += _removals(sub, f"{path}.{key}")
    elif isinstance(value, list):
        for n, sub in enumerate(value):
            out += _removals(sub, f"{path}[{n}]")
    return out


def refusal(
    overlays: Mapping[str, Obj | None],
    allow: frozenset[str],
    prefixes: tuple[str, ...],
    path_allowed: Callable[[str], bool],
) -> str | None:
    """Why the roles' pod templates (role -> overlay) are refused (the condition's
    message), or None. ``path_allowed`` is hostpaths.allowed under ``prefixes``."""
    found = [
        item
        for role, overlay in overlays.items()
        for item in forbidden(role, overlay or {}, allow, path_allowed)
    ]
    if not found:
        return None
    directives = [path for path, why in found if why == DIRECTIVE]
    if directives:
        return (
            f"{', '.join(directives)}: only $patch: delete on an item of a list merged by "
            "key is supported (e.g. a topologySpreadConstraints entry): the StatefulSets "
            "are not applied. Write the value whole instead"
        )
    own = [path for path, why in found if why == KVFERRY_OWN]
    if own:
        return (
            f"{', '.join(own)}: removes what kvferry's pods need (the engine container, "
            "its settings, the containers or volumes): the StatefulSets are not applied. "
            "Merge into it instead: the overlay may add to the engine and change what the "
            "typed fields do not set"
        )
    hooks = [path for path, why in found if why == HOOK]
    if hooks:
        roles = ", ".join(dict.fromkeys(f"spec.{p.split('.')[1]}.drainSeconds" for p in hooks))
        return (
            f"{', '.join(hooks)}: the lifecycle hooks of kvferry's containers are kvferry's "
            "(the engine's preStop is the drain: it holds the engine until the sidecar's "
            "turns are done): the StatefulSets are not applied. Remove lifecycle from the "
            f"pod template; how long the drain waits is {roles}"
        )
    fields = ", ".join(path for path, _ in found)
    fixes = []
    names = sorted({why for _, why in found if why != "prefixes"})
    if names:
        fixes.append(f"{CHART_VALUE}: [{', '.join(names)}] in the chart ({ENV} for the operator)")
    if any(why == "prefixes" for _, why in found):
        fixes.append(
            f"the node folder in {HOST_PATH_SETTING}; allowed now: {', '.join(prefixes) or 'none'}"
        )
    return (
        f"{fields}: not allowed by the operator's settings (each gives the pods the node: "
        "docs/security.md): the StatefulSets are not applied. Remove it from the pod "
        f"template, or have the operator's installer allow {' and '.join(fixes)}"
    )
