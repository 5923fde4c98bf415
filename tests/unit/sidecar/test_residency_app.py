"""Residency through the running app: /v1/residency, /metrics, engine scrape, restarts."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from kvferry_sidecar.upstream import FAILURES_BEFORE_NOT_READY
from kvferry_wire import report

from .conftest import Engines, MakeSidecar, sidecar_of
from .test_push import FakeOperator
from .test_turns import LONG_QUESTION, Conversation, outcome

ENGINE_METRICS = """\
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.4
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="m"} 2.0
# TYPE vllm:nixl_bytes_transferred histogram
vllm:nixl_bytes_transferred_count{engine="0",model_name="m"} 1.0
vllm:nixl_bytes_transferred_sum{engine="0",model_name="m"} 65536.0
# TYPE vllm:prompt_tokens_cached_by_source_total counter
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="p2p"} 16.0
"""


async def test_residency_route_serves_a_decodable_report(make_sidecar: MakeSidecar) -> None:
    """GET /v1/residency is the report the operator accepts, naming this pod."""
    client = await make_sidecar()
    conv = Conversation(client, stream=True)
    await conv.ask(LONG_QUESTION)
    await conv.ask("and then")
    resp = await client.get("/v1/residency")
    assert resp.status == 200
    assert resp.content_type == "application/json"
    rep = report.decode(await resp.read())
    assert (rep.server, rep.namespace, rep.pod, rep.role) == (
        "x",
        "serving",
        "x-decode-0",
        "decode",
    )
    assert rep.outcomes == {"no-handle": 1, "reused": 1}
    assert rep.handles == {"consumed": 1}
    assert rep.by_turn["2"].reused_turns == 1
    assert rep.ttft_reused.total == 1 and rep.ttft_recomputed.total == 1
    assert rep.pinned.handles == 1 and rep.pinned.blocks > 0
    assert rep.engine.healthy is True


async def test_gap_is_reported_after_the_handle_expired(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """The second turn finds the handle expired; its gap is in the report anyway."""
    client = await make_sidecar()
    conv = Conversation(client)
    await conv.ask(LONG_QUESTION)
    engines.clock.advance(700.0)  # past the fake D's 480 s TTL
    resp, _ = await conv.ask("and then")
    assert outcome(resp) == "expired"
    rep = report.decode(await (await client.get("/v1/residency")).read())
    assert rep.gaps.total == 1
    assert 700.0 <= rep.gaps.sum < 705.0  # bounded: a fast in-process turn
    assert rep.handles == {"expired": 1}


async def test_prefill_role_serves_a_report_too(make_sidecar: MakeSidecar) -> None:
    client = await make_sidecar(role="prefill")
    rep = report.decode(await (await client.get("/v1/residency")).read())
    assert rep.role == "prefill"
    assert rep.outcomes == {}


async def test_engine_metrics_are_scraped_into_the_report(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    engines.decode.metrics_text = ENGINE_METRICS
    client = await make_sidecar()
    assert await sidecar_of(client).scrape_engine() is True
    rep = report.decode(await (await client.get("/v1/residency")).read())
    assert (rep.engine.kv_usage, rep.engine.preemptions) == (0.4, 2)
    assert rep.transfer.bytes == 65536
    assert rep.transfer.bytes_per_token == 4096.0


async def test_residency_figures_are_prometheus_series(make_sidecar: MakeSidecar) -> None:
    """Stable names with units, read from the same snapshot as the JSON report."""
    client = await make_sidecar()
    conv = Conversation(client, stream=True)
    await conv.ask(LONG_QUESTION)
    await conv.ask("and then")
    text = await (await client.get("/metrics")).text()
    assert "kvferry_inter_turn_gap_seconds_count 1.0" in text
    assert 'kvferry_inter_turn_gap_seconds_bucket{le="+Inf"} 1.0' in text
    assert 'kvferry_ttft_seconds_count{reuse="reused"} 1.0' in text
    assert 'kvferry_handle_fates_total{fate="consumed"} 1.0' in text
    assert 'kvferry_turns_by_index_total{turn="2"} 1.0' in text
    assert "kvferry_pinned_handles 1.0" in text
    assert "kvferry_pinned_blocks " in text
    assert "kvferry_kv_events_missed_total 0.0" in text


async def test_engine_restart_drops_kv_event_state(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """A restarted engine holds nothing and numbers its events from 0 again."""
    client = await make_sidecar()
    sc = sidecar_of(client)
    sc.kv_index.next_seq = 10
    engines.decode.healthy = False
    for _ in range(FAILURES_BEFORE_NOT_READY):
        await sc.probe()
    engines.decode.restart()
    engines.decode.healthy = True
    await sc.probe()
    assert sc.kv_index.cleared == 1
    assert sc.kv_index.next_seq is None


async def test_app_pushes_its_report_to_the_operator(
    make_sidecar: MakeSidecar, aiohttp_server: Any, tmp_path: Path
) -> None:
    """With operatorUrl set, the running app pushes decodable reports with the token."""
    op = FakeOperator()
    server = await aiohttp_server(op.app())
    token = tmp_path / "token"
    token.write_text("pod-token")
    await make_sidecar(
        operator_url=str(server.make_url("/v1/reports")),
        report_interval_seconds=0.02,
        token_file=str(token),
    )
    async with asyncio.timeout(5.0):  # bounded: the first push is due after 20 ms
        while not op.bodies:
            await asyncio.sleep(0.01)
    assert op.auth[0] == "Bearer pod-token"
    assert report.decode(op.bodies[0]).pod == "x-decode-0"
