"""Run the kopf operator (``kvferry-operator run``)."""

from __future__ import annotations

import asyncio
import logging
import socket

import kopf

from .settings import from_env


def run(namespaces: list[str], standalone: bool) -> int:
    from . import handlers  # noqa: F401 - registers the kopf handlers

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    # The handlers find the operator's settings and scope in kopf's memo, not in globals.
    try:
        settings = from_env()
    except ValueError as exc:  # a bad variable: say which, without a traceback
        logging.getLogger(__name__).error("bad setting: %s", exc)
        return 2
    memo = kopf.Memo(settings=settings, namespaces=list(namespaces))
    asyncio.run(
        kopf.operator(
            identity=identity(),
            standalone=standalone,
            namespaces=namespaces,
            clusterwide=not namespaces,
            memo=memo,
        )
    )
    return 0


def identity() -> str:
    """kopf's identity for this process, without kopf's default lookup: that one asks
    ``getpass.getuser()``, which raises in a container whose uid has no passwd entry
    (the kubelet adds none, podman does: the artifact tier runs with ``--passwd=false``)."""
    return f"kvferry-operator@{socket.gethostname()}"
