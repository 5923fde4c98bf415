//go:build tools

// Package tools pins kwok, which gives kvferry's cluster tests fake GPU nodes.
package tools

import (
	_ "sigs.k8s.io/kwok/cmd/kwok"
)
