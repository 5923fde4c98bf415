"""``kvferry-sidecar``: run the sidecar for one pod.

    kvferry-sidecar --role decode --config /etc/kvferry/sidecar.json \\
        --topology /etc/kvferry/topology.json

Every setting (``kvferry_sidecar.config.Settings``) has a flag ``--<field>`` (e.g.
``--engine-url``) and an environment twin ``KVFERRY_<FIELD>`` (``KVFERRY_ENGINE_URL``);
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

# What --help says beyond the flag's name.
_HELP = {
    "settings_path": "settings file (JSON or YAML)",
    "topology_path": "topology file, re-read live",
    "internal_port": "peers, /metrics, /v1/residency (0 = --port)",
    "metrics_port": "GET /metrics only, for scrapers (0 = none)",
    "engine_url": "the vLLM server in this pod",
    "prefill_engines": "comma-separated prefill engine URLs",
    "decode_sidecars": "comma-separated decode sidecar URLs, by ordinal",
    "ordinal": "this pod's ordinal (default: from POD_NAME)",
    "session_keys": "comma-separated, in order of preference",
    "operator_url": "POST residency reports here ('' = off)",
    "operator_ca_file": "CA bundle for the operator's TLS",
    "kv_events": "engine KV-event PUB endpoint ('' = off)",
    "kv_events_replay": "engine KV-event replay endpoint",
    "max_model_len": "context bodies are measured against (default: the engine's)",
    "max_inflight_body_bytes": "request bodies held at once, all turns (then 503)",
    "owner_header": "header the gateway sets to the authenticated client (default: no owners)",
    "owner_max_handles": "handles one owner keeps (default: handle_store_cap / 8)",
    "owner_max_pinned_tokens": "tokens one owner's handles pin (default: D's KV / 8)",
    "retention_seconds": "hold handles this long until the operator's policy says (live)",
    "retention_ceiling_seconds": "D's decoder_kv_blocks_ttl (default: --retention-seconds)",
    "prefill_placement": "Measured (per turn, from the measured costs) or Threshold",
}


def parser() -> argparse.ArgumentParser:
    """One flag per setting (``config.flag_names``); values are read as the
    environment's are (``config.build``), so a bad one names its flag."""
    p = argparse.ArgumentParser(prog="kvferry-sidecar", description=__doc__.split("\n\n")[0])
    for name in config.FIELDS:
        choices = config.ROLES if name == "role" else None
        p.add_argument(*config.flag_names(name), dest=name, choices=choices, help=_HELP.get(name))
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
        "starting role=%s port=%s internal_port=%s metrics_port=%s engine=%s "
        "prefill_engines=%s decode_ring=%s ordinal=%s",
        settings.role,
        settings.listen_port,
        settings.internal_port,
        settings.metrics_port,
        settings.engine_url,
        len(settings.prefill_engines),
        len(settings.decode_sidecars),
        settings.ordinal,
    )
    ports = [settings.listen_port] + [
        p for p in (settings.internal_port, settings.metrics_port) if p
    ]
    try:
        socks = [socket.create_server((settings.listen_host, port)) for port in ports]
    except OSError as exc:
        print(f"kvferry-sidecar: cannot listen on {ports}: {exc}", file=sys.stderr)
        return 1
    web.run_app(
        app_factory(settings, drain_on_sigterm=True),
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
