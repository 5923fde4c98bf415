"""Keep a local P, D and decode sidecar up by hand: ``python -m kvferry_dev.up [LOG_DIR]``
(from the repository root). Prints their URLs as JSON; Ctrl-C stops everything."""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .configs import tiny_server
from .engines import build_tiny_model, engine_env, start_pair
from .sidecars import start_sidecar


def main(argv: Sequence[str] | None = None) -> int:
    """Keep P, D and the decode sidecar up until Ctrl-C (or SIGTERM); print their URLs
    as JSON."""

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    argv = list(sys.argv[1:] if argv is None else argv)
    logs = Path(argv[0] if argv else "/tmp/kvferry-local")
    py = engine_env()
    model = build_tiny_model(py)
    server = tiny_server()
    with (
        start_pair(py, model, logs, server=server) as pair,
        start_sidecar(pair, server, logs) as sc,
    ):
        urls = {"sidecar": sc.url, "prefill": pair.prefill.url, "decode": pair.decode.url}
        print(json.dumps({**urls, "logs": str(logs)}), flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while all(e.alive() for e in pair) and sc.proc and sc.proc.poll() is None:
                time.sleep(1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
