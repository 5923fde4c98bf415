"""``kvferry-sidecar``: run the sidecar for one pod.

    kvferry-sidecar --role decode --config /etc/kvferry/sidecar.json \\
        --topology /etc/kvferry/topology.json

Every flag has a ``KVFERRY_<FIELD>`` environment twin (e.g. ``KVFERRY_ENGINE_URL``);
flags win over the environment, which wins over the files. The pod's ordinal comes
from ``--ordinal`` or the StatefulSet pod name in ``POD_NAME``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
from collections.abc import Sequence
from typing import Any

from kvferry_wire import extras

from . import config


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvferry-sidecar", description=__doc__.split("\n\n")[0])
    p.add_argument("--role", choices=config.ROLES)
    p.add_argument("--config", dest="settings_path", help="settings file (JSON or YAML)")
    p.add_argument("--topology", dest="topology_path", help="topology file, re-read live")
    p.add_argument("--host", dest="listen_host")
    p.add_argument("--port", dest="listen_port", type=int)
    p.add_argument("--internal-port", type=int, help="peers, /metrics, /v1/residency (0 = --port)")
    p.add_argument("--engine-url", help="the vLLM server in this pod")
    p.add_argument("--prefill-engines", type=_csv, help="comma-separated prefill engine URLs")
    p.add_argument(
        "--decode-sidecars", type=_csv, help="comma-separated decode sidecar URLs, by ordinal"
    )
    p.add_argument("--ordinal", type=int, help="this pod's ordinal (default: from POD_NAME)")
    p.add_argument("--model")
    p.add_argument("--engine-build")
    p.add_argument("--session-keys", type=_csv)
    p.add_argument("--skip-prefill-below-tokens", type=int)
    p.add_argument("--recompute-threshold", type=int)
    p.add_argument("--retention-seconds", type=float)
    p.add_argument("--expiry-margin-seconds", type=float)
    p.add_argument("--handle-store-cap", type=int)
    p.add_argument("--block-size", type=int)
    p.add_argument("--operator-url", help="POST residency reports here ('' = off)")
    p.add_argument("--operator-ca-file", help="CA bundle for the operator's TLS")
    p.add_argument("--report-interval-seconds", type=float)
    p.add_argument("--kv-events", help="engine KV-event PUB endpoint ('' = off)")
    p.add_argument("--kv-events-replay", help="engine KV-event replay endpoint")
    p.add_argument("--log-level")
    return p


def settings_from_args(argv: Sequence[str] | None = None) -> config.Settings:
    args: dict[str, Any] = vars(parser().parse_args(argv))
    return config.build({k: v for k, v in args.items() if v is not None})


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's event loop (libuv; the sidecar's turns spend much of their CPU in the
    loop and its transports: docs/performance.md, sidecar cost), or asyncio's own with
    ``KVFERRY_SIDECAR_EVENT_LOOP=asyncio`` or where uvloop is not installed."""
    if os.environ.get("KVFERRY_SIDECAR_EVENT_LOOP", "uvloop") != "asyncio":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def main(argv: Sequence[str] | None = None) -> int:
    try:
        settings = settings_from_args(argv)
    except config.ConfigError as exc:
        print(f"kvferry-sidecar: {exc}", file=sys.stderr)
        return 2
    absent = extras.missing(extras.SIDECAR)
    if absent:
        print(f"kvferry-sidecar: {extras.message(extras.SIDECAR, absent)}", file=sys.stderr)
        return 2
    from aiohttp import web

    from .app import app_factory  # needs the sidecar extra (ZeroMQ, Prometheus client)

    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    logging.getLogger(__name__).info(
        "starting role=%s port=%s internal_port=%s engine=%s prefill_engines=%s "
        "decode_ring=%s ordinal=%s",
        settings.role,
        settings.listen_port,
        settings.internal_port,
        settings.engine_url,
        len(settings.prefill_engines),
        len(settings.decode_sidecars),
        settings.ordinal,
    )
    ports = [settings.listen_port] + ([settings.internal_port] if settings.internal_port else [])
    try:
        socks = [socket.create_server((settings.listen_host, port)) for port in ports]
    except OSError as exc:
        print(f"kvferry-sidecar: cannot listen on {ports}: {exc}", file=sys.stderr)
        return 1
    web.run_app(
        app_factory(settings),
        loop=new_event_loop(),
        sock=socks,
        access_log=None,
        print=None,
        # A client that goes away cancels its handler, which closes the engine
        # connections: vLLM aborts the requests instead of generating for nobody.
        handler_cancellation=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
