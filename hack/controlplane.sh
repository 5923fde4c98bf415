#!/usr/bin/env bash
# A real Kubernetes control plane on loopback for kvferry's cluster tests:
# etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok (fake
# GPU/RDMA nodes; no kubelet), built from Go modules pinned in hack/controlplane
# and hack/kwok, cached outside the clone.
#
#   hack/controlplane.sh build    build (or reuse) the binaries; prints their folder
#   hack/controlplane.sh up       build, start everything, create nodes; prints KUBECONFIG
#   hack/controlplane.sh down     stop what `up` started (by PID) and remove its state
#   hack/controlplane.sh status   say what runs
#
# Environment:
#   KVFERRY_CACHE      binary cache root (default ~/.cache/kvferry)
#   KVFERRY_CP_DIR     state folder of a running plane (default /tmp/kvferry-cp)
#   KVFERRY_CP_PORT    kube-apiserver secure port (default 16443)
#   KVFERRY_CP_NODES   fake nodes to create (default 2): 8 nvidia.com/gpu + 1 RDMA each
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cache_root=${KVFERRY_CACHE:-$HOME/.cache/kvferry}
state=${KVFERRY_CP_DIR:-/tmp/kvferry-cp}
port=${KVFERRY_CP_PORT:-16443}
nodes=${KVFERRY_CP_NODES:-2}
k8s_version=v1.37.2

log() { printf 'controlplane: %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# The cache key covers everything that decides the binaries' bytes.
cache_key() {
  cat "$here/controlplane/go.mod" "$here/controlplane/go.sum" \
      "$here/kwok/go.mod" "$here/kwok/go.sum" \
      <(go env GOVERSION) <(echo "$k8s_version build-v1") | sha256sum | cut -c1-16
}

bin_dir() { echo "$cache_root/controlplane/$(cache_key)/bin"; }

build() {
  local out; out=$(bin_dir)
  if [[ -x $out/kube-apiserver && -x $out/kube-controller-manager && -x $out/kube-scheduler \
        && -x $out/etcd && -x $out/kwok ]]; then
    echo "$out"; return 0
  fi
  command -v go >/dev/null || die "go is not installed; cluster tests need Go to build the control plane"
  local tmp="$out.partial"
  rm -rf "$tmp"; mkdir -p "$tmp"
  local started=$SECONDS
  # kube's /version would say v0.0.0-master without these.
  local ld="-s -w"
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ld+=" -X $pkg.gitVersion=$k8s_version -X $pkg.gitMajor=1 -X $pkg.gitMinor=37"
    ld+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
  done
  log "building kube-apiserver, kube-controller-manager, kube-scheduler, etcd (cold: ~30 min on 2 cores)"
  # One go build for all four so the shared packages compile once; -pgo=off
  # because kube ships default.pgo profiles that slow a cold build a lot.
  (cd "$here/controlplane" && go build -pgo=off -trimpath -ldflags "$ld" -o "$tmp/" \
      k8s.io/kubernetes/cmd/kube-apiserver \
      k8s.io/kubernetes/cmd/kube-controller-manager \
      k8s.io/kubernetes/cmd/kube-scheduler \
      go.etcd.io/etcd/server/v3) || die "go build of the control plane failed (see above)"
  mv "$tmp/v3" "$tmp/etcd" 2>/dev/null || mv "$tmp/server" "$tmp/etcd"
  log "building kwok"
  (cd "$here/kwok" && go build -pgo=off -trimpath -ldflags "-s -w" -o "$tmp/kwok" sigs.k8s.io/kwok/cmd/kwok) \
    || die "go build of kwok failed (see above)"
  rm -rf "$out"; mv "$tmp" "$out"
  log "built in $((SECONDS - started)) s into $out"
  echo "$out"
}

case "${1:-}" in
  build) build ;;
  *) echo "usage: $0 build|up|down|status" >&2; exit 2 ;;
esac
