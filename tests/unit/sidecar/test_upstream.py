"""Engine capabilities and the prefill pool's choice."""

from __future__ import annotations

import pytest

from kvferry_sidecar.enginemetrics import parse
from kvferry_sidecar.upstream import EngineClient, PrefillPool, parse_version, streams_handles

METRICS = (
    "# TYPE vllm:cache_config_info gauge\n"
    'vllm:cache_config_info{block_size="16",cache_dtype="auto",gpu_memory_utilization="0.9"} 1.0\n'
)


@pytest.mark.parametrize(
    ("version", "expected"),
    [
        ("0.32.0", False),
        ("0.32.1.dev5+g1234", False),
        ("0.33.0", True),
        ("0.33.0rc1", True),
        ("0.34.1", True),
        ("1.0.0", True),
        ("unknown", False),
        (None, False),
    ],
)
def test_streaming_handles_from_version(version: str | None, expected: bool) -> None:
    """Only vLLM 0.33+ puts kv_transfer_params on the final streamed chunk."""
    assert streams_handles(version) is expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0.32.0", (0, 32)),
        ("0.32.1+cpu", (0, 32)),
        ("0.11.0rc2.dev123+g1234abc", (0, 11)),
        ("1", (1, 0)),
        ("v0.33.0", (0, 33)),
        ("not-a-version", None),
        ("", None),
        (None, None),
    ],
)
def test_parse_version(text: str | None, expected: tuple[int, int] | None) -> None:
    """Versions are read as PEP 440 (local and dev parts included); anything else is None."""
    assert parse_version(text) == expected


def test_block_size_from_engine_metrics() -> None:
    assert parse(METRICS).block_size == 16
    assert parse("vllm:num_requests_running 0\n").block_size is None


class _Session:
    """EngineClient never touches the session in these tests."""


def make_pool(*urls: str) -> PrefillPool:
    pool = PrefillPool(session=_Session(), connect_timeout=1.0)  # type: ignore[arg-type]
    pool.update(urls)
    return pool


def test_prefill_choice_least_outstanding() -> None:
    """The ready engine with the fewest requests in flight is chosen."""
    pool = make_pool("http://p0", "http://p1", "http://p2")
    pool.engines["http://p0"].outstanding = 3
    pool.engines["http://p1"].outstanding = 1
    pool.engines["http://p2"].outstanding = 2
    chosen = pool.choose(set())
    assert chosen is not None and chosen.url == "http://p1"


def test_prefill_choice_skips_not_ready_and_tried() -> None:
    pool = make_pool("http://p0", "http://p1", "http://p2")
    pool.mark_down("http://p0")
    chosen = pool.choose({"http://p1"})
    assert chosen is not None and chosen.url == "http://p2"
    assert pool.choose({"http://p1", "http://p2"}) is None


def test_prefill_in_flight_counts_and_releases() -> None:
    pool = make_pool("http://p0")
    engine = pool.engines["http://p0"]
    with pool.in_flight(engine):
        assert engine.outstanding == 1
    assert engine.outstanding == 0


def test_prefill_pool_update_keeps_known_engines() -> None:
    """A topology reload keeps the state of engines that stay and drops the rest."""
    pool = make_pool("http://p0", "http://p1")
    pool.engines["http://p0"].outstanding = 2
    pool.update(["http://p0/", "http://p9"])
    assert set(pool.engines) == {"http://p0", "http://p9"}
    assert pool.engines["http://p0"].outstanding == 2
    assert isinstance(pool.engines["http://p9"].client, EngineClient)
