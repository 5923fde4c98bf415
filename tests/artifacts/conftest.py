"""The artifact tier: what ships, installed and run as a user gets it.

Built once per session: the kvferry wheel (``pip wheel`` of this tree, no test
extras), the build context the images use (hack/images.sh: that wheel plus every
dependency wheel, cached by the wheel's requirements), and one fresh virtual
environment per role with exactly what that role's image installs (the same pip
command, offline, from the same wheels). The cluster parts start the tier's own
control plane (tests/kube.py), which stops with the tier. Nothing here is skipped:
a tier that cannot run fails with the reason.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from kvferry_dev.fakeengines import FakeEngine
from kvferry_operator import api, render
from tests.artifacts.pods import Container, from_pod_spec
from tests.images import run
from tests.kube import kubeconfig, kubectl, ns, operator  # noqa: F401 - fixtures, package-scoped
from tests.manifests import server
from tests.progress import step

ROLES = ("operator", "sidecar")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/artifacts/" in str(item.fspath):
            item.add_marker(pytest.mark.artifacts)


@dataclass(frozen=True)
class RoleVenv:
    role: str
    path: Path

    def bin(self, name: str) -> str:
        return str(self.path / "bin" / name)

    def installed(self) -> set[str]:
        """Distribution names installed, normalized (lowercase, dashes)."""
        out = run([self.bin("python"), "-m", "pip", "list", "--format=freeze"]).stdout
        return {line.split("==")[0].lower().replace("_", "-") for line in out.split()}


def _role_venv(role: str, wheel: Path, ctx: Path, where: Path) -> RoleVenv:
    # The command images/<role>/Dockerfile runs, from the same wheels, offline. Without
    # compiling every module up front (the image does, for its read-only root): the
    # Kubernetes client alone is ~13k files, and this venv imports a fraction of them.
    with step(f"fresh venv with kvferry[{role}] from the wheel"):
        run([sys.executable, "-m", "venv", str(where)])
        run(
            [
                str(where / "bin" / "pip"),
                "install",
                "-q",
                "--no-compile",
                "--disable-pip-version-check",
                "--no-index",
                "--find-links",
                str(ctx / "wheels"),
                f"kvferry[{role}] @ {wheel.as_uri()}",
            ]
        )
    return RoleVenv(role, where)


@pytest.fixture(scope="session")
def operator_venv(
    wheel: Path, image_context: Path, tmp_path_factory: pytest.TempPathFactory
) -> RoleVenv:
    return _role_venv("operator", wheel, image_context, tmp_path_factory.mktemp("venv-operator"))


@pytest.fixture(scope="session")
def sidecar_venv(
    wheel: Path, image_context: Path, tmp_path_factory: pytest.TempPathFactory
) -> RoleVenv:
    return _role_venv("sidecar", wheel, image_context, tmp_path_factory.mktemp("venv-sidecar"))


@pytest.fixture(scope="session")
def role_venvs(operator_venv: RoleVenv, sidecar_venv: RoleVenv) -> dict[str, RoleVenv]:
    return {"operator": operator_venv, "sidecar": sidecar_venv}


# ------------------------------------------------------------------ fake engines


@dataclass
class FakeEngines:
    prefill: FakeEngine
    decode: FakeEngine


class _EngineThread:
    """The in-process fake vLLM engines (kvferry_dev/fakeengines.py) served on real
    ports by an event loop in a thread, for a sidecar in another process to call."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.runners: list[web.AppRunner] = []

    def start(self, engine: FakeEngine, host: str = "127.0.0.1") -> FakeEngine:
        async def serve() -> str:
            runner = web.AppRunner(engine.app())
            await runner.setup()
            site = web.TCPSite(runner, host, 0)
            await site.start()
            self.runners.append(runner)
            port = runner.addresses[0][1]
            return f"http://{host}:{port}"

        engine.url = asyncio.run_coroutine_threadsafe(serve(), self.loop).result(10)
        return engine

    def stop(self) -> None:
        async def cleanup() -> None:
            for runner in self.runners:
                await runner.cleanup()

        asyncio.run_coroutine_threadsafe(cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def fake_engines() -> Iterator[FakeEngines]:
    """A fake prefill and a fake decode engine (vLLM 0.33 shapes) on loopback ports."""
    served = _EngineThread()
    served.thread.start()
    try:
        yield FakeEngines(
            prefill=served.start(FakeEngine("prefill", "prefill-0")),
            decode=served.start(FakeEngine("decode", "decode-0")),
        )
    finally:
        served.stop()


# ------------------------------------------------------------------ the sidecar as rendered

SIDECAR_FIELDS = {
    "metadata.name": "tiny-decode-0",
    "metadata.namespace": "artifacts",
    "status.podIP": "127.0.0.1",
}


def rendered_sidecar(
    workdir: Path, engines: FakeEngines, port: int, internal_port: int
) -> Container:
    """The decode pod's sidecar container and its files as the operator renders them for
    the tiny server, pointed at the fake engines: the engine URL, the listen addresses
    (clients on ``port``, peers and the readiness detail on ``internal_port``) and the
    topology (cluster DNS names) are the only changes; the engine's KV-event socket
    is off (a fake engine publishes none), and a short prompt goes through prefill too
    (the whole P -> D path)."""
    objs = render.render(api.parse_server(server(name="tiny", namespace="artifacts")))
    (sts,) = [
        o for o in objs if o["kind"] == "StatefulSet" and o["metadata"]["name"].endswith("decode")
    ]
    (cm,) = [o for o in objs if o["kind"] == "ConfigMap"]
    pod_spec = sts["spec"]["template"]["spec"]
    (container,) = [c for c in pod_spec["initContainers"] if c["name"] == "kvferry-sidecar"]
    topology = {
        "version": 1,
        "prefillEngines": [engines.prefill.url],
        "decodeSidecars": [f"http://127.0.0.1:{internal_port}"],
    }

    def files(volume: dict[str, Any]) -> dict[str, bytes] | None:
        if "configMap" in volume:
            data = {**cm["data"], render.CONFIG_KEY_TOPOLOGY: json.dumps(topology)}
            return {k: v.encode() for k, v in data.items()}
        if "projected" in volume:
            return {"token": b"unused: no operatorUrl in these settings"}
        return None

    c = from_pod_spec(pod_spec, container, workdir, files, SIDECAR_FIELDS)
    return c.with_env(
        KVFERRY_ENGINE_URL=engines.decode.url,
        KVFERRY_LISTEN_HOST="127.0.0.1",
        KVFERRY_LISTEN_PORT=str(port),
        KVFERRY_INTERNAL_PORT=str(internal_port),
        KVFERRY_METRICS_PORT="0",  # 8002 as rendered would collide on this machine
        KVFERRY_KV_EVENTS="",
        KVFERRY_KV_EVENTS_REPLAY="",
        KVFERRY_SKIP_PREFILL_BELOW_TOKENS="0",
    )


def http(method: str, url: str, body: Any = None, timeout: float = 10) -> tuple[int, dict, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def wait_http_ready(url: str, proc: subprocess.Popen, log: Path, timeout: float = 60) -> dict:
    """/readyz answering 200; fail with the log as soon as the process exits."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"exited {proc.returncode} before ready:\n{log.read_text()[-4000:]}")
        try:
            status, _, body = http("GET", f"{url}/readyz", timeout=2)
            if status == 200:
                return json.loads(body)
            last = (status, body)
        except OSError as exc:
            last = exc
        time.sleep(0.3)
    pytest.fail(
        f"{url}/readyz not 200 after {timeout}s (last {last!r}):\n{log.read_text()[-4000:]}"
    )


def public_readyz_says_only_ready(url: str) -> None:
    """The client port's /readyz carries no engine detail (the internal port does)."""
    status, _, body = http("GET", f"{url}/readyz")
    assert (status, json.loads(body)) == (200, {"status": "ready"}), body


def serve_one_turn(url: str, engines: FakeEngines) -> None:
    """One chat turn through the sidecar: prefill on P, decode on D, the answer back."""
    status, _, body = http(
        "POST",
        f"{url}/v1/chat/completions",
        {"model": "tiny-llama", "messages": [{"role": "user", "content": "hello there"}]},
    )
    assert status == 200, body
    assert json.loads(body)["choices"][0]["message"]["content"] == engines.decode.reply
    assert len(engines.prefill.completions()) == 1
    (decoded,) = engines.decode.completions()
    # Decode got prefill's KV transfer parameters: the P -> D handoff happened.
    assert (decoded.body.get("kv_transfer_params") or {}).get("do_remote_prefill"), decoded.body
