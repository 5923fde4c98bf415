"""The baseline: a minimal P/D proxy with the behaviour of vLLM's multi-turn example
(``examples/disaggregated/disaggregated_serving/disagg_proxy_multiturn.py``), which is
where users start. Written here (aiohttp, the sidecar's own framework, so the two
compare on logic rather than on web stacks) and run as its own process:

    python -m bench.refproxy --port 8000 --prefill URL --decode URL --ttl 90

What it does, as the example does:

- one handle per ``conversation_id`` (a top-level body field, removed before the
  engines see it), **single use** (popped on lookup), dropped when older than the TTL
  (the example: 450 s against vLLM's 480 s);
- round-robin over the prefill and the decode engines;
- **no token check**: the handle goes to P whatever the new prompt is;
- P: the client's body with ``stream: false, max_tokens: 1`` and the handle (or the
  plain P->D flags); P's ``kv_transfer_params`` (``remote_host`` set to P's host) go
  to D; D's final ``kv_transfer_params`` (``remote_host`` set to D's host) are kept.

One difference, for vLLM 0.32: D is called **without streaming** (0.32 returns the
handle only then; the example reads it from the final streamed chunk, 0.33+), and its
JSON answer goes back to the client as is. ``--no-reuse`` never attaches a handle.

For the benchmark only, two response headers say what happened:
``X-Bench-Handle`` (``hit``, ``miss``, ``stale``) and ``X-Bench-Offered-Tokens`` (the
tokens P was told it may pull: ``min(remote_num_tokens, prompt tokens)``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

HDR_HANDLE = "X-Bench-Handle"
HDR_OFFERED = "X-Bench-Offered-Tokens"

NO_HANDLE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@dataclass
class Entry:
    params: dict[str, Any]
    stored: float = field(default_factory=time.time)


@dataclass
class Proxy:
    prefill: list[str]
    decode: list[str]
    ttl: float
    reuse: bool = True
    handles: dict[str, Entry] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._p = itertools.cycle(range(len(self.prefill)))
        self._d = itertools.cycle(range(len(self.decode)))
        self.session: aiohttp.ClientSession | None = None

    def take(self, conversation_id: str) -> tuple[dict[str, Any] | None, str]:
        entry = self.handles.pop(conversation_id, None)
        if entry is None:
            return None, "miss"
        if time.time() - entry.stored > self.ttl:
            return None, "stale"
        return dict(entry.params), "hit"

    async def handle(self, request: web.Request) -> web.Response:
        assert self.session is not None
        body = await request.json()
        request_id = str(uuid.uuid4())
        conversation_id = str(body.pop("conversation_id", "") or "")
        cached, verdict = (None, "miss")
        if conversation_id and self.reuse:
            cached, verdict = self.take(conversation_id)
        if cached:
            cached["do_remote_decode"] = True
            cached["do_remote_prefill"] = False
            body["kv_transfer_params"] = cached
        else:
            body["kv_transfer_params"] = dict(NO_HANDLE)
        headers = {"X-Request-Id": request_id}
        api = request.path

        p_url = self.prefill[next(self._p)]
        p_body = dict(body, stream=False, max_tokens=1)
        for key in ("max_completion_tokens", "min_tokens", "stream_options"):
            p_body.pop(key, None)
        async with self.session.post(p_url + api, json=p_body, headers=headers) as r:
            if r.status != 200:
                return web.Response(
                    status=r.status, body=await r.read(), content_type="application/json"
                )
            p_answer = await r.json()
        p_params = p_answer.get("kv_transfer_params") or {}
        if p_params:
            p_params["remote_host"] = urlsplit(p_url).hostname
            body["kv_transfer_params"] = p_params
        offered = 0
        if cached:
            prompt = (p_answer.get("usage") or {}).get("prompt_tokens") or 0
            offered = min(int(cached.get("remote_num_tokens") or 0), int(prompt))

        d_url = self.decode[next(self._d)]
        d_body = dict(body, stream=False)
        async with self.session.post(d_url + api, json=d_body, headers=headers) as r:
            raw = await r.read()
            status = r.status
        out = {HDR_HANDLE: verdict, HDR_OFFERED: str(offered)}
        if status == 200 and conversation_id:
            answer = json.loads(raw)
            d_params = answer.get("kv_transfer_params")
            if d_params:
                d_params["remote_host"] = urlsplit(d_url).hostname
                self.handles[conversation_id] = Entry(d_params)
        return web.Response(status=status, body=raw, content_type="application/json", headers=out)


def app_factory(proxy: Proxy) -> web.Application:
    app = web.Application()

    async def client(app: web.Application):  # type: ignore[no-untyped-def]
        proxy.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None)
        )
        yield
        await proxy.session.close()

    app.cleanup_ctx.append(client)
    app.router.add_post("/v1/chat/completions", proxy.handle)
    app.router.add_post("/v1/completions", proxy.handle)

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app.router.add_get("/health", health)
    return app


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.refproxy", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--prefill", action="append", required=True, help="P engine URL (repeatable)")
    p.add_argument("--decode", action="append", required=True, help="D engine URL (repeatable)")
    p.add_argument("--ttl", type=float, default=450.0, help="handle TTL, seconds (example: 450)")
    p.add_argument("--no-reuse", action="store_true", help="never attach a handle")
    args = p.parse_args(argv)
    proxy = Proxy(
        [u.rstrip("/") for u in args.prefill],
        [u.rstrip("/") for u in args.decode],
        ttl=args.ttl,
        reuse=not args.no_reuse,
    )
    web.run_app(app_factory(proxy), host=args.host, port=args.port, print=None, access_log=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
