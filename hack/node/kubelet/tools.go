//go:build tools

// Package tools pins the node binaries of hack/node.sh's real nodes: the kubelet
// and kube-proxy, the same Kubernetes release as hack/controlplane.
package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-proxy"
	_ "k8s.io/kubernetes/cmd/kubelet"
)
