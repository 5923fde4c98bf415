"""Run the kopf operator (``kvferry-operator run``)."""

from __future__ import annotations

import asyncio
import logging

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
            standalone=standalone,
            namespaces=namespaces,
            clusterwide=not namespaces,
            memo=memo,
        )
    )
    return 0
