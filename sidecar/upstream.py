"""HTTP to vLLM's OpenAI server (0.32 and 0.33): the local engine and the prefill pool.

Endpoints used, all present in both versions: ``/health`` (readiness), ``/version``
(capabilities), ``/v1/models`` (``max_model_len``: the context, which bounds request
bodies), ``/metrics`` (``vllm:cache_config_info`` carries the KV block size),
``/tokenize`` (chat messages or a prompt -> ``tokens``), ``/v1/chat/completions`` and
``/v1/completions``. Every engine request carries the turn's ``X-Request-Id``: the
sidecar's own id of the turn, never the client's.

Timeouts: connecting is bounded (``connect_timeout_seconds``); a prefill is bounded
as a whole (``prefill_timeout_seconds``); the decode leg too, generously
(``decode_timeout_seconds``: long generations are legitimate), and a stream may not
fall silent longer than ``stream_idle_timeout_seconds``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from packaging.version import InvalidVersion, Version

from kvferry_wire.protocol import HDR_REQUEST_ID

from . import enginemetrics, offload
from .types import JSON, PATH_HEALTH, PATH_METRICS, PATH_MODELS, PATH_TOKENIZE, PATH_VERSION

log = logging.getLogger(__name__)

# Failed /health probes in a row before an engine counts as not ready.
FAILURES_BEFORE_NOT_READY = 3
# vLLM 0.33 added kv_transfer_params to the final streamed chunk.
STREAMING_HANDLES_SINCE = (0, 33)


class UpstreamError(Exception):
    """An engine request that produced no usable answer."""

    def __init__(self, url: str, reason: str, status: int | None = None) -> None:
        super().__init__(f"{url}: {reason}")
        self.url = url
        self.reason = reason
        self.status = status


class EngineUnavailable(UpstreamError):
    """Nothing reached the engine, or it closed the connection before answering."""


class EngineUnreachable(EngineUnavailable):
    """The connection was never made: the request certainly did not reach the engine."""


class EngineTimeout(UpstreamError):
    """The engine took longer than allowed."""


def parse_version(text: str | None) -> tuple[int, int] | None:
    """The (major, minor) release of a vLLM version string (PEP 440, as vLLM's own
    ``vllm.__version__`` is); pre-releases count as their release: 0.33.0rc1 has
    0.33's streamed handles."""
    try:
        release = Version(text or "").release
    except InvalidVersion:
        return None
    return (release[0], release[1] if len(release) > 1 else 0)


def streams_handles(version: str | None) -> bool:
    parsed = parse_version(version)
    return parsed is not None and parsed >= STREAMING_HANDLES_SINCE


def max_model_len(models: Any) -> int | None:
    """The longest context among the models a vLLM ``/v1/models`` answer lists (the
    base model and its adapters share one), or None when it names none."""
    data = models.get("data") if isinstance(models, dict) else None
    lengths = [
        n
        for m in (data if isinstance(data, list) else ())
        if isinstance(m, dict)
        and isinstance(n := m.get("max_model_len"), int)
        and not isinstance(n, bool)
        and n > 0
    ]
    return max(lengths, default=None)


@dataclass
class EngineInfo:
    """What the local engine can do, read when it becomes ready."""

    version: str | None = None
    streaming_handles: bool = False
    block_size: int | None = None
    num_gpu_blocks: int | None = None  # its KV blocks in all (owners' token caps)
    # The engine's prefix-cache hash algorithm: only sha256_cbor hashes can be
    # recomputed by the sidecar (blockhash.py).
    prefix_hash_algo: str | None = None
    started_at: float | None = None  # process start: a new value is a new engine
    # The context length it serves (max_model_len in /v1/models): bounds request bodies.
    max_model_len: int | None = None


def encode_json(body: JSON) -> bytes:
    """An engine request's body, as aiohttp's ``json=`` writes it."""
    return json.dumps(body).encode()


def decode_json(raw: bytes) -> Any:
    """An engine's answer: its JSON, or its text when it is none."""
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode("utf-8", "replace")


def _ints(values: list[Any]) -> list[int]:
    return [int(v) for v in values]


