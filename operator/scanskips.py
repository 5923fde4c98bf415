"""The scanner checks a server's pods cannot pass, and why: the
``checkov.io/skipN: CKV_K8S_xx=reason`` annotations on each StatefulSet. Pure.

Platform teams admit the pod shapes their scanners (checkov in CI and admission)
accept, or that say on the object why a check does not apply; tests/static/
test_checkov.py runs checkov 3.3 over every example and wants 0 failed checks. The
rules:

- Each skip is decided from the rendered pod template, not from the spec, so it is on
  the object only while the pod really fails the check: an image named by digest, a
  pull policy of ``Always``, a non-root engine image's ``runAsNonRoot`` drop their skip.
- Each reason says why the check does not fit and what would make the pod pass. It
  holds no ``=``: checkov splits the annotation's value on it.
- A skip that names a cause (the CPU engine's missing limits, RDMA's ``IPC_LOCK``) is
  set only for that cause: a pod failing the check for any other reason fails the scan.
  ``IPC_LOCK`` a podTemplate overlay adds on a server without RDMA has its own reason.
- The annotations go on the StatefulSet, not the pod template, where checkov reads them
  for its StatefulSet checks: adding or changing one restarts no pod.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

Obj = dict[str, Any]

SKIP_ANNOTATION_PREFIX = "checkov.io/skip"

# checkov's "high UID" (CKV_K8S_40): a user above the node's own.
HIGH_UID = 10000


@dataclass(frozen=True)
class Workload:
    """What a pod's skips depend on beyond the pod: the server's device and RDMA, and the
    role (a reason names the field that caused it)."""

    on_cpu: bool = False
    rdma: bool = False
    role: str = "<role>"


def _containers(pod: Obj) -> Iterator[Obj]:
    yield from pod.get("initContainers", [])
    yield from pod.get("containers", [])


def _effective(pod: Obj, container: Obj, key: str) -> Any:
    """A security-context field as the kubelet applies it: the container's, else the pod's."""
    own = container.get("securityContext", {})
    return own[key] if key in own else pod.get("securityContext", {}).get(key)


def _engine(pod: Obj) -> Obj:
    return next(c for c in _containers(pod) if c["name"] == "engine")


def _runs_as_root(pod: Obj, c: Obj) -> bool:
    return not (_effective(pod, c, "runAsNonRoot") or (_effective(pod, c, "runAsUser") or 0) > 0)


def _low_uid(pod: Obj, c: Obj) -> bool:
    return (_effective(pod, c, "runAsUser") or 0) < HIGH_UID


# The containers kvferry renders; the tag and pull-policy reasons name their images.
OURS = frozenset({"engine", "kvferry-sidecar"})


Applies = Callable[[Obj, Workload], bool]


def _ours_only(test: Callable[[Obj, Obj], bool]) -> Applies:
    """Applies when some container fails ``test`` and each that does is kvferry's: an
    overlay's own container (``spec.<role>.podTemplate``) failing it fails the scan."""

    def applies(pod: Obj, _w: Workload) -> bool:
        failing = {c["name"] for c in _containers(pod) if test(pod, c)}
        return bool(failing) and failing <= OURS

    return applies


def _locked_down(c: Obj) -> bool:
    """All capabilities dropped and no escalation, as render sets them (an overlay may
    change the engine's security context)."""
    ctx = c.get("securityContext", {})
    drop = [d.upper() for d in ctx.get("capabilities", {}).get("drop", [])]
    return "ALL" in drop and ctx.get("allowPrivilegeEscalation") is False


def _engine_only(
    test: Callable[[Obj, Obj], bool], cpu: bool = False, locked: bool = False
) -> Applies:
    """Applies when the engine, and no other container, fails ``test`` (on a CPU server
    only, with ``cpu``; with ``locked``, only while the engine drops every capability
    and cannot escalate, which the reason says): the reason is the engine's, so another
    container failing the check (an overlay's, a sidecar change) fails the scan."""

    def applies(pod: Obj, w: Workload) -> bool:
        failing = [c["name"] for c in _containers(pod) if test(pod, c)]
        return (
            failing == ["engine"]
            and (w.on_cpu or not cpu)
            and (not locked or _locked_down(_engine(pod)))
        )

    return applies


