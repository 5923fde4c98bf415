//go:build tools

// Package tools pins the Kubernetes control-plane binaries kvferry's cluster
// tests run; hack/controlplane.sh builds them from this module.
package tools

import (
	_ "go.etcd.io/etcd/server/v3"
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
)
