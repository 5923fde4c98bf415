"""The engine's /metrics figures the residency report reads."""

from __future__ import annotations

import pytest

from kvferry_sidecar.enginemetrics import Cumulative, EngineFigures, parse, parse_or_none

# Shaped as vLLM 0.32 exposes them through prometheus_client (two engines, DP=2):
# counters with _total and _created, NIXL histograms per transfer.
VLLM_032 = """\
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="llama"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="llama"} 0.625
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="llama"} 3.0
vllm:num_preemptions_total{engine="1",model_name="llama"} 4.0
# HELP vllm:num_preemptions_created Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_created gauge
vllm:num_preemptions_created{engine="0",model_name="llama"} 1.79e+09
# HELP vllm:prompt_tokens_cached_by_source_total Prefix-cache hit tokens by tier.
# TYPE vllm:prompt_tokens_cached_by_source_total counter
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="llama",source="device"} 512.0
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="llama",source="p2p"} 1063.0
vllm:prompt_tokens_cached_by_source_total{engine="1",model_name="llama",source="p2p"} 1000.0
# HELP vllm:nixl_xfer_time_seconds Histogram of transfer duration for NIXL KV Cache transfers.
# TYPE vllm:nixl_xfer_time_seconds histogram
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="0.005",model_name="llama"} 0.0
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="0.05",model_name="llama"} 1.0
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="+Inf",model_name="llama"} 2.0
vllm:nixl_xfer_time_seconds_count{engine="0",model_name="llama"} 2.0
vllm:nixl_xfer_time_seconds_sum{engine="0",model_name="llama"} 0.08
# HELP vllm:nixl_bytes_transferred Histogram of bytes transferred per NIXL KV Cache transfers.
# TYPE vllm:nixl_bytes_transferred histogram
vllm:nixl_bytes_transferred_bucket{engine="0",le="2048.0",model_name="llama"} 0.0
vllm:nixl_bytes_transferred_bucket{engine="0",le="+Inf",model_name="llama"} 2.0
vllm:nixl_bytes_transferred_count{engine="0",model_name="llama"} 2.0
vllm:nixl_bytes_transferred_sum{engine="0",model_name="llama"} 3.7748736e+07
# HELP vllm:nixl_num_failed_transfers_total Number of failed NIXL KV Cache transfers.
# TYPE vllm:nixl_num_failed_transfers_total counter
vllm:nixl_num_failed_transfers_total{engine="0",model_name="llama"} 1.0
# HELP vllm:nixl_num_kv_expired_reqs_total Number of requests that had their KV expire.
# TYPE vllm:nixl_num_kv_expired_reqs_total counter
vllm:nixl_num_kv_expired_reqs_total{engine="0",model_name="llama"} 2.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",cache_dtype="auto",engine="0"} 1.0
"""


def test_parses_every_figure_of_a_vllm_032_scrape() -> None:
    """Counters summed over engines; KV usage is the fullest engine's."""
    assert parse(VLLM_032) == EngineFigures(
        kv_usage=0.625,
        preemptions=7.0,
        nixl_bytes=37748736.0,
        nixl_seconds=0.08,
        nixl_transfers=2.0,
        nixl_expired=2.0,
        nixl_failed=1.0,
        p2p_tokens=2063.0,
        block_size=128,
    )


def test_nixl_bytes_as_a_plain_counter_is_read_too() -> None:
    text = (
        "# TYPE vllm:nixl_bytes_transferred counter\n"
        'vllm:nixl_bytes_transferred_total{engine="0"} 4096.0\n'
        "# TYPE vllm:num_preemptions counter\n"
        "vllm:num_preemptions 2.0\n"
    )
    figures = parse(text)
    assert (figures.nixl_bytes, figures.preemptions) == (4096.0, 2.0)


def test_missing_metrics_stay_unknown_or_zero() -> None:
    """An engine without NIXL traffic or with metrics off."""
    assert parse("# nothing here\n") == EngineFigures()


@pytest.mark.parametrize("text", ["vllm:kv_cache_usage_perc{engine= 0.5\n", "a b c d\n"])
def test_unparsable_text_gives_none(text: str) -> None:
    assert parse_or_none(text) is None


def test_cumulative_counts_a_drop_as_an_engine_restart() -> None:
    acc = Cumulative()
    assert [acc.update("x", v) for v in (5.0, 7.0, 2.0, 3.0)] == [5.0, 7.0, 9.0, 10.0]
