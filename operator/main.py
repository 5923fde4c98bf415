"""Run the kopf operator (``kvferry-operator run``)."""

from __future__ import annotations

import asyncio
import logging

import kopf


def run(namespaces: list[str], standalone: bool) -> int:
    from . import handlers  # registers the kopf handlers

    handlers.WATCH_NAMESPACES[:] = namespaces

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    asyncio.run(
        kopf.operator(
            standalone=standalone,
            namespaces=namespaces,
            clusterwide=not namespaces,
        )
    )
    return 0