class EngineClient:
    """One vLLM server."""

    def __init__(self, session: aiohttp.ClientSession, url: str, connect_timeout: float) -> None:
        self.url = url.rstrip("/")
        self._session = session
        self._connect = connect_timeout

    def _timeout(self, total: float | None) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=total, connect=self._connect, sock_connect=self._connect)

    @staticmethod
    def _headers(request_id: str | None) -> dict[str, str]:
        return {HDR_REQUEST_ID: request_id} if request_id else {}

    @classmethod
    async def _json_body(
        cls, body: JSON, request_id: str | None, heavy: bool
    ) -> tuple[bytes, dict[str, str]]:
        """The body as JSON bytes (written in the heavy-work thread for a big turn),
        and the headers that go with it."""
        data = await offload.maybe(heavy, encode_json, body)
        return data, {**cls._headers(request_id), "Content-Type": "application/json"}

    async def get(self, path: str, *, timeout: float | None = None) -> tuple[int, bytes, str]:
        try:
            async with self._session.get(
                self.url + path, timeout=self._timeout(timeout or self._connect * 2)
            ) as resp:
                return resp.status, await resp.read(), resp.content_type
        except TimeoutError as exc:
            raise EngineTimeout(self.url, f"GET {path} timed out") from exc
        except aiohttp.ClientError as exc:
            raise EngineUnavailable(self.url, f"GET {path}: {exc}") from exc

    async def healthy(self) -> bool:
        try:
            status, _, _ = await self.get(PATH_HEALTH)
        except UpstreamError:
            return False
        return status == 200

    async def info(self) -> EngineInfo:
        """Version and block size; missing pieces stay unknown."""
        info = EngineInfo()
        with contextlib.suppress(UpstreamError, ValueError):
            status, body, _ = await self.get(PATH_VERSION)
            if status == 200:
                info.version = str(json.loads(body).get("version"))
                info.streaming_handles = streams_handles(info.version)
        with contextlib.suppress(UpstreamError, ValueError):
            status, body, _ = await self.get(PATH_MODELS)
            if status == 200:
                info.max_model_len = max_model_len(json.loads(body))
        with contextlib.suppress(UpstreamError):
            status, body, _ = await self.get(PATH_METRICS)
            figures = enginemetrics.parse_or_none(body.decode("utf-8", "replace"))
            if status == 200 and figures is not None:
                info.block_size = figures.block_size
                info.num_gpu_blocks = figures.num_gpu_blocks
                info.prefix_hash_algo = figures.prefix_hash_algo
                info.started_at = figures.started_at
        return info

    async def post_json(
        self,
        path: str,
        body: JSON,
        *,
        request_id: str | None,
        timeout: float | None,
        heavy: bool = False,
    ) -> tuple[int, Any]:
        """(status, parsed JSON or text). Raises EngineUnavailable / EngineTimeout.
        ``heavy``: a big turn's body, written off the loop (``offload``); an answer
        past ``offload.HEAVY_BYTES`` is read off the loop whatever the body was."""
        data, headers = await self._json_body(body, request_id, heavy)
        try:
            async with self._session.post(
                self.url + path, data=data, headers=headers, timeout=self._timeout(timeout)
            ) as resp:
                raw = await resp.read()
                return resp.status, await offload.maybe(
                    len(raw) > offload.HEAVY_BYTES, decode_json, raw
                )
        except TimeoutError as exc:
            raise EngineTimeout(self.url, f"POST {path} timed out after {timeout}s") from exc
        except aiohttp.ClientConnectorError as exc:
            raise EngineUnreachable(self.url, f"POST {path}: {exc}") from exc
        except aiohttp.ClientError as exc:
            raise EngineUnavailable(self.url, f"POST {path}: {exc}") from exc

    async def tokenize(
        self, body: JSON, *, request_id: str | None, heavy: bool = False
    ) -> list[int]:
        status, data = await self.post_json(
            PATH_TOKENIZE, body, request_id=request_id, timeout=self._connect * 10, heavy=heavy
        )
        if status != 200 or not isinstance(data, dict) or not isinstance(data.get("tokens"), list):
            raise UpstreamError(self.url, f"tokenize answered {status}", status)
        tokens = data["tokens"]
        return await offload.maybe(len(tokens) > offload.HEAVY_IDS, _ints, tokens)

    async def open(
        self,
        path: str,
        body: JSON,
        *,
        request_id: str | None,
        total: float | None = None,
        idle: float | None = None,
        heavy: bool = False,
    ) -> aiohttp.ClientResponse:
        """Start a request whose body the caller reads (streams); caller releases it.
        ``total`` bounds it all, ``idle`` each wait for more bytes (a read past either
        raises ``TimeoutError``); ``heavy`` as for ``post_json``."""
        timeout = aiohttp.ClientTimeout(
            total=total, connect=self._connect, sock_connect=self._connect, sock_read=idle
        )
        data, headers = await self._json_body(body, request_id, heavy)
        try:
            return await self._session.post(
                self.url + path, data=data, headers=headers, timeout=timeout
            )
        except TimeoutError as exc:
            raise EngineTimeout(self.url, f"POST {path}: no answer within {total}s") from exc
        except aiohttp.ClientError as exc:
            raise EngineUnavailable(self.url, f"POST {path}: {exc}") from exc


# ------------------------------------------------------------------ the local engine


