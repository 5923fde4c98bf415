"""Run the kopf operator (``kvferry-operator run``)."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
from typing import Any

import kopf

from .settings import Settings, from_env


def run(namespaces: list[str], standalone: bool, leader_elect: bool = False) -> int:
    from . import handlers  # noqa: F401 - registers the kopf handlers
    from .malloc import limit_arenas

    limit_arenas()  # before kopf starts its threads
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    # The handlers find the operator's settings and scope in kopf's memo, not in globals.
    try:
        settings = from_env()
        if leader_elect and not settings.leader_namespace:
            raise ValueError(
                "--leader-elect needs KVFERRY_LEADER_ELECTION_NAMESPACE (the Lease's "
                "namespace; the chart sets it to the operator's own)"
            )
        if leader_elect:
            from . import leader

            leader.check_timings(
                settings.leader_retry_seconds,
                settings.leader_renew_seconds,
                settings.leader_lease_seconds,
            )
    except ValueError as exc:  # a bad variable: say which, without a traceback
        logging.getLogger(__name__).error("bad setting: %s", exc)
        return 2
    memo = kopf.Memo(settings=settings, namespaces=list(namespaces))
    if leader_elect:
        return asyncio.run(elected(settings, namespaces, standalone, memo))
    asyncio.run(operate(namespaces, standalone, memo))
    return 0


async def operate(namespaces: list[str], standalone: bool, memo: kopf.Memo) -> None:
    await kopf.operator(
        identity=identity(),
        standalone=standalone,
        namespaces=namespaces,
        clusterwide=not namespaces,
        memo=memo,
    )


async def elected(
    settings: Settings,
    namespaces: list[str],
    standalone: bool,
    memo: kopf.Memo,
    kube: Any = None,
) -> int:
    """Wait for the Lease as a standby, then run kopf while holding it. Leadership
    lost is the end of the process (exit 1, at once: the handlers' threads must not
    write one more object); the kubelet starts it again as a candidate."""
    from . import leader, report_endpoint, standby
    from .kube import Kube

    log = logging.getLogger(__name__)
    me = leader.identity(settings.pod_name or socket.gethostname())
    kube = kube if kube is not None else Kube()
    elector = leader.Elector(
        kube,
        settings.leader_namespace,
        settings.leader_name,
        me,
        settings.leader_lease_seconds,
        settings.leader_renew_seconds,
        settings.leader_retry_seconds,
    )
    mark = (
        leader.PodMark(kube, settings.pod_namespace, settings.pod_name)
        if settings.pod_namespace and settings.pod_name
        else None
    )
    if mark is not None:
        # Before anything is served: once Ready, this pod must not be routed to as
        # the leader its predecessor in this pod may have been.
        await mark.set(False)
    else:
        log.warning(
            "KVFERRY_POD_NAME or KVFERRY_POD_NAMESPACE unset: the leader labels no pod, "
            "so a Service that selects %s (the chart's) routes reports nowhere",
            leader.LEADER_LABEL,
        )
    runners = []
    if settings.tls_cert_file and settings.tls_key_file:
        tls = report_endpoint.tls_context(settings.tls_cert_file, settings.tls_key_file)
        runners.append(
            await report_endpoint.serve(
                standby.app_factory(), settings.report_host, settings.report_port, tls
            )
        )
    if settings.metrics_port:
        try:
            runners.append(
                await report_endpoint.serve(
                    standby.metrics_app_factory(),
                    settings.metrics_host,
                    settings.metrics_port,
                    None,
                )
            )
        except OSError as exc:
            log.error("standby metrics off: port %d: %s", settings.metrics_port, exc)

    def lost() -> None:  # on the Lease's threads
        log.error("leadership lost: exiting so that no handler writes again")
        sys.stderr.flush()
        os._exit(1)

    loop = asyncio.get_running_loop()
    try:
        await elector.acquire()
        # The deadline runs from the Lease's acquisition.
        holding = elector.keep(lost)
    finally:
        for runner in runners:  # the leader's endpoints take these ports
            await runner.cleanup()
    # Beside kopf's start, not before it: the handlers need not wait for the Service.
    marking = loop.create_task(mark.set(True)) if mark is not None else None
    try:
        await operate(namespaces, standalone, memo)
    finally:
        holding.set()
        if marking is not None:
            marking.cancel()
            # Off first, so that the Service stops routing here before a standby leads;
            # one try (the pod's end takes it out of the Service anyway), after a
            # labelling patch still under way.
            await mark.set_once_in_order(False)
        await loop.run_in_executor(None, elector.release)
    return 0


def identity() -> str:
    """kopf's identity for this process, without kopf's default lookup: that one asks
    ``getpass.getuser()``, which raises in a container whose uid has no passwd entry
    (the kubelet adds none, podman does: the artifact tier runs with ``--passwd=false``)."""
    return f"kvferry-operator@{socket.gethostname()}"
