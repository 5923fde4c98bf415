"""What an engine's ``/metrics`` says happened between two reads."""

from __future__ import annotations

from dataclasses import dataclass

from kvferry_sidecar.promtext import Scrape


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
    def between(cls, before: Scrape, after: Scrape) -> PrefillFigures:
        def d(name: str, **labels: str) -> float:
            return after.total(name, **labels) - before.total(name, **labels)

        return cls(
            pulled_tokens=d("vllm:prompt_tokens_cached_by_source", source="p2p"),
            computed_tokens=d("vllm:prompt_tokens_by_source", source="local_compute"),
            cached_tokens=d("vllm:prompt_tokens_by_source", source="local_cache_hit"),
            pull_bytes=d("vllm:nixl_bytes_transferred_sum"),
            expired_reads=d("vllm:nixl_num_kv_expired_reqs"),
            failed_transfers=d("vllm:nixl_num_failed_transfers"),
        )
