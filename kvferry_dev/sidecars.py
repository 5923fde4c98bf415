"""The real decode sidecar (``kvferry-sidecar``) as a subprocess: the one launcher the
demo, the engine tier and the cluster tier start it with (``spawn_sidecar``,
``sidecar_running``), and ``SidecarProcess`` in front of a local P/D pair, configured
with the operator's own settings file for the server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvferry_operator.render import JOURNAL_FILE, build_sidecar_settings
from kvferry_sidecar.promtext import Scrape

from .client import HttpServer
from .engines import EnginePair
from .procs import LIVE, EngineError, free_port, stop_group, tail


def sidecar_argv(
    config: Path, *, topology: Path | None = None, flags: Sequence[str] = ()
) -> list[str]:
    """``kvferry-sidecar --role decode --config CONFIG [--topology T] FLAGS...`` from this
    python's venv (its console script, or the module where the script is missing)."""
    script = Path(sys.executable).parent / "kvferry-sidecar"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "kvferry_sidecar.cli"]
    where = ["--topology", str(topology)] if topology is not None else []
    return [*cmd, "--role", "decode", "--config", str(config), *where, *flags]


def spawn_sidecar(
    argv: Sequence[str], log_path: Path, env: Mapping[str, str]
) -> subprocess.Popen[bytes]:
    """Start `argv` in a process group of its own (``stop_group`` ends it and anything
    it forked), from ``/`` so that nothing is read from the checkout by accident, its
    output appended to `log_path`."""
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            list(argv),
            cwd="/",
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


@contextmanager
def sidecar_running(
    config: Path,
    log_path: Path,
    env: Mapping[str, str],
    *,
    topology: Path | None = None,
    flags: Sequence[str] = (),
    stop_timeout: float = 20.0,
) -> Iterator[subprocess.Popen[bytes]]:
    """The decode sidecar with the settings file `config` for the length of the block;
    SIGTERM to its group at the end (SIGKILL after `stop_timeout`)."""
    proc = spawn_sidecar(sidecar_argv(config, topology=topology, flags=flags), log_path, env)
    try:
        yield proc
    finally:
        stop_group(proc, stop_timeout)


