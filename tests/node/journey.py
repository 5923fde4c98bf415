"""The user's journey on real pods: e2e/run.sh on hack/node.sh's node, then turns from a
pod through the server's Service while its pods are replaced (tests/node/test_journey.py).
"""

from __future__ import annotations

import json
import subprocess
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.manifests import ROOT
from tests.node.cluster import NAMESPACE as CLIENT_NAMESPACE
from tests.node.cluster import NodeCluster

MANIFEST = ROOT / "e2e" / "manifests" / "tiny-cpu.yaml"
SERVER = "tiny-cpu"
NAMESPACE = "node-journey"
MODEL = "tiny-llama"
OPERATOR_NAMESPACE = "kvferry-system"
# The node tier links the engine venv here; the chart's hostPathPrefixes admits it.
VENV_LINK = Path("/run/kvferry-node-engine/venv")
SERVICE_URL = f"http://{SERVER}.{NAMESPACE}.svc:8000/v1/chat/completions"
PREFILL_ENGINE = f"http://{SERVER}-prefill-0.{SERVER}-prefill.{NAMESPACE}.svc:8200"
CLIENT = Path(__file__).with_name("journey_client.py")

_PROSE = (
    "river valley harbour lantern orchard meadow granite copper willow ember quarry "
    "summit glacier beacon thistle cobalt fennel saffron juniper basalt marble cedar"
)
WORDS = _PROSE.split()


def user_message(turn: int, words: int = 120) -> str:
    """A deterministic user message of ``words`` words, different for every turn."""
    picked = [WORDS[(turn * 7 + i * (turn + 3)) % len(WORDS)] for i in range(words)]
    return f"Turn {turn}: " + " ".join(picked) + "."


def chat_body(
    messages: list[dict[str, str]], max_tokens: int, stream: bool, session: str
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
        "session_id": session,
    }
    return body


@dataclass
class Answer:
    status: int
    text: str
    headers: dict[str, str] = field(default_factory=dict)
    chunks: int = 0
    retried: list[dict[str, Any]] = field(default_factory=list)
    cut: str | None = None

    @property
    def outcome(self) -> str | None:
        return self.headers.get("X-Kvferry-Outcome")

    @property
    def reused_tokens(self) -> int:
        return int(self.headers.get("X-Kvferry-Reused-Tokens", "0"))


def _exec_argv(nodes: NodeCluster, request: dict[str, Any]) -> list[str]:
    return [
        "kubectl",
        "--kubeconfig",
        str(nodes.kubeconfig),
        *("exec", "-n", CLIENT_NAMESPACE, "web", "-c", "web", "--"),
        *("python3", "-c", CLIENT.read_text(), json.dumps(request)),
    ]


class Turn:
    """A turn sent from the ``web`` pod (the base image's python3) through the Service."""

    def __init__(
        self,
        nodes: NodeCluster,
        body: dict[str, Any],
        url: str = SERVICE_URL,
        deadline_s: float = 300,
        timeout_s: float = 600,
    ) -> None:
        request = {
            "url": url,
            "body": body,
            "headers": {"X-Session-Id": body.get("session_id", "")},
            "deadline_s": deadline_s,
            # Per socket operation: a connect to a pod that is gone (no RST) waits this
            # long, not the kernel's two minutes of SYN retries.
            "timeout_s": timeout_s,
        }
        self.proc = subprocess.Popen(
            _exec_argv(nodes, request),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.first_byte = False

    def wait_first_byte(self) -> None:
        """Block until the first streamed content arrived (the turn is in flight)."""
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        event = json.loads(line) if line.strip() else {}
        assert event.get("event") == "first-byte", (
            f"expected the stream's first byte, got {line!r}; stderr: {self._stderr()}"
        )
        self.first_byte = True

    def running(self) -> bool:
        return self.proc.poll() is None

    def answer(self, timeout: float = 600) -> Answer:
        out, err = self.proc.communicate(timeout=timeout)
        lines = [json.loads(x) for x in out.splitlines() if x.strip()]
        done = [x for x in lines if x.get("event") == "done"]
        assert done, f"the client printed no answer (exit {self.proc.returncode}): {err[-3000:]}"
        d = done[-1]
        return Answer(d["status"], d["text"], d["headers"], d["chunks"], d["retried"], d.get("cut"))

    def _stderr(self) -> str:
        if self.proc.poll() is None:
            return "(running)"
        return self.proc.stderr.read()[-3000:] if self.proc.stderr else ""


def send(nodes: NodeCluster, body: dict[str, Any], **kwargs: Any) -> Answer:
    return Turn(nodes, body, **kwargs).answer()


def reference(nodes: NodeCluster, messages: list[dict[str, str]], max_tokens: int) -> str:
    """The same messages straight to P's engine: one engine, no sidecar, no KV transfer,
    and a fresh ``cache_salt`` so no cached block (P's own, or KV it pulled) is used:
    a full recompute."""
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "cache_salt": uuid.uuid4().hex,
    }
    answer = send(nodes, body, url=f"{PREFILL_ENGINE}/v1/chat/completions", deadline_s=120)
    assert answer.status == 200, f"reference from P's engine: {answer}"
    return answer.text


def engine_metric(nodes: NodeCluster, name: str, **labels: str) -> float | None:
    """A counter of P's engine /metrics (summed over series matching ``labels``;
    ``name`` as vLLM registers it, exposed with Prometheus' ``_total`` suffix); None
    while no such series exists (a labelled counter appears at its first count)."""
    code = (
        "import urllib.request;"
        f"print(urllib.request.urlopen('{PREFILL_ENGINE}/metrics', timeout=60).read().decode())"
    )
    text = nodes.kubectl.run(
        "exec", "-n", CLIENT_NAMESPACE, "web", "-c", "web", "--", "python3", "-c", code, timeout=120
    ).stdout
    total, found = 0.0, False
    for line in text.splitlines():
        if not line.startswith((f"{name}_total{{", f"{name}_total ")):
            continue
        series, value = line.rsplit(" ", 1)
        if all(f'{k}="{v}"' in series for k, v in labels.items()):
            total += float(value)
            found = True
    return total if found else None


def pods(nodes: NodeCluster, role: str) -> list[dict[str, Any]]:
    out = nodes.kubectl.json(
        "get",
        "pods",
        "-n",
        NAMESPACE,
        "-l",
        f"app.kubernetes.io/instance={SERVER},kvferry.io/role={role}",
    )
    return list(out["items"])


def container_status(pod: dict[str, Any], name: str) -> dict[str, Any]:
    status = pod["status"]
    for s in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or []):
        if s["name"] == name:
            return dict(s)
    raise AssertionError(f"pod {pod['metadata']['name']} has no container {name}: {status}")
