"""Operator-wide settings, read once from the environment (the chart sets them)."""

from __future__ import annotations

import functools
import json
import logging
import os
from dataclasses import dataclass
from typing import Any

from . import hostpaths, podtemplate
from .api import ROLES, Server
from .render import DEFAULT_SIDECAR_IMAGE, Context

log = logging.getLogger(__name__)

# The safety pass's interval by default (KVFERRY_RESYNC_SECONDS; the chart's
# settings.resyncSeconds): one pass costs a list of the servers and one of each child
# kind, whatever the number of servers.
RESYNC_SECONDS = 300

# Variables an earlier release read, with why they are gone: named in a warning rather
# than ignored in silence (docs/upgrading.md).
REMOVED = {"KVFERRY_DEBOUNCE_SECONDS": "it was read and never used"}


@dataclass(frozen=True)
class Settings:
    # Image for the kvferry-sidecar when a server does not name one; the chart
    # sets it to the sidecar image released with this operator.
    sidecar_image: str
    # The safety pass (handlers._resync_forever): lists the servers and their children,
    # re-applies what no longer holds our fields and refreshes status, even when no
    # watch event arrived (a missed event, a lost connection). Each wait is this, +-20 %
    # at random, so operators started together do not pass together. Drift and spec
    # changes are applied from the watches; this is the net under them.
    resync_seconds: float
    # The report endpoint sidecars push to. TLS from the chart's Secret; without
    # a certificate the endpoint does not start (reports need HTTPS: they carry
    # bearer tokens).
    report_port: int = 8443
    report_host: str = "0.0.0.0"
    tls_cert_file: str = ""
    tls_key_file: str = ""
    # What sidecars are told: the endpoint's in-cluster URL (the chart's Service)
    # and the CA that signed its certificate (rendered into each server's ConfigMap).
    tls_ca_file: str = ""
    report_url: str = ""
    # A pod whose latest report is older than this is shown stale and left out
    # of the figures (3 missed pushes at the sidecar's default 15 s, and then some).
    report_stale_seconds: float = 90.0
    # A stale pod's row is dropped at once when the pod is gone or replaced, and in
    # any case after this long without a report (so status never lists ghosts).
    report_prune_seconds: float = 600.0
    # How often reports are folded into KVCacheStatus, and the least time
    # between two status writes of one KVCacheStatus.
    publish_seconds: float = 10.0
    min_status_write_seconds: float = 10.0
    # How long the prerequisite checks reuse what they read (nodes, the namespace's
    # Pod Security label, Multus objects) while a server's pods are not all ready.
    prerequisites_cache_seconds: float = 30.0
    # A server's status is written once its events have been quiet this long (at most
    # status_most_seconds after the first): P's and D's readiness in one write.
    status_quiet_seconds: float = 1.0
    status_most_seconds: float = 5.0
    # Plain-HTTP /metrics (what the operator decided, per server); 0 = off.
    metrics_port: int = 8080
    metrics_host: str = "0.0.0.0"
    # Node folders a server's hub cache may mount (hostPath), normalised; none by
    # default: a hostPath is the node's disk read-write in a root container.
    host_path_prefixes: tuple[str, ...] = ()
    # NetworkPolicy peers rendered into every server's policy on the sidecars' metrics
    # port (KVFERRY_METRICS_CLIENTS, JSON; the chart's networkPolicy.metricsClients).
    metrics_clients: tuple[dict[str, Any], ...] = ()
    # What a server's spec.<role>.podTemplate may set beyond the default (podtemplate.py):
    # privileged, hostNamespaces, capabilities; none by default, each is the node's root.
    pod_template_allow: frozenset[str] = frozenset()
    # Leader election (``run --leader-elect``, leader.py): the Lease's namespace and
    # name, this pod's name for the holder identity, and client-go's timings.
    leader_namespace: str = ""
    leader_name: str = "kvferry-operator"
    pod_name: str = ""
    # With pod_name: the pod the leader labels as such (leader.LEADER_LABEL), which the
    # chart's Service selects. Empty (a process outside a pod): no label.
    pod_namespace: str = ""
    leader_lease_seconds: float = 15.0
    leader_renew_seconds: float = 10.0
    leader_retry_seconds: float = 2.0

    def pod_template_refusal(self, server: Server) -> str | None:
        """Why the server's pod templates are refused under these settings, or None."""
        return podtemplate.refusal(
            {role: server.spec.role(role).pod_template for role in ROLES},
            self.pod_template_allow,
            self.host_path_prefixes,
            lambda path: hostpaths.allowed(path, self.host_path_prefixes),
        )

    def render_context(self) -> Context:
        return render_context_of(self)


