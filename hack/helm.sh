#!/usr/bin/env bash
# helm for kvferry's chart tests and `make deploy-manifest`, built from the Go
# module pinned in hack/helm (no downloaded binaries), cached outside the clone
# the same way hack/controlplane.sh caches the control plane.
#
#   hack/helm.sh build          build (or reuse) helm; prints its path
#   hack/helm.sh [helm args]    run the cached helm with these arguments
#
# Environment:
#   KVFERRY_CACHE   binary cache root (default ~/.cache/kvferry)
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cache_root=${KVFERRY_CACHE:-$HOME/.cache/kvferry}

log() { printf 'helm.sh: %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# Everything that decides the binary's bytes.
cache_key() {
  cat "$here/helm/go.mod" "$here/helm/go.sum" <(go env GOVERSION) <(echo "build-v1") \
    | sha256sum | cut -c1-16
}

build() {
  command -v go >/dev/null || die "go is not installed; the chart tests need Go to build helm"
  local out; out="$cache_root/helm/$(cache_key)"
  if [[ -x $out/helm ]]; then
    echo "$out/helm"; return 0
  fi
  local tmp="$out.partial.$$"
  rm -rf "$tmp"; mkdir -p "$tmp"
  local started=$SECONDS
  # What helm's own Makefile stamps in: its version, and the Kubernetes version
  # `helm template` assumes (client-go v0.X.Y -> Kubernetes 1.X).
  local helm_version k8s_minor ld
  helm_version=$(cd "$here/helm" && go list -f '{{.Version}}' -m helm.sh/helm/v3)
  k8s_minor=$(cd "$here/helm" && go list -f '{{.Version}}' -m k8s.io/client-go | cut -d. -f2)
  ld="-s -w -X helm.sh/helm/v3/internal/version.version=$helm_version"
  ld+=" -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
  for pkg in helm.sh/helm/v3/pkg/lint/rules helm.sh/helm/v3/pkg/chartutil; do
    ld+=" -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=$k8s_minor"
  done
  log "building helm $helm_version (cold: a few minutes on 2 cores)"
  (cd "$here/helm" && CGO_ENABLED=0 go build -trimpath -ldflags "$ld" -o "$tmp/helm" \
      helm.sh/helm/v3/cmd/helm) || die "go build of helm failed (see above)"
  rm -rf "$out"; mv "$tmp" "$out"
  log "built helm in $((SECONDS - started)) s into $out"
  echo "$out/helm"
}

case "${1:-}" in
  build) build ;;
  *) helm=$(build); exec "$helm" "$@" ;;
esac
