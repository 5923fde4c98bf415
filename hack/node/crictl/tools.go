//go:build tools

// Package tools pins crictl, which hack/node.sh uses to clear a node's pods
// through CRI at `down`; its own module because cri-tools pins its own
// Kubernetes libraries.
package tools

import (
	_ "sigs.k8s.io/cri-tools/cmd/crictl"
)