def from_env() -> Settings:
    env = os.environ.get
    for var, why in REMOVED.items():
        if var in os.environ:
            log.warning("setting removed, ignored env=%s: %s", var, why)
    return Settings(
        report_port=int(env("KVFERRY_REPORT_PORT", "8443")),
        report_host=env("KVFERRY_REPORT_HOST", "0.0.0.0"),
        tls_cert_file=env("KVFERRY_TLS_CERT_FILE", ""),
        tls_key_file=env("KVFERRY_TLS_KEY_FILE", ""),
        tls_ca_file=env("KVFERRY_TLS_CA_FILE", ""),
        report_url=env("KVFERRY_REPORT_URL", ""),
        report_stale_seconds=float(env("KVFERRY_REPORT_STALE_SECONDS", "90")),
        report_prune_seconds=float(env("KVFERRY_REPORT_PRUNE_SECONDS", "600")),
        publish_seconds=float(env("KVFERRY_PUBLISH_SECONDS", "10")),
        min_status_write_seconds=float(env("KVFERRY_MIN_STATUS_WRITE_SECONDS", "10")),
        prerequisites_cache_seconds=float(env("KVFERRY_PREREQUISITES_CACHE_SECONDS", "30")),
        status_quiet_seconds=float(env("KVFERRY_STATUS_QUIET_SECONDS", "1")),
        status_most_seconds=float(env("KVFERRY_STATUS_MOST_SECONDS", "5")),
        metrics_port=int(env("KVFERRY_METRICS_PORT", "8080")),
        metrics_host=env("KVFERRY_METRICS_HOST", "0.0.0.0"),
        host_path_prefixes=hostpaths.parse_prefixes(env(hostpaths.ENV, "")),
        metrics_clients=parse_metrics_clients(env(METRICS_CLIENTS_ENV, "")),
        pod_template_allow=podtemplate.parse_allow(env(podtemplate.ENV, "")),
        sidecar_image=os.environ.get("KVFERRY_SIDECAR_IMAGE", ""),
        resync_seconds=float(os.environ.get("KVFERRY_RESYNC_SECONDS", str(RESYNC_SECONDS))),
        leader_namespace=env("KVFERRY_LEADER_ELECTION_NAMESPACE", ""),
        leader_name=env("KVFERRY_LEADER_ELECTION_ID", "kvferry-operator"),
        pod_name=env("KVFERRY_POD_NAME", ""),
        pod_namespace=env("KVFERRY_POD_NAMESPACE", ""),
        leader_lease_seconds=float(env("KVFERRY_LEADER_LEASE_SECONDS", "15")),
        leader_renew_seconds=float(env("KVFERRY_LEADER_RENEW_SECONDS", "10")),
        leader_retry_seconds=float(env("KVFERRY_LEADER_RETRY_SECONDS", "2")),
    )


METRICS_CLIENTS_ENV = "KVFERRY_METRICS_CLIENTS"
_PEER_KEYS = frozenset({"ipBlock", "namespaceSelector", "podSelector"})


def parse_metrics_clients(value: str) -> tuple[dict[str, Any], ...]:
    """A JSON list of NetworkPolicy peers ("" = none). The API server checks each
    peer's fields when the policy is applied; this checks the shape, so a typo stops
    the operator at start with the variable named instead of failing every apply."""
    if not value.strip():
        return ()
    try:
        peers = json.loads(value)
    except ValueError as exc:
        raise ValueError(f"{METRICS_CLIENTS_ENV} is not JSON ({exc}): {value!r}") from exc
    if not isinstance(peers, list) or not all(
        isinstance(p, dict) and p and set(p) <= _PEER_KEYS for p in peers
    ):
        raise ValueError(
            f"{METRICS_CLIENTS_ENV} must be a JSON list of NetworkPolicy peers (objects "
            f"with ipBlock, namespaceSelector or podSelector), got {value!r}"
        )
    return tuple(peers)


def _read(path: str) -> str:
    """The file's text, re-read only when it changes (a rotated CA is picked up;
    every child apply does not cost a read)."""
    if not path:
        return ""
    return _read_cached(path, os.stat(path).st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _read_cached(path: str, mtime_ns: int) -> str:
    with open(path) as f:
        return f.read()


def render_context_of(settings: Settings) -> Context:
    return Context(
        sidecar_image=settings.sidecar_image or DEFAULT_SIDECAR_IMAGE,
        report_url=settings.report_url,
        report_ca_pem=_read(settings.tls_ca_file),
        metrics_clients=settings.metrics_clients,
    )
