#!/usr/bin/env bash
# Creates the report endpoint's certificate for the plain-manifest install: a CA and a
# serving certificate for the operator's Service, stored as Secret kvferry-tls
# (tls.crt, tls.key, ca.crt) in the operator's namespace. Run once after
# `kubectl apply -f deploy/kvferry.yaml`; the operator pod starts when the Secret exists.
#
#   deploy/gen-tls.sh [namespace] [cluster-domain]     (defaults: kvferry-system cluster.local)
#
# To rotate: delete the Secret and run this again. The operator reloads the new
# certificate (no restart) and copies the new CA into every server's ConfigMap; pushes
# fail until the kubelet has refreshed those (a minute or two) and then resume.
set -euo pipefail

ns=${1:-kvferry-system}
domain=${2:-cluster.local}
svc=kvferry
days=3650
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT

openssl req -x509 -newkey rsa:2048 -nodes -days "$days" -subj "/CN=$svc-ca" \
  -keyout "$dir/ca.key" -out "$dir/ca.crt" 2>/dev/null
openssl req -newkey rsa:2048 -nodes -subj "/CN=$svc.$ns.svc" \
  -keyout "$dir/tls.key" -out "$dir/tls.csr" 2>/dev/null
printf 'subjectAltName=DNS:%s,DNS:%s.%s,DNS:%s.%s.svc,DNS:%s.%s.svc.%s\nextendedKeyUsage=serverAuth\n' \
  "$svc" "$svc" "$ns" "$svc" "$ns" "$svc" "$ns" "$domain" > "$dir/ext"
openssl x509 -req -in "$dir/tls.csr" -CA "$dir/ca.crt" -CAkey "$dir/ca.key" -CAcreateserial \
  -days "$days" -extfile "$dir/ext" -out "$dir/tls.crt" 2>/dev/null

kubectl -n "$ns" create secret generic kvferry-tls --type kubernetes.io/tls \
  --from-file=tls.crt="$dir/tls.crt" --from-file=tls.key="$dir/tls.key" \
  --from-file=ca.crt="$dir/ca.crt"
