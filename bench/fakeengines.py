"""The unit tier's fake vLLM engines (kvferry_dev/fakeengines.py), a prefill and a
decode, served on real ports by one process:

    python -m bench.fakeengines --prefill-port P --decode-port D [--version 0.32.0]

The fakes record every request for tests to inspect; here only the last few are kept,
so a long benchmark does not grow without bound.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import sys

from aiohttp import web

from kvferry_dev.fakeengines import FakeEngine


async def serve(prefill_port: int, decode_port: int, version: str) -> None:
    runners = []
    for role, port in (("prefill", prefill_port), ("decode", decode_port)):
        engine = FakeEngine(role, f"{role}-0", version=version)
        engine.seen = collections.deque(maxlen=8)  # type: ignore[assignment]
        engine.handles = collections.deque(maxlen=8)  # type: ignore[assignment]
        runner = web.AppRunner(engine.app(), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
    print("ready", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        for runner in runners:
            await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fakeengines")
    p.add_argument("--prefill-port", type=int, required=True)
    p.add_argument("--decode-port", type=int, required=True)
    p.add_argument("--version", default="0.32.0", help="the vLLM version the fakes claim")
    args = p.parse_args(argv)
    asyncio.run(serve(args.prefill_port, args.decode_port, args.version))
    return 0


if __name__ == "__main__":
    sys.exit(main())
