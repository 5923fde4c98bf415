"""End to end: a scripted multi-turn run on real vLLM P/D through the real decode
sidecar, whose residency reports reach the real operator (TokenReview-authenticated
with a token bound to the DisaggregatedServer's kwok decode pod) and show in
`kubectl get kv-cache-status` on the real API server; a real Prometheus scrapes the
sidecar, both engines and the operator throughout, and every query of the shipped
Grafana dashboard is evaluated on what it collected.

The tests share one run (module fixtures) and go in order: the conversation and
its figures, then forced preemptions on decode (D restarted with a tiny KV cache,
then restored), then the Events, then the dashboard over the whole run.

The script's inter-turn gap is fixed (GAP_SECONDS), so GAP-P95 must land near it.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvferry_dev import dashboard
from kvferry_dev.client import chat_body, filler_text
from kvferry_dev.configs import tiny_server_manifest
from kvferry_dev.engines import EnginePair
from kvferry_dev.procs import EngineError, free_port
from kvferry_dev.prom import (
    Prometheus,
    check_queries,
    check_variables,
    pod_target,
    prometheus_binary,
)
from kvferry_dev.sidecars import sidecar_files, sidecar_running
from tests.cluster.test_reports import bound_token
from tests.kube import Kubectl, Operator, wait_for_event, wait_until

pytestmark = [pytest.mark.engine, pytest.mark.cluster]

SESSIONS = 4
TURNS = 6  # -> 4 x 5 = 20 gaps, the tuner's minimum sample
GAP_SECONDS = 9.0  # inside the (5, 10] s bucket, away from its edges
SERVER = "tiny-llama"
DECODE_POD = f"{SERVER}-decode-0"
PREFILL_POD = f"{SERVER}-prefill-0"
# Preemptions: D restarted with this many KV blocks of 32 tokens (vLLM needs room for
# one max-model-len request: 4096 / 32 = 128, plus its null block), then a burst of
# requests whose answers outgrow them: 6 x (~13 prompt + 16 answer blocks) > 136.
TINY_KV_BLOCKS = 136
BURST = 6
BURST_ANSWER_TOKENS = 500


def ask(url: str, body: dict) -> tuple[dict, dict[str, str]]:
    req = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=600) as resp:
        return json.loads(resp.read()), dict(resp.headers)


def conversation(url: str, session: int, outcomes: list[str], errors: list[str]) -> None:
    messages = [{"role": "user", "content": filler_text(f"s{session}", 300)}]
    try:
        for turn in range(TURNS):
            out, headers = ask(
                url, chat_body(messages, max_tokens=16, session_id=f"session-{session}")
            )
            outcomes.append(headers.get("X-Kvferry-Outcome", "?"))
            messages += [
                {"role": "assistant", "content": out["choices"][0]["message"]["content"]},
                {"role": "user", "content": filler_text(f"s{session}t{turn}", 60)},
            ]
            if turn < TURNS - 1:
                time.sleep(GAP_SECONDS)
    except Exception as exc:  # reported by the test, not lost in a thread
        errors.append(f"session {session}: {exc!r}")


def run_threads(target: Any, count: int, timeout: float) -> tuple[list[str], list[str]]:
    outcomes: list[str] = []
    errors: list[str] = []
    threads = [threading.Thread(target=target, args=(i, outcomes, errors)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    return outcomes, errors


def table(kubectl: Kubectl, ns: str, *args: str) -> dict[str, str]:
    lines = kubectl.run("get", "kv-cache-status", SERVER, "-n", ns, *args).stdout.splitlines()
    return dict(zip(lines[0].split(), lines[1].split(), strict=True))


# ---------------------------------------------------------------------- the shared run


@dataclass
class Run:
    ns: str
    url: str
    started: float
    log_dir: Path
    outcomes: list[str]
    errors: list[str]


@pytest.fixture(scope="module")
def namespace(kubectl: Kubectl) -> Iterator[str]:
    name = f"t-{uuid.uuid4().hex[:8]}"
    kubectl.run("create", "namespace", name)
    yield name
    kubectl.run("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = os.environ.get("KVFERRY_ENGINE_LOG_DIR")
    path = Path(d) / "kv-cache-status" if d else tmp_path_factory.mktemp("kv-cache-status")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="module")
def pods(kubectl: Kubectl, operator: Operator, namespace: str) -> dict[str, dict]:
    """The DisaggregatedServer on the API server, its kwok pods Running."""
    manifest = tiny_server_manifest(name=SERVER, skip_prefill_below_tokens=0)
    manifest["metadata"]["namespace"] = namespace
    # The pressure rule halves retention; the default minimum (30 s) is above half of
    # what this run's ~9 s gaps recommend, so allow less.
    manifest["spec"]["cacheTuning"] = {"minRetentionSeconds": 10}
    kubectl.apply(manifest, "--server-side")
    out = {}
    for pod in (DECODE_POD, PREFILL_POD):
        out[pod] = wait_until(
            lambda p=pod: (
                (obj := kubectl.get("pod", p, namespace))
                and obj.get("status", {}).get("phase") == "Running"
                and obj
            ),
            60,
            f"pod {pod} Running",
        )
    return out


@pytest.fixture(scope="module")
def prometheus(
    engine_pair: EnginePair,
    pods: dict[str, dict],
    namespace: str,
    operator: Operator,
    log_dir: Path,
    sidecar_port: int,
    internal_port: int,
) -> Iterator[Prometheus]:
    """Prometheus scraping the sidecar, both engines and the operator, labelled as the
    chart's PodMonitor labels them (its own relabelings, the pods' real labels)."""
    from tests.helm import one, template

    try:
        binary = prometheus_binary()
    except EngineError as exc:
        pytest.fail(f"no Prometheus for the dashboard test: {exc}", pytrace=False)
    monitor = one(template("podMonitor.enabled=true"), "PodMonitor", "kvferry-servers")
    relabelings = monitor["spec"]["podMetricsEndpoints"][0]["relabelings"]

    def target(address: str, pod: str, container: str):
        labels = pods[pod]["metadata"]["labels"]
        return pod_target(
            address, namespace=namespace, pod=pod, container=container, pod_labels=labels
        )

    prom = Prometheus(binary, log_dir / "prometheus")
    prom.folder.mkdir(parents=True, exist_ok=True)
    config = prom.write_config(
        [
            target(f"127.0.0.1:{internal_port}", DECODE_POD, "kvferry-sidecar"),
            target(f"127.0.0.1:{engine_pair.decode.port}", DECODE_POD, "engine"),
            target(f"127.0.0.1:{engine_pair.prefill.port}", PREFILL_POD, "engine"),
        ],
        relabelings,
        honor_labels_targets=[f"127.0.0.1:{operator.metrics_port}"],
    )
    try:
        prom.start(config)
    except EngineError as exc:
        pytest.fail(str(exc), pytrace=False)
    yield prom
    prom.stop()


@pytest.fixture(scope="module")
def sidecar_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def internal_port() -> int:
    """The sidecar's internal port: /metrics and /v1/residency (Prometheus scrapes it)."""
    return free_port()


