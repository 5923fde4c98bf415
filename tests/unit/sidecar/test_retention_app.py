"""The retention policy in the running sidecar: D's pressure from its /metrics and the
policy's releases reach P as release requests, counted by reason in the report."""

from __future__ import annotations

from typing import Any

from kvferry_wire import report

from .conftest import Engines, MakeSidecar, sidecar_of
from .test_turns import (
    LONG_QUESTION,
    Conversation,
    kv,
    outcome,
    prefill_bodies,
    releases_done,
    rider,
)

BLOCKS = 1024  # the fake D's num_gpu_blocks (cache_config_info)


def engine_metrics(kv_usage: float, preemptions: int) -> str:
    return (
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        f'vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {kv_usage}\n'
        "# TYPE vllm:num_preemptions_total counter\n"
        f'vllm:num_preemptions_total{{engine="0",model_name="m"}} {float(preemptions)}\n'
    )


async def residency(client: Any) -> report.Report:
    return report.decode(await (await client.get("/v1/residency")).read())


def released_params(engines: Engines) -> list[dict[str, Any]]:
    """What P was sent to release (nothing to pull), in order."""
    return [kv(b) for b in prefill_bodies(engines) if (kv(b) or {}).get("remote_num_tokens") == 0]


async def two_sessions(make_sidecar: MakeSidecar) -> tuple[Any, list[Conversation]]:
    client = await make_sidecar()
    convs = [Conversation(client, session_id=f"s{i}") for i in range(2)]
    for conv in convs:
        await conv.ask(LONG_QUESTION)
    await releases_done(client)
    assert len(sidecar_of(client).store) == 2
    return client, convs


async def test_d_over_its_high_water_mark_releases_the_lowest_value_handle_on_p(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """D's KV usage a block over 90 %: the background loop's look releases one handle,
    the lowest value, through P, and counts it as ``pressure``; the other session
    still reuses its own."""
    client, convs = await two_sessions(make_sidecar)
    sc = sidecar_of(client)
    before = len(released_params(engines))
    engines.decode.metrics_text = engine_metrics((0.9 * BLOCKS + 1) / BLOCKS, 0)
    assert await sc.scrape_engine() is True
    now = sc.store.now()
    pol = sc.retention
    lowest = min(sc.store.values(), key=lambda h: pol.value(pol.held[h.session], now))
    assert sc.release_due() == 1
    await releases_done(client)
    assert released_params(engines)[before:] == [rider(dict(lowest.params))]
    rep = await residency(client)
    assert rep.evictions.pressure == 1 and rep.handles.get("evicted") == 1
    outcomes = sorted([outcome((await conv.ask("and then"))[0]) for conv in convs])
    assert outcomes == ["no-handle", "reused"]


async def test_each_new_preemption_on_d_releases_one_handle(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """Preemptions D had before the first look are not answered for; one more since
    the last look releases one handle (``preemption``); no pressure releases none."""
    client, _ = await two_sessions(make_sidecar)
    sc = sidecar_of(client)
    engines.decode.metrics_text = engine_metrics(0.1, 5)
    assert await sc.scrape_engine() is True
    assert sc.release_due() == 0
    engines.decode.metrics_text = engine_metrics(0.1, 6)
    assert await sc.scrape_engine() is True
    assert sc.release_due() == 1
    assert sc.release_due() == 0  # the preemption was answered once
    await releases_done(client)
    rep = await residency(client)
    assert rep.evictions.preemption == 1 and len(sc.store) == 1
    text = await (await client.get("/metrics")).text()
    assert 'kvferry_handle_evictions_total{reason="preemption"} 1.0' in text


async def test_a_request_waiting_for_blocks_on_an_idle_d_releases_one_handle(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """D runs nothing while a request waits for room (KV usage under the high-water
    mark, no preemption counted): one handle is released for it; a request waiting for
    its KV transfer (``deferred``) or beside running ones asks for nothing."""
    client, _ = await two_sessions(make_sidecar)
    sc = sidecar_of(client)

    def waiting(running: int, reason: str) -> str:
        return engine_metrics(0.5, 0) + (
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{engine="0",model_name="m"}} {running}.0\n'
            "# TYPE vllm:num_requests_waiting_by_reason gauge\n"
            "vllm:num_requests_waiting_by_reason"
            f'{{engine="0",model_name="m",reason="{reason}"}} 1.0\n'
        )

    for running, reason in ((0, "deferred"), (1, "capacity")):
        engines.decode.metrics_text = waiting(running, reason)
        assert await sc.scrape_engine() is True
        assert sc.release_due() == 0
    engines.decode.metrics_text = waiting(0, "capacity")
    assert await sc.scrape_engine() is True
    assert sc.release_due() == 1
    await releases_done(client)
    rep = await residency(client)
    assert rep.evictions.preemption == 1 and len(sc.store) == 1


async def test_without_engine_figures_nothing_is_released_for_pressure(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """A D whose /metrics say nothing of its KV: the loop releases nothing early."""
    client, _ = await two_sessions(make_sidecar)
    sc = sidecar_of(client)
    engines.decode.metrics_text = ""
    await sc.scrape_engine()
    assert sc.release_due() == 0 and len(sc.store) == 2
