"""End to end: a scripted multi-turn run on real vLLM P/D through the real decode
sidecar, whose residency reports reach the real operator (TokenReview-authenticated
with a token bound to the DisaggregatedServer's kwok decode pod) and show in
`kubectl get kv-cache-status` on the real API server.

The script's inter-turn gap is fixed (GAP_SECONDS), so GAP-P95 must land near it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from kvferry_dev.client import chat_body, filler_text
from kvferry_dev.configs import tiny_server_manifest
from kvferry_dev.engines import EnginePair
from kvferry_dev.procs import free_port
from kvferry_dev.sidecars import sidecar_files
from tests.cluster.test_reports import bound_token
from tests.kube import Kubectl, Operator, wait_until

pytestmark = [pytest.mark.engine, pytest.mark.cluster]

SESSIONS = 4
TURNS = 6  # -> 4 x 5 = 20 gaps, the tuner's minimum sample
GAP_SECONDS = 9.0  # inside the (5, 10] s bucket, away from its edges
SERVER = "tiny-llama"


def ask(url: str, body: dict) -> tuple[dict, dict[str, str]]:
    req = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
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


def test_multi_turn_run_shows_in_kubectl_get_kv_cache_status(
    kubectl: Kubectl, operator: Operator, ns: str, engine_pair: EnginePair, tmp_path: Path
):
    manifest = tiny_server_manifest(name=SERVER, skip_prefill_below_tokens=0)
    manifest["metadata"]["namespace"] = ns
    kubectl.apply(manifest, "--server-side")
    wait_until(lambda: kubectl.get("pod", f"{SERVER}-decode-0", ns), 60, "the decode pod")
    wait_until(
        lambda: (
            (kubectl.get("pod", f"{SERVER}-decode-0", ns) or {}).get("status", {}).get("phase")
            == "Running"
        ),
        60,
        "the decode pod Running",
    )

    # The sidecar runs with the settings the operator rendered for this server...
    cm = kubectl.get("configmap", f"{SERVER}-sidecar", ns)["data"]
    rendered = json.loads(cm["sidecar.json"])
    (tmp_path / "operator-ca.crt").write_text(cm["operator-ca.crt"])
    (tmp_path / "token").write_text(bound_token(kubectl, ns, f"{SERVER}-decode-0"))
    port = free_port()
    settings, topology = _files(engine_pair, port, rendered, tmp_path)
    (tmp_path / "sidecar.json").write_text(json.dumps(settings))
    (tmp_path / "topology.json").write_text(json.dumps(topology))
    # ...as the pod it stands in for (downward API values and the projected token).
    env = {
        **os.environ,
        "POD_NAME": f"{SERVER}-decode-0",
        "POD_NAMESPACE": ns,
        "KVFERRY_SERVER": SERVER,
        "KVFERRY_TOKEN_FILE": str(tmp_path / "token"),
    }
    log = open(tmp_path / "sidecar.log", "wb")  # noqa: SIM115 - the process owns it
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvferry_sidecar.cli",
            "--role",
            "decode",
            "--config",
            str(tmp_path / "sidecar.json"),
            "--topology",
            str(tmp_path / "topology.json"),
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        cwd="/",
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _ready(url), 60, "the sidecar ready")
        outcomes: list[str] = []
        errors: list[str] = []
        threads = [
            threading.Thread(target=conversation, args=(url, s, outcomes, errors))
            for s in range(SESSIONS)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=900)
        assert errors == []
        assert outcomes.count("reused") >= SESSIONS * (TURNS - 1) // 2, outcomes

        def figures() -> dict[str, str] | None:
            # Wait for the reports that carry every gap of the script, not just the first.
            status = kubectl.get("kvcachestatus", SERVER, ns).get("status") or {}
            gaps = ((status.get("retention") or {}).get("gapSeconds") or {}).get("count", 0)
            if gaps < SESSIONS * (TURNS - 1):
                return None
            lines = kubectl.run("get", "kv-cache-status", SERVER, "-n", ns).stdout.splitlines()
            return dict(zip(lines[0].split(), lines[1].split(), strict=False))

        row = wait_until(figures, 60, "figures in kubectl get kv-cache-status")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
        log.close()
        print((tmp_path / "sidecar.log").read_text()[-3000:])
    print(kubectl.run("get", "kv-cache-status", SERVER, "-n", ns).stdout)
    assert float(row["HIT-RATE"].rstrip("%")) > 0
    assert float(row["REUSED"].rstrip("%")) > 0
    gap_p95 = float(row["GAP-P95"].rstrip("s"))
    assert abs(gap_p95 - GAP_SECONDS) <= 0.2 * GAP_SECONDS, row
    recommended = float(row["RECOMMENDED"].rstrip("s"))
    assert recommended >= GAP_SECONDS, row  # covers 95% (all) of the script's gaps
    status = kubectl.get("kvcachestatus", SERVER, ns)["status"]
    assert status["retention"]["gapSeconds"]["count"] == SESSIONS * (TURNS - 1)


def _files(pair: EnginePair, port: int, rendered: dict, folder: Path) -> tuple[dict, dict]:
    from kvferry_operator.api import parse_server

    settings, topology = sidecar_files(parse_server(tiny_server_manifest(name=SERVER)), pair, port)
    # This machine's addresses stay; everything else is what the operator rendered.
    local = ("listenPort", "enginePort", "engineUrl", "kvEvents", "kvEventsReplay")
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
