"""Residency reports on a real API server: TokenReview-authenticated pushes from
pods' bound tokens, refusals, and `kubectl get kv-cache-status` showing the figures."""

from __future__ import annotations

import json
import re
import ssl
import time
import urllib.error
import urllib.request

from kvferry_operator import api
from kvferry_sidecar.promtext import Scrape
from kvferry_wire import report as wire
from tests.cluster.conftest import Kubectl, Operator, wait_until
from tests.cluster.test_operator import make, wait_ready
from tests.kube import condition, wait_condition, wait_for_event

GAPS = [30.0] * 40 + [50.0] * 10  # p95 interpolates inside (45, 60]


def bound_token(kubectl: Kubectl, ns: str, pod: str) -> str:
    """What the kubelet projects into the pod: a token bound to it, audience kvferry."""
    uid = kubectl.get("pod", pod, ns)["metadata"]["uid"]
    return kubectl.run(
        "create",
        "token",
        "default",
        "-n",
        ns,
        "--audience",
        "kvferry",
        "--bound-object-kind",
        "Pod",
        "--bound-object-name",
        pod,
        "--bound-object-uid",
        uid,
    ).stdout.strip()


EVIDENCE = "TCP: no RDMA device in the pod (/sys/class/infiniband is empty); UCX_TLS=tcp,self"


STARTED = time.time() - 60


def decode_report(
    ns: str,
    server: str,
    pod: str,
    preemptions: int = 0,
    started_at: float = STARTED,
    kv_usage: float | None = None,
    unreleasable: int = 0,
) -> bytes:
    rep = wire.Report(
        version=wire.REPORT_VERSION,
        server=server,
        namespace=ns,
        pod=pod,
        role="decode",
        started_at=started_at,
        generated_at=time.time(),
        transport="TCPFallback",
        transport_reason=EVIDENCE,
        handles={"consumed": 9, "expired": 1},
        pinned=wire.Pinned(
            handles=2 + unreleasable,
            blocks=40,
            bytes=3 * 2**20,
            unused_handles=unreleasable,
            unreleasable_handles=unreleasable,
        ),
        transfer=wire.Transfer(pulls=9, bytes=2_400_000_000, seconds=2.0, transfers=30),
        engine=wire.Engine(preemptions=preemptions, kv_usage=kv_usage),
    )
    rep.by_turn = {"1": wire.TurnBucket(10, 0, 5000, 0), "2": wire.TurnBucket(10, 9, 6000, 5100)}
    rep.outcomes = {"no-handle": 10, "reused": 9, "expired": 1}
    for g in GAPS:
        rep.gaps.observe(g)
    for _ in range(9):
        rep.ttft_reused.observe(0.3)
    for _ in range(11):
        rep.ttft_recomputed.observe(2.0)
    return wire.encode(rep)


