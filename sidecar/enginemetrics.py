"""The local engine's Prometheus figures the residency report needs. Pure parsing.

Names as vLLM 0.32 registers them (``v1/metrics/loggers.py``,
``kv_connector/v1/nixl/stats.py``); counters are exposed with ``_total``:

- ``vllm:kv_cache_usage_perc`` (gauge, a fraction 0..1 despite the name)
- ``vllm:num_preemptions`` (counter)
- ``vllm:nixl_bytes_transferred`` (histogram per transfer: ``_sum`` / ``_count``;
  a plain counter or gauge of bytes is accepted too)
- ``vllm:nixl_xfer_time_seconds`` (histogram: ``_sum`` seconds, ``_count`` transfers)
- ``vllm:nixl_num_kv_expired_reqs``, ``vllm:nixl_num_failed_transfers`` (counters)
- ``vllm:prompt_tokens_cached_by_source{source="p2p"}`` (counter: prompt tokens this
  engine received from another vLLM instance, i.e. NIXL pulls)
- ``vllm:cache_config_info{block_size=..., num_gpu_blocks=..., prefix_caching_hash_algo=...}``
  (info gauge)
- ``vllm:num_requests_running`` and ``vllm:num_requests_waiting_by_reason{reason="capacity"}``
  (gauges): requests waiting for room while none runs wait for KV blocks (a request
  waiting for its KV transfer is ``deferred``, not ``capacity``)

Every series is summed over its label sets (engines, models), except the KV usage
fraction, where the highest engine counts (the pressure the tuner must see).
Missing metrics stay None/0: a P without NIXL traffic, an engine without metrics.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from .promtext import is_sample_of, samples

log = logging.getLogger(__name__)

KV_USAGE = "vllm:kv_cache_usage_perc"
PREEMPTIONS = "vllm:num_preemptions"
NIXL_BYTES = "vllm:nixl_bytes_transferred"
NIXL_TIME = "vllm:nixl_xfer_time_seconds"
NIXL_EXPIRED = "vllm:nixl_num_kv_expired_reqs"
NIXL_FAILED = "vllm:nixl_num_failed_transfers"
CACHED_BY_SOURCE = "vllm:prompt_tokens_cached_by_source"
CACHE_CONFIG = "vllm:cache_config_info"
# prometheus_client's process collector in the API server: it changes when the engine
# restarts, and only then (a slow /health is not a restart).
PROCESS_START = "process_start_time_seconds"
P2P_SOURCE = "p2p"
RUNNING = "vllm:num_requests_running"
WAITING_BY_REASON = "vllm:num_requests_waiting_by_reason"
WAITING_CAPACITY = "capacity"


@dataclass(frozen=True)
class EngineFigures:
    """One scrape. Counters are the engine's own (they restart with the engine)."""

    kv_usage: float | None = None
    preemptions: float = 0.0
    nixl_bytes: float = 0.0
    nixl_seconds: float = 0.0
    nixl_transfers: float = 0.0
    nixl_expired: float = 0.0
    nixl_failed: float = 0.0
    p2p_tokens: float = 0.0
    block_size: int | None = None
    # The engine's KV blocks in all (cache_config_info): x block_size = D's KV in tokens.
    num_gpu_blocks: int | None = None
    prefix_hash_algo: str | None = None  # e.g. sha256_cbor (reproducible block hashes)
    started_at: float | None = None  # the engine process's start (its identity)
    running: float | None = None  # requests in the engine's batches now
    waiting_for_capacity: float | None = None  # requests waiting for room now

    @property
    def stalled(self) -> int:
        """Requests waiting for room on an engine that runs none: they wait for KV
        blocks (nothing else can hold an empty batch back). vLLM counts no preemption
        for them, and its usage may be under the high-water mark."""
        if not self.running and self.waiting_for_capacity:
            return max(0, int(self.waiting_for_capacity))
        return 0


def parse(text: str) -> EngineFigures:
    """The figures in a ``/metrics`` text; raises ValueError when it is not one."""
    kv: float | None = None
    sums = dict.fromkeys(
        ("pre", "bytes", "bytes_plain", "secs", "xfers", "expired", "failed", "p2p"), 0.0
    )
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    hash_algo: str | None = None
    started_at: float | None = None
    running: float | None = None
    waiting: float | None = None
    for s in samples(text):
        name, value = s.name, s.value
        if value != value:  # NaN: an engine with nothing observed yet
            continue
        if name == KV_USAGE:
            kv = value if kv is None else max(kv, value)
        elif is_sample_of(PREEMPTIONS, name):
            sums["pre"] += value
        elif name == NIXL_BYTES + "_sum":
            sums["bytes"] += value
        elif is_sample_of(NIXL_BYTES, name):
            sums["bytes_plain"] += value
        elif name == NIXL_TIME + "_sum":
            sums["secs"] += value
        elif name == NIXL_TIME + "_count":
            sums["xfers"] += value
        elif is_sample_of(NIXL_EXPIRED, name):
            sums["expired"] += value
        elif is_sample_of(NIXL_FAILED, name):
            sums["failed"] += value
        elif is_sample_of(CACHED_BY_SOURCE, name) and s.labels.get("source") == P2P_SOURCE:
            sums["p2p"] += value
        elif name == RUNNING:
            running = (running or 0.0) + value
        elif name == WAITING_BY_REASON and s.labels.get("reason") == WAITING_CAPACITY:
            waiting = (waiting or 0.0) + value
        elif name == PROCESS_START and started_at is None:
            started_at = value
        elif name == CACHE_CONFIG and block_size is None:
            raw = s.labels.get("block_size", "")
            block_size = int(raw) if raw.isdigit() else None
            blocks = s.labels.get("num_gpu_blocks", "")
            num_gpu_blocks = int(blocks) if blocks.isdigit() else None
            hash_algo = s.labels.get("prefix_caching_hash_algo") or None
    return EngineFigures(
        kv_usage=kv,
        preemptions=sums["pre"],
        nixl_bytes=sums["bytes"] or sums["bytes_plain"],
        nixl_seconds=sums["secs"],
        nixl_transfers=sums["xfers"],
        nixl_expired=sums["expired"],
        nixl_failed=sums["failed"],
        p2p_tokens=sums["p2p"],
        block_size=block_size,
        num_gpu_blocks=num_gpu_blocks,
        prefix_hash_algo=hash_algo,
        started_at=started_at,
        running=running,
        waiting_for_capacity=waiting,
    )


def parse_or_none(text: str) -> EngineFigures | None:
    try:
        return parse(text)
    except (ValueError, TypeError, IndexError) as exc:
        log.debug("engine metrics unparsable err=%s", exc)
        return None


class Cumulative:
    """Engine counters made monotonic across engine restarts.

    The report's counters run from the sidecar's start; an engine that restarts
    starts its own at 0, so a drop means "restarted": the new value is all new.
    """

    def __init__(self) -> None:
        self._last: dict[str, float] = {}
        self.total: dict[str, float] = {}

    def update(self, name: str, value: float) -> float:
        last = self._last.get(name)
        delta = value if last is None or value < last else value - last
        self._last[name] = value
        self.total[name] = self.total.get(name, 0.0) + delta
        return self.total[name]

    def get(self, name: str) -> float:
        return self.total.get(name, 0.0)