@pytest.fixture(scope="module")
def run(
    kubectl: Kubectl,
    namespace: str,
    pods: dict[str, dict],
    engine_pair: EnginePair,
    log_dir: Path,
    sidecar_port: int,
    internal_port: int,
    prometheus: Prometheus,
) -> Iterator[Run]:
    """The decode sidecar as the pod it stands in for, and the scripted conversation."""
    cm = kubectl.get("configmap", f"{SERVER}-sidecar", namespace)["data"]
    rendered = json.loads(cm["sidecar.json"])
    (log_dir / "operator-ca.crt").write_text(cm["operator-ca.crt"])
    (log_dir / "token").write_text(bound_token(kubectl, namespace, DECODE_POD))
    settings, topology = _files(engine_pair, sidecar_port, internal_port, rendered, log_dir)
    (log_dir / "sidecar.json").write_text(json.dumps(settings))
    (log_dir / "topology.json").write_text(json.dumps(topology))
    env = {
        **os.environ,
        "POD_NAME": DECODE_POD,
        "POD_NAMESPACE": namespace,
        "KVFERRY_SERVER": SERVER,
        "KVFERRY_TOKEN_FILE": str(log_dir / "token"),
    }
    url = f"http://127.0.0.1:{sidecar_port}"
    try:
        with sidecar_running(
            log_dir / "sidecar.json",
            log_dir / "sidecar.log",
            env,
            topology=log_dir / "topology.json",
            stop_timeout=30,
        ):
            wait_until(lambda: _ready(url), 60, "the sidecar ready")
            prometheus.wait_for_targets_up(4)
            started = time.time()
            outcomes, errors = run_threads(
                lambda s, o, e: conversation(url, s, o, e), SESSIONS, timeout=900
            )
            yield Run(namespace, url, started, log_dir, outcomes, errors)
    finally:
        print((log_dir / "sidecar.log").read_text()[-3000:])


