//go:build tools

// Package tools pins the helm CLI kvferry's chart tests run; hack/helm.sh
// builds it from this module (no downloaded binaries).
package tools

import (
	_ "helm.sh/helm/v3/cmd/helm"
)
