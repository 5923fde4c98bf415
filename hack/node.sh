#!/usr/bin/env bash
# Real kubelet nodes on the local control plane: hack/controlplane.sh (its own port and
# state folder) with N nodes, each a kubelet with its own containerd (runc, bridge CNI),
# one kube-proxy (iptables mode) and CoreDNS for cluster DNS, all on one bridge.
#
#   hack/node.sh tools          install containerd, runc, CNI plugins, iptables, nftables,
#                               conntrack, gcc and the image tools from Debian packages when missing
#   hack/node.sh build          build (or reuse) kubelet, kube-proxy, crictl, CoreDNS and the
#                               pause image; prints their folder
#   hack/node.sh up [N]         control plane + N (default 1) nodes; prints KUBECONFIG last
#   hack/node.sh load IMAGE...  put local podman images on every node (podman save + ctr import)
#   hack/node.sh down           stop everything and leave the machine as `up` found it
#   hack/node.sh status         say what runs
#
# Networks (nothing else in the repository uses them): bridge kvfnode0 holds 10.231.0.254
# (API server, CoreDNS, the pods' gateway) and the node IPs 10.231.0.<n>; node n's pods get
# 10.231.<n>.2-254; Services 10.232.0.0/24 (cluster DNS 10.232.0.10). Pods have no default
# route, DNS forwards nowhere, image pulls go to a dead local address, and both ranges have
# blackhole routes while nodes are up: no packet leaves the machine. `up` refuses ranges that
# are already routed, and a machine where a kubelet or kube-proxy already runs.
#
# Environment:
#   KVFERRY_CACHE      binary cache root (default ~/.cache/kvferry)
#   KVFERRY_NODE_DIR   state folder (default /tmp/kvferry-node)
#   KVFERRY_NODE_PORT  kube-apiserver port (default 27443; the plane uses PORT..PORT+5)
#   KVFERRY_NODE_CRDS  1: apply crds/ at start; 0 (default): a bare cluster, as a user's
# errtrace: the ERR trap `up` sets (tear down what it started) must fire inside the
# functions it calls too, not only in its own body.
set -Eeuo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cache_root=${KVFERRY_CACHE:-$HOME/.cache/kvferry}
state=${KVFERRY_NODE_DIR:-/tmp/kvferry-node}
port=${KVFERRY_NODE_PORT:-27443}
k8s_version=v1.37.2

bridge=kvfnode0
host_ip=10.231.0.254
pod_cidr=10.231.0.0/16
svc_cidr=10.232.0.0/24
dns_ip=10.232.0.10
dns_health=$host_ip:$((port + 7))
dns_ready=$host_ip:$((port + 8))
max_nodes=8
# The host paths a kubelet or containerd writes whatever their flags say (the device
# manager's socket, shim sockets, containerd's opt plugin, libcni's result cache):
# removed at `down` when `up` found them absent.
host_paths="/var/lib/kubelet /run/containerd /opt/containerd /var/lib/cni"
# The sysctls the kubelet (setupKernelTunables), kube-proxy and the CNI bridge write;
# restored at `down`. An extended regex over `sysctl -a` names.
sysctl_names='vm\.overcommit_memory|vm\.panic_on_oom|kernel\.panic|kernel\.panic_on_oops|kernel\.keys\.root_max(keys|bytes)|net\.ipv4\.ip_forward|net\.ipv[46]\.conf\.(all|default)\.[a-z_]+|net\.bridge\.[a-z_-]+|net\.netfilter\.nf_conntrack_(max|tcp_[a-z_]+)|net\.nf_conntrack_max'

TOOLS_DEB="containerd runc containernetworking-plugins iptables nftables conntrack gcc libc6-dev"

