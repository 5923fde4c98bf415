# The two commands a newcomer needs:  `make demo`  and  `make test`.
SHELL := /bin/bash
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test lint venv controlplane-up controlplane-down helm deploy-manifest

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $@

venv: $(BIN)/.installed

# The main job on a local default: render the minimal sample into the
# Kubernetes objects the operator would apply.
demo: venv
	$(BIN)/kvferry-operator render examples/minimal.yaml

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check operator sidecar tests

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
