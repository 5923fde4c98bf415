"""A flood of forged reports against the real operator's endpoint while real pods
report: the pods' reports keep landing and the operator's memory stays bounded.

Prints the figures (reports/s answered, valid reports landed, operator RSS); the
closing note of issue 11 quotes a run. Loopback only, bounded in time."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import ssl
import time
from pathlib import Path

import aiohttp

from kvferry_wire import report as wire
from tests.cluster.conftest import Kubectl, Operator, wait_until
from tests.cluster.test_operator import make, wait_ready
from tests.cluster.test_reports import bound_token, decode_report
from tests.progress import say

SECONDS = float(os.environ.get("KVFERRY_FLOOD_SECONDS", "20"))
FORGERS = 32  # concurrent connections sending forged reports as fast as answered
PUSH_EVERY = 1.5  # a real sidecar pushes every 15 s; ten times that here


def forged_token(i: int, pod: str) -> str:
    """Shaped like a projected token for our audience naming a real pod, so it passes
    the shape filter and costs a TokenReview: the expensive kind of forgery."""

    def part(obj: dict) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).rstrip(b"=").decode()

    claims = {"aud": ["kvferry"], "exp": time.time() + 3600,
              "kubernetes.io": {"namespace": "x", "pod": {"name": pod}}}  # fmt: skip
    return f"{part({'alg': 'RS256'})}.{part(claims)}.forged{i}"


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


async def flood(operator: Operator, pods: dict[str, tuple[str, bytes]]) -> dict:
    ctx = ssl.create_default_context(cafile=str(operator.cert))
    url = operator.report_url
    deadline = time.monotonic() + SECONDS
    forged: dict[int, int] = {}
    valid = {pod: {"sent": 0, "landed": 0, "other": {}} for pod in pods}
    rss: list[float] = []
    assert operator.proc is not None
    pid = operator.proc.pid
    conn = aiohttp.TCPConnector(ssl=ctx, limit=FORGERS + len(pods) + 4)
    timeout = aiohttp.ClientTimeout(total=15)

    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:

        async def forger(n: int) -> None:
            i = 0
            body = decode_report("x", "tiny", "tiny-decode-0")
            while time.monotonic() < deadline:
                i += 1
                token = forged_token(n * 10_000_000 + i, "tiny-decode-0") if i % 4 else "junk"
                try:
                    async with session.post(
                        url, data=body, headers={"Authorization": f"Bearer {token}"}
                    ) as resp:
                        await resp.read()
                        forged[resp.status] = forged.get(resp.status, 0) + 1
                except (aiohttp.ClientError, TimeoutError):
                    forged[0] = forged.get(0, 0) + 1

        async def pod_pusher(pod: str) -> None:
            token, body = pods[pod]
            while time.monotonic() < deadline:
                valid[pod]["sent"] += 1
                try:
                    async with session.post(
                        url, data=body, headers={"Authorization": f"Bearer {token}"}
                    ) as resp:
                        await resp.read()
                        if resp.status == 202:
                            valid[pod]["landed"] += 1
                        else:
                            other = valid[pod]["other"]
                            other[resp.status] = other.get(resp.status, 0) + 1
                except (aiohttp.ClientError, TimeoutError) as exc:
                    valid[pod]["other"][type(exc).__name__] = 1
                await asyncio.sleep(PUSH_EVERY)

        async def sampler() -> None:
            while time.monotonic() < deadline:
                rss.append(rss_mib(pid))
                await asyncio.sleep(1)

        started = time.monotonic()
        await asyncio.gather(
            *(forger(n) for n in range(FORGERS)), *(pod_pusher(p) for p in pods), sampler()
        )
        took = time.monotonic() - started
    return {"seconds": round(took, 1), "forged": forged, "valid": valid, "rss": rss}


def test_valid_pods_keep_landing_under_a_flood_of_forged_reports(
    kubectl: Kubectl, operator: Operator, ns: str
):
    kubectl.apply(make(ns, spec={"decode": {"replicas": 2}}), "--server-side")
    wait_ready(kubectl, ns)
    pods = {}
    for pod in ("tiny-decode-0", "tiny-decode-1"):
        body = decode_report(ns, "tiny", pod)
        assert wire.decode(body).pod == pod
        pods[pod] = (bound_token(kubectl, ns, pod), body)
    assert operator.proc is not None
    rss_start = rss_mib(operator.proc.pid)
    figures = asyncio.run(flood(operator, pods))
    answered = sum(v for k, v in figures["forged"].items() if k)
    rss_end = rss_mib(operator.proc.pid)
    say(
        f"flood {figures['seconds']}s: forged answered {answered / figures['seconds']:.0f}/s "
        f"{figures['forged']}; valid {figures['valid']}; operator RSS start {rss_start:.0f} MiB, "
        f"max {max(figures['rss']):.0f} MiB, end {rss_end:.0f} MiB"
    )
    assert figures["forged"].get(202, 0) == 0, "a forged report was accepted"
    assert figures["forged"].get(500, 0) == 0
    for pod, v in figures["valid"].items():
        assert v["landed"] >= 0.9 * v["sent"], (pod, v)
    # Caches and pools fill in the first half; after that the memory must stay flat.
    half = len(figures["rss"]) // 2
    first, second = max(figures["rss"][:half]), max(figures["rss"][half:])
    say(f"operator RSS max first half {first:.0f} MiB, second half {second:.0f} MiB")
    assert max(figures["rss"]) - rss_start < 100, "operator memory grew under the flood"
    assert second - first < 16, "operator memory still growing under the flood"
    # Both pods' rows are fresh in KVCacheStatus: the publisher kept running too.
    rows = wait_until(
        lambda: (
            len(
                r := (kubectl.get("kvcachestatus", "tiny", ns).get("status") or {}).get("pods")
                or []
            )
            == 2
            and r
        ),
        30,
        "two pod rows",
    )
    assert not any(row["stale"] for row in rows)
    assert "Traceback" not in operator.log()