log() { printf 'node.sh: %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
kctl() { kubectl --kubeconfig "$state/cp/kubeconfig" "$@"; }

# ------------------------------------------------------------------ tools and build

tools() {
  local missing=() p
  command -v containerd >/dev/null || missing+=(containerd)
  command -v runc >/dev/null || missing+=(runc)
  [[ -x /usr/lib/cni/bridge && -x /usr/lib/cni/host-local ]] || missing+=(containernetworking-plugins)
  command -v iptables >/dev/null || missing+=(iptables)
  command -v conntrack >/dev/null || missing+=(conntrack)
  command -v nft >/dev/null || missing+=(nftables)
  command -v gcc >/dev/null || missing+=(gcc libc6-dev)
  if ((${#missing[@]})); then
    command -v apt-get >/dev/null || die "missing ${missing[*]} and no apt-get here: install $TOOLS_DEB"
    ((EUID == 0)) || die "missing ${missing[*]}: run as root, or: sudo apt-get install -y $TOOLS_DEB"
    log "installing ${missing[*]} from Debian packages (one time, ~30 s)"
    local started=$SECONDS
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2 || die "apt-get update failed"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2 \
      || die "apt-get install ${missing[*]} failed"
    log "installed in $((SECONDS - started)) s"
  fi
  # podman and buildah, for the pause image and `load`
  "$here/images.sh" tools
  for p in containerd runc iptables nft conntrack gcc podman buildah; do
    command -v "$p" >/dev/null || die "$p still missing after installing"
  done
}

# The cache key covers everything that decides the binaries' and the pause image's bytes.
cache_key() {
  cat "$here"/node/kubelet/go.{mod,sum} "$here"/node/crictl/go.{mod,sum} \
      "$here"/node/coredns/go.{mod,sum} "$here"/node/coredns/main.go "$here"/node/pause.c \
      <(go env GOVERSION) <(echo "$k8s_version node-build-v1") | sha256sum | cut -c1-16
}

bin_dir() { echo "$cache_root/node/$(cache_key)/bin"; }

build() {
  local out; out=$(bin_dir)
  if [[ -x $out/kubelet && -x $out/kube-proxy && -x $out/crictl && -x $out/coredns && -s $out/pause.tar ]]; then
    echo "$out"; return 0
  fi
  command -v go >/dev/null || die "go is not installed; the node tier builds its binaries with Go"
  tools
  local tmp="$out.partial.$$" started=$SECONDS ld="-s -w" pkg
  rm -rf "$tmp"; mkdir -p "$tmp"
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ld+=" -X $pkg.gitVersion=$k8s_version -X $pkg.gitMajor=1 -X $pkg.gitMinor=37"
    ld+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
  done
  log "building kubelet, kube-proxy (the control plane's release: ~75 s here on its warm Go build cache)"
  (cd "$here/node/kubelet" && go build -pgo=off -trimpath -ldflags "$ld" -o "$tmp/" \
      k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kube-proxy) || die "go build of the kubelet failed"
  log "building crictl"
  (cd "$here/node/crictl" && go build -pgo=off -trimpath -ldflags "-s -w" -o "$tmp/crictl" \
      sigs.k8s.io/cri-tools/cmd/crictl) || die "go build of crictl failed"
  log "building CoreDNS, kubernetes plugin only (crictl, CoreDNS and the pause image: ~2 min here)"
  (cd "$here/node/coredns" && go build -pgo=off -trimpath -ldflags "-s -w" -o "$tmp/coredns" .) \
    || die "go build of CoreDNS failed"
  pause_image "$tmp"
  rm -rf "$out"; mv "$tmp" "$out"
  log "built in $((SECONDS - started)) s into $out"
  echo "$out"
}

# registry.k8s.io/pause:3.10, containerd's sandbox image, from a static C program in a
# `from scratch` image: no registry to pull it from.
pause_image() {
  local out=$1 c
  gcc -Os -static -o "$out/pause" "$here/node/pause.c" && strip "$out/pause"
  c=$(buildah from scratch)
  buildah copy "$c" "$out/pause" /pause >/dev/null
  buildah config --entrypoint '["/pause"]' --user 65535:65535 "$c"
  buildah commit -q "$c" registry.k8s.io/pause:3.10 >/dev/null
  buildah rm "$c" >/dev/null
  podman save -q -o "$out/pause.tar" registry.k8s.io/pause:3.10
  podman rmi registry.k8s.io/pause:3.10 >/dev/null   # the tarball is the artefact
  rm -f "$out/pause"
}

# ------------------------------------------------------------------ helpers

pids() { echo "$state/pids"; }
alive() { [[ -f $(pids)/$1 ]] && kill -0 "$(cat "$(pids)/$1")" 2>/dev/null; }

# start <name> <command...>: in its own session, logging to logs/<name>.log
start() {
  local name=$1; shift
  setsid "$@" >"$state/logs/$name.log" 2>&1 < /dev/null &
  echo $! > "$(pids)/$name"
}

# stop <name>: SIGTERM the process group, SIGKILL it after 20 s, forget it
stop() {
  local name=$1 pid
  [[ -f $(pids)/$name ]] || return 0
  pid=$(cat "$(pids)/$name")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
    local deadline=$((SECONDS + 20))
    while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.2; done
    kill -KILL -- "-$pid" 2>/dev/null || true
  fi
  rm -f "$(pids)/$name"
}

wait_for() {
  local limit=$1 what=$2; shift 2
  local deadline=$((SECONDS + limit))
  until "$@" >/dev/null 2>&1; do
    ((SECONDS < deadline)) || { log "ERROR: $what not ready after ${limit}s"; return 1; }
    sleep 0.5
  done
}

# The routes (any table) that overlap our two ranges, ours excepted.
overlapping_routes() {
  ip -4 route show table all | python3 -c '
import ipaddress, sys
ours = [ipaddress.ip_network(n) for n in sys.argv[1:]]
types = {"unicast", "local", "broadcast", "multicast", "blackhole", "unreachable", "prohibit", "throw", "nat", "anycast"}
for line in sys.stdin:
    words = line.split()
    dst = words[1] if len(words) > 1 and words[0] in types else (words[0] if words else "default")
    if dst == "default":
        continue
    if any(ipaddress.ip_network(dst, strict=False).overlaps(o) for o in ours):
        print(line.rstrip())
' "$pod_cidr" "$svc_cidr"
}

sysctl_snapshot() {
  sysctl -a 2>/dev/null | grep -E "^($sysctl_names) = " || true
}

# ------------------------------------------------------------------ configs

pki_pre() {
  local d=$state/pki n sans="IP:$host_ip"
  mkdir -p "$d"; cd "$d"
  for ((n = 1; n <= max_nodes; n++)); do sans+=",IP:10.231.0.$n,DNS:kvferry-node-$n"; done
  # A CA of the nodes' own: the API server's client cert for the kubelets (logs, exec,
  # port-forward) must exist before the API server starts, and so before the plane's CA.
  openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 30 \
    -subj "/CN=kvferry-node-ca" 2>/dev/null
  printf 'extendedKeyUsage=clientAuth\n' > client.ext
  # system:masters, so the kubelet's SubjectAccessReview for the API server passes
  openssl req -newkey rsa:2048 -nodes -keyout apiserver-kubelet-client.key -out apiserver-kubelet-client.csr \
    -subj "/O=system:masters/CN=kube-apiserver-kubelet-client" 2>/dev/null
  openssl x509 -req -in apiserver-kubelet-client.csr -CA ca.crt -CAkey ca.key -CAcreateserial \
    -out apiserver-kubelet-client.crt -days 30 -extfile client.ext 2>/dev/null
  printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth\n' "$sans" > serving.ext
  openssl req -newkey rsa:2048 -nodes -keyout kubelet-serving.key -out kubelet-serving.csr \
    -subj "/CN=kvferry-node-kubelet" 2>/dev/null
  openssl x509 -req -in kubelet-serving.csr -CA ca.crt -CAkey ca.key -CAcreateserial \
    -out kubelet-serving.crt -days 30 -extfile serving.ext 2>/dev/null
  cd - >/dev/null
}

# client_kubeconfig <name> <subject>: a cert from the plane's CA and a kubeconfig for it
client_kubeconfig() {
  local name=$1 subject=$2 d=$state/pki cp=$state/cp/pki
  openssl req -newkey rsa:2048 -nodes -keyout "$d/$name.key" -out "$d/$name.csr" -subj "$subject" 2>/dev/null
  openssl x509 -req -in "$d/$name.csr" -CA "$cp/ca.crt" -CAkey "$cp/ca.key" -CAcreateserial \
    -out "$d/$name.crt" -days 30 -extfile "$d/client.ext" 2>/dev/null
  cat > "$state/etc/$name.kubeconfig" <<EOT
apiVersion: v1
kind: Config
clusters:
- name: local
  cluster: {server: "https://$host_ip:$port", certificate-authority: $cp/ca.crt}
users:
- name: $name
  user: {client-certificate: $d/$name.crt, client-key: $d/$name.key}
contexts:
- name: local
  context: {cluster: local, user: $name}
current-context: local
EOT
}

node_config() {
  local n=$1 d=$state/node$n e=$state/etc/node$n
  mkdir -p "$e/cni" "$e/certs.d/_default" "$d"
  # Every pull goes to a dead local address (no registry, and no packet off the machine).
  printf 'server = "http://127.0.0.1:9"\n[host."http://127.0.0.1:9"]\n  capabilities = ["pull", "resolve"]\n' \
    > "$e/certs.d/_default/hosts.toml"
  cat > "$e/containerd.toml" <<EOT
# containerd $n of hack/node.sh: everything under $d (a kubelet garbage-collects the
# sandboxes it does not know, so two nodes never share one containerd).
version = 2
root = "$d/containerd/root"
state = "$d/containerd/state"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs"]
[grpc]
  address = "$d/containerd.sock"
[ttrpc]
  address = "$d/containerd.sock.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "$d/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "registry.k8s.io/pause:3.10"
  # no CAP_SYS_RESOURCE in every sandbox: never ask for an oom_score_adj below containerd's own
  restrict_oom_score_adj = true
  disable_apparmor = true
  netns_mounts_under_state_dir = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        BinaryName = "$(command -v runc)"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$e/cni"
    max_conf_num = 1
  [plugins."io.containerd.grpc.v1.cri".registry]
    config_path = "$e/certs.d"
EOT
  # Pods: an address on the bridge, a route to the Services through the host, and no
  # default route. isGateway false: the bridge's address is ours (and the plugin would
  # otherwise switch on ip_forward itself); no portmap (hostPort unused, fewer chains).
  cat > "$e/cni/10-kvferry-node.conflist" <<EOT
{
  "cniVersion": "1.0.0",
  "name": "kvferry-node",
  "plugins": [{
    "type": "bridge", "bridge": "$bridge", "isGateway": false, "ipMasq": false, "hairpinMode": true,
    "ipam": {
      "type": "host-local", "dataDir": "$d/cni-ipam",
      "ranges": [[{"subnet": "$pod_cidr", "rangeStart": "10.231.$n.2", "rangeEnd": "10.231.$n.254", "gateway": "$host_ip"}]],
      "routes": [{"dst": "$svc_cidr", "gw": "$host_ip"}]
    }
  }]
}
EOT
  cat > "$e/kubelet.yaml" <<EOT
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: 10.231.0.$n
port: 10250
readOnlyPort: 0
healthzBindAddress: 10.231.0.$n
healthzPort: 10248
tlsCertFile: $state/pki/kubelet-serving.crt
tlsPrivateKeyFile: $state/pki/kubelet-serving.key
rotateCertificates: false
serverTLSBootstrap: false
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $state/pki/ca.crt}
authorization:
  mode: Webhook
containerRuntimeEndpoint: unix://$d/containerd.sock
cgroupDriver: cgroupfs
failCgroupV1: false
cgroupsPerQOS: true
# distinct per node: each kubelet removes the pod cgroups it does not know
cgroupRoot: /kvferry-node-$n
enforceNodeAllocatable: ["pods"]
podLogsDir: $d/pod-logs
# every node sees the whole machine's disk and memory: never evict, never GC images
evictionHard: {memory.available: "0%", nodefs.available: "0%", nodefs.inodesFree: "0%", imagefs.available: "0%"}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
failSwapOn: false
clusterDNS: ["$dns_ip"]
clusterDomain: cluster.local
# empty: no host search domain or nameserver reaches a pod
resolvConf: $state/etc/resolv.conf
maxPods: 30
registerNode: true
nodeStatusReportFrequency: 1m
syncFrequency: 10s
EOT
}

cgroups() {   # cgroups create|remove <name>: the kubelet's cgroupRoot in every hierarchy
  local op=$1 name=$2 c
  if [[ -f /sys/fs/cgroup/cgroup.controllers ]]; then   # v2: one tree
    case $op in
      create) mkdir -p "/sys/fs/cgroup/$name" ;;
      remove) [[ -d /sys/fs/cgroup/$name ]] && find "/sys/fs/cgroup/$name" -depth -type d -exec rmdir {} \; ;;
    esac
    return 0
  fi
  for c in /sys/fs/cgroup/*/; do
    c=${c%/}
    case $op in
      create)
        mkdir -p "$c/$name"
        if [[ $(basename "$c") == cpuset ]]; then
          cat "$c/cpuset.cpus" > "$c/$name/cpuset.cpus"; cat "$c/cpuset.mems" > "$c/$name/cpuset.mems"
        fi ;;
      remove) [[ -d $c/$name ]] && find "$c/$name" -depth -type d -exec rmdir {} \; ;;
    esac
  done
  return 0
}

# The objects a real cluster's add-ons would make: the `kubernetes` Service's endpoints
# (the plane runs with --endpoint-reconciler-type none) and the cluster DNS Service.
cluster_objects() {
  kctl apply -f - >/dev/null <<EOT
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: kubernetes
  namespace: default
  labels: {kubernetes.io/service-name: kubernetes, endpointslice.kubernetes.io/managed-by: kvferry-node-sh}
addressType: IPv4
endpoints: [{addresses: ["$host_ip"], conditions: {ready: true}}]
ports: [{name: https, port: $port, protocol: TCP}]
---
apiVersion: v1
kind: Service
metadata:
  name: kube-dns
  namespace: kube-system
  labels: {k8s-app: kube-dns}
spec:
  clusterIP: $dns_ip
  ports:
  - {name: dns, port: 53, protocol: UDP, targetPort: 53}
  - {name: dns-tcp, port: 53, protocol: TCP, targetPort: 53}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: kube-dns-host
  namespace: kube-system
  labels: {kubernetes.io/service-name: kube-dns, endpointslice.kubernetes.io/managed-by: kvferry-node-sh}
addressType: IPv4
endpoints: [{addresses: ["$host_ip"], conditions: {ready: true}}]
ports:
- {name: dns, port: 53, protocol: UDP}
- {name: dns-tcp, port: 53, protocol: TCP}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: "system:coredns"}
rules:
- {apiGroups: [""], resources: [endpoints, services, pods, namespaces], verbs: [list, watch]}
- {apiGroups: [discovery.k8s.io], resources: [endpointslices], verbs: [list, watch]}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: "system:coredns"}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "system:coredns"}
subjects: [{kind: User, name: "system:coredns", apiGroup: rbac.authorization.k8s.io}]
EOT
}

# ------------------------------------------------------------------ up / down

preflight() {
  ((EUID == 0)) || die "real nodes need root (network, mounts, cgroups)"
  [[ -d /sys/fs/cgroup ]] && [[ -n $(ls /sys/fs/cgroup) ]] || die "no cgroup file system at /sys/fs/cgroup"
  local p
  for p in kubelet kube-proxy; do
    pgrep -x "$p" >/dev/null && die "a $p already runs on this machine; two would fight over its iptables chains"
  done
  iptables-save 2>/dev/null | grep -q '^:KUBE-' \
    && die "KUBE-* iptables chains exist already (another Kubernetes node here?); not touching them"
  ip link show "$bridge" >/dev/null 2>&1 && die "bridge $bridge exists: left from a run? hack/node.sh down"
  local routes; routes=$(overlapping_routes)
  [[ -z $routes ]] || die "$pod_cidr or $svc_cidr is already routed here: $routes"
  return 0
}

up() {
  local n_nodes=${1:-1} n started=$SECONDS
  [[ $n_nodes =~ ^[1-9]$ ]] && ((n_nodes <= max_nodes)) || die "up N: N is 1..$max_nodes (got $n_nodes)"
  if [[ -f $state/run/nodes ]] && alive kubelet1; then log "already up"; echo "$state/cp/kubeconfig"; return 0; fi
  preflight
  tools   # a cached build does not mean this machine has containerd
  local bin; bin=$(build)
  rm -rf "$state"; mkdir -p "$(pids)" "$state/logs" "$state/run" "$state/etc"
  # From here on, a failure or an interrupt tears down what was made.
  trap up_failed ERR INT TERM
  echo "$n_nodes" > "$state/run/nodes"
  echo "$bin" > "$state/run/bin"   # down uses these, whatever the tree says by then
  sysctl_snapshot > "$state/run/sysctl.saved"
  for p in $host_paths; do [[ -e $p ]] && echo "$p"; done > "$state/run/paths.present" || true
  # iptables-nft makes a table at first use (the kubelet's canaries make ip mangle and
  # the ip6 ones); `down` removes the tables that are new and hold no rule.
  nft list tables > "$state/run/nft.tables"
  : > "$state/etc/resolv.conf"

  ip link add "$bridge" type bridge
  ip link set "$bridge" up
  ip addr add "$host_ip/16" dev "$bridge"
  for ((n = 1; n <= n_nodes; n++)); do ip addr add "10.231.0.$n/32" dev "$bridge"; done
  # Traffic to a ClusterIP kube-proxy has not programmed (yet), or to a pod address the
  # bridge cannot reach, stops here instead of following the default route off the machine.
  ip route add blackhole "$svc_cidr"
  ip route add blackhole "$pod_cidr" metric 4242
  # pod -> ClusterIP -> pod: the host routes it back onto the bridge, and the bridge's
  # frames pass iptables so the reply is un-NATed.
  sysctl -qw net.ipv4.ip_forward=1
  [[ -d /proc/sys/net/bridge ]] || modprobe br_netfilter
  sysctl -qw net.bridge.bridge-nf-call-iptables=1

  pki_pre
  log "control plane on https://$host_ip:$port"
  KVFERRY_CP_DIR=$state/cp KVFERRY_CP_PORT=$port KVFERRY_CP_NODES=0 KVFERRY_CP_CRDS=${KVFERRY_NODE_CRDS:-0} \
    KVFERRY_CP_ADDRESS=$host_ip KVFERRY_CP_SERVICE_CIDR=$svc_cidr \
    KVFERRY_CP_APISERVER_ARGS="--kubelet-client-certificate=$state/pki/apiserver-kubelet-client.crt --kubelet-client-key=$state/pki/apiserver-kubelet-client.key --kubelet-certificate-authority=$state/pki/ca.crt --kubelet-preferred-address-types=InternalIP" \
    "$here/controlplane.sh" up >/dev/null
  cluster_objects

  for ((n = 1; n <= n_nodes; n++)); do
    node_config "$n"
    cgroups create "kvferry-node-$n"
    start "containerd$n" containerd --config "$state/etc/node$n/containerd.toml"
    wait_for 30 "containerd$n" ctr -a "$state/node$n/containerd.sock" version
    ctr -a "$state/node$n/containerd.sock" -n k8s.io images import "$bin/pause.tar" >/dev/null
    client_kubeconfig "kubelet-$n" "/O=system:nodes/CN=system:node:kvferry-node-$n"
    mkdir -p "$state/node$n/kubelet"
    start "kubelet$n" "$bin/kubelet" --config "$state/etc/node$n/kubelet.yaml" \
      --kubeconfig "$state/etc/kubelet-$n.kubeconfig" --root-dir "$state/node$n/kubelet" \
      --cert-dir "$state/node$n/kubelet/pki" --hostname-override "kvferry-node-$n" \
      --node-ip "10.231.0.$n" --node-labels "kvferry.io/node=$n" --v 1
  done

  client_kubeconfig kube-proxy "/CN=system:kube-proxy"
  cat > "$state/etc/kube-proxy.yaml" <<EOT
# One kube-proxy for every node: they share this machine's one iptables.
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: $state/etc/kube-proxy.kubeconfig}
hostnameOverride: kvferry-node-1
mode: iptables
clusterCIDR: $pod_cidr
bindAddress: $host_ip
healthzBindAddress: $host_ip:10256
metricsBindAddress: $host_ip:10249
nodePortAddresses: ["$host_ip/32"]
# leave the machine's conntrack table sizes alone
conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
iptables: {localhostNodePorts: false, masqueradeAll: false, syncPeriod: 30s, minSyncPeriod: 1s}
EOT
  start kube-proxy "$bin/kube-proxy" --config "$state/etc/kube-proxy.yaml" --v 1

  client_kubeconfig coredns "/CN=system:coredns"
  cat > "$state/etc/Corefile" <<EOT
# Cluster names only: no forward plugin, so nothing else is looked up anywhere.
cluster.local:53 in-addr.arpa:53 ip6.arpa:53 {
    bind $host_ip
    errors
    health $dns_health
    ready $dns_ready
    cache 5
    kubernetes cluster.local in-addr.arpa ip6.arpa {
        kubeconfig $state/etc/coredns.kubeconfig local
        pods insecure
    }
}
EOT
  start coredns "$bin/coredns" -conf "$state/etc/Corefile"

  for ((n = 1; n <= n_nodes; n++)); do
    wait_for 90 "node kvferry-node-$n" kctl wait --for condition=Ready "node/kvferry-node-$n" --timeout 2s
  done
  wait_for 30 kube-proxy curl -sf "http://$host_ip:10256/healthz"
  wait_for 30 CoreDNS curl -sf "http://$dns_ready/ready"
  wait_for 60 "default ServiceAccount" kctl get serviceaccount default
  trap - ERR INT TERM
  log "up in $((SECONDS - started)) s: $n_nodes node(s)"
  echo "$state/cp/kubeconfig"
}

up_failed() {
  log "ERROR: up failed; the last lines of each log, then down"
  tail_logs
  down >/dev/null 2>&1 || true
  exit 1
}

tail_logs() {
  local f
  for f in "$state"/logs/*.log "$state"/cp/*.log; do
    [[ -f $f ]] || continue
    printf '==> %s (last 15 lines) <==\n' "$f" >&2; tail -n 15 "$f" >&2
  done
}

down() {
  [[ -d $state ]] || { log "not running"; return 0; }
  local started=$SECONDS n n_nodes bin
  n_nodes=$(cat "$state/run/nodes" 2>/dev/null || echo "$max_nodes")
  bin=$(cat "$state/run/bin" 2>/dev/null || bin_dir)
  # 1. kube-proxy, then its chains and rules (and its conntrack entries)
  if [[ -f $(pids)/kube-proxy ]]; then
    stop kube-proxy
    "$bin/kube-proxy" --cleanup --config "$state/etc/kube-proxy.yaml" >/dev/null 2>&1 || true
  fi
  stop coredns
  # 2. the kubelets, so nothing restarts what CRI removes next; then every sandbox through
  #    CRI (containers stopped, CNI DEL: veths and addresses released); then containerd
  #    (the shims have exited with their containers)
  for ((n = 1; n <= n_nodes; n++)); do stop "kubelet$n"; done
  for ((n = 1; n <= n_nodes; n++)); do
    if alive "containerd$n"; then
      "$bin/crictl" -r "unix://$state/node$n/containerd.sock" rmp -fa >/dev/null 2>&1 || true
    fi
    stop "containerd$n"
  done
  # shims left by a containerd that died: only ours, found by their socket address
  local pid
  for pid in $(pgrep -f "containerd-shim-runc-v2 .*-address $state/" || true); do
    log "stray shim $pid"; kill -KILL "$pid" 2>/dev/null || true
  done
  log "down: kube-proxy, CoreDNS, kubelets, sandboxes, containerd stopped ($((SECONDS - started)) s)"
  # 3. mounts under the state folder (volumes, rootfs, netns), deepest first
  { awk '{print $5}' /proc/self/mountinfo | grep "^$state/" || true; } | sort -r | while read -r m; do
    umount "$m" 2>/dev/null || umount -l "$m" || true
  done
  log "down: unmounted ($((SECONDS - started)) s)"
  # 4. the kubelet's chains (kubelet_network_linux.go); kube-proxy --cleanup left them
  local ipt t
  for ipt in iptables ip6tables; do
    while $ipt -t filter -D INPUT -j KUBE-FIREWALL 2>/dev/null; do :; done
    while $ipt -t filter -D OUTPUT -j KUBE-FIREWALL 2>/dev/null; do :; done
    $ipt -t filter -F KUBE-FIREWALL 2>/dev/null || true
    $ipt -t filter -X KUBE-FIREWALL 2>/dev/null || true
    for t in filter nat mangle; do
      $ipt -t "$t" -F KUBE-KUBELET-CANARY 2>/dev/null || true
      $ipt -t "$t" -X KUBE-KUBELET-CANARY 2>/dev/null || true
      $ipt -t "$t" -X KUBE-IPTABLES-HINT 2>/dev/null || true
    done
  done
  local table rules
  if [[ -f $state/run/nft.tables ]]; then
    { nft list tables | grep -vxFf "$state/run/nft.tables" || true; } | while read -r _ table; do
      # shellcheck disable=SC2086 # "FAMILY NAME", two words
      rules=$(nft -a list table $table | grep '# handle' | grep -cvE '^\s*(table|chain|set|map) ' || true)
      # shellcheck disable=SC2086
      ((rules > 0)) || nft delete table $table
    done
  fi
  log "down: iptables and nft cleaned ($((SECONDS - started)) s)"
  # 5. the control plane
  KVFERRY_CP_DIR=$state/cp "$here/controlplane.sh" down >/dev/null 2>&1 || true
  log "down: control plane stopped ($((SECONDS - started)) s)"
  # 6. cgroups, conntrack entries, routes, the bridge, sysctls, host paths
  for ((n = 1; n <= n_nodes; n++)); do
    cgroups remove "kvferry-node-$n" 2>/dev/null || log "cgroup kvferry-node-$n not empty"
  done
  conntrack -D -s "$pod_cidr" >/dev/null 2>&1 || true
  conntrack -D -d "$pod_cidr" >/dev/null 2>&1 || true
  conntrack -D -d "$svc_cidr" >/dev/null 2>&1 || true
  ip route del blackhole "$svc_cidr" 2>/dev/null || true
  ip route del blackhole "$pod_cidr" metric 4242 2>/dev/null || true
  ip link show "$bridge" >/dev/null 2>&1 && ip link del "$bridge"
  if [[ -f $state/run/sysctl.saved ]]; then
    local key value
    { diff <(sysctl_snapshot) "$state/run/sysctl.saved" || true; } | sed -n 's/^> //p' | while IFS=' = ' read -r key value; do
      sysctl -qw "$key=$value" 2>/dev/null || true
    done
  fi
  local p
  for p in $host_paths; do
    grep -qxF "$p" "$state/run/paths.present" 2>/dev/null && continue
    [[ -e $p ]] && rm -rf "$p"
  done
  rm -f /var/lib/cni/results/kvferry-node-* 2>/dev/null || true
  rm -rf "$state"
  log "down in $((SECONDS - started)) s"
}

status() {
  [[ -d $(pids) ]] || { echo "down"; return 1; }
  local f rc=0
  for f in "$(pids)"/*; do
    [[ -f $f ]] || continue
    if kill -0 "$(cat "$f")" 2>/dev/null; then echo "$(basename "$f") running (pid $(cat "$f"))"
    else echo "$(basename "$f") DEAD"; rc=1; fi
  done
  KVFERRY_CP_DIR=$state/cp "$here/controlplane.sh" status || rc=1
  return $rc
}

load() {
  (($#)) || die "load IMAGE...: name at least one local podman image"
  [[ -f $state/run/nodes ]] || die "not up: hack/node.sh up first"
  local img tar n n_nodes started=$SECONDS
  n_nodes=$(cat "$state/run/nodes")
  tar=$state/run/load.tar
  for img in "$@"; do
    podman image exists "$img" || die "no local podman image $img (podman images lists them)"
    rm -f "$tar"   # podman save refuses an existing target
    podman save -q -o "$tar" "$img"
    for ((n = 1; n <= n_nodes; n++)); do
      ctr -a "$state/node$n/containerd.sock" -n k8s.io images import "$tar" >/dev/null \
        || die "ctr import of $img on node $n failed"
    done
    rm -f "$tar"
    log "loaded $img on $n_nodes node(s)"
  done
  log "loaded in $((SECONDS - started)) s"
}

case "${1:-}" in
  tools) tools ;;
  build) build ;;
  up) up "${2:-1}" ;;
  down) down ;;
  status) status ;;
  load) shift; load "$@" ;;
  *) sed -n '2,13p' "$0" >&2; exit 2 ;;
esac