def _files(
    pair: EnginePair, port: int, internal: int, rendered: dict, folder: Path
) -> tuple[dict, dict]:
    from kvferry_operator.api import parse_server

    server = parse_server(tiny_server_manifest(name=SERVER))
    settings, topology = sidecar_files(server, pair, port, internal_port=internal)
    # This machine's addresses stay; everything else is what the operator rendered.
    local = (
        "listenPort",
        "internalPort",
        "metricsPort",
        "enginePort",
        "engineUrl",
        "kvEvents",
        "kvEventsReplay",
        "diagnosticHeaders",  # the scripted conversation reads the outcomes
    )
    settings.update({k: v for k, v in rendered.items() if k not in local})
    settings.update(
        listenPort=port,
        engineUrl=pair.decode.url,
        operatorCaFile=str(folder / "operator-ca.crt"),
        reportIntervalSeconds=2,
    )
    return settings, topology


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/readyz", timeout=5) as resp:
            return resp.status == 200
    except OSError:
        return False


# ---------------------------------------------------------------------- tests, in order


def test_multi_turn_run_shows_in_kubectl_get_kv_cache_status(kubectl: Kubectl, run: Run):
    ns = run.ns
    assert run.errors == []
    assert run.outcomes.count("reused") >= SESSIONS * (TURNS - 1) // 2, run.outcomes

    def figures() -> dict[str, str] | None:
        # Wait for the reports that carry every gap of the script, not just the first.
        status = kubectl.get("kvcachestatus", SERVER, ns).get("status") or {}
        gaps = ((status.get("retention") or {}).get("gapSeconds") or {}).get("count", 0)
        return table(kubectl, ns) if gaps >= SESSIONS * (TURNS - 1) else None

    row = wait_until(figures, 60, "figures in kubectl get kv-cache-status")
    print(kubectl.run("get", "kv-cache-status", SERVER, "-n", ns, "-o", "wide").stdout)
    assert float(row["HIT-RATE"].rstrip("%")) > 0
    assert float(row["REUSED"].rstrip("%")) > 0
    gap_p95 = float(row["GAP-P95"].rstrip("s"))
    assert abs(gap_p95 - GAP_SECONDS) <= 0.2 * GAP_SECONDS, row
    recommended = float(row["RECOMMENDED"].rstrip("s"))
    assert recommended >= GAP_SECONDS, row  # covers 95% (all) of the script's gaps
    status = kubectl.get("kvcachestatus", SERVER, ns)["status"]
    assert status["retention"]["gapSeconds"]["count"] == SESSIONS * (TURNS - 1)

    # Transport: NIXL over UCX tcp on loopback (UCX_TLS=tcp,self, no RDMA device here),
    # with the bandwidth measured from the decode engine's own NIXL transfers. TCP, not
    # TCPFallback: RDMA was not asked for (a CPU server, where network.transport auto is tcp).
    transport = re.fullmatch(r"TCP@(\d+\.\d\d)GB/s", row["TRANSPORT"])
    assert transport, row
    assert float(transport.group(1)) > 0
    transfer = status["transfer"]
    assert transfer["transfers"] > 0 and transfer["bytes"] > 0, transfer
    assert "UCX_TLS=tcp,self" in transfer["transportReason"], transfer
    wide = table(kubectl, ns, "-o", "wide")
    assert wide["GB/S"] == f"{transport.group(1)}GB/s"
    assert re.fullmatch(r"\d+%", wide["EXPIRED"]), wide
    assert re.fullmatch(r"\d+/[\d.]+(B|KiB|MiB|GiB)", wide["PINNED"]), wide
    server = kubectl.get("dserver", SERVER, ns)["status"]
    assert server["transport"] == "TCP"
    (cond,) = [c for c in server["conditions"] if c["type"] == "KVTransport"]
    # Nothing asked for RDMA: reported, not a warning.
    assert (cond["status"], cond["reason"]) == ("True", "TCP")
    assert "UCX_TLS=tcp,self" in cond["message"]