def sidecar_files(
    server: Any,
    pair: EnginePair,
    port: int,
    *,
    internal_port: int | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(sidecar.json, topology.json) for the decode sidecar in front of `pair`.

    sidecar.json is the operator's ``build_sidecar_settings(server)`` with this
    machine's addresses (``internal_port``: a free one by default) and the decode
    engine's real UCX settings (in a pod the operator copies them into the sidecar's
    environment); topology.json names P's engine and this sidecar (ordinal 0, at its
    internal port, where peers reach it). The harness reads the per-turn diagnostic
    headers, so they are on.
    """
    internal_port = internal_port or free_port()
    d = pair.decode
    engine_env = d.env()
    settings = dict(build_sidecar_settings(server))
    settings.pop("enginePort", None)
    settings.update(
        {
            "role": "decode",
            "listenHost": "127.0.0.1",
            "listenPort": port,
            "internalPort": internal_port,
            # No scrape-only port: several harness sidecars share this machine.
            "metricsPort": 0,
            "diagnosticHeaders": True,
            "engineUrl": d.url,
            "ordinal": 0,
            "blockSize": d.block_size,
            "kvEvents": d.kv_events_endpoint,
            "kvEventsReplay": d.kv_replay_endpoint,
            "engineUcxTls": engine_env.get("UCX_TLS"),
            "engineUcxNetDevices": engine_env.get("UCX_NET_DEVICES"),
        }
    )
    settings.update(overrides or {})
    topology = {
        "version": 1,
        "prefillEngines": [pair.prefill.url],
        "decodeSidecars": [f"http://127.0.0.1:{internal_port}"],
    }
    return settings, topology


@dataclass(eq=False)
class SidecarProcess(HttpServer):
    """``kvferry-sidecar --role decode`` as a subprocess of this python's venv."""

    name: str
    settings: dict[str, Any]
    topology: dict[str, Any]
    log_dir: Path
    port: int
    proc: subprocess.Popen | None = None
    # Set after the KVFERRY_* of this process's environment are dropped.
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:  # type: ignore[override]
        return f"http://127.0.0.1:{self.port}"

    @property
    def internal_url(self) -> str:
        """Peers and monitoring: /metrics and /v1/residency answer here only."""
        return f"http://127.0.0.1:{self.settings['internalPort']}"

    def residency(self) -> dict[str, Any]:
        """The sidecar's residency report (GET /v1/residency, internal port)."""
        r = self.request("GET", "/v1/residency", timeout=30, base=self.internal_url)
        return r.body

    def metrics(self) -> Scrape:
        """The sidecar's /metrics (internal port), parsed."""
        return Scrape(self.request("GET", "/metrics", timeout=30, base=self.internal_url).body)

    @property
    def what(self) -> str:  # type: ignore[override]
        return f"sidecar {self.name}"

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.name}.log"

    @property
    def journal_path(self) -> Path:
        """The pin journal: the pod's emptyDir path becomes a file of this sidecar's
        (by name: a sidecar started again under its name reads what it left)."""
        return self.log_dir / f"{self.name}.pins.jsonl"

    def argv(self) -> list[str]:
        settings_path = self.log_dir / f"{self.name}.sidecar.json"
        topology_path = self.log_dir / f"{self.name}.topology.json"
        settings = dict(self.settings)
        if settings.get("pinJournalPath") == JOURNAL_FILE:
            settings["pinJournalPath"] = str(self.journal_path)
        settings_path.write_text(json.dumps(settings, indent=2) + "\n")
        topology_path.write_text(json.dumps(self.topology, indent=2) + "\n")
        return sidecar_argv(settings_path, topology=topology_path)

    def start(self, timeout: float = 60.0) -> SidecarProcess:
        if self.proc is not None:
            raise EngineError(f"sidecar {self.name} already started")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KVFERRY_", "POD_"))}
        env["PYTHONUNBUFFERED"] = "1"
        env.update(self.extra_env)
        argv = self.argv()
        with open(self.log_path, "ab") as log:
            log.write(f"# kvferry: {' '.join(argv)}\n".encode())
        self.proc = spawn_sidecar(argv, self.log_path, env)
        LIVE.add(self)
        self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 60.0) -> dict[str, Any]:
        """Wait until /readyz answers 200 (its engine is up); returns the readyz body."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc is None or self.proc.poll() is not None:
                raise EngineError(f"sidecar {self.name} exited:\n{self.logtail()}")
            try:
                r = self.request("GET", "/readyz", timeout=5, check=False)
                if r.status == 200:
                    return r.body
            except EngineError:
                pass
            if time.monotonic() > deadline:
                raise EngineError(
                    f"sidecar {self.name} not ready after {timeout:.0f} s:\n{self.logtail()}"
                )
            time.sleep(0.2)

    def readyz(self) -> tuple[int, Any]:
        """/readyz with its detail (handles, engine): the internal port's answer; the
        public port says only ready or not."""
        r = self.request("GET", "/readyz", timeout=10, check=False, base=self.internal_url)
        return r.status, r.body

    def stop(self, timeout: float = 10.0) -> None:
        LIVE.discard(self)
        proc, self.proc = self.proc, None
        if proc is not None:
            stop_group(proc, timeout)

    def logtail(self, lines: int = 60) -> str:
        try:
            return tail(self.log_path.read_text(errors="replace"), lines)
        except OSError as e:
            return f"(no log: {e})"

    def __enter__(self) -> SidecarProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_sidecar(
    pair: EnginePair,
    server: Any,
    log_dir: Path | str,
    *,
    name: str = "sidecar",
    overrides: Mapping[str, Any] | None = None,
    port: int | None = None,
    timeout: float = 60.0,
) -> SidecarProcess:
    """Start the decode sidecar for `pair` with the operator's settings for `server`
    (plus `overrides`, camelCase file keys) and wait until it is ready."""
    port = port or free_port()
    settings, topology = sidecar_files(server, pair, port, overrides=overrides)
    sc = SidecarProcess(
        name=name,
        settings=settings,
        topology=topology,
        log_dir=Path(log_dir),
        port=port,
    )
    return sc.start(timeout)
