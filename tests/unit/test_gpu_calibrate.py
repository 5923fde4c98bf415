"""bench/gpu_calibrate.py (GPU prices for the eviction simulator) run as a test can run
it: ``--device cpu --quick`` in the engine venv's Python (torch is not in the test
venv), its JSON then read here as ``bench.eviction --costs`` and ``kvferry-operator
what-if --status`` read it. The quick figures test the script; they are not prices.

The engine venv comes from hack/engine-env.sh (CI builds it first; here it is built on
first use or waited for). If it cannot be had the test FAILS with the reason, as the
engine tier's do (tests/engine/conftest.py); it is never skipped."""

from __future__ import annotations

import json
import os
import subprocess
from argparse import Namespace
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

from bench import eviction as ev
from bench import gpu_calibrate as gc
from kvferry_dev.engines import engine_env
from kvferry_dev.procs import EngineError
from kvferry_operator.cli import whatif_costs

# 2 x layers x KV heads x head dim x 2 bytes (bf16), by hand.
KV_8B = 2 * 32 * 8 * 128 * 2
KV_70B_TP8 = 2 * 80 * 1 * 128 * 2  # one rank: 8 KV heads / 8
KV_MOE = 2 * 48 * 4 * 128 * 2


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        python = engine_env()
    except EngineError as e:
        pytest.fail(f"engine venv (hack/engine-env.sh) is unusable: {e}", pytrace=False)
    out = tmp_path_factory.mktemp("gpu-calibrate") / "gpu-calibrate.json"
    res = subprocess.run(
        [str(python), "-m", "bench.gpu_calibrate", *("--device", "cpu", "--quick", "--out", out)],
        cwd=out.parent,
        env={**os.environ, "PYTHONPATH": str(gc.ROOT)},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert res.returncode == 0, f"bench.gpu_calibrate failed:\n{res.stdout}\n{res.stderr}"
    assert "QUICK: for testing the script, not prices" in res.stdout
    return out


def _data(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def test_the_eviction_simulator_reads_its_calibration(calibrated: Path) -> None:
    recompute, pull = ev.costs_from(calibrated)
    assert recompute > pull > 0
    cal = _data(calibrated)["results"]["calibration"]
    assert (cal["model"], cal["bytesPerToken"], cal["blockTokens"]) == ("8b", KV_8B, 16)
    assert cal["pullSecondsPerToken"] == pytest.approx(KV_8B / cal["pullBytesPerSecond"])


def test_kv_bytes_are_the_formula_of_the_real_shapes(calibrated: Path) -> None:
    shapes = _data(calibrated)["results"]["shapes"]
    assert shapes["8b"]["bytesPerToken"] == KV_8B == 131072
    assert shapes["70b-tp8"]["bytesPerToken"] == KV_70B_TP8 == 40960
    assert shapes["moe"]["bytesPerToken"] == KV_MOE
    for s in shapes.values():
        assert s["blockTokens"] == 16
        # --quick times a narrower layer but keeps the real shape's layers and KV.
        assert s["timedShape"]["layers"] == s["shape"]["layers"]
        assert s["timedShape"]["hidden"] == s["shape"]["hidden"] // gc.QUICK_SCALE


def test_every_fit_grows_with_the_prompt(calibrated: Path) -> None:
    data = _data(calibrated)
    for name, s in data["results"]["shapes"].items():
        tokens, seconds = s["promptTokens"], s["prefillSeconds"]
        assert tokens == sorted(tokens) and len(tokens) == 3
        assert all(b > a > 0 for a, b in pairwise(seconds)), (name, seconds)
        fit = s["fit"]
        assert fit["secondsPerToken"] > 0, name
        assert s["recomputeSecondsPerToken"] == fit["secondsPerToken"]
        assert fit["worstRelativeResidual"] >= 0
        assert s["pullSecondsPerToken"] > 0
        assert s["layerSeconds"][0] * s["shape"]["layers"] == pytest.approx(seconds[0])
    assert data["results"]["shapes"]["moe"]["moeKernel"] in ("grouped_mm", "loop")


def test_it_says_what_it_ran_on_and_that_quick_is_no_price(calibrated: Path) -> None:
    data = _data(calibrated)
    r = data["results"]
    assert r["quick"] is True and "NOT prices" in r["note"]
    assert "(CPU)" in r["device"] and r["torch"] == data["versions"]["torch"]
    assert data["settings"]["device"] == "cpu" and data["settings"]["quickScale"] == 8
    assert set(r["bandwidthBytesPerSecond"]) == {"hbmToHbm", "hbmToHost", "hostToHbm"}


def test_what_if_prices_at_its_status(calibrated: Path) -> None:
    cal = _data(calibrated)["results"]["calibration"]
    args = Namespace(
        status=str(calibrated),
        bytes_per_token=None,
        bandwidth_gbps=None,
        pull_fixed_ms=None,
        recompute_us_per_token=None,
        retention=None,
        also=None,
    )
    costs, retention = whatif_costs(args)
    assert costs.recompute_seconds_per_token == pytest.approx(cal["recomputeSecondsPerToken"])
    assert costs.bytes_per_token == KV_8B
    assert costs.transfer_bytes_per_second == pytest.approx(cal["pullBytesPerSecond"])
    assert retention > 0


# -- the pure parts, here in the test venv (no torch)
def test_fit_line_is_least_squares() -> None:
    fit = gc.fit_line([512, 2048, 8192], [0.01 + 2e-5 * n for n in (512, 2048, 8192)])
    assert fit.fixed_s == pytest.approx(0.01)
    assert fit.per_token_s == pytest.approx(2e-5)
    assert fit.worst_relative_residual == pytest.approx(0, abs=1e-9)
    bent = gc.fit_line([1, 2, 3], [1.0, 2.0, 4.0])  # b = 1.5, a = -2/3
    assert bent.per_token_s == pytest.approx(1.5)
    assert bent.worst_relative_residual == pytest.approx((1 / 3) / 2.0)
    with pytest.raises(ValueError):
        gc.fit_line([512, 512], [1.0, 2.0])


def test_quick_shapes_stay_valid_layers() -> None:
    for shape in gc.SHAPES.values():
        small = shape.scaled(gc.QUICK_SCALE)
        assert small.q_heads % small.kv_heads == 0 and small.kv_heads >= 1
        assert small.layers == shape.layers and small.head_dim == shape.head_dim
        assert (small.experts > 0) == (shape.experts > 0)
        assert small.top_k <= small.experts


def test_a_network_link_prices_the_pull() -> None:
    bw = {"hbmToHbm": 2e12, "hbmToHost": 50e9, "hostToHbm": 40e9}
    assert gc.pull_bandwidth(bw, "host", None) == 40e9
    assert gc.pull_bandwidth(bw, "hbm", None) == 2e12
    assert gc.pull_bandwidth(bw, "host", 400) == 50e9  # gigabits/s


def test_arguments_are_checked() -> None:
    args = gc.parse(["--shapes", "70b-tp8", "--model", "8b"])
    assert args.shapes == ["70b-tp8", "8b"]  # the priced shape is always measured
    for bad in (["--shapes", "13b"], ["--network-gbps", "0"], ["--prompt-tokens", "512,512"]):
        with pytest.raises(SystemExit):
            gc.parse(bad)
