"""Two operator replicas with leader election on the real API server, behind a
round-robin balancer (kwok routes no Services): the leader is killed in the middle
of report traffic and a rollout; the standby takes the Lease, the rollout finishes,
KVCacheStatus keeps moving, and no report is counted twice. A second server, Ready
before the kill and untouched after, costs the new leader no write (issue 23, item 3:
a takeover re-applies nothing that has landed)."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from pathlib import Path

import aiohttp

from kvferry_sidecar.push import Pusher
from kvferry_wire import report as wire
from tests.cluster.conftest import Kubectl, Operator, wait_until
from tests.cluster.test_operator import make, wait_ready
from tests.cluster.test_reports import EVIDENCE, bound_token
from tests.kube import audited_kubeconfig, audited_requests, wait_condition
from tests.roundrobin import RoundRobinThread

LEASE = "kvferry-failover"
# The chart's timings (client-go's): a killed leader's Lease is taken 15-17 s later.
TAKEOVER_BUDGET_S = 30.0


def holder(kubectl: Kubectl, ns: str) -> str:
    lease = kubectl.get("lease", LEASE, ns) or {}
    return (lease.get("spec") or {}).get("holderIdentity") or ""


def report(ns: str, pulls: int, preemptions: int, started: float) -> bytes:
    rep = wire.Report(
        version=wire.REPORT_VERSION,
        server="tiny",
        namespace=ns,
        pod="tiny-decode-0",
        role="decode",
        started_at=started,
        generated_at=time.time(),
        transport="TCPFallback",
        transport_reason=EVIDENCE,
        handles={"consumed": pulls},
        transfer=wire.Transfer(
            pulls=pulls, bytes=pulls * 10**8, seconds=pulls * 0.1, transfers=pulls
        ),
        engine=wire.Engine(preemptions=preemptions),
    )
    return wire.encode(rep)


class Sidecar:
    """The sidecar's own Pusher (the standby retry included), pushing the latest
    cumulative report every 1.5 s through the balancer, on a thread (its interval,
    5 s, only sets each push's timeout)."""

    def __init__(self, url: str, token_file: Path, ca: Path) -> None:
        self.body = b""
        self.pusher = Pusher(
            url, lambda: self.body, token_file=str(token_file), ca_file=str(ca), interval_s=5
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        async with aiohttp.ClientSession() as session:
            while not self._stop.is_set():
                if self.body:
                    await self.pusher.push_once(session)
                await asyncio.sleep(1.5)  # under the endpoint's 1 report/s per pod

    def __enter__(self) -> Sidecar:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(15)


def writes_to(server: str, ns: str, since: float) -> list:
    """The audited operator's writes to ``server`` or its children (every child's name
    is the server's or starts with ``<server>-``), received since ``since``."""
    return [
        r
        for r in audited_requests(since)
        if r.write and r.namespace == ns and (r.name == server or r.name.startswith(f"{server}-"))
    ]


def kvcs(kubectl: Kubectl, ns: str) -> dict:
    return (kubectl.get("kvcachestatus", "tiny", ns) or {}).get("status") or {}


def test_the_standby_takes_over_a_killed_leader_mid_rollout_and_report_traffic(
    kubectl: Kubectl, operator: Operator, kubeconfig: Path, ns: str, tmp_path: Path
):
    operator.stop()  # the tier's own operator would reconcile this namespace too
    replicas: list[Operator] = []
    try:
        with RoundRobinThread([]) as balancer:
            url = f"https://127.0.0.1:{balancer.port}/v1/reports"
            # op-b, the one that takes over, under the audited user: every request it
            # makes is in the API server's audit log (tests/cluster/test_quiet.py).
            audited = audited_kubeconfig(kubeconfig, tmp_path)
            for name in ("op-a", "op-b"):
                op = Operator(audited if name == "op-b" else kubeconfig, tmp_path / f"{name}.log")
                if replicas:  # one certificate for both, as the chart's Secret is
                    op.cert, op.key = replicas[0].cert, replicas[0].key
                op.report_url = url  # what the ConfigMaps carry: the Service's address
                op.args = ["--leader-elect", f"--namespace={ns}"]
                op.extra_env = {
                    "KVFERRY_LEADER_ELECTION_NAMESPACE": ns,
                    "KVFERRY_LEADER_ELECTION_ID": LEASE,
                    "KVFERRY_POD_NAME": name,
                }
                replicas.append(op)
            balancer.balancer.set_backends([("127.0.0.1", op.report_port) for op in replicas])
            a, b = replicas
            a.start()
            wait_until(lambda: holder(kubectl, ns).startswith("op-a_"), 60, "op-a leading")
            b_started = time.time()
            b.start()
            wait_until(lambda: "standby: lease" in b.log(), 60, "op-b waiting as a standby")

            kubectl.apply(make(ns), "--server-side")
            kubectl.apply(make(ns, "quiet"), "--server-side")  # untouched from here on
            wait_ready(kubectl, ns)
            wait_ready(kubectl, ns, "quiet")
            token_file = tmp_path / "token"
            token_file.write_text(bound_token(kubectl, ns, "tiny-decode-0"))
            with Sidecar(url, token_file, a.cert) as sidecar:
                # The fake sidecar started a minute ago: inside the pressure window, so
                # op-a, seeing its pod first, counts its 4 preemptions as recent.
                started = time.time() - 60
                sidecar.body = report(ns, pulls=9, preemptions=4, started=started)
                wait_until(
                    lambda: (
                        kvcs(kubectl, ns).get("retention", {}).get("decodePreemptionsRecent") == 4
                    ),
                    60,
                    "op-a publishing the report",
                )

                # A rollout, and the leader killed while it runs: of prefill, so that
                # the reporting decode pod (and its bound token) stays.
                kubectl.run(
                    "patch", "dserver", "tiny", "-n", ns, "--type=merge",
                    "-p", json.dumps({"spec": {"prefill": {"podLabels": {"rev": "2"}}}}),
                )  # fmt: skip
                generation = kubectl.get("dserver", "tiny", ns)["metadata"]["generation"]
                a.stop(signal.SIGKILL)
                killed = time.monotonic()
                sidecar.body = report(ns, pulls=12, preemptions=6, started=started)

                wait_until(
                    lambda: holder(kubectl, ns).startswith("op-b_"), 60, "op-b taking the lease"
                )
                took_over = time.monotonic() - killed
                seen: list = []

                def published_again() -> bool:
                    seen[:] = [kvcs(kubectl, ns).get("retention"), balancer.balancer.connections]
                    return (seen[0] or {}).get("decodePreemptionsRecent") == 6

                try:
                    wait_until(published_again, 60, "op-b publishing the reports after the kill")
                except AssertionError as exc:
                    raise AssertionError(f"{exc}; {seen}, {vars(sidecar.pusher)}") from None
                moving = time.monotonic() - killed
                pushes = sidecar.pusher
                print(
                    f"\nfailover: lease taken {took_over:.1f}s, KVCacheStatus moving "
                    f"{moving:.1f}s after the kill; pushes refused by the standby "
                    f"{pushes.standby_refusals}, failed {pushes.failures}"
                )
                assert took_over <= TAKEOVER_BUDGET_S and moving <= TAKEOVER_BUDGET_S

                # The rollout finishes under the new leader.
                wait_until(
                    lambda: (
                        kubectl.get("dserver", "tiny", ns)["status"].get("observedGeneration")
                        == generation
                    ),
                    120,
                    "the new generation observed",
                )
                wait_ready(kubectl, ns)
                sts = kubectl.get("statefulset", "tiny-prefill", ns)
                assert sts["spec"]["template"]["metadata"]["labels"]["rev"] == "2"
                wait_until(
                    lambda: (
                        (s := kubectl.get("statefulset", "tiny-prefill", ns)["status"]).get(
                            "updatedReplicas"
                        )
                        == s.get("replicas")
                    ),
                    120,
                    "prefill rolled",
                )
                wait_condition(kubectl, ns, "tiny", "Ready", status="True", timeout=120)

            # The untouched server cost the new leader no write: not from kopf's initial
            # listing (its generation had landed), nor from the child watches' (its
            # children hold our fields), nor from a safety pass (none is missing).
            wait_until(lambda: "safety pass done" in b.log(), 60, "op-b's first safety pass")
            assert writes_to("quiet", ns, b_started) == []
            assert writes_to("tiny", ns, b_started), "op-b's requests are not in the audit log"

            # Counted once: the cumulative figures as the last report carried them
            # (12 pulls, 1.2 GB in 1.2 s), the preemptions 4 then 6 as 6, not 10.
            status = kvcs(kubectl, ns)
            assert status["transfer"]["gigabytesPerSecond"] == 1.0
            assert status["retention"]["decodePreemptionsRecent"] == 6
            assert [p["name"] for p in status["pods"]] == ["tiny-decode-0"]
            # The standby said why it refused; the old leader's children were not
            # fought over (one field manager, one owner).
            assert "leading: lease" in b.log()
    finally:
        for op in replicas:
            op.stop()
        kubectl.run("delete", "lease", LEASE, "-n", ns, "--ignore-not-found", check=False)
        operator.start()