def _lacks_limit(name: str) -> Callable[[Obj, Obj], bool]:
    return lambda _pod, c: name not in c.get("resources", {}).get("limits", {})


def _adds_capabilities(_pod: Obj, c: Obj) -> bool:
    return bool(c.get("securityContext", {}).get("capabilities", {}).get("add"))


def _adds_ipc_lock_only(rdma: bool) -> Applies:
    """The engine alone adds capabilities, IPC_LOCK only, on a server with RDMA (render
    adds it) or without (a podTemplate overlay added it): each has its own reason."""

    def applies(pod: Obj, w: Workload) -> bool:
        return (
            w.rdma is rdma
            and _engine_only(_adds_capabilities)(pod, w)
            and _engine(pod)["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
        )

    return applies


# (check, when it applies to a pod, why), in annotation order. A reason's {role} is
# the pod's role.
RULES: tuple[tuple[str, Applies, str], ...] = (
    (
        "CKV_K8S_43",
        _ours_only(lambda _pod, c: "@" not in c.get("image", "")),
        "images named by tag: spec.engine.image and the operator's sidecar image (the chart's "
        "sidecarImage); name them by digest (image@sha256:...) to pin them",
    ),
    (
        "CKV_K8S_15",
        _ours_only(lambda _pod, c: c.get("imagePullPolicy") != "Always"),
        "IfNotPresent: a pod starts from the node's copy of its multi-GB engine image while the "
        "registry is slow or down; spec.engine.imagePullPolicy Always pulls the engine each start",
    ),
    (
        "CKV_K8S_22",
        _engine_only(
            lambda _pod, c: not c.get("securityContext", {}).get("readOnlyRootFilesystem")
        ),
        "the engine: vLLM writes its compile and kernel caches (torch.compile, Triton, "
        "FlashInfer) under the image's home; the sidecar's root filesystem is read-only",
    ),
    (
        "CKV_K8S_23",
        _engine_only(_runs_as_root, locked=True),
        "the engine keeps its image's user and vLLM's images run as root; it has no "
        "capabilities and cannot escalate; the sidecar runs as 65532",
    ),
    (
        "CKV_K8S_40",
        _engine_only(_low_uid, locked=True),
        "the engine keeps its image's user and vLLM's images run as root; it has no "
        "capabilities and cannot escalate; the sidecar runs as 65532",
    ),
    (
        "CKV_K8S_25",
        _adds_ipc_lock_only(rdma=True),
        "IPC_LOCK on the engine with RDMA (spec.network.rdma): registering (pinning) the KV "
        "memory with the NIC needs it; nothing else is added",
    ),
    (
        "CKV_K8S_25",
        _adds_ipc_lock_only(rdma=False),
        "IPC_LOCK on the engine from spec.{role}.podTemplate (spec.network.rdma is off): the "
        "overlay adds it to lock memory; nothing else is added; remove it there to pass the check",
    ),
    (
        "CKV_K8S_11",
        _engine_only(_lacks_limit("cpu"), cpu=True),
        "a CPU engine (spec.engine.device cpu) has no CPU limit: a CFS quota would throttle its "
        "OpenMP threads (docs/production.md, Resources); spec.<role>.resources.limits sets one",
    ),
    (
        "CKV_K8S_13",
        _engine_only(_lacks_limit("memory"), cpu=True),
        "a CPU engine (spec.engine.device cpu) has no memory limit: its weights are the model's "
        "size (docs/production.md, Resources); spec.<role>.resources.memory sets one",
    ),
)


def build_scanner_skips(
    pod: Obj, on_cpu: bool, rdma: bool = False, role: str = "<role>"
) -> dict[str, str]:
    """The ``checkov.io/skipN`` annotations for a workload whose pod spec is ``pod``."""
    w = Workload(on_cpu, rdma, role)
    found = [f"{check}={why.format(role=role)}" for check, applies, why in RULES if applies(pod, w)]
    return {f"{SKIP_ANNOTATION_PREFIX}{i}": value for i, value in enumerate(found, start=1)}
