"""README's "Try it without GPUs" against the code it describes.

The walk-through runs on kind or minikube, which this project's machines do not have
(the section says so), so its steps are checked here as text: the image it builds is
the one the example names, built FROM vLLM's CPU image (a CPU server has no default
image: that one ships no NIXL), and the server it applies and waits for is
examples/cpu.yaml's.
"""

from __future__ import annotations

import re

from kvferry_operator import api
from tests.manifests import ROOT, load_example

SECTION = "## Try it without GPUs"


def section() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    return text[start:end]


EXAMPLE = load_example(ROOT / "examples" / "cpu.yaml")


def test_the_image_it_builds_is_the_one_the_example_names():
    built = re.findall(r"docker build -t (\S+) ", section())
    assert built == [EXAMPLE["spec"]["engine"]["image"]]
    assert f"kind load docker-image {built[0]} " in section()


def test_it_builds_from_vllms_cpu_image():
    default = api.VLLM_CPU_IMAGE
    assert api.DEVICE_CPU not in api.DEFAULT_ENGINE_IMAGES
    assert re.findall(r"^\s*FROM (\S+)$", section(), re.M) == [default]
    # The versions the prose names are the image's.
    assert f"`{default}` (vLLM 0.32.0" in section()


def test_it_applies_the_cpu_example_and_waits_for_that_server():
    name, ns = EXAMPLE["metadata"]["name"], EXAMPLE["metadata"]["namespace"]
    assert EXAMPLE["spec"]["engine"]["device"] == api.DEVICE_CPU
    assert "kubectl apply -f examples/cpu.yaml" in section()
    assert f"kubectl -n {ns} wait dserver/{name} --for=condition=Ready" in section()
    assert f"svc/{name} 8000:8000" in section()
    assert f'"model": "{EXAMPLE["spec"]["model"]["name"]}"' in section()
