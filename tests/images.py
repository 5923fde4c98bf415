"""What ships, built once per test session for every tier that runs it: the kvferry
wheel (``pip wheel`` of this tree, no test extras), the images' build context (that
wheel and its dependency wheels, hack/images.sh), and the operator and sidecar images
built from them with buildah (the artifact tier runs them under podman; the README
walk-through installs the chart with them)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.manifests import ROOT
from tests.progress import step

IMAGES_SH = ROOT / "hack" / "images.sh"


def run(args: list[str], timeout: float = 600, **kw) -> subprocess.CompletedProcess[str]:
    """Run ``args``; fail the test with its output when it exits non-zero."""
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kw)
    if proc.returncode != 0:
        pytest.fail(
            f"{' '.join(map(str, args))} exited {proc.returncode}:\n"
            f"{proc.stderr[-6000:]}{proc.stdout[-2000:]}",
            pytrace=False,
        )
    return proc


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    with step("building the kvferry wheel (pip wheel, no test extras)"):
        run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(ROOT)])
    (found,) = out.glob("kvferry-*.whl")
    return found


@pytest.fixture(scope="session")
def image_context(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The images' build context: the wheel and its dependency wheels (wheels/)."""
    ctx = tmp_path_factory.mktemp("image-context")
    env = {**os.environ, "PYTHON": sys.executable, "KVFERRY_IMAGE_CONTEXT": str(ctx)}
    with step("dependency wheels for the images (hack/images.sh context; downloads once)"):
        run(["bash", str(IMAGES_SH), "context", str(wheel)], env=env)
    return ctx


TAG = "artifacts"


@dataclass(frozen=True)
class Images:
    operator: str
    sidecar: str


@pytest.fixture(scope="session")
def images(wheel: Path, image_context: Path) -> Images:
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "KVFERRY_IMAGE_CONTEXT": str(image_context),
        "KVFERRY_IMAGE_TAG": TAG,
    }
    what = (
        "building the operator and sidecar images (hack/images.sh build; the first run on a "
        "machine installs podman/buildah/runc/mmdebstrap and builds the base, ~3 min)"
    )
    with step(what):
        out = run(["bash", str(IMAGES_SH), "build", str(wheel)], env=env, timeout=1200)
    operator_image, sidecar_image = out.stdout.split()
    return Images(operator_image, sidecar_image)
