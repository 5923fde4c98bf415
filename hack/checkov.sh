#!/usr/bin/env bash
# checkov, the scanner platform teams run on Kubernetes manifests in CI and admission,
# over what kvferry ships: `kvferry-operator render` of every example and
# `helm template` of the chart. tests/static/test_checkov.py runs it in CI.
#
#   hack/checkov.sh build        build (or reuse) checkov's venv; prints its checkov binary
#   hack/checkov.sh scan DIR     run checkov over the manifests in DIR (kubernetes framework)
#
# checkov lives in its OWN virtual environment, outside the clone (it pulls ~150
# packages whose pins would fight the project's), at
#   ${KVFERRY_CACHE:-~/.cache/kvferry}/checkov-<hash of the version and python>
# complete once it holds .kvferry-complete. checkov is pinned to one release: a new
# release adds checks, and CI must fail on our change, not on checkov's.
#
# Environment:
#   KVFERRY_CACHE          cache root (default ~/.cache/kvferry)
#   KVFERRY_CHECKOV_PYTHON python for the venv (default python3.11, else python3)
set -euo pipefail

cache_root=${KVFERRY_CACHE:-$HOME/.cache/kvferry}
CHECKOV_VERSION=3.3.30
RECIPE_VERSION=1   # bump when the steps below change the result

log() { printf 'checkov.sh: %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

build() {
  local py=${KVFERRY_CHECKOV_PYTHON:-} py_version key venv marker started
  if [[ -z $py ]]; then
    if command -v python3.11 >/dev/null 2>&1; then py=python3.11; else py=python3; fi
  fi
  py_version=$("$py" -c 'import sys; print(sys.version.split()[0])') \
    || die "no python interpreter '$py' runs"
  key=$(printf '%s\n' "checkov $CHECKOV_VERSION" "recipe $RECIPE_VERSION" "python $py_version" \
        | sha256sum | cut -c1-16)
  venv="$cache_root/checkov-$key"
  marker="$venv/.kvferry-complete"
  if [[ -f $marker ]]; then echo "$venv/bin/checkov"; return 0; fi
  mkdir -p "$cache_root"
  # One builder at a time (two pytest runs may start together).
  exec 9>"$venv.lock"
  flock -w 900 9 || die "timed out waiting for another build of $venv"
  if [[ -f $marker ]]; then echo "$venv/bin/checkov"; return 0; fi
  started=$SECONDS
  log "installing checkov $CHECKOV_VERSION into $venv (one time: 132 s and 291 MB with no pip cache on 2 cores)"
  rm -rf "$venv"
  "$py" -m venv "$venv" || die "$py -m venv failed"
  # From a folder outside the clone: its operator/ folder shadows the stdlib module.
  (cd / && "$venv/bin/python" -m pip install --quiet --no-input --progress-bar off \
      --disable-pip-version-check "checkov==$CHECKOV_VERSION" >&2) \
    || { rm -rf "$venv"; die "pip install checkov==$CHECKOV_VERSION failed (see above)"; }
  (cd / && "$venv/bin/checkov" --version >/dev/null) \
    || { rm -rf "$venv"; die "the installed checkov does not run"; }
  "$venv/bin/python" -m pip freeze >"$marker.tmp"
  mv "$marker.tmp" "$marker"
  log "installed in $((SECONDS - started)) s"
  echo "$venv/bin/checkov"
}

scan() {
  local dir=${1:?usage: hack/checkov.sh scan DIR} checkov
  [[ -d $dir ]] || die "no such folder: $dir"
  dir=$(cd "$dir" && pwd)
  checkov=$(build)
  # --quiet: failed checks only; the summary line still counts passed and skipped.
  # --skip-download: nothing from the network (checkov fetches its guideline links).
  # From /: the clone's operator/ folder would shadow the stdlib module.
  cd / && exec "$checkov" --quiet --compact --skip-download --framework kubernetes -d "$dir"
}

case "${1:-}" in
  build) build ;;
  scan) shift; scan "$@" ;;
  *) sed -n '2,8p' "$0" >&2; exit 2 ;;
esac
