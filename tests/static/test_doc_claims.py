"""Claims the docs make that test_docs.py's name checks cannot catch, each checked
against what helm and the operator render: the examples users copy, the ports the
chart's docs name for its monitors and NetworkPolicy, the defaults `kubectl get -o
yaml` does not show, and where the chart and its sources come from (nothing is
published: no chart repository, no public Git repository, no images).

Each test reads the claim out of the text it is made in (a table row, a values
comment, a paragraph) and compares it with the rendered objects, so a doc that drifts
from the code, or code that drifts from its doc, fails here.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Any

import pytest

from kvferry_operator import api, render
from tests.manifests import EXAMPLES, load_example

Obj = dict[str, Any]


def rendered(path: Path) -> list[Obj]:
    return render.render(api.parse_server(load_example(path)))


def pod_templates(objs: list[Obj]) -> list[Obj]:
    return [o["spec"]["template"] for o in objs if o["kind"] == "StatefulSet"]


def containers(pod: Obj) -> list[Obj]:
    return pod["spec"]["containers"] + pod["spec"].get("initContainers", [])


_QUANTITY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "G": 10**9, "T": 10**12}


def quantity_bytes(value: str) -> int:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|G|T)?", str(value))
    assert m, f"not a storage quantity this test reads: {value!r}"
    return int(float(m[1]) * _QUANTITY.get(m[2] or "", 1))


# ------------------------------------------------------------------ the examples

# The weights a hub example downloads, in bytes (the repository's safetensors): what
# its ephemeral-storage request must hold. A new hub example adds its model here.
HUB_WEIGHTS = {"Qwen/Qwen3-0.6B": 1.5 * 10**9}
# Room above the weights for what the engine writes into its container (compile
# caches, logs): the request is sized to the model, not a default for any model.
HUB_HEADROOM = 8 * 2**30


def _hub_downloads() -> list[Path]:
    """Examples whose pods download the weights onto the node's disk (an emptyDir)."""
    out = []
    for path in EXAMPLES:
        hub = api.parse_server(load_example(path)).spec.model.hub
        if hub and not (hub.cache.pvc_claim_name or hub.cache.host_path):
            out.append(path)
    return out


def test_the_examples_include_a_hub_download():
    assert _hub_downloads(), "no example downloads from the hub: the test below checks none"


@pytest.mark.parametrize("path", _hub_downloads(), ids=lambda p: p.name)
def test_a_hub_example_requests_the_disk_its_model_needs(path: Path):
    """An example is what users copy: 100Gi (the CRD's default) for a 1.5 GB model
    keeps pods off nodes that have the disk for it many times over."""
    spec = load_example(path)["spec"]
    model = spec["model"]["name"]
    assert model in HUB_WEIGHTS, f"{path.name}: add {model}'s download size to HUB_WEIGHTS"
    cache = spec["model"].get("source", {}).get("hub", {}).get("cache", {})
    assert "ephemeralStorage" in cache, (
        f"{path.name} leaves spec.model.source.hub.cache.ephemeralStorage to the CRD's "
        "default: size it to the model"
    )
    (pod, *_) = pod_templates(rendered(path))
    engine = next(c for c in containers(pod) if c["name"] == "engine")
    request = quantity_bytes(engine["resources"]["requests"]["ephemeral-storage"])
    weights = HUB_WEIGHTS[model]
    assert weights <= request <= weights + HUB_HEADROOM, (
        f"{path.name}: requests {request / 2**30:.1f} GiB for {weights / 10**9:.1f} GB of weights"
    )


_DEBUG = re.compile(r"^(debug|trace)$", re.I)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_no_example_turns_on_debug_logging(path: Path):
    """Debug logs in production write prompts and slow the engine; nobody should copy
    them from an example."""
    for pod in pod_templates(rendered(path)):
        for c in containers(pod):
            for entry in c.get("env", []):
                if "LOG" in entry["name"]:
                    assert not _DEBUG.match(str(entry.get("value", ""))), (path.name, entry)
            args = c.get("args", [])
            for flag, value in itertools.pairwise(args):
                if "log-level" in flag:
                    assert not _DEBUG.match(value), (path.name, flag, value)
