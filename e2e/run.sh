#!/usr/bin/env bash
# kvferry end-to-end scenarios against the cluster in KUBECONFIG (kind, a GPU cluster).
#
#   e2e/run.sh                      all steps with the defaults below
#   E2E_MANIFEST=my-server.yaml e2e/run.sh
#
# Steps: CRDs (server-side apply) -> chart (helm upgrade --install, wait) -> operator
# rollout -> a DisaggregatedServer -> Ready=True -> multi-turn chat through the
# server's Service (port-forward) -> kubectl get kv-cache-status -> clean up.
#
# Environment (defaults in brackets):
#   E2E_MANIFEST          DisaggregatedServer to apply [examples/minimal.yaml]; its
#                         namespace must exist or is created; PVC/secrets it names must exist
#   E2E_OPERATOR_NS       namespace of the chart release [kvferry-system]
#   E2E_RELEASE           release name [kvferry]
#   E2E_HELM_ARGS         extra helm args, e.g. "--set image.repository=reg/op --set image.tag=dev"
#   E2E_READY_TIMEOUT     wait for Ready=True [1800s] (model download + load)
#   E2E_TURNS             conversation turns [4]
#   E2E_SKIP_REQUESTS     1 = stop after Ready (no chat) [0]
#   E2E_REPORT_TIMEOUT    seconds to wait for residency reports in KVCacheStatus [120]
#   E2E_REQUIRE_REPORTS   1 = fail when no report arrived in time [0]
#   E2E_KEEP              1 = leave the server and the release in place [0]
#   HELM                  helm binary [helm on PATH, else hack/helm.sh builds one]
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
manifest=${E2E_MANIFEST:-$root/examples/minimal.yaml}
op_ns=${E2E_OPERATOR_NS:-kvferry-system}
release=${E2E_RELEASE:-kvferry}
ready_timeout=${E2E_READY_TIMEOUT:-1800s}
turns=${E2E_TURNS:-4}
report_timeout=${E2E_REPORT_TIMEOUT:-120}
helm=${HELM:-$(command -v helm || "$root/hack/helm.sh" build)}

step() { printf '\n==> %s\n' "$*" >&2; }
die() { printf 'e2e: FAILED: %s\n' "$*" >&2; exit 1; }

pf_pid=""
cleanup() {
  [[ -n $pf_pid ]] && kill "$pf_pid" 2>/dev/null || true
  if [[ ${E2E_KEEP:-0} != 1 && -n ${name:-} ]]; then
    step "cleaning up (E2E_KEEP=1 keeps everything)"
    kubectl -n "$ns" delete dserver "$name" --wait=true --timeout=5m || true
    "$helm" uninstall "$release" -n "$op_ns" --wait || true
  fi
}
trap cleanup EXIT

step "cluster: $(kubectl config current-context 2>/dev/null || echo '?')"
kubectl version -o json | python3 -c 'import json,sys; print("server", json.load(sys.stdin)["serverVersion"]["gitVersion"])'

step "CRDs (server-side apply: Helm installs crds/ only once, never upgrades them)"
# --force-conflicts: CRDs a `helm install` created belong to the field manager "helm".
kubectl apply --server-side --force-conflicts -f "$root/crds/"
kubectl wait --for condition=Established --timeout=60s \
  crd/disaggregatedservers.kvferry.io crd/kvcachestatuses.kvferry.io crd/rolescalers.kvferry.io

step "chart: $helm upgrade --install $release -n $op_ns"
# shellcheck disable=SC2086 # E2E_HELM_ARGS is a list of words on purpose
"$helm" upgrade --install "$release" "$root/charts/kvferry" -n "$op_ns" --create-namespace \
  --wait --timeout 5m ${E2E_HELM_ARGS:-}
deploy=$(kubectl -n "$op_ns" get deploy -l "app.kubernetes.io/instance=$release" -o name)
kubectl -n "$op_ns" rollout status "$deploy" --timeout=5m

step "DisaggregatedServer from $manifest"
name=$(kubectl create --dry-run=client -f "$manifest" -o jsonpath='{.metadata.name}')
ns=$(kubectl create --dry-run=client -f "$manifest" -o jsonpath='{.metadata.namespace}')
ns=${ns:-default}
kubectl create namespace "$ns" --dry-run=client -o yaml | kubectl apply -f - >/dev/null
kubectl apply --server-side --field-manager=e2e -f "$manifest"
model=$(kubectl -n "$ns" get dserver "$name" -o jsonpath='{.spec.model.name}')

step "waiting up to $ready_timeout for $ns/$name Ready=True"
if ! kubectl -n "$ns" wait "dserver/$name" --for=condition=Ready --timeout="$ready_timeout"; then
  kubectl -n "$ns" get dserver "$name" -o yaml | sed -n '/^status:/,$p' >&2
  kubectl -n "$ns" get pods -l "app.kubernetes.io/instance=$name" -o wide >&2
  die "$ns/$name did not become Ready"
fi
kubectl -n "$ns" get dserver "$name"

if [[ ${E2E_SKIP_REQUESTS:-0} != 1 ]]; then
  step "multi-turn conversation through service/$name (port-forward)"
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  kubectl -n "$ns" port-forward "service/$name" "$port:8000" >/dev/null 2>&1 &
  pf_pid=$!
  for _ in $(seq 60); do
    curl -fsS "http://127.0.0.1:$port/healthz" >/dev/null 2>&1 && break
    sleep 1
  done
  python3 "$root/e2e/conversation.py" --url "http://127.0.0.1:$port" --model "$model" \
    --turns "$turns" || die "conversation failed"
fi

step "kubectl get kv-cache-status (reports arrive every ~15 s)"
deadline=$((SECONDS + report_timeout))
phase=""
while ((SECONDS < deadline)); do
  phase=$(kubectl -n "$ns" get kvcs "$name" -o jsonpath='{.status.phase}' 2>/dev/null || true)
  [[ $phase == Reporting ]] && break
  sleep 5
done
kubectl -n "$ns" get kv-cache-status "$name"
if [[ $phase != Reporting ]]; then
  msg="no residency report reached KVCacheStatus in ${report_timeout}s (phase: ${phase:-none})"
  [[ ${E2E_REQUIRE_REPORTS:-0} == 1 ]] && die "$msg"
  printf 'e2e: WARNING: %s\n' "$msg" >&2
fi
kubectl -n "$ns" get kvcs "$name" -o yaml | sed -n '/^status:/,$p'

step "e2e: PASSED"