def push(operator: Operator, body: bytes, token: str) -> tuple[int, dict]:
    ctx = ssl.create_default_context(cafile=str(operator.cert))
    req = urllib.request.Request(
        operator.report_url,
        data=body,
        method="POST",
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_reports_reach_kv_cache_status(kubectl: Kubectl, operator: Operator, ns: str):
    kubectl.apply(make(ns), "--server-side")
    wait_ready(kubectl, ns)
    token = bound_token(kubectl, ns, "tiny-decode-0")
    assert push(operator, decode_report(ns, "tiny", "tiny-decode-0"), token) == (
        202,
        {"accepted": True},
    )

    def shown() -> list[str] | None:
        out = kubectl.run("get", "kv-cache-status", "tiny", "-n", ns).stdout.splitlines()
        row = out[1].split()
        return row if row[1] != "-" else None

    row = wait_until(shown, 30, "figures in kubectl get kv-cache-status")
    header = kubectl.run("get", "kvcs", "-n", ns).stdout.splitlines()[0].split()
    figures = dict(zip(header, row, strict=False))
    assert figures["HIT-RATE"] == "90%"
    assert figures["REUSED"] == "85%"
    gap = float(figures["GAP-P95"].rstrip("s"))
    assert 45 <= gap <= 60  # the script's gaps: 40 x 30 s, 10 x 50 s
    assert figures["RETENTION"] == "480s"
    recommended = float(figures["RECOMMENDED"].rstrip("s"))
    assert recommended >= gap  # covers the configured coverage
    assert figures["TRANSPORT"] == "TCPFallback@1.20GB/s"
    wide = kubectl.run("get", "kvcs", "tiny", "-n", ns, "-o", "wide").stdout.splitlines()
    wide_figures = dict(zip(wide[0].split(), wide[1].split(), strict=True))
    assert (wide_figures["GB/S"], wide_figures["EXPIRED"], wide_figures["PINNED"]) == (
        "1.20GB/s",
        "10%",
        "2/3.0MiB",
    )
    # Every field the operator wrote came back from the API server (nothing pruned).
    kvcs = kubectl.get("kvcachestatus", "tiny", ns)["status"]
    assert kvcs["phase"] == "Reporting"
    assert kvcs["retention"]["reason"].startswith("p95 of 50 inter-turn gaps")
    assert (kvcs["retention"]["expiredShare"], kvcs["retention"]["pinnedBytes"]) == ("10%", 3 << 20)
    assert kvcs["retention"]["decodePreemptionsRecent"] == 0
    assert kvcs["transfer"]["transportReason"] == f"tiny-decode-0: {EVIDENCE}"
    assert (kvcs["transfer"]["gigabytesPerSecond"], kvcs["transfer"]["transfers"]) == (1.2, 30)
    assert kvcs["transfer"]["meanTransferSeconds"] == 0.0667
    assert [(p["name"], p["gigabytesPerSecond"], p["preemptions"]) for p in kvcs["pods"]] == [
        ("tiny-decode-0", 1.2, 0)
    ]
    server = kubectl.get("dserver", "tiny", ns)["status"]
    assert server["retention"]["recommended"] == int(recommended)
    assert (server["transport"], server["transportReason"]) == (
        "TCPFallback",
        f"tiny-decode-0: {EVIDENCE}",
    )
    (event,) = wait_for_event(kubectl, ns, "tiny", "RetentionRecommended")
    assert "gapSamples=50" in event["message"] and "preemptionsDelta=0" in event["message"]
    # No RDMA asked for: the fallback is reported, not warned about.
    cond = wait_condition(kubectl, ns, "tiny", "KVTransport", "TCPFallback", timeout=30)
    assert (cond["status"], cond["message"]) == ("True", f"tiny-decode-0: {EVIDENCE}")

    # Decode starts preempting: the next report's counter rose, the recommendation drops.
    assert (
        push(operator, decode_report(ns, "tiny", "tiny-decode-0", preemptions=4), token)[0] == 202
    )
    lowered = wait_until(
        lambda: (
            (r := kubectl.get("dserver", "tiny", ns)["status"]["retention"])["recommended"]
            < recommended
            and r
        ),
        30,
        "a lower recommendation",
    )
    assert "preemptions +4" in lowered["reason"]
    events = wait_until(
        lambda: len(e := wait_for_event(kubectl, ns, "tiny", "RetentionRecommended")) == 2 and e,
        30,
        "a second RetentionRecommended event",
    )
    assert any("preemptionsDelta=4" in e["message"] for e in events)
    kvcs = kubectl.get("kvcachestatus", "tiny", ns)["status"]
    assert kvcs["retention"]["decodePreemptionsRecent"] == 4

    # The operator's /metrics carry the same decision (the dashboard's history panel).
    with urllib.request.urlopen(operator.metrics_url, timeout=10) as resp:
        scraped = Scrape(resp.read().decode())
    labels = {"namespace": ns, "server": "tiny"}
    assert (
        scraped.total("kvferry_operator_retention_recommended_seconds", **labels)
        == (lowered["recommended"])
    )
    assert scraped.total("kvferry_operator_retention_applied_seconds", **labels) == 480
    assert scraped.total("kvferry_operator_decode_preemptions_recent", **labels) == 4
    assert scraped.total("kvferry_operator_transport_info", transport="TCPFallback", **labels) == 1


def test_a_restarted_operator_still_counts_the_recent_preemptions(
    kubectl: Kubectl, operator: Operator, ns: str
):
    """A decode sidecar started 20 minutes ago preempts 2 requests (4, then 6); the
    operator restarts with empty memory and the pod reports 6 again: the 2 are still
    recent (the window was seeded from KVCacheStatus, written and read back through the
    API server, which prunes any field its schema does not declare)."""
    kubectl.apply(make(ns), "--server-side")
    wait_ready(kubectl, ns)
    token = bound_token(kubectl, ns, "tiny-decode-0")
    started = time.time() - 1200

    def report(preemptions: int) -> bytes:
        return decode_report(ns, "tiny", "tiny-decode-0", preemptions, started, kv_usage=0.5)

    def kvcs() -> dict:
        return kubectl.get("kvcachestatus", "tiny", ns)["status"]

    def row() -> dict:
        return next(iter(kvcs().get("pods") or []), {})

    assert push(operator, report(4), token)[0] == 202
    wait_until(lambda: row().get("preemptions") == 4, 30, "the pod's row with 4 preemptions")
    assert push(operator, report(6), token)[0] == 202
    before = wait_until(
        lambda: (k := kvcs())["retention"]["decodePreemptionsRecent"] == 2 and k,
        30,
        "2 recent preemptions",
    )
    # The fields a new leader seeds from, as the API server stored them.
    (pod,) = before["pods"]
    assert (pod["startedAt"], pod["preemptions"]) == (api.iso_time(started), 6)
    (rise,) = before["pressure"]["preemptions"]
    assert rise["count"] == 2 and -1 <= time.time() - api.parse_time(rise["time"]) < 60
    assert {u["kvUsage"] for u in before["pressure"]["kvUsage"]} == {0.5}

    operator.stop()
    operator.start()

    def pushed() -> bool:
        try:
            return push(operator, report(6), token)[0] == 202
        except (urllib.error.URLError, ConnectionError):
            return False  # not listening yet

    wait_until(pushed, 60, "the restarted operator accepting the report")
    # Its first write: the row shows the report it received, not the one before.
    after = wait_until(
        lambda: (k := kvcs())["pods"][0]["lastReport"] > pod["lastReport"] and k,
        60,
        "KVCacheStatus written by the restarted operator",
    )
    assert after["retention"]["decodePreemptionsRecent"] == 2
    assert after["retention"]["inputs"]["preemptionsDelta"] == 2
    assert after["pressure"]["preemptions"] == before["pressure"]["preemptions"]
    assert "under KV pressure" in after["retention"]["reason"]


def kv_transport_false(kubectl: Kubectl, ns: str) -> dict:
    """The KVTransport condition of server tiny once it is False (it stays so)."""
    return wait_until(
        lambda: (c := condition(kubectl, ns, "tiny", "KVTransport")).get("status") == "False" and c,
        30,
        "KVTransport=False",
    )


def test_tcp_when_rdma_was_asked_for_is_a_warning(kubectl: Kubectl, operator: Operator, ns: str):
    rdma = {
        "network": {
            "transport": "rdma",
            "rdma": {"enabled": True, "resourceName": "rdma/hca_shared_devices_a"},
        }
    }
    kubectl.apply(make(ns, spec=rdma), "--server-side")
    wait_ready(kubectl, ns)
    token = bound_token(kubectl, ns, "tiny-decode-0")
    assert push(operator, decode_report(ns, "tiny", "tiny-decode-0"), token)[0] == 202
    cond = kv_transport_false(kubectl, ns)
    assert cond["reason"] == "TCPFallback"
    assert "network.transport: rdma asks for RDMA, but KV moves over TCP" in cond["message"]
    (event,) = wait_for_event(kubectl, ns, "tiny", "TCPFallback")
    assert event["type"] == "Warning" and EVIDENCE in event["message"]
    described = kubectl.run("describe", "dserver", "tiny", "-n", ns).stdout
    assert re.search(r"Warning\s+TCPFallback", described), described


def test_kv_reads_that_all_fail_are_no_transport_and_a_warning(
    kubectl: Kubectl, operator: Operator, ns: str
):
    """The sidecars see RDMA (the shared device plugin shows every pod the node's
    HCAs), yet every NIXL transfer fails: status says NoTransport, with a Warning."""
    kubectl.apply(make(ns), "--server-side")
    wait_ready(kubectl, ns)
    token = bound_token(kubectl, ns, "tiny-decode-0")
    rep = wire.Report(
        version=wire.REPORT_VERSION,
        server="tiny",
        namespace=ns,
        pod="tiny-decode-0",
        role="decode",
        started_at=STARTED,
        generated_at=time.time(),
        transport="RDMA",
        transport_reason="RDMA device(s) mlx5_0 active and UCX_TLS=unset allows RDMA",
        outcomes={"no-handle": 4, "pull-failed": 4},
        engine=wire.Engine(nixl_failed=4),
    )
    assert push(operator, wire.encode(rep), token)[0] == 202
    cond = kv_transport_false(kubectl, ns)
    assert cond["reason"] == "NoTransport"
    assert "4 KV transfers between the pods failed and none succeeded" in cond["message"]
    server = kubectl.get("dserver", "tiny", ns)["status"]
    assert server["transport"] == "NoTransport"
    (event,) = wait_for_event(kubectl, ns, "tiny", "NoTransport")
    assert event["type"] == "Warning" and "mlx5_0" in event["message"]


def test_forged_and_foreign_reports_are_refused(kubectl: Kubectl, operator: Operator, ns: str):
    kubectl.apply(make(ns), "--server-side")
    kubectl.apply(make(ns, name="other"), "--server-side")
    wait_ready(kubectl, ns)
    wait_ready(kubectl, ns, "other")
    body = decode_report(ns, "tiny", "tiny-decode-0")
    status, out = push(operator, body, "forged." + "x" * 40)
    assert status == 401, out
    # A real token, but of a pod of another server.
    other = bound_token(kubectl, ns, "other-decode-0")
    status, out = push(operator, decode_report(ns, "tiny", "other-decode-0"), other)
    assert status == 403 and "belongs to server 'other'" in out["error"]
    # A token of the wrong audience (the default API audience).
    uid = kubectl.get("pod", "tiny-decode-0", ns)["metadata"]["uid"]
    wrong = kubectl.run(
        "create",
        "token",
        "default",
        "-n",
        ns,
        "--bound-object-kind",
        "Pod",
        "--bound-object-name",
        "tiny-decode-0",
        "--bound-object-uid",
        uid,
    ).stdout.strip()
    status, out = push(operator, body, wrong)
    assert status == 401, out
    time.sleep(2)  # longer than the publish period: nothing may have landed
    assert kubectl.get("kvcachestatus", "tiny", ns)["status"]["phase"] == "NoReports"