class LocalEngine:
    """The engine in this pod: readiness, capabilities, and restarts.

    Readiness: one failed ``/health`` is not enough to stop serving (a busy engine
    answers slowly); ``FAILURES_BEFORE_NOT_READY`` in a row are. A restart is told by
    the engine's identity (its process start time, from ``/metrics``), not by a missed
    probe: a restarted engine's pinned blocks are gone, a slow one's are not. Without
    an identity (no process metrics), coming back after being not ready counts as a
    restart, the safe side.
    """

    def __init__(
        self,
        client: EngineClient,
        *,
        streaming_override: bool | None = None,
        block_size_override: int | None = None,
    ) -> None:
        self.client = client
        self.ready = False
        self.info = EngineInfo()
        self._was_ready = False
        self._failures = 0
        self._streaming_override = streaming_override
        self._block_size_override = block_size_override
        self.last_error: str | None = "not probed yet"

    @property
    def streaming_handles(self) -> bool:
        if self._streaming_override is not None:
            return self._streaming_override
        return self.info.streaming_handles

    @property
    def block_size(self) -> int | None:
        return self._block_size_override or self.info.block_size

    @property
    def kv_capacity_tokens(self) -> int | None:
        """The tokens of KV the engine holds in all, when it says."""
        blocks, size = self.info.num_gpu_blocks, self.block_size
        return blocks * size if blocks and size else None

    def observe_identity(self, started_at: float | None) -> bool:
        """The engine's process start as last seen; True when it changed (a restart)."""
        if started_at is None:
            return False
        changed = self.info.started_at is not None and started_at != self.info.started_at
        self.info.started_at = started_at
        return changed

    async def probe(self) -> bool:
        """Refresh readiness; True when this probe found a restarted engine."""
        healthy = await self.client.healthy()
        if not healthy:
            self._failures += 1
            self.last_error = f"health check failed ({self._failures} in a row)"
            if self.ready and self._failures >= FAILURES_BEFORE_NOT_READY:
                self.ready = False
                log.warning("engine not ready url=%s err=%s", self.client.url, self.last_error)
            return False
        self._failures = 0
        if self.ready:
            return False
        previous = self.info.started_at
        self.info = await self.client.info()
        restarted = self._was_ready and (
            previous is None or self.info.started_at is None or self.info.started_at != previous
        )
        self._was_ready = True
        self.ready = True
        self.last_error = None
        log.info(
            "engine ready url=%s version=%s streaming_handles=%s block_size=%s restarted=%s",
            self.client.url,
            self.info.version,
            self.streaming_handles,
            self.block_size,
            restarted,
        )
        if not self.streaming_handles:
            log.info(
                "engine does not stream kv_transfer_params (vLLM < 0.33): a streamed "
                "turn reads P's KV and is re-anchored on D in one-token requests of "
                "their own (anchor.py) url=%s",
                self.client.url,
            )
        return restarted


# ------------------------------------------------------------------ the prefill pool


@dataclass
class PrefillEngine:
    client: EngineClient
    ready: bool = True  # optimistic until a probe or a request says otherwise
    outstanding: int = 0
    chosen: int = 0
    failures: int = 0  # failed probes in a row
    seen_healthy: bool = False  # an engine never seen healthy gets no benefit of doubt

    @property
    def url(self) -> str:
        return self.client.url


@dataclass
class PrefillPool:
    """Ready prefill engines, least outstanding requests first."""

    session: aiohttp.ClientSession
    connect_timeout: float
    engines: dict[str, PrefillEngine] = field(default_factory=dict)

    def update(self, urls: Iterable[str]) -> None:
        wanted = [u.rstrip("/") for u in urls]
        for url in list(self.engines):
            if url not in wanted:
                del self.engines[url]
        for url in wanted:
            if url not in self.engines:
                self.engines[url] = PrefillEngine(
                    EngineClient(self.session, url, self.connect_timeout)
                )

    def ready_count(self) -> int:
        return sum(e.ready for e in self.engines.values())

    def choose(self, exclude: set[str]) -> PrefillEngine | None:
        candidates = [e for e in self.engines.values() if e.ready and e.url not in exclude]
        if not candidates:
            return None
        # Ties go to the engine chosen least often, so an idle pool round-robins.
        best = min(candidates, key=lambda e: (e.outstanding, e.chosen))
        best.chosen += 1
        return best

    def mark_down(self, url: str) -> None:
        engine = self.engines.get(url)
        if engine is not None and engine.ready:
            engine.ready = False
            log.warning("prefill engine marked not ready url=%s", url)

    async def probe(self) -> None:
        """A healthy probe makes an engine ready at once; it takes
        ``FAILURES_BEFORE_NOT_READY`` failed ones in a row to stop choosing it (a busy
        engine answers /health late; a refused connection on a request marks it down
        at once, ``mark_down``)."""
        engines = list(self.engines.values())
        results = await asyncio.gather(*(e.client.healthy() for e in engines))
        for engine, healthy in zip(engines, results, strict=True):
            engine.failures = 0 if healthy else engine.failures + 1
            engine.seen_healthy = engine.seen_healthy or healthy
            ready = healthy or (
                engine.seen_healthy and engine.ready and engine.failures < FAILURES_BEFORE_NOT_READY
            )
            if ready != engine.ready:
                log.info("prefill engine ready=%s url=%s", ready, engine.url)
            engine.ready = ready

    @contextlib.contextmanager
    def in_flight(self, engine: PrefillEngine) -> Iterator[None]:
        engine.outstanding += 1
        try:
            yield
        finally:
            engine.outstanding -= 1