def test_preemptions_on_decode_lower_the_recommendation(
    kubectl: Kubectl, run: Run, engine_pair: EnginePair
):
    ns = run.ns
    before = kubectl.get("dserver", SERVER, ns)["status"]["retention"]["recommended"]
    decode = engine_pair.decode
    normal_args = list(decode.extra_args)
    t0 = time.monotonic()
    decode.restart(extra_args=[*normal_args, "--num-gpu-blocks-override", str(TINY_KV_BLOCKS)])
    restart_s = time.monotonic() - t0
    try:
        wait_until(lambda: _ready(run.url), 60, "the sidecar ready again")

        def burst(i: int, outcomes: list[str], errors: list[str]) -> None:
            body = chat_body(
                [{"role": "user", "content": filler_text(f"burst{i}", 380)}],
                max_tokens=BURST_ANSWER_TOKENS,
                session_id=f"burst-{i}",
            )
            try:
                _, headers = ask(run.url, body)
                outcomes.append(headers.get("X-Kvferry-Outcome", "?"))
            except Exception as exc:
                errors.append(f"burst {i}: {exc!r}")

        t1 = time.monotonic()
        _, errors = run_threads(burst, BURST, timeout=900)
        burst_s = time.monotonic() - t1
        assert errors == []
        assert decode.metrics().total("vllm:num_preemptions") > 0, "no preemption on decode"

        def preempted(reason: str) -> bool:
            pressure = re.search(r"preemptions \+(\d+)", reason)
            return pressure is not None and int(pressure.group(1)) > 0

        # The KV usage (past 90 %) often lowers it a pass before the preemptions' report
        # lands: the reason names them from the next pass on (they stay in the window).
        lowered = wait_until(
            lambda: (
                (r := kubectl.get("dserver", SERVER, ns)["status"]["retention"])["recommended"]
                < before
                and preempted(r["reason"])
                and r
            ),
            60,
            f"a recommendation below {before}s that names decode's preemptions",
        )
        kvcs = kubectl.get("kvcachestatus", SERVER, ns)["status"]
        assert kvcs["retention"]["decodePreemptionsRecent"] > 0
        print(
            f"decode restart (tiny KV) {restart_s:.0f}s, burst {burst_s:.0f}s: "
            f"{before}s -> {lowered['recommended']}s ({lowered['reason']})"
        )
    finally:
        t2 = time.monotonic()
        decode.restart(extra_args=normal_args)
        print(f"decode restored in {time.monotonic() - t2:.0f}s")


def test_describe_dserver_shows_recommendations_with_inputs(kubectl: Kubectl, run: Run):
    events = wait_for_event(kubectl, run.ns, SERVER, "RetentionRecommended")
    messages = [e["message"] for e in events]
    assert any("gapSamples=20" in m for m in messages), messages
    # An Event per new value: the lowered one names the pressure and its inputs. (A
    # cache full enough to preempt is also past the 90% usage mark, which the tuner
    # often sees first; the reason in status then names the preemptions too, above.)
    lowered = [m for m in messages if "under KV pressure" in m]
    assert lowered, messages
    assert re.search(r"decodeKVUsageMax=[\d.]+, preemptionsDelta=\d+", lowered[-1]), lowered
    described = kubectl.run("describe", "dserver", SERVER, "-n", run.ns).stdout
    assert "RetentionRecommended" in described and "(inputs: " in described


def test_every_dashboard_query_has_data_from_the_run(run: Run, prometheus: Prometheus):
    # The panels' rate windows need a few scrapes after the last event.
    time.sleep(3 * 2)
    shipped = json.loads(dashboard.OUT.read_text())
    queries = dashboard.panel_queries(shipped)
    assert len(queries) >= 25
    end = time.time()
    problems = check_queries(prometheus, queries, run.started, end)
    problems += check_variables(prometheus, dashboard.VARIABLES)
    assert problems == [], "\n".join(problems)
    dump = os.environ.get("KVFERRY_DASHBOARD_DUMP")
    if dump:  # data for the README's picture (hack/dashboard_png.py)
        out = {
            "start": run.started,
            "end": end,
            "panels": [
                {
                    "title": title,
                    "expr": expr,
                    "result": prometheus.query_range(_concrete(expr), run.started, end)[1]["data"][
                        "result"
                    ],
                }
                for title, expr in queries
            ],
        }
        Path(dump).write_text(json.dumps(out))


def _concrete(expr: str) -> str:
    from kvferry_dev.prom import DEFAULT_SUBSTITUTIONS, substitute

    return substitute(expr, DEFAULT_SUBSTITUTIONS)


def test_the_dashboard_check_fails_on_a_series_nobody_exports(run: Run, prometheus: Prometheus):
    """The check above can fail: a panel naming a series no target exports, and one
    whose PromQL does not parse, are both reported."""
    bogus = [
        ("nobody exports this", 'sum(rate(kvferry_no_such_series_total{pod=~"$pod"}[1m]))'),
        ("does not parse", "sum by (pod (kvferry_pinned_bytes)"),
        ("exported", 'max(kvferry_engine_ready{pod=~"$pod"})'),
    ]
    problems = check_queries(prometheus, bogus, run.started, time.time())
    assert [p.split(":")[0] for p in problems] == ["nobody exports this", "does not parse"]
    assert "no data from the run" in problems[0] and "bad_data" in problems[1]
