"""Gathers the cluster facts the prerequisite checks need (``prerequisites.py``),
through ``kube.py``, with a short cache: status is refreshed on every pod event,
and a rollout brings many.

A fact that cannot be read (RBAC narrower than the chart's, an API error) is
``None``: its check is skipped and the failure logged once per fact, never
reported as a missing prerequisite.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from .api import Server
from .kube import ApiException, Kube, api_error_message
from .prerequisites import NAD_CRD, ClusterFacts, network_refs, node_facts_from

log = logging.getLogger(__name__)

# How long a fact is reused (KVFERRY_PREREQUISITES_CACHE_SECONDS). A fixed
# prerequisite (a device plugin installed, a namespace relabelled) shows in the
# condition at most this much later.
TTL_SECONDS = 30.0


class PrerequisiteProbe:
    def __init__(
        self,
        kube: Kube,
        ttl: float = TTL_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kube = kube
        self.ttl = ttl
        self.clock = clock
        self._lock = threading.Lock()  # kopf runs sync handlers in threads
        self._cache: dict[tuple[str, ...], tuple[float, Any]] = {}
        self._warned: set[tuple[str, ...]] = set()

    def _cached(self, key: tuple[str, ...], read: Callable[[], Any]) -> Any:
        now = self.clock()
        with self._lock:
            hit = self._cache.get(key)
            if hit and now - hit[0] < self.ttl:
                return hit[1]
        try:
            value = read()
        except ApiException as exc:
            value = None
            if key not in self._warned:
                self._warned.add(key)
                log.warning(
                    "prerequisite check %s skipped: %s", "/".join(key), api_error_message(exc)
                )
        except Exception as exc:  # a probe must never break status
            value = None
            if key not in self._warned:
                self._warned.add(key)
                log.warning("prerequisite check %s skipped: %r", "/".join(key), exc)
        with self._lock:
            self._cache[key] = (now, value)
        return value

    def facts(self, server: Server) -> ClusterFacts:
        ns = server.namespace
        nodes = self._cached(
            ("nodes",), lambda: [node_facts_from(n) for n in self.kube.list_nodes()]
        )
        labels = self._cached(
            ("namespace", ns),
            lambda: ((self.kube.get_namespace(ns) or {}).get("metadata") or {}).get("labels") or {},
        )
        refs = network_refs(server)
        crd = nads = None
        if refs:
            crd = self._cached(("crd", NAD_CRD), lambda: self.kube.crd_exists(NAD_CRD))
            if crd:
                nads = {}
                for ref in refs:
                    other_ns, name = ref.split("/", 1)
                    found = self._cached(
                        ("nad", ref),
                        lambda o=other_ns, n=name: (
                            self.kube.get_network_attachment_definition(o, n) is not None
                        ),
                    )
                    if found is not None:
                        nads[ref] = found
        return ClusterFacts(nodes=nodes, namespace_labels=labels, nad_crd_installed=crd, nads=nads)
