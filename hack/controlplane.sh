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
#   hack/controlplane.sh apiserver-stop / apiserver-start
#                                 stop or start kube-apiserver alone (fault tests)
#
# Environment:
#   KVFERRY_CACHE      binary cache root (default ~/.cache/kvferry)
#   KVFERRY_CP_DIR     state folder of a running plane (default /tmp/kvferry-cp)
#   KVFERRY_CP_PORT    kube-apiserver secure port (default 16443)
#   KVFERRY_CP_NODES   fake nodes to create (default 2): 8 nvidia.com/gpu + 1 RDMA + 2Ti disk each;
#                      0: none (hack/node.sh brings real kubelets)
#   KVFERRY_CP_ADDRESS kube-apiserver bind and advertise address, in its cert and the
#                      kubeconfig (default 127.0.0.1; hack/node.sh: its bridge, for pods)
#   KVFERRY_CP_SERVICE_CIDR  Service range (default 10.0.0.0/24; a /24 or larger, whose
#                      first address is the `kubernetes` Service's, in the cert)
#   KVFERRY_CP_CRDS    1 (default): apply crds/ before the controllers start; 0: a bare
#                      cluster, as a user's is before installing kvferry
#   KVFERRY_CP_APISERVER_ARGS  more kube-apiserver flags, space-separated (the operator-scale
#                      benchmark turns on an audit log with them)
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cache_root=${KVFERRY_CACHE:-$HOME/.cache/kvferry}
state=${KVFERRY_CP_DIR:-/tmp/kvferry-cp}
port=${KVFERRY_CP_PORT:-16443}
nodes=${KVFERRY_CP_NODES:-2}
address=${KVFERRY_CP_ADDRESS:-127.0.0.1}
service_cidr=${KVFERRY_CP_SERVICE_CIDR:-10.0.0.0/24}
# The `kubernetes` Service takes the range's first address (the cert must name it).
service_ip=${service_cidr%/*}; service_ip=${service_ip%.*}.$((${service_ip##*.} + 1))
read -r -a apiserver_args <<< "${KVFERRY_CP_APISERVER_ARGS:-}"
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

# ------------------------------------------------------------------ up/down

# Keep all ports below the kernel's ephemeral range (32768+ by default): a port
# there can be taken by any outgoing connection between our check and our bind.
etcd_port=$((port + 1)); etcd_peer=$((port + 2)); sched_port=$((port + 3))
kwok_port=$((port + 4)); kcm_port=$((port + 5))

pids_file() { echo "$state/pids"; }

is_up() {
  [[ -f $(pids_file) ]] || return 1
  local pid
  while read -r _ pid; do kill -0 "$pid" 2>/dev/null || return 1; done < "$(pids_file)"
}

# Start a process in its own session, logging to $state/<name>.log.
start() {
  local name=$1; shift
  setsid "$@" >"$state/$name.log" 2>&1 < /dev/null &
  echo "$name $!" >> "$(pids_file)"
}

fail_with_logs() {
  log "ERROR: $*"
  for f in "$state"/*.log; do
    [[ -f $f ]] || continue
    printf '==> %s (last 25 lines) <==\n' "$f" >&2; tail -n 25 "$f" >&2
  done
  down >/dev/null 2>&1 || true
  exit 1
}

# wait_for <seconds> <what> <command...>
wait_for() {
  local limit=$1 what=$2; shift 2
  local deadline=$((SECONDS + limit))
  until "$@" >/dev/null 2>&1; do
    ((SECONDS < deadline)) || fail_with_logs "$what not ready after ${limit}s"
    sleep 0.5
  done
}

certs() {
  local d=$state/pki; mkdir -p "$d"; cd "$d"
  openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 30 \
    -subj "/CN=kvferry-test-ca" 2>/dev/null
  cat > server.ext <<EOT
subjectAltName=IP:127.0.0.1,IP:$address,IP:$service_ip,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc
extendedKeyUsage=serverAuth
EOT
  openssl req -newkey rsa:2048 -nodes -keyout server.key -out server.csr -subj "/CN=kube-apiserver" 2>/dev/null
  openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out server.crt \
    -days 30 -extfile server.ext 2>/dev/null
  printf 'extendedKeyUsage=clientAuth\n' > client.ext
  openssl req -newkey rsa:2048 -nodes -keyout admin.key -out admin.csr \
    -subj "/O=system:masters/CN=kvferry-admin" 2>/dev/null
  openssl x509 -req -in admin.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out admin.crt \
    -days 30 -extfile client.ext 2>/dev/null
  openssl genrsa -out sa.key 2048 2>/dev/null
  openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
  cd - >/dev/null
}

kubeconfig() {
  cat > "$state/kubeconfig" <<EOT
apiVersion: v1
kind: Config
clusters:
- name: kvferry-local
  cluster:
    server: https://$address:$port
    certificate-authority: $state/pki/ca.crt
users:
- name: admin
  user:
    client-certificate: $state/pki/admin.crt
    client-key: $state/pki/admin.key
contexts:
- name: kvferry-local
  context: {cluster: kvferry-local, user: admin, namespace: default}
current-context: kvferry-local
EOT
}

kwok_stages() {
  # The standard stages ship inside the kwok module; kwok refuses to start without any.
  local dir; dir=$(cd "$here/kwok" && go list -m -f '{{.Dir}}' sigs.k8s.io/kwok)
  local s=$dir/kustomize/stage
  for f in "$s/node/fast/node-initialize.yaml" "$s/node/heartbeat-with-lease/node-heartbeat-with-lease.yaml" \
           "$s/pod/fast/pod-ready.yaml" "$s/pod/fast/pod-complete.yaml" "$s/pod/fast/pod-delete.yaml"; do
    echo "---"; cat "$f"
  done
}

create_nodes() {
  local i
  for ((i = 0; i < nodes; i++)); do
    cat <<EOT
---
apiVersion: v1
kind: Node
metadata:
  name: gpu-node-$i
  annotations: {kwok.x-k8s.io/node: fake}
  labels:
    kubernetes.io/hostname: gpu-node-$i
    kubernetes.io/os: linux
    kubernetes.io/arch: amd64
    type: kwok
    nvidia.com/gpu.product: NVIDIA-H200
status:
  capacity: &cap {cpu: "256", memory: 4Ti, pods: "110", ephemeral-storage: 2Ti, nvidia.com/gpu: "8", rdma/hca_shared_devices_a: "1"}
  allocatable: *cap
EOT
  done | "$kubectl" --kubeconfig "$state/kubeconfig" apply -f - >/dev/null
}

kubectl=${KUBECTL:-kubectl}

start_apiserver() {
  local bin=$1 pki=$state/pki
  start kube-apiserver "$bin/kube-apiserver" --etcd-servers "http://127.0.0.1:$etcd_port" \
    --bind-address "$address" --advertise-address "$address" --secure-port "$port" \
    --tls-cert-file "$pki/server.crt" --tls-private-key-file "$pki/server.key" \
    --client-ca-file "$pki/ca.crt" \
    --service-account-issuer https://kubernetes.default.svc \
    --service-account-key-file "$pki/sa.pub" --service-account-signing-key-file "$pki/sa.key" \
    --api-audiences https://kubernetes.default.svc \
    --authorization-mode Node,RBAC --service-cluster-ip-range "$service_cidr" \
    --endpoint-reconciler-type none --allow-privileged=true "${apiserver_args[@]}"
  wait_for 90 kube-apiserver "$kubectl" --kubeconfig "$state/kubeconfig" get --raw /readyz
}

# Stop one component of a running plane (its process group) and forget its PID.
stop_one() {
  local name=$1 pid
  [[ -f $(pids_file) ]] || die "not running"
  pid=$(awk -v n="$name" '$1 == n {print $2}' "$(pids_file)")
  [[ -n $pid ]] || die "$name is not running"
  kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
  local deadline=$((SECONDS + 15))
  while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.2; done
  kill -KILL -- "-$pid" 2>/dev/null || true
  awk -v n="$name" '$1 != n' "$(pids_file)" > "$(pids_file).new" && mv "$(pids_file).new" "$(pids_file)"
  log "$name stopped"
}

# Fault injection for the cluster tests: the API server alone goes away and comes
# back (etcd keeps the state), as in a control-plane upgrade or a crash.
apiserver_stop() { stop_one kube-apiserver; }
apiserver_start() {
  [[ -f $(pids_file) ]] || die "not running"
  grep -q '^kube-apiserver ' "$(pids_file)" && die "kube-apiserver already runs"
  start_apiserver "$(build)"
  log "kube-apiserver started"
}

up() {
  if is_up; then log "already up"; echo "$state/kubeconfig"; return 0; fi
  down >/dev/null 2>&1 || true
  local bin; bin=$(build)
  local started=$SECONDS
  mkdir -p "$state"; : > "$(pids_file)"
  certs
  kubeconfig
  local pki=$state/pki
  start etcd "$bin/etcd" --name kvferry --data-dir "$state/etcd" --unsafe-no-fsync \
    --listen-client-urls "http://127.0.0.1:$etcd_port" --advertise-client-urls "http://127.0.0.1:$etcd_port" \
    --listen-peer-urls "http://127.0.0.1:$etcd_peer" --initial-advertise-peer-urls "http://127.0.0.1:$etcd_peer" \
    --initial-cluster "kvferry=http://127.0.0.1:$etcd_peer" --log-level warn
  wait_for 30 etcd curl -sf "http://127.0.0.1:$etcd_port/health"
  start_apiserver "$bin"
  # CRDs before the controller-manager: its garbage collector discovers new
  # owner types only every 30 s.
  if [[ ${KVFERRY_CP_CRDS:-1} == 1 && -d $here/../crds ]]; then
    "$kubectl" --kubeconfig "$state/kubeconfig" apply --server-side -f "$here/../crds" >/dev/null \
      || fail_with_logs "applying crds/ failed"
    # kubectl wait fails at once, not after its timeout, when it reads a CRD whose
    # status has no conditions yet (".status.conditions accessor error"), which a
    # loaded machine sees right after the apply: ask again until the deadline.
    wait_for 60 "crds/ Established" "$kubectl" --kubeconfig "$state/kubeconfig" wait \
      --for condition=Established --timeout 10s -f "$here/../crds"
  fi
  start kube-controller-manager "$bin/kube-controller-manager" --kubeconfig "$state/kubeconfig" \
    --service-account-private-key-file "$pki/sa.key" --root-ca-file "$pki/ca.crt" \
    --use-service-account-credentials=false --leader-elect=false \
    --bind-address 127.0.0.1 --secure-port "$kcm_port" \
    --node-monitor-grace-period 5m --concurrent-gc-syncs 5
  start kube-scheduler "$bin/kube-scheduler" --kubeconfig "$state/kubeconfig" --leader-elect=false \
    --bind-address 127.0.0.1 --secure-port "$sched_port"
  kwok_stages > "$state/kwok.yaml"
  start kwok "$bin/kwok" --kubeconfig "$state/kubeconfig" --config "$state/kwok.yaml" \
    --manage-all-nodes=false --manage-nodes-with-annotation-selector kwok.x-k8s.io/node=fake \
    --node-lease-duration-seconds 40 --server-address "127.0.0.1:$kwok_port" --cidr 10.244.0.0/16
  if ((nodes > 0)); then
    create_nodes
    wait_for 60 "fake nodes" "$kubectl" --kubeconfig "$state/kubeconfig" wait --for condition=Ready \
      node --all --timeout 2s
  fi
  wait_for 60 "default ServiceAccount" "$kubectl" --kubeconfig "$state/kubeconfig" get serviceaccount default
  wait_for 30 kube-scheduler curl -sfk "https://127.0.0.1:$sched_port/healthz"
  wait_for 30 kube-controller-manager curl -sfk "https://127.0.0.1:$kcm_port/healthz"
  # A component that died at start (a port taken, say) must fail `up`, not the tests later.
  is_up || fail_with_logs "a component exited during start-up"
  log "up in $((SECONDS - started)) s"
  echo "$state/kubeconfig"
}

down() {
  [[ -f $(pids_file) ]] || { log "not running"; return 0; }
  local name pid
  # Reverse start order: controllers first, etcd last.
  tac "$(pids_file)" | while read -r name pid; do
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
  done
  local deadline=$((SECONDS + 15))
  while read -r name pid; do
    while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.2; done
    kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
  done < "$(pids_file)"
  rm -rf "$state"
  log "down"
}

status() {
  if [[ ! -f $(pids_file) ]]; then echo "down"; return 1; fi
  local name pid rc=0
  while read -r name pid; do
    if kill -0 "$pid" 2>/dev/null; then echo "$name running (pid $pid)"; else echo "$name DEAD (pid $pid)"; rc=1; fi
  done < "$(pids_file)"
  echo "KUBECONFIG=$state/kubeconfig"
  return $rc
}

case "${1:-}" in
  build) build ;;
  up) up ;;
  down) down ;;
  status) status ;;
  apiserver-stop) apiserver_stop ;;
  apiserver-start) apiserver_start ;;
  *) echo "usage: $0 build|up|down|status|apiserver-stop|apiserver-start" >&2; exit 2 ;;
esac
