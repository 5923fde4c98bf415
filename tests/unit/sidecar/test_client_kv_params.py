"""No client-supplied KV transfer parameters reach an engine, top-level or as an
extension argument; every engine request carries the sidecar's own (issue 20, item 5).
Against fakes that record what each engine received."""

from __future__ import annotations

from kvferry_sidecar.types import LOCAL_HANDLE_PARAMS, PREFILL_REQUEST_PARAMS

from .conftest import Engines, MakeSidecar
from .test_client_fields import engine_bodies
from .test_turns import CHAT, LONG_QUESTION, kv, outcome, prefill_bodies, releases_done

# A client's attempt to steer an engine's KV transfer: pull another session's blocks.
FOREIGN_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": "decode-0",
    "remote_block_ids": [[7, 8, 9]],
    "remote_host": "10.0.0.2",
    "remote_port": 5601,
    "remote_num_tokens": 12,
}


async def test_kv_params_inside_vllm_xargs_reach_no_engine(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """vLLM reads ``vllm_xargs.kv_transfer_params`` when the top-level field is empty:
    the sidecar strips it (other xargs pass) and every engine request carries a
    top-level kv_transfer_params of the sidecar's own."""
    client = await make_sidecar()
    xargs = {"kv_transfer_params": FOREIGN_PARAMS, "my_extension": "1"}
    messages = [{"role": "user", "content": LONG_QUESTION}]
    body = {"model": "m", "session_id": "s", "vllm_xargs": xargs, "kv_transfer_params": {}}
    resp = await client.post(CHAT, json={**body, "messages": messages})
    assert resp.status == 200
    answer = await resp.json()
    messages += [
        {"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
        {"role": "user", "content": "and then"},
    ]
    resp = await client.post(CHAT, json={**body, "messages": messages})
    assert outcome(resp) == "reused"
    await releases_done(client)

    seen = engine_bodies(engines)
    assert len(seen) == 4  # P, D, P (with the handle), D
    for got in seen:
        assert got["vllm_xargs"] == {"my_extension": "1"}
        assert "kv_transfer_params" in got
    p1, d1, p2, d2 = seen
    assert kv(p1) == PREFILL_REQUEST_PARAMS
    assert kv(d1)["remote_engine_id"] in {"prefill-0", "prefill-1"}
    assert kv(p2) == engines.decode.handles[0]
    assert kv(d2)["remote_engine_id"] in {"prefill-0", "prefill-1"}


async def test_every_kind_of_engine_request_carries_the_sidecars_own_kv_params(
    make_sidecar: MakeSidecar, engines: Engines
) -> None:
    """D prefilling alone, D asked for several sequences (no transfer: an explicit
    null), and a release request to P: none carries the client's parameters."""
    client = await make_sidecar(skip_prefill_below_tokens=256)
    xargs = {"kv_transfer_params": FOREIGN_PARAMS}
    messages = [{"role": "user", "content": "hi"}]
    body = {"model": "m", "messages": messages, "session_id": "s", "vllm_xargs": xargs}
    resp = await client.post(CHAT, json=body)
    assert outcome(resp) == "skipped-prefill"
    d_local = engines.decode.last().body
    assert kv(d_local) == LOCAL_HANDLE_PARAMS
    assert d_local["vllm_xargs"] == {}

    # A turn of several sequences: D gets no transfer, said explicitly.
    resp = await client.post(CHAT, json={**body, "n": 2, "session_id": "t"})
    assert resp.status == 200
    d_multi = engines.decode.last().body
    assert "kv_transfer_params" in d_multi and d_multi["kv_transfer_params"] is None
    assert d_multi["vllm_xargs"] == {}

    # The next turn of session s drops the handle unread (skip-prefill again): it goes
    # to P in a release request of the sidecar's own.
    resp = await client.post(
        CHAT,
        json={**body, "messages": [{"role": "user", "content": "other"}]},
    )
    await releases_done(client)
    (release,) = prefill_bodies(engines)
    assert kv(release)["remote_num_tokens"] == 0
    assert kv(release)["remote_block_ids"] == engines.decode.handles[0]["remote_block_ids"]
    assert "vllm_xargs" not in release
