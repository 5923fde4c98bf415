"""What a standby replica serves while another holds the Lease (``leader.py``).

The kubelet's probes: ``/healthz`` answers (the process is alive and campaigning)
and ``/readyz`` does not (a Service routes reports only to the leader). A report
that reaches it anyway (a balancer that ignores readiness, a connection opened
before the leader changed) is refused with 503, ``Retry-After: 1`` and the
standby header, and the connection is closed: the sidecar sends it again at once
on a new connection, which a Service balances to the leader. Refusing loses
nothing: reports are cumulative, the next one carries everything. The metrics port
answers too (``kvferry_operator_leader 0``), so a scrape of the standby is not a
target down.
"""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CollectorRegistry, Gauge

from kvferry_wire.protocol import HDR_OPERATOR_STANDBY, REPORT_PATH

from . import metrics

READY_PATH = "/readyz"


def app_factory() -> web.Application:
    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok (standby)")

    async def readyz(_: web.Request) -> web.Response:
        return web.Response(status=503, text="standby: another replica holds the lease")

    async def report(_: web.Request) -> web.Response:
        return web.json_response(
            {"error": "this operator replica is a standby; send the report again"},
            status=503,
            headers={"Retry-After": "1", HDR_OPERATOR_STANDBY: "1", "Connection": "close"},
        )

    app = web.Application(client_max_size=1024)
    app.router.add_get("/healthz", healthz)
    app.router.add_get(READY_PATH, readyz)
    app.router.add_post(REPORT_PATH, report)
    return app


def metrics_app_factory() -> web.Application:
    registry = CollectorRegistry()
    Gauge(
        "kvferry_operator_leader", "1 on the replica that holds the lease.", registry=registry
    ).set(0)
    return metrics.app_factory(registry)
